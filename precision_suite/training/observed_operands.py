"""What an observed GEMM operand is (training/observation.py finds them): its element format,
scaling block and scale kind in recipe vocabulary, where its scale maps the blocks' amax (the
scale's target), and how good and how correct its quantization of the high-precision source is.

Operands are described as the suite's recipes describe them (recipes.py): x as (tokens, in), W as
(out, in), dy as (tokens, out), so a granularity reads the same in a declaration and in an
observation ("e4m3:row" is one scale per row of x).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from precision_suite.numerics.code_tables import Codes, codes
from precision_suite.numerics.formats import ElementType, get_format
from precision_suite.numerics.layouts import to_blocks
from precision_suite.numerics.metrics import QuantStats, reconstruction_stats
from precision_suite.numerics.quantization import round_by_bits

GEMMS = ("fprop", "dgrad", "wgrad")
# dtype name -> the suite's element format of the data; scale dtypes are described apart
LOW_PRECISION = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2fnuz": "e5m2fnuz",
}
UNQUANTIZED = "fp32"  # an operand a GEMM of a quantized module took unquantized (recipes.HIGH_PRECISION)
# the axis each operand reduces over in the suite's orientation: x (tokens, in) and W (out, in)
# over `in` in fprop; dy (tokens, out) over `out` and W over `out` in dgrad; dy and x over tokens
CONTRACTION_AXIS = {"fprop.a": 1, "fprop.b": 1, "dgrad.a": 1, "dgrad.b": 0, "wgrad.a": 0, "wgrad.b": 0}
# consumed elements may be off by rounding of the recomputed scaled source: a product or quotient
# recomputed with the reciprocal scale is within 2 float32 ulps of the one the kernel computed
_SOURCE_SLACK = 2.0**-22


@dataclass(frozen=True)
class Scaling:
    """How a quantized tensor relates to its high-precision source: ``op`` "mul" (q = x * factor,
    torchao's convention) or "div" (q = x / factor, the dequantization scale `_scaled_mm` takes)."""

    op: str
    factor: Tensor

    def scaled(self, x: Tensor) -> Tensor:
        """The source in the quantized grid's units."""
        return x * self.factor if self.op == "mul" else x / self.factor

    def dequantized(self, q: Tensor) -> Tensor:
        """The reconstruction a GEMM with this scale computes with."""
        return q / self.factor if self.op == "mul" else q * self.factor

    def transposed(self) -> Scaling:
        return Scaling(self.op, self.factor.t() if self.factor.dim() == 2 else self.factor)


@dataclass
class ObservedOperand:
    """One operand of one observed scaled GEMM, in the suite's orientation (module docstring)."""

    module: str
    gemm: str  # fprop | dgrad | wgrad
    operand: str  # "fprop.a" ... "wgrad.b"
    fmt: str  # element format: "e4m3", "e5m2", ...
    granularity: str  # "tensor", "row", "column" or "RxC" blocks
    block: str  # the block one scale covers, "RxC" ("tensor": one scale), whatever its granularity's name
    scale: str  # scale kind: "float32", "float32 pow2", "float8_e8m0fnu", ...
    fast_accumulation: bool | None  # the GEMM's use_fast_accum, None where the call does not say
    stats: QuantStats | None  # None: the source was not found
    mismatched: int  # consumed elements round-to-nearest of the source cannot give
    checked: int  # elements compared (0: the source was not found or the format is unknown)
    target: float = math.nan  # the scale's target (scale_target), NaN where not read
    shape: str = ""  # "RxC": the operand's rows x columns in the suite's orientation (blocks clip to it)
    quantized_gemm: bool = (
        True  # its GEMM took a quantized operand (False: an fp32 GEMM of a quantized module)
    )

    @property
    def text(self) -> str:
        """The recipe vocabulary's "<fmt>:<layout>" (recipes.Operand.text), "fp32" unquantized."""
        return self.fmt if self.fmt == UNQUANTIZED else f"{self.fmt}:{self.granularity}"


@dataclass
class StepObservation:
    """What one sampled step observed (no tensor of the step is kept)."""

    operands: list[ObservedOperand] = field(default_factory=list)
    cast_modules: set[str] = field(default_factory=set)  # modules that cast to 8-bit floats
    unconsumed: dict[str, int] = field(
        default_factory=dict
    )  # module -> elements cast but fed to no GEMM seen


def describe_observation(steps: Sequence[StepObservation], model: torch.nn.Module) -> str:
    """What quantized a run, in a line: the classes of the modules whose scaled GEMMs were observed
    and the observed recipe, e.g. "observed: Float8Linear (torchao.float8.float8_linear) in 4
    modules; fprop e4m3:tensor x e4m3:tensor, dgrad e5m2:tensor x e4m3:tensor, ..."."""
    modules = dict(model.named_modules())
    operands = [item for step in steps for item in step.operands]
    if not operands:
        casts = sum(sum(step.unconsumed.values()) for step in steps)
        return f"observed: {casts:,} elements cast to 8-bit floats, no scaled GEMM seen" if casts else ""
    owners = dict.fromkeys(item.module for item in operands)
    classes = dict.fromkeys(
        f"{type(modules[name]).__name__} ({type(modules[name]).__module__})"
        for name in owners
        if name in modules
    )
    texts: dict[str, dict[str, None]] = {}
    for item in operands:
        texts.setdefault(item.operand, {})[item.text] = None
    recipe = ", ".join(
        f"{gemm} {' x '.join('|'.join(texts.get(f'{gemm}.{side}', {'-': None})) for side in 'ab')}"
        for gemm in GEMMS
        if f"{gemm}.a" in texts or f"{gemm}.b" in texts
    )
    return f"observed: {', '.join(classes) or 'the model'} in {len(owners)} module(s); {recipe}"


def low_precision_format(dtype: torch.dtype) -> str | None:
    """The element format of a low-precision dtype this module observes, None for any other."""
    return LOW_PRECISION.get(str(dtype).removeprefix("torch."))


def describe_operand(
    module: str,
    gemm: str,
    operand: str,
    data: Tensor,
    scaling: Scaling | None,
    source: Tensor | None,
    cast_input: Tensor | None,
    fast: bool | None,
    consumed: Tensor | None = None,
) -> ObservedOperand:
    """One operand, in the suite's orientation: `data` the 8-bit values (a high-precision tensor
    where `scaling` is None: taken unquantized), `scaling` its scale over `data`, `source` the
    high-precision tensor it was quantized from and `cast_input` its cast's input (None: not
    found), `fast` its GEMM's use_fast_accum, `consumed` the reconstruction a fake-quantized GEMM
    took (None: the data times its scale, as a scaled GEMM computes)."""
    shape = f"{data.shape[0]}x{data.shape[1]}"
    if scaling is None:
        return ObservedOperand(module, gemm, operand, UNQUANTIZED, "", "", "", fast, None, 0, 0, shape=shape)
    fmt = low_precision_format(data.dtype) or str(data.dtype).removeprefix("torch.")
    compact = _compact_factor(scaling.factor, data.shape)
    granularity = _granularity(scaling.factor, data.shape, compact is not None)
    block = (
        "tensor"
        if granularity in ("tensor", "unknown")
        else f"{data.shape[0] // scaling.factor.shape[0]}x{data.shape[1] // scaling.factor.shape[1]}"
    )
    kind = _scale_kind(scaling.factor)
    if compact is None:
        return ObservedOperand(
            module, gemm, operand, fmt, granularity, block, kind, fast, None, 0, 0, shape=shape
        )
    if not data.is_contiguous() and data.t().is_contiguous():
        # what follows is the same in either orientation: sweep the tensors in memory order
        data, source, cast_input, consumed, compact = (
            None if t is None else t.t() for t in (data, source, cast_input, consumed, compact)
        )
    blocks = tuple(compact.shape)
    # each block its own (r, c) slice: the factor (R/r, 1, C/c, 1) scales it without being repeated
    layout = (data.shape[0] // blocks[0], data.shape[1] // blocks[1])
    per_block = Scaling(scaling.op, compact.reshape(blocks[0], 1, blocks[1], 1))
    table = codes(data.dtype, data.device) if low_precision_format(data.dtype) else None
    index = table.index(data) if table is not None else None

    @functools.cache
    def values() -> Tensor:  # the 8-bit values as float32, by block; only where something needs them
        q = data.float() if table is None else table.value.index_select(0, index).reshape(data.shape)
        return to_blocks(q, layout)

    dequantized = per_block.dequantized(values()) if consumed is None else consumed.contiguous()
    stats, mismatched, checked = None, 0, 0
    scaled = per_block.scaled(to_blocks(source.contiguous(), layout)) if source is not None else None
    # where amax maps: the scaled source before any clamp, else the 8-bit values the GEMM took
    target = scale_target((scaled if scaled is not None else values()).reshape(data.shape), blocks, fmt, kind)
    if scaled is not None:
        # the cast's own input, where the GEMM's scale agrees with the cast's: exact, no slack
        cast_input = None if cast_input is None else to_blocks(cast_input.contiguous(), layout)
        exact = cast_input is not None and _within(cast_input, scaled, _SOURCE_SLACK)
        reference = cast_input if exact else scaled
        element = _element(fmt)
        threshold = element.overflow_threshold if element is not None else math.inf
        stats = reconstruction_stats(source, dequantized, reference, threshold)
        if element is not None:
            slack = 0.0 if exact else _SOURCE_SLACK
            mismatched = _unlike_nearest(values, reference, element, slack, index, table)
            checked = data.numel()
    return ObservedOperand(
        module,
        gemm,
        operand,
        fmt,
        granularity,
        block,
        kind,
        fast,
        stats,
        mismatched,
        checked,
        target,
        shape=shape,
    )


# --------------------------------------------------------------------------- helpers


def _element(fmt: str) -> ElementType | None:
    try:
        return get_format(fmt).element
    except ValueError:
        return None


def _compact_factor(factor: Tensor, shape: torch.Size) -> Tensor | None:
    """The scale factor as one value per block of a 2-D operand of `shape`, shape (R/r, C/c): one
    per tensor, row, column or block; None for a layout this cannot read (swizzled MX scales)."""
    if factor.numel() == 1:
        return factor.reshape(1, 1)
    if factor.dim() != 2:
        return None
    rows, cols = shape
    fr, fc = factor.shape
    if fr == 0 or fc == 0 or rows % fr or cols % fc:
        return None
    return factor


def _granularity(factor: Tensor, shape: torch.Size, readable: bool) -> str:
    """ "tensor", "row" (one scale per row), "column", "RxC" blocks, or "unknown"."""
    if factor.numel() == 1:
        return "tensor"
    if not readable:
        return "unknown"
    rows, cols = shape
    block = (rows // factor.shape[0], cols // factor.shape[1])
    if block == (1, cols):
        return "row"
    if block == (rows, 1):
        return "column"
    return f"{block[0]}x{block[1]}"


def block_factor(
    factor: Tensor, shape_at: Sequence[int], chain: Sequence[Callable[[Tensor], Tensor]]
) -> Tensor | None:
    """The scale `factor`, broadcast over a tensor of shape `shape_at` and taken through `chain` to
    a 2-D operand, as one factor per block of that operand: shape (rows / r, cols / c). Which block
    an element belongs to is read from the factor's index, broadcast and replayed like the tensor,
    not from its values (neighbouring blocks may share a scale, power-of-two scales often do); a
    factor as large as the tensor (expanded already, e.g. by repeat_interleave) is read from its
    values. None where the blocks do not tile the operand."""
    factor = factor.detach()
    if factor.numel() == 1:
        return factor.float().reshape(())
    expanded = factor.numel() == math.prod(shape_at)
    if expanded:
        compact = _compact_key(factor.float(), shape_at, chain)
        return None if compact is None else compact.float()
    # which factor each block takes depends on the shapes and the chain only: cached by them (a
    # chain whose steps are not all plain values is read afresh)
    steps = tuple(getattr(step, "key", None) for step in chain)
    cache_key = None if None in steps else (tuple(factor.shape), factor.device, tuple(shape_at), steps)
    if cache_key not in _BLOCK_INDEX:
        ids = torch.arange(factor.numel(), device=factor.device).reshape(factor.shape)
        index = _compact_key(ids, shape_at, chain)
        if cache_key is None:
            return None if index is None else factor.float().flatten()[index]
        if len(_BLOCK_INDEX) >= 4096:
            _BLOCK_INDEX.clear()
        _BLOCK_INDEX[cache_key] = index
    index = _BLOCK_INDEX[cache_key]
    return None if index is None else factor.float().flatten()[index]


# (factor shape, device, shape_at, the chain's step keys) -> block_factor's index of each block's factor
_BLOCK_INDEX: dict[tuple, Tensor | None] = {}


def _compact_key(
    key: Tensor, shape_at: Sequence[int], chain: Sequence[Callable[[Tensor], Tensor]]
) -> Tensor | None:
    """`key` broadcast over `shape_at` and taken through `chain`, one value per block of the 2-D
    result; None where the blocks do not tile it (block_factor)."""
    try:
        key = key.expand(tuple(shape_at))
        for step in chain:
            key = step(key)
    except RuntimeError:
        return None
    if key.dim() != 2:
        return None
    r, c = _run_length(key), _run_length(key.t())
    compact = key[::r, ::c]
    rows, cols = key.shape
    if not bool((key.reshape(rows // r, r, cols // c, c) == compact[:, None, :, None]).all()):
        return None
    return compact


def _run_length(key: Tensor) -> int:
    """The rows one block of `key` (2-D) spans: the greatest common divisor of where it changes."""
    changes = ((key[1:] != key[:-1]).any(dim=1).nonzero().flatten() + 1).tolist()
    return math.gcd(key.shape[0], *changes)


def scale_target(scaled: Tensor, blocks: Sequence[int], fmt: str, scale_kind: str) -> float:
    """The scale's target: the largest scaled magnitude per block as a fraction of the format's
    largest finite value (amax -> 448 in E4M3 is 1.0, amax -> 240 is 0.54), NaN where unknown;
    `blocks`: how many blocks along rows and columns (the compact scale's shape).

    Part of the observed recipe, so unchanged code must give the identical value under rounding
    noise and other seeds: the median over the blocks that hold a nonzero (a recipe maps every
    block's amax the same way; outliers of a clamp or an all-zero block do not move a median),
    rounded to 2 significant digits (a float32 scale computed as target / amax lands within an
    ulp of the target). With power-of-two scales a block's amax lands anywhere in (T/2, T] for a
    target T: what such a recipe determines is that bracket, reported as its upper end, the power
    of two at or above the median (1.0 for amax -> 448 floored to a power of two, 0.5 for 240)."""
    element = _element(fmt)
    if element is None or scaled.dim() != 2 or len(blocks) != 2:
        return math.nan
    rows, cols = scaled.shape
    across, down = blocks
    if across == 0 or down == 0 or rows % across or cols % down:
        return math.nan
    blocked = scaled.detach().reshape(across, rows // across, down, cols // down)
    # per block: the largest of max and -min (no pass for |x|), then a few values, in numpy
    extremes = torch.stack([blocked.amax(dim=(1, 3)), blocked.amin(dim=(1, 3))]).cpu().numpy()
    amax = np.maximum(extremes[0], -extremes[1]).ravel()
    amax = np.sort(amax[np.isfinite(amax) & (amax > 0)])
    if not amax.size:
        return math.nan
    ratio = float(amax[(amax.size - 1) // 2]) / element.max  # the lower median, as torch's
    if scale_kind.endswith("pow2"):
        return 2.0 ** math.ceil(math.log2(ratio))
    return float(f"{ratio:.2g}")


def _scale_kind(factor: Tensor) -> str:
    """The scale's dtype, with " pow2" when every finite nonzero scale is a power of two."""
    kind = str(factor.dtype).removeprefix("torch.")
    if factor.is_floating_point() and factor.element_size() >= 2:
        values = factor.detach().float().cpu().numpy()  # one value per block: numpy is quicker
        nonzero = np.abs(values[(values != 0) & np.isfinite(values)])
        if nonzero.size and bool((np.frexp(nonzero)[0] == 0.5).all()):
            kind += " pow2"
    return kind


def _within(values: Tensor, reference: Tensor, slack: float) -> bool:
    """Whether every element of `values` is within the relative `slack` of `reference`: false where
    either is NaN. In float arithmetic, which a CPU runs several times faster than comparisons;
    first whether they are equal (the usual case: the same op on the same tensors)."""
    difference = values - reference
    if not int(torch.count_nonzero(difference)):  # NaN - anything is NaN: counted
        return True
    excess = difference.abs_().sub_(reference.abs(), alpha=slack)
    return bool(excess.amax() <= 0)


def _rounds_to_nearest(index: Tensor, scaled: Tensor, table: Codes) -> bool:
    """Whether each code in `index` is the round-to-nearest-even of its element of `scaled`
    (saturating): each lies in its code's interval. False where any scaled element is NaN."""
    scaled = scaled.reshape(-1)
    below = table.low.index_select(0, index).sub_(scaled)  # <= 0 where scaled >= low
    above = table.high.index_select(0, index).sub_(scaled)  # >= 0 where scaled <= high
    return bool((below.amax() <= 0) & (above.amin() >= 0))


def _unlike_nearest(
    values: Callable[[], Tensor],
    scaled: Tensor,
    element: ElementType,
    slack: float,
    index: Tensor | None = None,
    table: Codes | None = None,
) -> int:
    """How many elements of q = values() (the low-precision values as float32, computed only where
    the tables do not settle it) round-to-nearest-even of the scaled source cannot give,
    saturating at +-max, allowing the source the relative `slack` of its recomputation: q must lie
    between the roundings of the interval's ends (rounding is monotone). A non-finite source
    admits NaN and +-max.

    First q against the rounding of the source itself, which every admitted interval contains: a
    quantization that matches it (the usual case) is settled in a few float operations on the
    codes' tables (`index` the codes of q, `table` theirs; without them every element is rounded)."""
    if table is not None and index.numel() and _rounds_to_nearest(index, scaled, table):
        return 0
    q = values()
    finite = torch.isfinite(scaled)
    value = torch.where(finite, scaled, 0.0)
    if slack == 0:  # the exact input: one rounding
        nearest = round_by_bits(value.clamp(-element.max, element.max), element)
        admitted = torch.where(finite, q == nearest, q.isnan() | (q.abs() == element.max))
        return int((~admitted).sum())
    low = value - value.abs() * slack
    high = value + value.abs() * slack
    low = round_by_bits(low.clamp(-element.max, element.max), element)
    high = round_by_bits(high.clamp(-element.max, element.max), element)
    admitted = torch.where(finite, (q >= low) & (q <= high), q.isnan() | (q.abs() == element.max))
    return int((~admitted).sum())
