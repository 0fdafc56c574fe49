"""Low-precision number formats, declared as data.

A format is an element type (a minifloat grid) plus a scale rule. Adding a format is a few lines
in `FORMATS`; the arithmetic lives once, in quantization.py, keyed by `Format.scale_rule`.
Definitions follow ../shared/SCIENCE.md and the OCP Microscaling v1.0 spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScaleRule = Literal["amax", "e8m0", "nvfp4", "none"]


@dataclass(frozen=True)
class ElementType:
    """A sign-magnitude minifloat with IEEE-style subnormals and a finite maximum.

    Only what rounding needs is stored: exponent and mantissa widths, the exponent bias and the
    largest finite value (which differs from the IEEE rule for `fn` types such as e4m3fn).
    `torch_dtype` names torch's own type for the grid, when it has one: eagerly its cast rounds the
    same way and runs about twice as fast as the bit arithmetic (quantization.round_to_element).
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max: float
    torch_dtype: str | None = None

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (subnormals share its quantum)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return math.frexp(self.max)[1] - 1

    @property
    def overflow_threshold(self) -> float:
        """Magnitudes above this round past `max` without saturation: max + half an ulp there.

        For e4m3fn that is 464, the point past which an unclamped cast returns NaN.
        """
        return self.max + 2.0 ** (self.emax - self.man_bits - 1)


E4M3 = ElementType("e4m3", exp_bits=4, man_bits=3, bias=7, max=448.0, torch_dtype="float8_e4m3fn")
E5M2 = ElementType("e5m2", exp_bits=5, man_bits=2, bias=15, max=57344.0, torch_dtype="float8_e5m2")
E2M1 = ElementType("e2m1", exp_bits=2, man_bits=1, bias=1, max=6.0)  # torch has no CPU float4 cast
BF16 = ElementType(
    "bf16", exp_bits=8, man_bits=7, bias=127, max=float.fromhex("0x1.fep127"), torch_dtype="bfloat16"
)


@dataclass(frozen=True)
class Format:
    """A quantization format: element grid, how block scales are chosen, and the block shape.

    scale_rule:
      "amax"  one FP32 scale per block, s = max(amax / element.max, tiny) (optionally a power of two)
      "e8m0"  OCP MX: s = 2**(floor(log2(amax)) - element.emax), clamped to E8M0's [-127, 127]
      "nvfp4" E4M3 block scale times an FP32 tensor scale (NVIDIA NVFP4 recipe)
      "none"  no scaling: a plain cast (bf16 reference)
    block: the fixed number of elements per block (MX, NVFP4), or None when any layout is allowed.
    """

    name: str
    element: ElementType
    scale_rule: ScaleRule
    block: int | None = None
    description: str = ""


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("e4m3", E4M3, "amax", description="FP8 E4M3 (max 448), one FP32 scale per block"),
        Format("e5m2", E5M2, "amax", description="FP8 E5M2 (max 57344), one FP32 scale per block"),
        Format("mxfp8", E4M3, "e8m0", block=32, description="OCP MXFP8: 32 E4M3 elements, E8M0 scale"),
        Format(
            "nvfp4",
            E2M1,
            "nvfp4",
            block=16,
            description="NVFP4: 16 E2M1 elements, E4M3 block scale, FP32 tensor scale",
        ),
        Format("bf16", BF16, "none", description="bfloat16 cast, no scaling (reference)"),
    )
}


def get_format(fmt: str | Format) -> Format:
    """Look a format up by name; a `Format` passes through unchanged."""
    if isinstance(fmt, Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(sorted(FORMATS))}") from None
