"""quant_error on a 4096 x 4096 float32 tensor beside a plain copy of it, in one run.

    pytest tests/test_bench_quant.py --benchmark-enable

prints the ratios (tests/conftest.py). Benchmarks are disabled by default (pyproject addopts),
so in the normal suite each body runs once as a smoke test.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite import quant_error

SHAPE = (4096, 4096)


@pytest.fixture(scope="module")
def big_tensor() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_copy_reference(benchmark, big_tensor):
    benchmark.group = "quant_error 4096x4096"
    benchmark.extra_info["reference"] = True
    out = benchmark(big_tensor.clone)
    assert torch.equal(out, big_tensor)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, layout", [("e4m3", (1, 128)), ("e4m3", (128, 1)), ("mxfp8", (1, 32))])
def test_quant_error(benchmark, big_tensor, fmt, layout):
    benchmark.group = "quant_error 4096x4096"
    quant_error(big_tensor, fmt, layout)  # compile outside the timed rounds
    metrics = benchmark(quant_error, big_tensor, fmt, layout)
    assert 0.99 < metrics["distortion"] <= 1.0
