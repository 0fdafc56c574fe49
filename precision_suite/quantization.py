"""Quantize-dequantize: the one place where scale rules and element rounding live.

Scales are float32 arithmetic; elements round through torch's own cast where the element type
has one (values clamped first, so every torch release agrees) and through exact bit arithmetic
otherwise (E2M1, or any newly declared minifloat). Both are checked bit for bit against ml_dtypes.

Non-finite inputs: NaN and +-Inf do not take part in a block's amax (they would wipe out the
whole block); NaN stays NaN and +-Inf saturates to +-max times the block scale. metrics.py counts
both.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from precision_suite.formats import E4M3, ElementType, Format, get_format
from precision_suite.layouts import Layout, as_2d, from_blocks, parse_layout, to_blocks

# Floor of an "amax" scale: the smallest normal float32, so an all-zero block gets a finite scale.
TINY_SCALE = 2.0**-126
# Below this many elements eager ops are fast enough and compiling would cost more than it saves.
COMPILE_MIN_NUMEL = 1 << 16
COMPILE_MAX_GRAPHS = 64
STATIC_MIN_NUMEL = 1 << 22
_F32_EXP_MASK = 0x7F800000
_F32_MAN_BITS = 23


def round_to_element(y: torch.Tensor, element: ElementType) -> torch.Tensor:
    """Round float32 `y` (already within +-element.max) to the nearest element, ties to even.

    torch's own cast where the element has a torch type (callers clamp first: older torch
    releases turn e4m3 values past 464 into NaN instead of saturating), else exact bit arithmetic.
    Both are checked bit for bit against ml_dtypes (tests/test_oracle.py).
    """
    if element.torch_dtype is not None:
        return y.to(getattr(torch, element.torch_dtype)).to(torch.float32)
    return round_by_bits(y, element)


def round_by_bits(y: torch.Tensor, element: ElementType) -> torch.Tensor:
    """`round_to_element` in float32 arithmetic on the bit pattern: any minifloat grid."""
    if element.emin - element.man_bits >= -126:
        # y / quantum is exact and torch.round rounds half to even
        quantum = element_quantum(y, element)
        return torch.round(y / quantum) * quantum
    # Same exponent range as float32 (bf16): round the bit pattern, the subnormals included.
    shift = _F32_MAN_BITS - element.man_bits
    bits = y.view(torch.int32)
    bits = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) & ~((1 << shift) - 1)
    return bits.view(torch.float32)


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
        scale = torch.clamp(amax / element.max, min=TINY_SCALE)
        if pow2_scale:  # round up to a power of two, so no element can exceed max
            mantissa, exponent = torch.frexp(scale)
            scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))
        return scale
    if fmt.scale_rule == "e8m0":
        # OCP MX v1.0 section 6.3: X = 2**(floor(log2(amax)) - emax_elem), E8M0 range [-127, 127].
        _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1)
        shared = torch.clamp(exponent - 1 - element.emax, -127, 127)
        return torch.ldexp(torch.ones_like(amax), shared)
    if fmt.scale_rule == "nvfp4":
        # FP32 tensor scale maps the tensor amax onto max(E2M1) * max(E4M3); the E4M3 block scale
        # then covers each block's amax / max(E2M1).
        tensor_scale = torch.clamp(amax.amax() / (element.max * E4M3.max), min=TINY_SCALE)
        wanted = torch.clamp(amax / element.max / tensor_scale, max=E4M3.max)
        return round_to_element(wanted, E4M3) * tensor_scale
    raise ValueError(f"format {fmt.name!r}: unknown scale rule {fmt.scale_rule!r}")


def qdq_blocks(blocks: torch.Tensor, fmt: Format, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize-dequantize float32 blocks `(nbr, r, nbc, c)`.

    Returns `(dequantized, scales, scaled)` where `scaled = x / s` before saturation (metrics use it
    to count overflow). A zero scale (an NVFP4 block scale that underflowed E4M3) flushes its block:
    dividing by an infinite stand-in scale sends every finite element to zero.
    """
    scales = block_scales(_finite_amax(blocks), fmt, pow2_scale)
    scaled = blocks / torch.where(scales > 0, scales, torch.inf)
    element = fmt.element
    q = round_to_element(scaled.clamp(-element.max, element.max), element)
    return q * scales, scales, scaled


def dequantize_blocks(blocks: torch.Tensor, fmt: Format, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`qdq_blocks` without the pre-saturation values: (dequantized, scales)."""
    dequantized, scales, _ = qdq_blocks(blocks, fmt, pow2_scale)
    return dequantized, scales


T = TypeVar("T")
_compiled: dict[tuple[Callable, Format, bool, bool], Callable] = {}
_compile_failed = False


def _compile(fn: Callable[[torch.Tensor, Format, bool], T], fmt: Format, pow2_scale: bool, static: bool) -> Callable:
    # Two closures with their own code objects: dynamo caches graphs per code object, and a
    # dynamic-shape graph would otherwise also serve the large tensors meant for static ones.
    def static_shapes(b: torch.Tensor) -> T:
        return fn(b, fmt, pow2_scale)

    def dynamic_shapes(b: torch.Tensor) -> T:
        return fn(b, fmt, pow2_scale)

    # fx_graph_cache off: inductor's on-disk cache has served a kernel compiled for other dynamic
    # shapes here (wrong e5m2 values, caught by tests/test_oracle.py), so compile afresh.
    # emulate_precision_casts: inductor otherwise drops the float32 -> bfloat16 -> float32 round
    # trip that *is* the bf16 quantization (caught by the same tests).
    return torch.compile(static_shapes if static else dynamic_shapes, dynamic=not static,
                         options={"fx_graph_cache": False, "emulate_precision_casts": True})


def fused(fn: Callable[[torch.Tensor, Format, bool], T], blocks: torch.Tensor, fmt: Format, pow2_scale: bool) -> T:
    """`fn(blocks, fmt, pow2_scale)`, through torch.compile for large inputs.

    Eager torch makes one pass over memory per op (about 35x a plain copy for quant_error);
    compiled, quantization and reductions fuse into one or two sweeps. Medium tensors (a model's
    activations, gradients and weights) share dynamic-shape kernels, one per format and size-1
    pattern of the blocks; large ones (>= STATIC_MIN_NUMEL, few shapes) get kernels specialised
    to their shape, about twice as fast. Eager is used for small inputs, with
    PRECISION_SUITE_COMPILE=0, or when compiling fails (no C++ compiler): same numbers, up to the
    order of float64 summation.
    """
    global _compile_failed
    if blocks.numel() >= COMPILE_MIN_NUMEL and not _compile_failed and os.environ.get("PRECISION_SUITE_COMPILE", "1") != "0":
        static = blocks.numel() >= STATIC_MIN_NUMEL
        key = (fn, fmt, pow2_scale, static)  # the Format itself: a user's format may reuse a name
        if key not in _compiled:
            _compiled[key] = _compile(fn, fmt, pow2_scale, static)
        try:
            # more graphs than dynamo's default of 8 per code object: formats share the closures
            with torch._dynamo.config.patch(recompile_limit=COMPILE_MAX_GRAPHS):
                return _compiled[key](blocks)
        except (ValueError, TypeError):  # our own bad-input errors, raised through dynamo
            raise
        except Exception as err:  # e.g. no C++ compiler for inductor
            _compile_failed = True
            warnings.warn(f"precision_suite: torch.compile unavailable ({type(err).__name__}: {err}); "
                          "computing eagerly", stacklevel=2)
    return fn(blocks, fmt, pow2_scale)


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
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}; convert it with {name}.float()")
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
    dequantized, scales = fused(dequantize_blocks, to_blocks(x2d, lay), f, pow2_scale)
    rows, cols = x2d.shape
    out = from_blocks(dequantized, rows, cols).reshape(x.shape).to(x.dtype)
    return Quantized(out, scales.reshape(scales.shape[0], scales.shape[2]), f, lay)
