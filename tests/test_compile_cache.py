"""The on-disk compile cache (precision_suite.use_project_cache) never serves a wrong kernel.

A fresh process loads its compiled quantizers from inductor's FX graph cache instead of compiling
them. The cache must hand a kernel only to the graphs it was compiled for: another format must
miss, and another shape may only hit the shape-generic kernel that is correct for it. Both are
checked bit for bit against the ml_dtypes oracle after the in-memory graphs are dropped, so every
kernel below comes from the disk cache or a fresh compile.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from precision_suite import use_project_cache
from test_oracle import _assert_bits_equal, _ours, _wide, oracle_fp8

SHAPE_A, SHAPE_B = (256, 384), (384, 640)  # both above quantization.COMPILE_MIN_NUMEL


@pytest.mark.slow
def test_a_cached_kernel_is_served_only_to_its_own_format_and_shape(tmp_path):
    a, b = _wide(0, SHAPE_A), _wide(1, SHAPE_B)
    with fresh_cache(dir=str(tmp_path)):
        torch._dynamo.reset()  # compile into this empty cache, not reuse graphs of earlier tests
        _assert_bits_equal(_ours(a, "e4m3", (1, 128)), oracle_fp8(a, "e4m3", (1, 128)))  # compiled and cached
        torch._dynamo.reset()  # a fresh process, as far as compiled graphs go
        counters.clear()
        _assert_bits_equal(_ours(a, "e4m3", (1, 128)), oracle_fp8(a, "e4m3", (1, 128)))
        assert counters["inductor"]["fxgraph_cache_hit"] == 1, "the kernel was not read back: nothing was tested"
        _assert_bits_equal(_ours(b, "e5m2", (1, 128)), oracle_fp8(b, "e5m2", (1, 128)))
        assert counters["inductor"]["fxgraph_cache_miss"] == 1, "an e4m3 kernel was served to e5m2"
        torch._dynamo.reset()
        _assert_bits_equal(_ours(b, "e4m3", (1, 128)), oracle_fp8(b, "e4m3", (1, 128)))  # shape B, kernel of A
        assert counters["inductor"]["fxgraph_cache_hit"] == 2
    torch._dynamo.reset()  # later tests compile against the normal cache again


def test_the_cache_lives_in_the_project_cache_dir_unless_inductor_is_told_where(tmp_path, monkeypatch):
    # set first, so that teardown restores the variable whatever use_project_cache writes into it
    # (a delenv of an absent variable records nothing, and the test's value leaked into later tests)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("PRECISION_SUITE_CACHE_DIR", str(tmp_path))
    use_project_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    use_project_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
