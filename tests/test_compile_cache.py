"""The on-disk compile cache (precision_suite.use_project_cache) never serves a wrong kernel.

A fresh process loads its compiled quantizers from inductor's FX graph cache instead of compiling
them. The cache must hand a kernel only to the graphs it was compiled for: another format must
miss, and another shape may only hit the shape-generic kernel that is correct for it. Both are
checked bit for bit against the ml_dtypes oracle after the in-memory graphs are dropped, so every
kernel below comes from the disk cache or a fresh compile. Nor may it hand a kernel to another
compile environment (CPU capability, compiler, torch): each has its own folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from precision_suite import KEYED_BY_US, quantize, use_project_cache
from precision_suite.numerics.accumulation import accumulate
from precision_suite.numerics.kernel_cache import compile_environment, keyed_cache_dir
from test_accumulation import fp8_operand
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
        assert counters["inductor"]["fxgraph_cache_hit"] == 1, (
            "the kernel was not read back: nothing was tested"
        )
        _assert_bits_equal(_ours(b, "e5m2", (1, 128)), oracle_fp8(b, "e5m2", (1, 128)))
        assert counters["inductor"]["fxgraph_cache_miss"] == 1, "an e4m3 kernel was served to e5m2"
        torch._dynamo.reset()
        _assert_bits_equal(
            _ours(b, "e4m3", (1, 128)), oracle_fp8(b, "e4m3", (1, 128))
        )  # shape B, kernel of A
        assert counters["inductor"]["fxgraph_cache_hit"] == 2
    torch._dynamo.reset()  # later tests compile against the normal cache again


@pytest.mark.slow
def test_the_compiled_kernels_serve_forward_and_backward_with_one_graph(monkeypatch):
    """Forward hooks quantize and accumulate with grad on, gradient hooks with grad off; dynamo
    guards on grad mode, so a kernel whose inputs need no grad must be called in one mode or each
    process compiles every graph twice."""
    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "1")
    x = torch.from_numpy(_wide(0, SHAPE_A))
    a, w = fp8_operand("normal", 64, 4096, "e4m3", 5), fp8_operand("normal", 64, 4096, "e4m3", 6)

    def quantize_and_accumulate() -> None:
        quantize(x, "e4m3", (1, 128))
        accumulate(a, w.t(), "hopper-promoted")

    torch._dynamo.reset()
    counters.clear()
    with torch.enable_grad():
        quantize_and_accumulate()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2, "nothing was compiled: nothing was tested"
    with torch.no_grad():
        quantize_and_accumulate()
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_the_cache_lives_in_the_project_cache_dir_unless_inductor_is_told_where(tmp_path, monkeypatch):
    # set first, so that teardown restores the variable whatever use_project_cache writes into it
    # (a delenv of an absent variable records nothing, and the test's value leaked into later tests)
    for name in ("TORCHINDUCTOR_CACHE_DIR", KEYED_BY_US):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("PRECISION_SUITE_CACHE_DIR", str(tmp_path))
    use_project_cache()
    folder = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert folder.parent == tmp_path / "inductor" and folder.is_dir()
    assert json.loads(folder.with_name(folder.name + ".json").read_text()) == compile_environment()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    use_project_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


def test_each_compile_environment_has_its_own_folder_and_a_folder_must_prove_its_key(tmp_path):
    native = compile_environment()
    avx2 = {**native, "ATEN_CPU_CAPABILITY": "avx2"}
    folder = keyed_cache_dir(tmp_path, native)
    assert keyed_cache_dir(tmp_path, native) == folder  # found again
    assert keyed_cache_dir(tmp_path, avx2) not in (folder, None)
    folder.with_name(folder.name + ".json").write_text("{}")  # a key that says otherwise
    assert keyed_cache_dir(tmp_path, native) == folder.with_name(folder.name + "-1")
    unproven = tmp_path / "other"
    (unproven / folder.name).mkdir(parents=True)  # a folder of that name, without its key file
    assert keyed_cache_dir(unproven, native).name == folder.name + "-1"


# Quantizes one tensor above COMPILE_MIN_NUMEL through the compiled kernel; prints its cache folder,
# the capability torch ran with and a digest of the result's bits.
QUANTIZE_ONCE = """
import hashlib, json, os
import numpy as np, torch
from precision_suite import quantize
# numpy draws it: torch's randn takes another path, and other numbers, under another capability
x = torch.from_numpy(np.random.default_rng(0).standard_normal((256, 384), dtype=np.float32) * 100)
bits = quantize(x, "e4m3", (1, 128)).dequantized.numpy().tobytes()
print(json.dumps({"cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  "capability": torch.backends.cpu.get_cpu_capability(),
                  "bits": hashlib.sha256(bits).hexdigest()}))
"""


def quantize_in_process(cache_root: Path, capability: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PRECISION_SUITE_CACHE_DIR=str(cache_root), PRECISION_SUITE_COMPILE="1")
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
    else:
        env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run(
        [sys.executable, "-c", QUANTIZE_ONCE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def cache_dir_of_a_child(**env: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", "import os, precision_suite; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_a_process_started_from_this_one_keys_its_own_cache_folder():
    # a rounding twin is such a process: it inherits our TORCHINDUCTOR_CACHE_DIR, and must not
    # take it for the user's when its own CPU capability differs
    ours = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    if os.environ.get(KEYED_BY_US) != ours:
        pytest.skip("TORCHINDUCTOR_CACHE_DIR was set by the user, who owns its key")
    assert cache_dir_of_a_child() == ours
    assert cache_dir_of_a_child(ATEN_CPU_CAPABILITY="default") != ours
    assert cache_dir_of_a_child(TORCHINDUCTOR_CACHE_DIR="/users/own") == "/users/own"


@pytest.mark.slow
def test_a_cache_filled_under_one_cpu_capability_serves_another_nothing(tmp_path):
    # a kernel cached under AVX-512 and served to an avx2 process trained a GPT to NaN
    native = quantize_in_process(tmp_path, "native")
    assert list(Path(native["cache"]).iterdir()), "the native process cached nothing: nothing was tested"
    plain = quantize_in_process(tmp_path, "default")
    assert plain["capability"] != native["capability"]
    assert plain["cache"] != native["cache"]
    assert plain["bits"] == native["bits"]
