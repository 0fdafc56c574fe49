"""Training recipes as declarations: a format, layout and rounding for each operand of each GEMM.

A linear layer y = x W^T runs three GEMMs, each with two operands (layouts are over the operand as
stored: x and dy are (tokens, features), W is (out, in)):

- ``fprop``: y = x W^T, operands x and W (reduction over in);
- ``dgrad``: dx = dy W, operands dy and W (reduction over out);
- ``wgrad``: dW = dy^T x, operands dy and x (reduction over tokens).

A GEMM may apply a random Hadamard transform along its reduction dimension to both operands
(``hadamard``: block size, 0 for none): (H dy)^T (H x) = dy^T x for an orthogonal H, so the
product is unchanged before quantization while outliers spread over the block. Stochastic
rounding draws from a generator seeded per layer (``set_recipe``): runs stay deterministic.

quant_linear.py runs a linear layer's three GEMMs with a recipe's operands (``QuantLinearFn``) and
puts a recipe on a model's linear layers (``set_recipe``); ``Operand.mismatches`` counts the
consumed elements that a fresh quantization of the live tensor cannot produce (a stale cache, a
wrong axis or format, a GEMM fed another tensor).

A recipe's scales must be ones a GEMM can apply: no operand's scaling block may be one element
long along its GEMM's reduction K (``Gemm.check_contraction``), or its scale would change at
every product of a dot product.

Each GEMM also says how its products are summed (``Gemm.accumulation``): in float32 (the
default, every recipe's GEMM before), or as an H100's FP8 tensor cores do, fast or promoted
(numerics/accumulation.py); ``quant_linear.QuantLinearFn`` then computes that GEMM with the
emulation (``emulated_gemm``), from the FP8 elements and scales of what it consumed (``Operand.factors``).

Like torchao's recipe configs, each named recipe carries its source, and a Recipe checks itself
when built. Named recipes: ``fp8-block``, ``fp8-hybrid``, ``mxfp8``, ``nvfp4`` (a plain block
scheme), ``nvfp4-training``, and ``fp8-hybrid-hopper``, ``fp8-block-hopper`` (their FP8 operands
accumulated as Transformer Engine, torchao and DeepSeek-V3 accumulate them on an H100); any
measurement scheme name (``e4m3:tensor``, ``bf16``) is a recipe too; and user recipes come from
TOML (recipe_registry.py: every name a recipe goes by).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from precision_suite.numerics import quantization  # by module: a planted bug in its scale rule reaches us too
from precision_suite.numerics.accumulation import Accumulation, full_scales, split_dequantized
from precision_suite.numerics.formats import ElementType, get_format
from precision_suite.numerics.layouts import Layout, from_blocks, layout_text, parse_layout, to_blocks
from precision_suite.numerics.quantization import quantize
from precision_suite.numerics.tensor_core import HOPPER_ELEMENTS
from precision_suite.training.model_modes import unobserved
from precision_suite.training.observed_operands import CONTRACTION_AXIS
from precision_suite.training.probes import Scheme, operand_shapes, transpose_layout

ROUNDINGS = ("nearest", "stochastic")
HIGH_PRECISION = "fp32"  # an operand kept in float32 (e.g. a high-precision wgrad GEMM)


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized: format (or "fp32": kept), layout, rounding."""

    fmt: str
    layout: Layout = "tensor"
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if self.fmt != HIGH_PRECISION:
            object.__setattr__(self, "layout", parse_layout(self.layout, get_format(self.fmt)))
            if self.rounding == "stochastic" and get_format(self.fmt).scale_rule == "none":
                raise ValueError(f"{self.fmt}: stochastic rounding needs a block-scaled format")

    def apply(self, x2d: Tensor, generator: torch.Generator | None) -> Tensor:
        """Quantize-dequantize the 2-D operand (float32 in, float32 out)."""
        if self.fmt == HIGH_PRECISION:
            return x2d
        # autograd.Function.forward gets inputs that still require grad; detached, the compiled
        # quantizer serves them with the graphs of the recorder's (detached) measurements
        x2d = x2d.detach()
        if self.rounding == "stochastic" and generator is None:
            raise ValueError(
                "stochastic rounding needs a generator: build the model's recipe with set_recipe"
            )
        with unobserved():  # the suite's emulation, not the model's own quantization
            if self.rounding == "nearest":
                return quantize(x2d, self.fmt, self.layout).dequantized
            blocks = to_blocks(x2d.float(), self.layout)
            result = quantization.qdq_blocks(
                blocks,
                get_format(self.fmt),
                rounding=lambda y, element: quantization.stochastic_round(y, element, generator),
            )
            return from_blocks(result.dequantized, *x2d.shape)

    def mismatches(self, live: Tensor, consumed: Tensor) -> Tensor:
        """How many elements of `consumed` (a 0-d int64 tensor) this operand's quantization of `live`
        cannot have produced. Computed afresh from `live`, never from `apply` or what a layer kept:
        fp32 must be `live` bit for bit, round-to-nearest a fresh quantization bit for bit (NaN
        matches NaN), stochastic rounding one of the two draws its law allows (below)."""
        live, consumed = live.detach().float(), consumed.detach().float()
        if consumed.shape != live.shape:
            return torch.tensor(max(consumed.numel(), live.numel()), device=consumed.device)
        if self.fmt == HIGH_PRECISION:
            return _bits_unlike(consumed, live)
        if self.rounding == "nearest":
            return _bits_unlike(consumed, quantization.quantize(live, self.fmt, self.layout).dequantized)
        # A fresh draw cannot equal the consumed one, but a block's scale depends only on its amax,
        # and stochastic_round's floor(y / q + u) * q, u in [0, 1), lands on the grid point at or
        # below the scaled value y or on the next one up (y / q + u may round up to it in float32
        # even from a point on the grid): nothing else. Compared as values: the draw turns a -0.0
        # into +0.0.
        blocks, fmt = to_blocks(live, self.layout), get_format(self.fmt)
        admitted = consumed.isnan() & live.isnan()
        for step in (0.0, 1.0):
            bound = quantization.qdq_blocks(blocks, fmt, rounding=functools.partial(_grid_point, step=step))
            admitted |= consumed == from_blocks(bound.dequantized, *live.shape)
        return (~admitted).sum()

    def factors(self, live: Tensor, consumed: Tensor) -> tuple[Tensor, Tensor]:
        """(elements, scales) of `consumed`, this FP8 operand's quantization of `live`: the
        elements as float32 and one scale per element ((1, 1) per tensor), elements * scales ==
        consumed. The scales are a fresh quantization's of `live`: a block's scale depends only
        on its amax, so they are the ones stochastic rounding used too."""
        fresh = quantization.quantize(live.detach().float(), self.fmt, self.layout)
        scales = full_scales(fresh.scales, self.layout, *consumed.shape)
        return split_dequantized(consumed.detach().float(), scales, get_format(self.fmt).element.name), scales

    def text(self) -> str:
        if self.fmt == HIGH_PRECISION:
            return HIGH_PRECISION
        layout = layout_text(self.layout)
        return f"{self.fmt}:{layout}" + (":stochastic" if self.rounding == "stochastic" else "")


def _bits_unlike(a: Tensor, b: Tensor) -> Tensor:
    """Elements of `a` that are not `b` bit for bit (NaN matches NaN), a 0-d int64 tensor."""
    a_bits, b_bits = a.view(torch.int32), b.view(torch.int32)
    if torch.equal(a_bits, b_bits):  # the usual case, in one pass
        return torch.zeros((), dtype=torch.int64, device=a.device)
    return ((a_bits != b_bits) & ~(a.isnan() & b.isnan())).sum()


def _grid_point(y: Tensor, element: ElementType, step: float) -> Tensor:
    """The element grid point at or below `y` (step 0) or the next one up (step 1), within +-max."""
    quantum = quantization.element_quantum(y, element)
    return ((torch.floor(y / quantum) + step) * quantum).clamp(-element.max, element.max)


# each GEMM operand of y = x W^T as the tensor role the probes measure it under (probes.py)
OPERAND_ROLES = {
    "fprop.a": "activation",
    "fprop.b": "weight",
    "dgrad.a": "gradient",
    "dgrad.b": "weight",
    "wgrad.a": "gradient_transpose",
    "wgrad.b": "activation",
}
GEMM_OPERANDS = tuple(OPERAND_ROLES)  # "fprop.a" ... "wgrad.b": the six operands of a linear layer


# Which dimension of each operand, as stored, is its GEMM's reduction K (fprop x W^T, dgrad dy W,
# wgrad dy^T x): the extent along K of its scaling blocks. One table, observation.py's: observed
# GEMMs are turned into the suite's orientation by it
REDUCTION_AXIS = CONTRACTION_AXIS
# each operand as stored, and its GEMM's K in words, for messages
_STORED = {
    "fprop.a": "x (tokens, in)",
    "fprop.b": "W (out, in)",
    "dgrad.a": "dy (tokens, out)",
    "dgrad.b": "W (out, in)",
    "wgrad.a": "dy (tokens, out)",
    "wgrad.b": "x (tokens, in)",
}
_K = {"fprop": "in features", "dgrad": "out features", "wgrad": "tokens"}


@dataclass(frozen=True)
class Gemm:
    """The two operands of one GEMM, an optional Hadamard transform along its reduction, and how
    its products are accumulated (numerics/accumulation.py: fp32, hopper-fast, hopper-promoted)."""

    a: Operand
    b: Operand
    hadamard: int = 0
    accumulation: Accumulation = Accumulation()

    def check_contraction(self, recipe: str, gemm: str) -> None:
        """ValueError naming the recipe, GEMM ("fprop", "dgrad", "wgrad") and operand whose scaling
        blocks are one element long along the GEMM's reduction K: its scale changes at every
        product of a dot product, so no GEMM can factor it out (a block scale multiplies a partial
        sum only where the block lies along K; per tensor, or a whole axis along K, is fine)."""
        for side, operand in (("a", self.a), ("b", self.b)):
            where, layout = f"{gemm}.{side}", operand.layout
            if (
                operand.fmt == HIGH_PRECISION
                or get_format(operand.fmt).scale_rule == "none"
                or not isinstance(layout, tuple)
                or layout[REDUCTION_AXIS[where]] != 1
            ):
                continue
            turned = layout[::-1]
            fix = (
                f"a layout whose blocks run along K, such as {operand.fmt}:{layout_text(turned)}"
                if turned[REDUCTION_AXIS[where]] != 1
                else "longer blocks along K, or tensor"
            )
            raise ValueError(
                f"recipe {recipe!r} {gemm}: operand {side} {operand.text()} of {_STORED[where]} has scaling blocks "
                f"one element long along axis {REDUCTION_AXIS[where]}, the GEMM's contraction axis "
                f"({gemm} sums over {_K[gemm]}): its scale changes at every element of K, so no GEMM can factor "
                f"it out of the dot product; use {fix}"
            )

    def check_accumulation(self, recipe: str, gemm: str) -> None:
        """ValueError naming the recipe and GEMM ("fprop", "dgrad", "wgrad") unless the
        accumulation can run on these operands: the Hopper model takes FP8 (e4m3, e5m2) operands
        with FP32 scales, not both E5M2, and scales that hold along K within each chain."""
        if not self.accumulation.hopper:
            return
        where, mode = f"recipe {recipe!r} {gemm}", self.accumulation.text()
        for side, operand in (("a", self.a), ("b", self.b)):
            fmt = get_format(operand.fmt) if operand.fmt != HIGH_PRECISION else None
            if fmt is None or fmt.element.name not in HOPPER_ELEMENTS or fmt.scale_rule != "amax":
                raise ValueError(
                    f"{where} accumulates {mode}, but operand {side} is {operand.text()}: the Hopper tensor-core "
                    f"model takes FP8 operands (e4m3 or e5m2, FP32 scales) only; MX and NVFP4 GEMMs run on "
                    f'Blackwell, whose accumulation is not modelled. Use accumulate = "fp32" for this GEMM'
                )
        if self.a.fmt == self.b.fmt == "e5m2":
            raise ValueError(
                f"{where} accumulates {mode} on E5M2 x E5M2, which cuBLAS refuses: make one operand e4m3"
            )
        for side, operand in (("a", self.a), ("b", self.b)):
            if not isinstance(operand.layout, tuple):  # one scale per tensor: constant along K
                continue
            extent = operand.layout[REDUCTION_AXIS[f"{gemm}.{side}"]]
            if self.accumulation.mode == "hopper-fast":
                raise ValueError(
                    f"{where} accumulates hopper-fast (one tensor-core chain over all of K), but operand {side} "
                    f"{operand.text()} has scales that change along K, which no chain can apply: use per-tensor "
                    "scales or hopper-promoted"
                )
            if extent % self.accumulation.interval:
                raise ValueError(
                    f"{where} promotes every {self.accumulation.interval} elements of K, but operand {side} "
                    f"{operand.text()} changes its scale every {extent}: each promoted chunk must lie within one "
                    f"scale block along K (an interval dividing {extent})"
                )


@dataclass(frozen=True)
class Recipe:
    """Operands of the three GEMMs of every linear layer (see the module docstring)."""

    name: str
    fprop: Gemm  # a = x, b = W
    dgrad: Gemm  # a = dy, b = W
    wgrad: Gemm  # a = dy, b = x
    source: str = ""
    seed: int = 0  # the Hadamard signs' seed

    def __post_init__(self) -> None:
        for gemm_name in ("fprop", "dgrad"):
            if getattr(self, gemm_name).hadamard:
                raise ValueError(
                    f"recipe {self.name!r}: a Hadamard transform on {gemm_name} would mix "
                    "features and needs its inverse in the layer; only wgrad (over tokens) takes one"
                )
        size = self.wgrad.hadamard
        if size and (size < 2 or size & (size - 1)):
            raise ValueError(
                f"recipe {self.name!r}: wgrad hadamard must be a power of two >= 2 (or 0), got {size}"
            )
        for gemm_name in ("fprop", "dgrad", "wgrad"):
            getattr(self, gemm_name).check_contraction(self.name, gemm_name)
            getattr(self, gemm_name).check_accumulation(self.name, gemm_name)

    def hadamard_matrix(self, device: torch.device) -> Tensor:
        """H diag(s) / sqrt(n): Sylvester's Hadamard matrix with seeded random signs, orthogonal."""
        n = self.wgrad.hadamard
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(self.seed)) * 2 - 1
        return (h * signs / math.sqrt(n)).to(device)

    def rotate_tokens(self, t2d: Tensor, matrix: Tensor) -> Tensor:
        """Apply the transform to blocks of ``n`` tokens (rows), zero-padding the last block."""
        n = matrix.shape[0]
        rows = t2d.shape[0]
        padded = torch.nn.functional.pad(t2d, (0, 0, 0, -rows % n))
        return (matrix @ padded.reshape(-1, n, t2d.shape[1])).reshape(-1, t2d.shape[1])

    def uses_stochastic_rounding(self) -> bool:
        return any(
            op.rounding == "stochastic" for g in (self.fprop, self.dgrad, self.wgrad) for op in (g.a, g.b)
        )

    def operand(self, where: str) -> Operand:
        """The operand named `where` ("fprop.a", ..., "wgrad.b": GEMM_OPERANDS)."""
        gemm, side = where.split(".")
        return getattr(getattr(self, gemm), side)

    def operands(
        self, in_features: int, out_features: int, tokens: int
    ) -> list[tuple[str, Operand, tuple[int, int]]]:
        """("fprop.a", operand, 2-D shape), ... for the six operands of a linear layer fed `tokens`
        rows, each shaped as the tensor role it is (probes.operand_shapes)."""
        shapes = operand_shapes(in_features, out_features, tokens)
        return [(where, self.operand(where), shapes[role]) for where, role in OPERAND_ROLES.items()]

    def check_fits(self, in_features: int, out_features: int, tokens: int, what: str) -> None:
        """ValueError when a block is bigger than the operand it would cut."""
        for where, operand, shape in self.operands(in_features, out_features, tokens):
            layout = operand.layout
            if (
                operand.fmt != HIGH_PRECISION
                and layout != "tensor"
                and (layout[0] > shape[0] or layout[1] > shape[1])
            ):
                raise ValueError(
                    f"{what}: recipe {self.name!r} cuts the {where.split('.')[0]} operand {operand.text()} "
                    f"({shape[0]}x{shape[1]}) into {layout_text(layout)} blocks, bigger than the tensor; "
                    f"use more tokens per step (now {tokens}) or a wider model, or a smaller layout"
                )

    def quantized_elements(
        self, in_features: int, out_features: int, tokens: int, checked: bool = False
    ) -> int:
        """Elements one training step quantizes through `quantize` (the compilable path) in a
        linear layer fed `tokens` rows: not the stochastically rounded operands (always eager), nor
        a dgrad weight quantized as in fprop (reused, see QuantLinearFn.backward). `checked`: those
        the check of a sampled step's consumed operands quantizes afresh (`Operand.mismatches`),
        the reused weight too."""
        reused = self.dgrad.b == self.fprop.b and not checked
        return sum(
            math.prod(shape)
            for where, operand, shape in self.operands(in_features, out_features, tokens)
            if operand.fmt != HIGH_PRECISION
            and operand.rounding == "nearest"
            and not (reused and where == "dgrad.b")
        )

    def describe(self) -> dict[str, Any]:
        """Each GEMM's operands, Hadamard size and accumulation, as `recipe_registry.recipes_from_toml` reads them."""
        return {
            gemm: {
                "a": g.a.text(),
                "b": g.b.text(),
                "hadamard": g.hadamard,
                "accumulate": g.accumulation.text(),
            }
            for gemm, g in (("fprop", self.fprop), ("dgrad", self.dgrad), ("wgrad", self.wgrad))
        }

    @classmethod
    def from_scheme(cls, scheme: Scheme, source: str = "") -> Recipe:
        """The recipe of a measurement scheme: the backward GEMMs reduce over other dimensions, so
        they take the transposed layouts (dgrad W, wgrad dy and x: blocks of tokens)."""

        def op(layout: Layout) -> Operand:
            return Operand(scheme.fmt, layout)

        return cls(
            scheme.name,
            fprop=Gemm(op(scheme.activation), op(scheme.weight)),
            dgrad=Gemm(op(scheme.gradient), op(transpose_layout(scheme.weight))),
            wgrad=Gemm(op(transpose_layout(scheme.gradient)), op(transpose_layout(scheme.activation))),
            source=source,
        )
