"""Error metrics of a quantize-dequantize, as defined in ../shared/SCIENCE.md (figure B).

`quant_stats` reduces a tensor to raw sums (counts and float64 dot products). Sums add, so the
several linear layers of one transformer block pool into one number by `a + b` before any ratio
is taken; `QuantStats.metrics()` turns sums into the reported metrics:

- underflow: fraction of elements non-zero before and zero after (Transformer Engine's
  `underflows%`, the lost-information count; Ling 2.0 counts all zeros: that is `zeros_after`);
- zeros_after: fraction of elements zero after quantization (Ling 2.0's definition);
- overflow: fraction of elements whose scaled value rounds past the format max (saturated by the
  clamp) or that are non-finite after;
- distortion: cosine similarity of x and x_hat over the whole tensor, in float64;
- sqnr_db: 20 log10(||x|| / ||x - x_hat||) (+inf when the reconstruction is exact);
- mse: mean of (x - x_hat)**2;
- nonfinite_in: NaN/Inf count of the input. Non-finite elements are left out of every other sum
  (distortion, sqnr, mse) so one bad value does not hide the rest of the tensor.

Tensors of `quantization.COMPILE_MIN_NUMEL` elements or more take a torch.compile'd pass
(`quantization.fused`) that fuses quantization and reductions into two sweeps over memory, except
inside a run too small for compiling to pay (`quantization.compile_pays`); set
PRECISION_SUITE_COMPILE=0 to stay eager, =1 to compile in small runs too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from precision_suite.numerics.formats import Format, get_format
from precision_suite.numerics.layouts import as_2d, parse_layout, to_blocks
from precision_suite.numerics.quantization import check_tensor, fused, qdq_blocks

SUM_FIELDS = ("numel", "nonfinite_in", "underflow", "zeros_after", "overflow", "dot", "xx", "yy", "err2")


@dataclass(frozen=True)
class QuantStats:
    """Additive sums of one or more quantized tensors.

    sums: float64 tensor ordered as SUM_FIELDS; scale_range: float32 [min, max] over blocks.
    Tensors (not Python numbers) so that pooling never forces a device sync.
    """

    sums: torch.Tensor
    scale_range: torch.Tensor

    def __add__(self, other: QuantStats) -> QuantStats:
        return QuantStats(
            self.sums + other.sums,
            torch.stack(
                [
                    torch.minimum(self.scale_range[0], other.scale_range[0]),
                    torch.maximum(self.scale_range[1], other.scale_range[1]),
                ]
            ),
        )

    def metrics(self) -> dict[str, float]:
        values = metrics_from_sums(self.sums.double().cpu().numpy())
        scale_min, scale_max = self.scale_range.tolist()
        return {
            **{name: float(value) for name, value in values.items()},
            "scale_min": scale_min,
            "scale_max": scale_max,
        }


def metrics_from_sums(sums: np.ndarray) -> dict[str, np.ndarray]:
    """The metrics of sums laid out as SUM_FIELDS along the last axis (any leading shape).

    The one definition of every quantization metric: `QuantStats.metrics` uses it for one tensor,
    datasets use it for sums pooled over modules, layers or steps. Cells with numel 0 (nothing
    measured) are NaN; a cell with no finite element has NaN distortion, SQNR and mse (nothing
    measurable is not a perfect reconstruction).
    """
    s = {name: np.asarray(sums, dtype=np.float64)[..., i] for i, name in enumerate(SUM_FIELDS)}
    n = s["numel"]
    finite = n - s["nonfinite_in"]
    with np.errstate(divide="ignore", invalid="ignore"):
        # Cauchy-Schwarz bounds the exact cosine by 1; float64 rounding of the sums may not
        cosine = np.minimum(s["dot"] / np.sqrt(s["xx"] * s["yy"]), 1.0)
        distortion = np.where(
            (s["xx"] == 0) & (s["yy"] == 0),
            1.0,  # zero reproduced as zero
            np.where((s["xx"] == 0) | (s["yy"] == 0), 0.0, cosine),
        )
        sqnr_db = np.where(
            s["err2"] == 0, np.inf, np.where(s["xx"] == 0, -np.inf, 10.0 * np.log10(s["xx"] / s["err2"]))
        )
        nothing = finite <= 0
        return {
            "underflow": s["underflow"] / n,
            "zeros_after": s["zeros_after"] / n,
            "overflow": s["overflow"] / n,
            "distortion": np.where(nothing, np.nan, distortion),
            "sqnr_db": np.where(nothing, np.nan, sqnr_db),
            "mse": np.where(nothing, np.nan, s["err2"] / finite),
            "nonfinite_in": s["nonfinite_in"],
            "numel": n,
        }


def _block_sums(blocks: torch.Tensor, fmt: Format, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 blocks and reduce to (SUM_FIELDS sums, [scale min, scale max]).

    `numel` and `zeros_after` still count the zero padding here; `quant_stats` takes it out, so
    this function sees only the blocks.

    Compiled, this is two sweeps over the blocks: their amax, then everything else (the masks
    read amax, see below), with vector accumulators that run across blocks. Counts accumulate in
    int32 (vectors twice as wide as int64) where the tensor allows, dot products in float64.
    """
    x_hat, scales, scaled, amax = qdq_blocks(blocks, fmt, pow2_scale)
    # The finite elements: amax is each block's largest finite |x|, which NaN and +-Inf exceed.
    # Compared with amax rather than by isfinite(blocks), the compiled kernel computes the mask in
    # its sweep over the blocks instead of a sweep of its own.
    finite = blocks.abs() <= amax
    overflowed = scaled.abs() > fmt.element.overflow_threshold
    return _sums(blocks, x_hat, finite, overflowed), torch.stack([scales.min(), scales.max()])


def _sums(
    x: torch.Tensor, x_hat: torch.Tensor, finite: torch.Tensor, overflowed: torch.Tensor
) -> torch.Tensor:
    """SUM_FIELDS of a float32 tensor `x` and its reconstruction `x_hat`: `finite` marks the finite
    elements of x, `overflowed` those whose scaled value rounded past the format's max."""
    x64 = torch.where(finite, x, 0.0).double()
    y64 = torch.where(finite, x_hat, 0.0).double()
    zero_after = x_hat == 0
    count = torch.int32 if x.numel() < 2**31 else torch.int64
    counts = [
        (~finite).sum(dtype=count),
        ((x != 0) & zero_after).sum(dtype=count),
        zero_after.sum(dtype=count),
        (overflowed | ~torch.isfinite(x_hat)).sum(dtype=count),
    ]
    products = [(x64 * y64).sum(), (x64 * x64).sum(), (y64 * y64).sum(), ((x64 - y64) ** 2).sum()]
    return torch.stack(
        [
            torch.full((), x.numel(), dtype=torch.float64, device=x.device),
            *(c.double() for c in counts),
            *products,
        ]
    )


# Elements per pass of `reconstruction_stats`: its float64 temporaries (512 KB each) stay in cache
# and in the heap's reused blocks. Whole-tensor temporaries of a 1024 x 1024 operand (8 MB each,
# fresh pages every call) made it 5 times slower.
_RECONSTRUCTION_CHUNK = 1 << 16


def reconstruction_stats(
    x: torch.Tensor, x_hat: torch.Tensor, scaled: torch.Tensor, threshold: float
) -> QuantStats:
    """The sums of a quantization someone else made: `x` the high-precision tensor, `x_hat` its
    reconstruction (same number of elements), `scaled` x in the format's grid units (as the cast
    received it) and `threshold` the magnitude past which a scaled value rounds past the format's
    max (overflow). Same definitions as `quant_stats`; the scale range is not known (NaN).

    Where x and x_hat are finite (their float64 sums of squares say so exactly: a float32 square
    cannot overflow float64), the counts come from counting nonzeros in float arithmetic, which on
    CPU runs several times faster than the boolean masks of the general case (`_sums`)."""
    x, x_hat = x.detach().float().reshape(-1), x_hat.detach().float().reshape(-1)
    nan = torch.full((2,), float("nan"), device=x.device)
    # sum x * x_hat, sum x^2, sum x_hat^2, sum (x - x_hat)^2; nonzeros of x, x * x_hat, x_hat
    products = torch.zeros(4, dtype=torch.float64, device=x.device)
    nonzero = torch.zeros(3, dtype=torch.int64, device=x.device)
    for start in range(0, x.numel(), _RECONSTRUCTION_CHUNK):
        part, part_hat = (
            x[start : start + _RECONSTRUCTION_CHUNK],
            x_hat[start : start + _RECONSTRUCTION_CHUNK],
        )
        x64, y64 = part.double(), part_hat.double()
        product = x64 * y64  # zero exactly where either is: float32 products do not underflow float64
        squares = torch.dot(x64, x64)
        err = x64.sub_(y64)  # x64 is this loop's own copy
        products += torch.stack([product.sum(), squares, torch.dot(y64, y64), torch.dot(err, err)])
        nonzero += torch.stack([torch.count_nonzero(t) for t in (part, product, part_hat)])
    if not bool(torch.isfinite(products[1] + products[2])):
        overflowed = (scaled.abs() > threshold).reshape(x.shape)
        return QuantStats(_sums(x, x_hat, torch.isfinite(x), overflowed), nan)
    nonzero = nonzero.double()
    overflow = torch.zeros((), dtype=torch.float64, device=x.device)
    if scaled.numel() and not bool(torch.maximum(scaled.amax(), -scaled.amin()) <= threshold):
        overflow += torch.count_nonzero(scaled.abs() > threshold)
    numel = torch.full((), x.numel(), dtype=torch.float64, device=x.device)
    sums = [
        numel,
        torch.zeros_like(numel),  # nonfinite_in
        nonzero[0] - nonzero[1],  # underflow
        numel - nonzero[2],  # zeros_after
        overflow,
        *products,
    ]
    return QuantStats(torch.stack(sums), nan)


def quant_stats(
    x: torch.Tensor, fmt: str | Format = "e4m3", layout: object = None, pow2_scale: bool = False
) -> QuantStats:
    """Quantize `x` and reduce the result to additive sums (see module doc)."""
    x = check_tensor(x)
    if x.numel() == 0:
        raise ValueError("quant_stats: x is empty; error metrics of an empty tensor are undefined")
    f = get_format(fmt)
    lay = parse_layout(layout, f)
    x2d = as_2d(x.detach().float())
    blocks = to_blocks(x2d, lay)
    sums, scale_range = fused(_block_sums, blocks, f, lay, pow2_scale)
    n_pad = blocks.numel() - x2d.numel()
    if n_pad:  # padding is zero before and after: it is not data
        sums = sums - torch.tensor([n_pad, 0, 0, n_pad, 0, 0, 0, 0, 0], dtype=sums.dtype, device=sums.device)
    return QuantStats(sums, scale_range)


def quant_error(
    x: torch.Tensor, fmt: str | Format = "e4m3", layout: object = None, pow2_scale: bool = False
) -> dict[str, float]:
    """Quantization error metrics of `x` under `fmt` and `layout` (see module doc for each key)."""
    return quant_stats(x, fmt, layout, pow2_scale).metrics()
