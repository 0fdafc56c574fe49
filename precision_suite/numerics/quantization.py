"""Quantize-dequantize: the one place where scale rules and element rounding live.

Scales are float32 arithmetic; elements round through torch's own cast where the element type
has one (values clamped first, so every torch release agrees) and through exact bit arithmetic
otherwise (E2M1, or any newly declared minifloat) and in compiled kernels (`fused`). Both are
checked bit for bit against ml_dtypes.

Non-finite inputs: NaN and +-Inf do not take part in a block's amax (they would wipe out the
whole block); NaN stays NaN and +-Inf saturates to +-max times the block scale. metrics.py counts
both.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from precision_suite.numerics.formats import E4M3, ElementType, Format, get_format
from precision_suite.numerics.layouts import Layout, as_2d, from_blocks, parse_layout, to_blocks

# Floor of an "amax" scale: the smallest normal float32, so an all-zero block gets a finite scale.
TINY_SCALE = 2.0**-126
# Below this many elements quantization runs eagerly. Once compiled, a kernel is cheaper than eager
# ops at every size, but each new layout and pattern of single-block dimensions compiles a graph:
# tensors this small (a model's smallest weights, the random shapes of property tests) take
# under a millisecond eagerly, while a 128 x 384 weight takes several.
COMPILE_MIN_NUMEL = 1 << 15
# A run compiles only when its quantizers see this many elements (Trainer.quantized_elements).
# Compiling costs a process about 3 s of torch.compile imports plus 1.3 s per graph loaded from the
# kernel cache (benchmarks/warmup.py; 5-15 s more per graph when the cache is cold), so 5-8 s for a
# recipe's graphs; eager costs 10-20 ns per element more than compiled to quantize and 60-80 ns
# more to measure (2-core x86 host, 64k-262k element tensors). Break-even is near 1e8 quantized
# elements; a run below it (a test's or a user's small model) never pays the compile tax.
COMPILE_MIN_RUN_ELEMENTS = 10**8
_F32_EXP_MASK = 0x7F800000
_F32_MAN_BITS = 23


def round_to_element(y: torch.Tensor, element: ElementType) -> torch.Tensor:
    """Round float32 `y` (already within +-element.max) to the nearest element, ties to even.

    Eagerly torch's own cast where the element has a torch type (callers clamp first: older torch
    releases turn e4m3 values past 464 into NaN instead of saturating), else exact bit arithmetic.
    Inside torch.compile always the bit arithmetic: inductor's CPU cast to float8 is a scalar loop
    per element, the bit arithmetic vectorizes. Both are checked bit for bit against ml_dtypes
    (tests/test_oracle.py).
    """
    if element.torch_dtype is not None and not torch.compiler.is_compiling():
        return y.to(getattr(torch, element.torch_dtype)).to(torch.float32)
    return round_by_bits(y, element)


def round_by_bits(y: torch.Tensor, element: ElementType) -> torch.Tensor:
    """`round_to_element` in float32 arithmetic on the bit pattern: any minifloat grid."""
    if element.emin - element.man_bits >= -126:
        # y / quantum is exact and torch.round rounds half to even
        quantum = element_quantum(y, element)
        if element.emax - element.man_bits <= 126:
            # 1 / quantum is a normal float32 too: multiplying by it rounds exactly as dividing
            # (both are y * 2**-k correctly rounded) and is several times cheaper
            return torch.round(y * ((254 << 23) - quantum.view(torch.int32)).view(torch.float32)) * quantum
        return torch.round(y / quantum) * quantum
    # Same exponent range as float32 (bf16): round the bit pattern, the subnormals included.
    shift = _F32_MAN_BITS - element.man_bits
    bits = y.view(torch.int32)
    bits = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) & ~((1 << shift) - 1)
    # a NaN's payload can carry into the sign bit and wrap around to zero: NaN stays NaN
    return torch.where(torch.isnan(y), y, bits.view(torch.float32))


def _binade(a: torch.Tensor) -> torch.Tensor:
    """2**floor(log2(a)) for finite float32 a > 0, subnormals included (exact bit arithmetic)."""
    subnormal = a < 2.0**-126
    # a subnormal is scaled into the normal range (exactly) and its binade scaled back
    top = (torch.where(subnormal, a * 2.0**24, a).view(torch.int32) & _F32_EXP_MASK).view(torch.float32)
    return torch.where(subnormal, top * 2.0**-24, top)


def element_quantum(y: torch.Tensor, element: ElementType) -> torch.Tensor:
    """The element grid's spacing at each float32 value of `y`: the quantum of y's binade, floored
    at the subnormal quantum. A normal float32 for elements whose subnormals are (emin - man_bits
    >= -126: every 8-bit and 4-bit format)."""
    if element.emin - element.man_bits < -126:
        raise ValueError(f"element {element.name}: its quantum is not a normal float32")
    exp_bits = (y.view(torch.int32) & _F32_EXP_MASK).clamp(min=(element.emin + 127) << 23)
    return (exp_bits - (element.man_bits << 23)).view(torch.float32)


def stochastic_round(y: torch.Tensor, element: ElementType, generator: torch.Generator) -> torch.Tensor:
    """Round float32 `y` (within +-element.max) to one of its two neighbouring elements, up with
    probability equal to the distance from the lower one in quanta: unbiased, E[result] = y.
    floor(y / q + u), u ~ U[0, 1), drawn from `generator` (seeded: deterministic)."""
    quantum = element_quantum(y, element)
    u = torch.rand(y.shape, generator=generator, device=y.device, dtype=torch.float32)
    rounded = torch.floor(y / quantum + u) * quantum
    return rounded.clamp(-element.max, element.max)


def _finite_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Per-block max |x| over finite elements, shape (n_block_rows, 1, n_block_cols, 1)."""
    return torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=(1, 3), keepdim=True)


def block_scales(amax: torch.Tensor, fmt: Format, pow2_scale: bool = False) -> torch.Tensor:
    """The float32 scale of each block from its amax, by the format's scale rule."""
    element = fmt.element
    if fmt.scale_rule == "none":
        return torch.ones_like(amax)
    if fmt.scale_rule == "amax":
        scale = torch.clamp(_quotient(amax, element.max), min=TINY_SCALE)
        if pow2_scale:  # round up to a power of two, so no element can exceed max
            # scale is a normal float32 (>= TINY_SCALE): a power of two is its own binade
            binade = _binade(scale)
            return torch.where(binade == scale, scale, binade * 2.0)
        return scale
    if fmt.scale_rule == "e8m0":
        # OCP MX v1.0 section 6.3: X = 2**(floor(log2(amax)) - emax_elem), E8M0 range [-127, 127].
        # Bit arithmetic, not frexp/ldexp: a compiled kernel recomputes the scale for every row of
        # a (32, 1) block, and inductor's frexp and ldexp are scalar loops.
        scale = torch.clamp(_binade(amax) * 2.0**-element.emax, 2.0**-127, 2.0**127)
        # an all-zero block: frexp's exponent of zero is 0, i.e. shared exponent -1 - emax
        return torch.where(amax > 0, scale, 2.0 ** min(max(-1 - element.emax, -127), 127))
    if fmt.scale_rule == "nvfp4":
        # FP32 tensor scale maps the tensor amax onto max(E2M1) * max(E4M3); the E4M3 block scale
        # then covers each block's amax / max(E2M1).
        tensor_scale = torch.clamp(_quotient(amax.amax(), element.max * E4M3.max), min=TINY_SCALE)
        wanted = torch.clamp(amax / element.max / tensor_scale, max=E4M3.max)
        return round_to_element(wanted, E4M3) * tensor_scale
    raise ValueError(f"format {fmt.name!r}: unknown scale rule {fmt.scale_rule!r}")


def _quotient(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """amax / divisor in float32, rounded as IEEE float32 division rounds, on every device. CUDA
    divides by a scalar through its reciprocal, and inductor does so for tensor divisors too:
    on an H200 that moved the E4M3 (1, 128) scale by one ulp in 1938 of 4096 blocks. In float64
    the quotient is off by at most an ulp of float64, which its rounding to float32 removes
    (for the maxima here, 448, 57344 and 2688, 7 or 21 times a power of two, the quotient's binary
    expansion repeats and never rounds onto a float32 tie; tests/test_oracle.py checks it)."""
    return (amax.double() / divisor).float()


class BlockQDQ(NamedTuple):
    """What quantize-dequantize of float32 blocks `(nbr, r, nbc, c)` yields, for metrics.py."""

    dequantized: torch.Tensor  # same shape as the blocks
    scales: torch.Tensor  # (nbr, 1, nbc, 1)
    scaled: torch.Tensor  # x / s before saturation (metrics count overflow on it)
    amax: torch.Tensor  # (nbr, 1, nbc, 1), the largest finite |x| of each block


def qdq_blocks(
    blocks: torch.Tensor,
    fmt: Format,
    pow2_scale: bool = False,
    rounding: Callable[[torch.Tensor, ElementType], torch.Tensor] | None = None,
) -> BlockQDQ:
    """Quantize-dequantize float32 blocks `(nbr, r, nbc, c)`; `rounding(scaled, element)` puts the
    scaled elements (within +-element.max) on the grid: `round_to_element` (looked up when called,
    so a planted rounding bug reaches it) or e.g. `stochastic_round` with a generator.

    A zero scale (an NVFP4 block scale that underflowed E4M3) flushes its block: dividing by an
    infinite stand-in scale sends every finite element to zero.
    """
    amax = _finite_amax(blocks)
    scales = block_scales(amax, fmt, pow2_scale)
    scaled = blocks / torch.where(scales > 0, scales, torch.inf)
    element = fmt.element
    q = (rounding or round_to_element)(scaled.clamp(-element.max, element.max), element)
    return BlockQDQ(q * scales, scales, scaled, amax)


def dequantize_blocks(
    blocks: torch.Tensor, fmt: Format, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qdq_blocks` reduced to what `quantize` returns: (dequantized, scales)."""
    result = qdq_blocks(blocks, fmt, pow2_scale)
    return result.dequantized, result.scales


T = TypeVar("T")
_compiled: dict[tuple[Callable, Format, Layout, bool], Callable] = {}
_compile_failed = False
# False inside `compiling_if(False)`: a run too small for compiling to pay. A process-wide flag, not
# a context variable: autograd runs a CUDA backward (dgrad, wgrad, the gradient probes) on a thread
# of its own, which would not see the run's context; a process trains one run at a time.
_run_compiles = True
_eager_only = False  # True inside `eager()`
COMPILE_SETTINGS = ("", "0", "1")  # PRECISION_SUITE_COMPILE: unset (each run decides), never, always


def compile_pays(elements: int) -> bool:
    """Whether a run whose quantizers see `elements` elements in all should compile them."""
    return elements >= COMPILE_MIN_RUN_ELEMENTS


@contextmanager
def compiling_if(pays: bool) -> Iterator[None]:
    """Inside the block, `fused` stays eager unless `pays` (tensors below COMPILE_MIN_NUMEL stay
    eager either way). A run decides once, from its spec (`compile_pays`), so its numbers do not
    depend on what the process compiled before."""
    global _run_compiles
    saved, _run_compiles = _run_compiles, bool(pays)
    try:
        yield
    finally:
        _run_compiles = saved


@contextmanager
def eager() -> Iterator[None]:
    """Inside the block nothing compiles, whatever its size or the run decided: for one-off work
    in a process that may never compile otherwise (the report's accumulation law: 0.3 s eager, 4 s
    with the compile tax)."""
    global _eager_only
    saved, _eager_only = _eager_only, True
    try:
        yield
    finally:
        _eager_only = saved


_INDUCTOR_OPTIONS = {
    # Every intermediate of a fused function is a pointwise function of the blocks on its way into
    # a reduction: recomputing it in the sweep over the blocks costs a few vector ops, storing it a
    # full-size buffer written and read back. Inductor stores CPU bodies of more than 50 ops, which
    # the MX and NVFP4 scale rules exceed.
    "realize_opcount_threshold": 1000,
    # Multiply-adds into FMAs: the float64 sums of metrics.py add products of float32 values (and
    # of x - x_hat, exact in float32), which are exact in float64, so an FMA rounds them the same;
    # the sweep gets about a tenth faster. The quantizer itself has no multiply-add to contract.
    "cpp.enable_floating_point_contract_flag": "fast",
}


def inductor_backend(tag: str, options: dict[str, object] | None = None) -> Callable:
    """Inductor with `tag` in the keys of its on-disk caches (FX graph and AOT autograd caches),
    with the quantizer's `_INDUCTOR_OPTIONS` unless `options` are given.

    The caches key on the traced graph, its input shapes and the compiler settings; the tag (the
    fused function, the full Format and the layout) adds those explicitly, so a kernel cached for
    one format or layout cannot be served to another even if their graphs printed alike. It is
    set only while a graph compiles: calls that hit compiled graphs pay nothing for it.
    """

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        with torch.compiler.config.patch(cache_key_tag=tag):
            return compile_fx(
                gm, example_inputs, config_patches=_INDUCTOR_OPTIONS if options is None else options
            )

    return backend


def compiled(fn: Callable, tag: str, options: dict[str, object] | None = None) -> Callable:
    """`fn` through torch.compile on `inductor_backend(tag, options)`, called without grad unless an
    input needs it: dynamo guards on grad mode, and forward hooks (grad on) and gradient hooks (grad
    off) would otherwise each compile, or load from the disk cache, a graph of their own."""
    graph = torch.compile(fn, dynamic=False, backend=inductor_backend(tag, options))

    def call(*tensors: torch.Tensor):
        with nullcontext() if any(t.requires_grad for t in tensors) else torch.no_grad():
            return graph(*tensors)

    return call


def _compile(
    fn: Callable[[torch.Tensor, Format, bool], T], fmt: Format, layout: Layout, pow2_scale: bool
) -> Callable:
    def fused_blocks(b: torch.Tensor) -> T:
        return fn(b, fmt, pow2_scale)

    # A code object of its own: dynamo keeps graphs (and its limit of 8) per code object, and
    # the closures of every function, format and layout would otherwise share one.
    fused_blocks.__code__ = fused_blocks.__code__.replace()
    # dynamic=False: only the dimensions `fused` marks are dynamic. Automatic dynamic shapes would
    # also turn a format's constants into runtime inputs once a closure at this source line had
    # seen another format, and such kernels run at half the speed.
    tag = f"precision_suite {fn.__qualname__} {fmt!r} {layout} pow2_scale={pow2_scale}"
    return compiled(fused_blocks, tag)


def fused(
    fn: Callable[[torch.Tensor, Format, bool], T],
    blocks: torch.Tensor,
    fmt: Format,
    layout: Layout,
    pow2_scale: bool,
) -> T:
    """`fn(blocks, fmt, pow2_scale)` for blocks cut by `layout`, through torch.compile for inputs of
    COMPILE_MIN_NUMEL elements or more.

    Eager torch makes one pass over memory per op (tens of times a plain copy for quant_error);
    compiled, quantization and reductions fuse into two sweeps. The number of blocks is a
    dynamic dimension and the block shape a static one, so one graph per function, format and
    layout (and pattern of single-block dimensions) serves every tensor size, with the
    block's own loops vectorized as in a shape-specialised kernel. Eager is used for small
    inputs, inside a run too small for compiling to pay (`compiling_if`; PRECISION_SUITE_COMPILE=1
    compiles there too), with PRECISION_SUITE_COMPILE=0, or when compiling fails (no C++
    compiler): same numbers, up to the order of float64 summation.
    """
    if compiling(blocks.numel()):
        key = (fn, fmt, layout, pow2_scale)  # the Format itself: a user's format may reuse a name
        if key not in _compiled:
            _compiled[key] = _compile(fn, fmt, layout, pow2_scale)
        for dim in (0, 1, 2, 3) if layout == "tensor" else (0, 2):  # all but a block's fixed shape
            torch._dynamo.maybe_mark_dynamic(blocks, dim)
        try:
            return _compiled[key](blocks)
        except (ValueError, TypeError):  # our own bad-input errors, raised through dynamo
            raise
        except Exception as err:  # e.g. no C++ compiler for inductor
            give_up_compiling(err)
    return fn(blocks, fmt, pow2_scale)


def compiling(numel: int, minimum: int = COMPILE_MIN_NUMEL, run_decides: bool = True) -> bool:
    """Whether work over `numel` elements goes through torch.compile: from `minimum` elements,
    unless PRECISION_SUITE_COMPILE=0, a run too small for compiling to pay (`compiling_if`, when
    `run_decides`; =1 compiles there too), `eager()` or an earlier failure to compile
    (`give_up_compiling`) says otherwise."""
    setting = os.environ.get("PRECISION_SUITE_COMPILE", "")  # "0": never, "1": even in a small run
    if setting not in COMPILE_SETTINGS:
        warnings.warn(
            f"PRECISION_SUITE_COMPILE={setting!r} is not one of 0 (never compile), 1 (compile small "
            "runs too) or unset (each run decides); each run decides",
            stacklevel=3,
        )
    run_allows = setting == "1" or _run_compiles or not run_decides
    return numel >= minimum and setting != "0" and run_allows and not (_compile_failed or _eager_only)


def give_up_compiling(err: Exception) -> None:
    """After a failed compile (e.g. no C++ compiler for inductor) the process computes eagerly."""
    global _compile_failed
    _compile_failed = True
    warnings.warn(
        f"precision_suite: torch.compile unavailable ({type(err).__name__}: {err}); computing eagerly",
        stacklevel=3,
    )


@dataclass(frozen=True)
class Quantized:
    """A quantize-dequantize result.

    dequantized: same shape and dtype as the input.
    scales: float32, one per block, shape (n_block_rows, n_block_cols) over the 2-D view
      (for NVFP4 the effective scale: E4M3 block scale times the FP32 tensor scale).
    """

    dequantized: torch.Tensor
    scales: torch.Tensor
    fmt: Format
    layout: Layout


def check_tensor(x: object, name: str = "x") -> torch.Tensor:
    """Reject what cannot be quantized with a message that says how to fix it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor, got {x.dtype}; convert it with {name}.float()"
        )
    return x


def quantize(
    x: torch.Tensor,
    fmt: str | Format = "e4m3",
    layout: object = None,
    pow2_scale: bool = False,
) -> Quantized:
    """Quantize-dequantize `x` with format `fmt` and scaling layout `layout` (None: the format's
    own, `(1, 32)` for MXFP8, `(1, 16)` for NVFP4, `(1, 128)` for FP8 with amax scales).

    The arithmetic runs in float32 (float64 inputs are rounded to float32 first) and the result is
    cast back to `x.dtype`. An empty tensor returns an empty result with no scales.
    """
    x = check_tensor(x)
    f = get_format(fmt)
    lay = parse_layout(layout, f)
    if x.numel() == 0:
        return Quantized(x.clone(), torch.empty(0, 0, dtype=torch.float32, device=x.device), f, lay)
    x2d = as_2d(x.float())
    dequantized, scales = fused(dequantize_blocks, to_blocks(x2d, lay), f, lay, pow2_scale)
    rows, cols = x2d.shape
    out = from_blocks(dequantized, rows, cols).reshape(x.shape).to(x.dtype)
    return Quantized(out, scales.reshape(scales.shape[0], scales.shape[2]), f, lay)
