"""quant_error on a 4096 x 4096 float32 tensor against memory-bound references, in one run.

    make bench   (pytest tests/test_bench_quant.py tests/test_bench_probes.py --benchmark-enable -p no:xdist)

Each format is a benchmark group: its reference `out.copy_(x)` (one read and one write of the
tensor into a preallocated one: no allocation, no page faults), one read `x.sum()`, and
quant_error in both orientations, measured one after the other so the reference sees the same
host. tests/conftest.py prints each ratio of medians against its goal; no test asserts
a time. Benchmarks are disabled by default (pyproject addopts), so in the normal suite each body
runs once as a smoke test.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite import quant_error

SHAPE = (4096, 4096)
# Each format's two orientations (its own block for MX and NVFP4) and the goal: quant_error
# within this many copies of the tensor.
FORMATS = {
    "e4m3": (((1, 128), (128, 1)), 2.0),
    "e5m2": (((1, 128), (128, 1)), 2.0),
    "mxfp8": (((1, 32), (32, 1)), 3.0),
    "nvfp4": (((1, 16), (16, 1)), 3.0),
}
SUBJECTS = [
    pytest.param(
        fmt, subject, id=f"{fmt}-{subject if isinstance(subject, str) else f'{subject[0]}x{subject[1]}'}"
    )
    for fmt, (layouts, _) in FORMATS.items()
    for subject in ("copy", "read", *layouts)
]


@pytest.fixture(scope="module")
def big_tensor() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize("fmt, subject", SUBJECTS)
def test_quant_error_against_a_copy(benchmark, big_tensor, fmt, subject):
    benchmark.group = f"quant_error 4096x4096 {fmt}"
    if subject == "copy":
        out = torch.empty_like(big_tensor)
        benchmark.extra_info.update(subject="out.copy_(x)", reference=True)
        benchmark(out.copy_, big_tensor)
        assert torch.equal(out, big_tensor)
    elif subject == "read":
        benchmark.extra_info["subject"] = "x.sum()"
        total = benchmark(big_tensor.sum)
        assert total.item() == pytest.approx(big_tensor.double().sum().item(), abs=1.0)
    else:
        benchmark.extra_info.update(subject=f"quant_error {fmt} {subject}", goal=FORMATS[fmt][1])
        quant_error(big_tensor, fmt, subject)  # compile outside the timed rounds
        metrics = benchmark(quant_error, big_tensor, fmt, subject)
        assert 0.99 < metrics["distortion"] <= 1.0
        assert metrics["numel"] == big_tensor.numel() and metrics["nonfinite_in"] == 0
