"""GEMM accumulation as an NVIDIA H100's FP8 tensor cores perform it, bit for bit, in torch.

Every other GEMM of the suite sums its products in float32 (``fp32``). An H100 does not
(DeepSeek-V3 report, arXiv 2412.19437, sections 3.3.2 and 3.5.2; SCIENCE.md, "GEMM accumulation
on FP8 tensor cores"). The modes (``ACCUMULATION_MODES``):

- ``fp32``: today's float32 GEMM (torch's own matmul of the dequantized operands).
- ``hopper-fast``: one tensor-core chain over all of K (cuBLAS ``use_fast_accum=True``).
- ``hopper-promoted``: a fresh chain over each chunk of ``chunk`` consecutive elements of K
  (default 128), the chunk results added into a float32 accumulator, in K order, with
  round-to-nearest additions (cuBLAS ``use_fast_accum=False``, Transformer Engine's split
  accumulator, DeepGEMM's promotion every N_C = 128).

The chain each mode is made of, and what is modelled exactly: `numerics.tensor_core`.

Split-K, which cuBLAS applies to some shapes (mmaemu's splitk tables), is not modelled: these
are the results of shapes cuBLAS does not split. Only E4M3 and E5M2 elements have the model, and
E5M2 x E5M2 is refused, as torch._scaled_mm and cuBLAS refuse it.

Scales (`scaled_gemm`): scales constant along K (per tensor, per row of A, per column of B)
multiply the accumulator once, in float32, by the float32 product of the two scales (cuBLAS's
epilogue; mmaemu validates it for tensor-wise scales). Scales that change along K (1x128 and
128x128 blocks) can only be applied where a chain ends: under ``hopper-promoted`` each chunk's
result is multiplied by its scales on promotion, as DeepGEMM does
(``final_accum += scale_a * scale_b * accum``, which nvcc compiles to one fused multiply-add),
so each chunk must lie within one scale block along K; ``hopper-fast`` refuses them (one chain
cannot apply a scale that changes inside it).

Every step is exact or one IEEE rounding (`numerics.tensor_core`); tested bit for bit against
mmaemu (tests/test_accumulation.py). The error metric a run records: `numerics.accumulation_error`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from precision_suite.numerics import quantization
from precision_suite.numerics.formats import get_format
from precision_suite.numerics.layouts import Layout, block_shape, from_blocks
from precision_suite.numerics.tensor_core import (
    GROUP,
    HOPPER_ELEMENTS,
    accumulate_operands,
    chain_runs,
    gemm_operands,
    nonfinite_outputs,
    with_nonfinite,
)

ACCUMULATION_MODES = ("fp32", "hopper-fast", "hopper-promoted")
PROMOTION_INTERVAL = 128  # N_C of DeepSeek-V3 and DeepGEMM; cuBLAS's slow-accumulation chunk


@dataclass(frozen=True)
class Accumulation:
    """How a GEMM accumulates: a mode of ACCUMULATION_MODES and, for ``hopper-promoted``, the
    promotion interval (elements of K per chain, a positive multiple of GROUP)."""

    mode: str = "fp32"
    interval: int = PROMOTION_INTERVAL

    def __post_init__(self) -> None:
        if self.mode not in ACCUMULATION_MODES:
            raise ValueError(f"accumulation mode {self.mode!r}: use one of {', '.join(ACCUMULATION_MODES)}")
        _check_interval(self.interval)

    @property
    def hopper(self) -> bool:
        return self.mode != "fp32"

    def text(self) -> str:
        """ "fp32", "hopper-fast" or "hopper-promoted:128": what `parse_accumulation` reads."""
        return f"{self.mode}:{self.interval}" if self.mode == "hopper-promoted" else self.mode


def parse_accumulation(text: object) -> Accumulation:
    """ "fp32", "hopper-fast", "hopper-promoted" (every 128) or "hopper-promoted:N"."""
    if not isinstance(text, str):
        raise TypeError(
            f'accumulation is written "fp32", "hopper-fast" or "hopper-promoted[:N]", got {text!r}'
        )
    mode, _, interval = text.partition(":")
    if interval and mode != "hopper-promoted":
        raise ValueError(
            f'accumulation {text!r}: only hopper-promoted takes an interval ("hopper-promoted:128")'
        )
    if interval and not interval.isdigit():
        raise ValueError(
            f"accumulation {text!r}: the promotion interval is a number of elements of K, e.g. 128"
        )
    return Accumulation(mode, int(interval) if interval else PROMOTION_INTERVAL)


def _check_interval(interval: object) -> None:
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < GROUP or interval % GROUP:
        raise ValueError(
            f"promotion interval {interval!r}: a positive multiple of {GROUP} (the tensor core's "
            "group of products), such as 128"
        )


def check_mode(mode: str, chunk: int) -> None:
    if mode not in ACCUMULATION_MODES:
        raise ValueError(f"accumulation mode {mode!r}: use one of {', '.join(ACCUMULATION_MODES)}")
    _check_interval(chunk)


def accumulate(
    a: torch.Tensor,
    b: torch.Tensor,
    mode: str,
    chunk: int = PROMOTION_INTERVAL,
    *,
    elements: tuple[str, str] | None = None,
) -> torch.Tensor:
    """The float32 accumulator of a (M, K) @ b (K, N) before any scale, as `mode` computes it
    (the module docstring; what mmaemu.accumulate returns for an unsplit GEMM).

    a, b: float8 tensors (E4M3, E5M2), or float32 tensors of FP8 values with
    ``elements=(element_a, element_b)`` naming their elements ("e4m3", "e5m2"); a value off its
    element's grid is a ValueError. chunk: hopper-promoted's interval, a multiple of 32.
    ``fp32`` is torch's float32 matmul (of any floating-point operands)."""
    check_mode(mode, chunk)
    return accumulate_operands(*gemm_operands(a, b, elements, mode), mode, chunk)


# ----------------------------------------------------------------------------- scales


def gemm_scale(
    scale: torch.Tensor | float, shape: tuple[int, int], name: str, device: torch.device
) -> torch.Tensor:
    """A float32 scale broadcastable to `shape` (a scalar, per row, per column or per element),
    positive and finite."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=device)
    s = s.reshape(1, 1) if s.dim() == 0 else s
    if s.dim() != 2 or any(d not in (1, full) for d, full in zip(s.shape, shape)):
        raise ValueError(
            f"{name} has shape {tuple(s.shape)}: it must broadcast to its operand's {shape} "
            "(a scalar, one per row, one per column, or one per element)"
        )
    if not bool(((s > 0) & s.isfinite()).all()):
        raise ValueError(f"{name} must be positive and finite")
    return s


def _constant_along(s: torch.Tensor, dim: int) -> bool:
    return s.shape[dim] == 1 or bool((s == s.narrow(dim, 0, 1)).all())


def _first_of_chunks(s: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """The scale at the start of each chunk of K (along `dim`)."""
    k = s.shape[dim]
    return s.narrow(dim, 0, 1) if k == 1 else s.index_select(dim, torch.arange(0, k, chunk, device=s.device))


def _constant_within_chunks(s: torch.Tensor, dim: int, chunk: int) -> bool:
    k = s.shape[dim]
    return k == 1 or bool(
        (s == _first_of_chunks(s, dim, chunk).repeat_interleave(chunk, dim).narrow(dim, 0, k)).all()
    )


def _chunk_scales(s: torch.Tensor, dim: int, chunk: int, name: str) -> torch.Tensor:
    """One scale per chunk of K (along `dim`), checked constant within each chunk."""
    if not _constant_within_chunks(s, dim, chunk):
        raise ValueError(
            f"{name} changes within a promotion interval of {chunk} elements of K: a scale can only "
            "be applied where a chain ends, so each interval must lie within one scale block along K "
            "(e.g. 1x128 and 128x128 blocks with an interval of 128)"
        )
    return _first_of_chunks(s, dim, chunk)


def runs_on(scale_a: torch.Tensor | float, scale_b: torch.Tensor | float, accumulation: Accumulation) -> bool:
    """Whether the hardware can accumulate a GEMM with these scales (broadcastable to its a (M, K)
    and b (K, N), as `scaled_gemm` takes them) as `accumulation` says: fp32 and scales constant
    along K always; scales that change along K only under hopper-promoted, each interval inside
    one scale block (what `scaled_gemm` refuses otherwise)."""
    s_a, s_b = torch.as_tensor(scale_a), torch.as_tensor(scale_b)
    s_a, s_b = (s.reshape(1, 1) if s.dim() == 0 else s for s in (s_a, s_b))
    if not accumulation.hopper or (_constant_along(s_a, 1) and _constant_along(s_b, 0)):
        return True
    return (
        accumulation.mode == "hopper-promoted"
        and _constant_within_chunks(s_a, 1, accumulation.interval)
        and _constant_within_chunks(s_b, 0, accumulation.interval)
    )


def _fma32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x * y + z of float32 tensors with one rounding to float32, as a GPU's FFMA.

    The float64 product is exact (24 + 24 bits); the float64 sum is rounded to odd (TwoSum gives
    its exact error) and then to float32, which rounds the exact value correctly since float64
    has more than 2 * 24 + 1 bits."""
    product, addend = x.double() * y.double(), z.double()
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    bits = total.view(torch.int64)
    to_odd = (error != 0) & (bits & 1 == 0) & total.isfinite()
    step = torch.where((error > 0) == (total > 0), 1, -1)
    return torch.where(to_odd, bits + step, bits).view(torch.float64).float()


def scaled_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    mode: str,
    chunk: int = PROMOTION_INTERVAL,
    *,
    elements: tuple[str, str] | None = None,
) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in float32 with `mode`'s accumulation (module docstring).

    a (M, K), b (K, N): FP8 elements as for `accumulate`. scale_a broadcasts to (M, K) and
    scale_b to (K, N): per tensor, per row of a / column of b, or per element (block scales
    expanded, `full_scales`). ``fp32``: torch's float32 matmul of the dequantized operands.
    Scales constant along K multiply the accumulator once (by the float32 product of the two);
    scales that change along K need ``hopper-promoted`` with each interval inside one scale block,
    and are applied to each interval's result on promotion by a fused multiply-add."""
    check_mode(mode, chunk)
    a, b = gemm_operands(a, b, elements, mode)
    (m, k), n, device = a.values.shape, b.values.shape[1], a.values.device
    scale_a, scale_b = (
        gemm_scale(scale_a, (m, k), "scale_a", device),
        gemm_scale(scale_b, (k, n), "scale_b", device),
    )
    if mode == "fp32":
        return (a.values * scale_a) @ (b.values * scale_b)
    if _constant_along(scale_a, 1) and _constant_along(scale_b, 0):
        return accumulate_operands(a, b, mode, chunk) * (scale_a[:, :1] * scale_b[:1])
    if mode == "hopper-fast":
        raise ValueError(
            "hopper-fast accumulates all of K in one tensor-core chain, which cannot apply a scale "
            "that changes along K: use scales per tensor, row or column, or hopper-promoted"
        )
    if k == 0 or m == 0 or n == 0:
        return torch.zeros(m, n, device=device)
    per_chunk_a = _chunk_scales(scale_a, 1, chunk, "scale_a")
    per_chunk_b = _chunk_scales(scale_b, 0, chunk, "scale_b")
    special = nonfinite_outputs(a.values, b.values)
    total = torch.zeros(m, n, device=device)
    for run, rows, chain in chain_runs(a, b, mode, chunk, special):
        # a scale constant along K has one column (row) for every run
        scale_of_a = per_chunk_a[rows, min(run, per_chunk_a.shape[1] - 1), None]
        total[rows] = _fma32(chain, scale_of_a * per_chunk_b[min(run, per_chunk_b.shape[0] - 1)], total[rows])
    return with_nonfinite(total, special)


# ----------------------------------------------------------------------------- quantized operands


def full_scales(scales: torch.Tensor, layout: Layout, rows: int, cols: int) -> torch.Tensor:
    """A quantization's block scales (n_block_rows, n_block_cols) as one scale per element of
    the rows x cols operand, or (1, 1) for a per-tensor scale."""
    if layout == "tensor":
        return scales.reshape(1, 1).float()
    r, c = block_shape(layout, rows, cols)
    nbr, nbc = scales.shape
    return from_blocks(scales.float()[:, None, :, None].expand(nbr, r, nbc, c), rows, cols)


def split_dequantized(dequantized: torch.Tensor, scales: torch.Tensor, element: str) -> torch.Tensor:
    """The FP8 elements q of a quantize-dequantize result, as float32: dequantized == q * scales
    (float32 products) for every element, NaN for NaN. `scales` broadcasts to `dequantized`
    (`full_scales`). The division is off by at most 2 float32 ulps, far below half a step of the
    element's grid, so rounding recovers q; a ValueError says when the product is not the input
    (scales that are not this quantization's)."""
    if element not in HOPPER_ELEMENTS:
        raise ValueError(f"element {element!r} has no tensor-core accumulation model; use e4m3 or e5m2")
    grid = get_format(element).element
    q = quantization.round_to_element((dequantized.float() / scales).clamp(-grid.max, grid.max), grid)
    product = q * scales
    unlike = (product.view(torch.int32) != dequantized.float().view(torch.int32)) & ~dequantized.isnan()
    if bool(unlike.any()):
        raise ValueError(
            f"{int(unlike.sum())} of {dequantized.numel()} values are not an {element} element times "
            "its scale: pass the scales of the quantization that produced them"
        )
    return q
