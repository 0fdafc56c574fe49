"""Measurement schemes: the formats and layouts each GEMM operand is measured under.

A ``Scheme`` is a format with block layouts for the operands of a linear layer's three GEMMs
(forward ``y = x W^T``, dgrad ``dx = dy W``, wgrad ``dW = dy^T x``); ``instrument.py`` measures
every operand under one or more schemes, and every scheme is also a training recipe
(``recipes.Recipe.from_scheme``): an FP8 block recipe like Ling 2.0's is x (1, 128), W (128, 128),
dy (1, 128) for dgrad, dy and x (128, 1) for wgrad.

Tensor roles (dataset coordinate ``tensor``) and what each measures, for a linear with input x
(tokens, in) and output gradient dy (tokens, out), leading dims flattened into tokens:

- ``activation``: x under the scheme's activation layout (forward GEMM operand);
- ``gradient``: dy under the gradient layout (dgrad operand);
- ``gradient_transpose``: dy under the transposed gradient layout (wgrad operand ``dy^T``);
- ``weight``: W (out, in) under the weight layout (forward GEMM operand).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from precision_suite.numerics.formats import get_format
from precision_suite.numerics.layouts import Layout, layout_label, layout_text, parse_layout

TENSOR_ROLES = ("activation", "gradient", "gradient_transpose", "weight")


def transpose_layout(layout: Layout) -> Layout:
    return layout if layout == "tensor" else (layout[1], layout[0])


@dataclass(frozen=True)
class Scheme:
    """A format with block layouts for the three operands of y = x W^T, as laid out in memory.

    The backward GEMMs reduce over other dimensions, so they use the transposed layouts: dgrad
    multiplies dy (``gradient`` layout) by W (transposed ``weight`` layout), wgrad multiplies
    dy^T by x (transposed ``gradient`` and ``activation`` layouts: blocks of tokens).
    """

    name: str
    fmt: str
    activation: Layout
    weight: Layout
    gradient: Layout

    def role_layouts(self) -> dict[str, Layout]:
        """The layout each measured tensor role is quantized with."""
        return {
            "activation": self.activation,
            "gradient": self.gradient,
            "gradient_transpose": transpose_layout(self.gradient),
            "weight": self.weight,
        }

    def role_labels(self) -> dict[str, str]:
        return {role: layout_label(self.fmt, layout) for role, layout in self.role_layouts().items()}


# Ling 2.0 / DeepSeek-V3 style FP8 block scaling; every other scheme is "<format>:<layout>"
FP8_BLOCK = Scheme("fp8-block", "e4m3", activation=(1, 128), weight=(128, 128), gradient=(1, 128))
SCHEME_EXAMPLES = "fp8-block, mxfp8, nvfp4, or <format>:<layout> such as e4m3:tensor, e5m2:1x128"


@functools.cache
def get_scheme(name: str) -> Scheme:
    """``fp8-block``, or ``<format>[:<layout>]`` with one layout for x, W and dy (``e4m3:tensor``,
    ``e5m2:1x128``); without a layout the format's default (``mxfp8``, ``nvfp4``: (1, block))."""
    if not isinstance(name, str):
        raise ValueError(f"a quantization scheme is named by a string ({SCHEME_EXAMPLES}), got {name!r}")
    if name == FP8_BLOCK.name:
        return FP8_BLOCK
    fmt_name, _, layout_spec = name.partition(":")
    try:
        fmt = get_format(fmt_name)
        layout = parse_layout(layout_spec or None, fmt)  # None: the format's default layout
    except ValueError as error:
        raise ValueError(f"bad quantization scheme {name!r} ({error}); use {SCHEME_EXAMPLES}") from None
    return Scheme(name, fmt.name, activation=layout, weight=layout, gradient=layout)


def check_measurements(schemes: Sequence[Scheme]) -> tuple[Scheme, ...]:
    """``schemes`` as a tuple; ValueError when there is none or two measure one (role, layout)."""
    if not schemes:
        raise ValueError("at least one measurement scheme is needed")
    seen: dict[tuple[str, str], str] = {}
    for scheme in schemes:
        for key in scheme.role_labels().items():
            if key in seen:
                raise ValueError(
                    f"{scheme.name!r} measures the {key[0]} under layout {key[1]!r}, "
                    f"which {seen[key]!r} already measures; drop it"
                )
            seen[key] = scheme.name
    return tuple(schemes)


def operand_shapes(in_features: int, out_features: int, tokens: int) -> dict[str, tuple[int, int]]:
    """The 2-D shape each role measures, for a linear layer fed ``tokens`` rows."""
    return {
        "activation": (tokens, in_features),
        "gradient": (tokens, out_features),
        "gradient_transpose": (tokens, out_features),
        "weight": (out_features, in_features),
    }


def check_scheme_fits(scheme: Scheme, in_features: int, out_features: int, tokens: int, what: str) -> None:
    """Raise ValueError when a block of ``scheme`` is bigger than a tensor it would cut."""
    layouts = scheme.role_layouts()
    for role, shape in operand_shapes(in_features, out_features, tokens).items():
        layout = layouts[role]
        if layout != "tensor" and (layout[0] > shape[0] or layout[1] > shape[1]):
            raise ValueError(
                f"{what}: {scheme.name!r} cuts the {role} ({shape[0]}x{shape[1]}) into "
                f"{layout_text(layout)} blocks, bigger than the tensor; use more tokens per step "
                f"(batch_size * seq_len = {tokens}) or a wider model, or a smaller layout"
            )
