"""The emulated FP8 GEMM (numerics/accumulation.py) against the float32 matmul of the same shape,
in one run.

    pytest tests/test_bench_accumulation.py --benchmark-enable -p no:xdist

One benchmark group: its reference `a @ b` in float32 (torch's BLAS, the GEMM every recipe ran
before) and `accumulate` in each Hopper mode on the same FP8 operands, measured one after the
other so the reference sees the same host. tests/conftest.py prints each ratio of medians
against its goal; no test asserts a time. Benchmarks are disabled by default (pyproject addopts),
so in the normal suite each body runs once as a smoke test.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite.numerics.accumulation import accumulate

M, K, N = 512, 4096, 512
GOAL = 20.0  # the emulated GEMM within this many float32 matmuls of its shape


@pytest.fixture(scope="module")
def operands() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(M, K, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(K, N, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    return a, b


@pytest.mark.slow
@pytest.mark.parametrize("subject", ["float32", "hopper-fast", "hopper-promoted"])
def test_emulated_gemm_against_a_float32_matmul(benchmark, operands, subject):
    benchmark.group = f"FP8 GEMM {M}x{K}x{N}"
    a, b = operands
    if subject == "float32":
        a32, b32 = a.float(), b.float()
        benchmark.extra_info.update(subject="float32 a @ b", reference=True)
        out = benchmark(torch.matmul, a32, b32)
        # the classic bound of a float32 dot product: |error| <= K 2^-24 sum |a_k b_k|
        bound = K * 2.0**-24 * (a32.double().abs() @ b32.double().abs())
        assert bool(((out.double() - a32.double() @ b32.double()).abs() <= bound).all())
    else:
        benchmark.extra_info.update(subject=f"accumulate {subject}", goal=GOAL)
        accumulate(a, b, subject)  # compile outside the timed rounds
        out = benchmark(accumulate, a, b, subject)
        assert out.shape == (M, N) and bool(out.isfinite().all())
