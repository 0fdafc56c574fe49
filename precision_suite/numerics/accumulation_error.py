"""The accumulation error a run records of its FP8 GEMMs: how far each mode's GEMM
(`numerics.accumulation.scaled_gemm`) lands from the exact product of the same quantized operands,
as additive sums (SCIENCE.md, "GEMM accumulation on FP8 tensor cores"); the fixed subset of outputs
a run measures it on; and its law in K, measured, that the report draws."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from precision_suite.numerics import quantization
from precision_suite.numerics.accumulation import (
    ACCUMULATION_MODES,
    PROMOTION_INTERVAL,
    Accumulation,
    check_mode,
    gemm_scale,
    runs_on,
    scaled_gemm,
    split_dequantized,
)
from precision_suite.numerics.tensor_core import finite_elements, gemm_operands

LAW_KS = tuple(2**i for i in range(7, 14))  # K = 128 ... 8192: the reductions `error_law` measures
LAW_DATA = ("same-sign", "mixed-sign")


# The additive sums of the error metric, in this order: sum (C - R)^2, sum R^2 over the outputs
# kept, the outputs left out (C or R not finite), and every output (kept or not).
ERROR_FIELDS = ("err2", "ref2", "nonfinite", "outputs")
# The modes every FP8 GEMM's error is also measured under, whatever it ran with: one chain over K
# (cuBLAS's fast accumulation) and promotion every 128 (cuBLAS's split accumulator, DeepGEMM)
WHAT_IF = (Accumulation("hopper-fast"), Accumulation("hopper-promoted", PROMOTION_INTERVAL))


def accumulation_error_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    mode: str,
    chunk: int = PROMOTION_INTERVAL,
    *,
    elements: tuple[str, str] | None = None,
) -> torch.Tensor:
    """How far `mode`'s GEMM lands from the exact product of the same quantized operands, as
    additive sums: float64, one per ERROR_FIELDS [sum (C - R)^2, sum R^2, outputs left out,
    outputs].

    C = scaled_gemm(a, b, scale_a, scale_b, mode, chunk); R = (a * scale_a) @ (b * scale_b) with
    every element times its scale, every product and every sum in float64 (the products are
    exact, the sums off by about 2^-53: R is the quantized GEMM without accumulation error).
    Outputs where C or R is not finite are left out of both sums and counted. Sums of several
    GEMMs (modules, steps) add; `relative_error` turns them into the metric.
    """
    check_mode(mode, chunk)
    [sums] = error_sums_by_mode(a, b, scale_a, scale_b, [Accumulation(mode, chunk)], elements=elements)
    if sums is None:  # what scaled_gemm says about these scales
        scaled_gemm(a, b, scale_a, scale_b, mode, chunk, elements=elements)
    return sums


# The outputs a training run measures the accumulation error on, per GEMM: at most this many rows
# of C (rows of a) times this many columns (columns of b), drawn once per shape (`output_subset`).
# The emulation costs products, M * N * K: a 512 x 1376 output of a 17M-parameter Llama costs 43x
# less, a 128 x 128 one is measured whole. Measured on that Llama's 87 GEMMs of a step
# (docs/performance.md): the estimate of the relative error is off the whole output's by 3% rms
# (12% at most), and log(hopper-fast / hopper-promoted), a change of accumulation as a verdict
# sees it (1.04 there), by 0.04 rms: the plants move it 25 times that. The subset is the same in
# a baseline's seeds and the run, so what it adds is part of the seed ensemble's spread.
SAMPLED_ROWS = SAMPLED_COLUMNS = 128
_SUBSET_SEED = 39


def output_subset(
    m: int, n: int, rows: int = SAMPLED_ROWS, columns: int = SAMPLED_COLUMNS
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows (of M) and columns (of N) of C a run measures, sorted; None: all of them.

    A function of the shape alone (a seeded permutation): the same GEMM of a baseline and of a
    run, on any host and thread count, measures the same outputs."""

    def pick(size: int, count: int, axis: int) -> torch.Tensor | None:
        if size <= count:
            return None
        generator = torch.Generator().manual_seed(_SUBSET_SEED * 1_000_003 + 2 * size + axis)
        return torch.randperm(size, generator=generator)[:count].sort().values

    return pick(m, rows, 0), pick(n, columns, 1)


def _subset_of(
    x: torch.Tensor | float, index: torch.Tensor | None, dim: int, size: int
) -> torch.Tensor | float:
    """x's entries at `index` along `dim` where x has `size` there (a scale constant along it has 1)."""
    if index is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[dim] != size:
        return x
    return x.index_select(dim, index.to(x.device))


def error_sums_by_mode(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    accumulations: Sequence[Accumulation],
    *,
    elements: tuple[str, str] | None = None,
    computed: Mapping[Accumulation, torch.Tensor] | None = None,
    sampled: bool = False,
) -> list[torch.Tensor | None]:
    """`accumulation_error_sums` of one GEMM under each of `accumulations`, each GEMM and the
    float64 product R computed once; None for a mode the hardware cannot run with these scales
    (`runs_on`). `computed`: `scaled_gemm` results already at hand (the GEMM as a run computed it),
    used instead of computing them again.

    sampled: measure only `output_subset`'s outputs (finite operands; with a NaN or Inf every
    output is measured, so that what is not finite is counted exactly), their sums scaled by
    M * N over the outputs measured: estimates of the whole output's sums, which add across GEMMs
    as the exact ones do; ``outputs`` stays M * N."""
    shaped = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 2
    m, n = (a.shape[0], b.shape[1]) if shaped else (0, 0)
    rows, columns = output_subset(m, n) if sampled and shaped else (None, None)
    if (rows is not None or columns is not None) and _finite_operands(a, b):
        a, scale_a = _subset_of(a, rows, 0, m), _subset_of(scale_a, rows, 0, m)
        b, scale_b = _subset_of(b, columns, 1, n), _subset_of(scale_b, columns, 1, n)
        computed = {
            mode: _subset_of(_subset_of(c, rows, 0, m), columns, 1, n) for mode, c in (computed or {}).items()
        }
        sums = error_sums_by_mode(a, b, scale_a, scale_b, accumulations, elements=elements, computed=computed)
        weight = m * n / (a.shape[0] * b.shape[1])
        return [
            None if s is None else torch.cat([s[:3] * weight, s.new_tensor([float(m * n)])]) for s in sums
        ]
    reference = None
    results = dict(computed or {})
    out: list[torch.Tensor | None] = []
    for accumulation in accumulations:
        if not runs_on(scale_a, scale_b, accumulation):
            out.append(None)
            continue
        if accumulation not in results:
            results[accumulation] = scaled_gemm(
                a, b, scale_a, scale_b, accumulation.mode, accumulation.interval, elements=elements
            )
        c = results[accumulation]
        if reference is None:
            reference = _float64_product(a, b, scale_a, scale_b, elements, accumulation.mode)
        kept = c.isfinite() & reference.isfinite()
        error = torch.where(kept, c.double() - reference, 0.0)
        exact = torch.where(kept, reference, 0.0)
        out.append(
            torch.stack(
                [
                    (error * error).sum(),
                    (exact * exact).sum(),
                    (~kept).sum().double(),
                    torch.tensor(float(c.numel()), dtype=torch.float64, device=c.device),
                ]
            )
        )
    return out


def _finite_operands(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every element of a and b is finite (float8 tensors by their codes)."""
    return finite_elements(a) and finite_elements(b)


def _float64_product(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    elements: tuple[str, str] | None,
    mode: str,
) -> torch.Tensor:
    """R: every element times its scale, products and sums in float64."""
    a, b = (operand.values for operand in gemm_operands(a, b, elements, mode))
    (m, k), n = a.shape, b.shape[1]
    scale_a = gemm_scale(scale_a, (m, k), "scale_a", a.device).double()
    scale_b = gemm_scale(scale_b, (k, n), "scale_b", a.device).double()
    return (a.double() * scale_a) @ (b.double() * scale_b)


def relative_errors(sums: np.ndarray) -> np.ndarray:
    """||C - R||_F / ||R||_F of sums laid out along the last axis as ERROR_FIELDS (pooled by
    addition first): 0 where both sums are zero (an exact zero GEMM), inf where only R's is."""
    sums = np.asarray(sums, dtype=np.float64)
    err2, ref2 = sums[..., 0], sums[..., 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref2 == 0, np.where(err2 == 0, 0.0, np.inf), np.sqrt(err2 / ref2))


def relative_error(sums: torch.Tensor) -> float:
    """||C - R||_F / ||R||_F from `accumulation_error_sums` (pooled by addition).

    The Frobenius ratio, not the largest elementwise relative error: an output near zero (a sum
    that cancels) has an unbounded relative error that says nothing about the accumulator, while
    the ratio of norms weighs every output by its size and is defined whenever R is not all zero
    (0 for an exact zero GEMM, inf when only R is zero)."""
    return float(relative_errors(torch.as_tensor(sums, dtype=torch.float64).cpu().numpy()))


def error_law(
    rows: int = 32, seed: int = 0, ks: Sequence[int] = LAW_KS, modes: Sequence[str] = ACCUMULATION_MODES
) -> list[dict[str, object]]:
    """The error's law in K, measured: for each K and each kind of random E4M3 operands (per-tensor
    amax scales), same-sign (|N(0, 1)| entries: every product adds, the sum grows like K) and
    mixed-sign (N(0, 1): the sum grows like sqrt(K)), the `relative_error` of a (rows x K) @
    (K x rows) GEMM under each mode (hopper-promoted every 128). Rows
    {"K": k, "data": kind, mode: error, ...}. Expected (SCIENCE.md): hopper-fast grows with K,
    hopper-promoted stays flat, fp32 stays near 2^-24."""
    table = []
    with quantization.eager():  # a few small GEMMs: the compile tax would cost ten times the work
        for k in ks:
            gen = torch.Generator().manual_seed(seed + k)
            x, w = torch.randn(rows, k, generator=gen), torch.randn(k, rows, generator=gen)
            for kind in LAW_DATA:
                a, scale_a = _e4m3_tensorwise(x.abs() if kind == "same-sign" else x)
                b, scale_b = _e4m3_tensorwise(w.abs() if kind == "same-sign" else w)
                row: dict[str, object] = {"K": k, "data": kind}
                for mode in modes:
                    row[mode] = relative_error(accumulation_error_sums(a, b, scale_a, scale_b, mode))
                table.append(row)
    return table


def _e4m3_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 elements, their per-tensor scale) of x, quantized as the suite does."""
    q = quantization.quantize(x, "e4m3", "tensor")
    scale = q.scales.reshape(1, 1).float()
    return split_dequantized(q.dequantized, scale, "e4m3").to(torch.float8_e4m3fn), scale
