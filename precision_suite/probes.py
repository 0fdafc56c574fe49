"""Per-layer measurements and emulated low-precision linear layers.

One autograd Function, ``QuantLinearFn``, computes ``y = x W^T + b`` and its two backward GEMMs
(dgrad ``dx = dy W``, wgrad ``dW = dy^T x``). It does two jobs, both off by default:

- **recipe**: quantize-dequantize the inputs of all three GEMMs with a ``Scheme`` (an FP8 block
  recipe like Ling 2.0's: x (1, 128), W (128, 128), dy (1, 128) for dgrad, dy and x (128, 1) for
  wgrad);
- **tap**: hand the very tensors those GEMMs consume (before the recipe's quantizer) to a
  ``LinearTap``, which adds their ``quant_stats`` under every measured scheme to its block's sums.

``QuantLinear`` (an ``nn.Linear``) calls plain ``F.linear`` when it has neither a recipe nor a tap,
so un-sampled steps of a float32 run pay nothing. ``Probes`` attaches taps to every block of a
model for one sampled step and returns that step's numbers per layer.

Tensor roles (dataset coordinate ``tensor``) and what each measures, for a linear with input x
(tokens, in) and output gradient dy (tokens, out), leading dims flattened into tokens:

- ``activation``: x under the scheme's activation layout (forward GEMM operand);
- ``gradient``: dy under the gradient layout (dgrad operand);
- ``gradient_transpose``: dy under the transposed gradient layout (wgrad operand ``dy^T``);
- ``weight``: W (out, in) under the weight layout (forward GEMM operand).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from precision_suite.formats import get_format
from precision_suite.layouts import Layout, layout_label, parse_layout
from precision_suite.metrics import QuantStats, quant_stats
from precision_suite.quantization import quantize

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


@functools.lru_cache(maxsize=None)
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


def _fake_quant(x: Tensor, fmt: str, layout: Layout) -> Tensor:
    return quantize(x, fmt, layout).dequantized


class LinearTap:
    """Receives a linear layer's GEMM operands on a sampled step and adds their stats to ``sums``.

    ``sums`` maps (tensor role, layout label) to pooled ``QuantStats``; the layers of one block
    share one dict, so their counts and dot products add up before any ratio is taken.
    """

    def __init__(self, schemes: Sequence[Scheme], sums: dict[tuple[str, str], QuantStats]) -> None:
        # (format, role -> (label, layout)) worked out once, not on each of a step's many tensors
        self.measured = [(s.fmt, {role: (s.role_labels()[role], layout) for role, layout in s.role_layouts().items()})
                         for s in schemes]
        self.sums = sums

    def _add(self, role: str, tensor: Tensor) -> None:
        for fmt, roles in self.measured:
            label, layout = roles[role]
            key = (role, label)
            stats = quant_stats(tensor.detach(), fmt, layout)
            self.sums[key] = stats if key not in self.sums else self.sums[key] + stats

    def forward_operands(self, x: Tensor, weight: Tensor) -> None:
        self._add("activation", x)
        self._add("weight", weight)

    def backward_operand(self, grad_output: Tensor) -> None:
        self._add("gradient", grad_output)
        self._add("gradient_transpose", grad_output)


class QuantLinearFn(torch.autograd.Function):
    """y = x W^T + b with optional recipe quantization and tap (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Scheme | None, tap: LinearTap | None):
        x2d = x.reshape(-1, x.shape[-1])
        if tap is not None:
            tap.forward_operands(x2d, weight)
        if recipe is not None:
            x_used = _fake_quant(x2d, recipe.fmt, recipe.activation)
            weight_used = _fake_quant(weight, recipe.fmt, recipe.weight)
        else:
            x_used, weight_used = x2d, weight
        y = F.linear(x_used, weight_used, bias)
        # the originals are saved: the backward GEMMs quantize them with their own (transposed)
        # layouts, except a weight whose layout is its own transpose ((128, 128), tensor): reused
        ctx.save_for_backward(x2d, weight, weight_used)
        ctx.recipe, ctx.tap, ctx.x_shape, ctx.has_bias = recipe, tap, x.shape, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x2d, weight, weight_used = ctx.saved_tensors
        recipe = ctx.recipe
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.tap is not None:
            ctx.tap.backward_operand(dy)
        if recipe is not None:
            dy_dgrad = _fake_quant(dy, recipe.fmt, recipe.gradient)
            dgrad_layout = transpose_layout(recipe.weight)
            weight_dgrad = weight_used if dgrad_layout == recipe.weight else _fake_quant(weight, recipe.fmt, dgrad_layout)
            dy_wgrad = _fake_quant(dy, recipe.fmt, transpose_layout(recipe.gradient))
            x_wgrad = _fake_quant(x2d, recipe.fmt, transpose_layout(recipe.activation))
        else:
            dy_dgrad = dy_wgrad = dy
            weight_dgrad, x_wgrad = weight, x2d
        grad_x = (dy_dgrad @ weight_dgrad).reshape(ctx.x_shape)
        grad_weight = dy_wgrad.t() @ x_wgrad
        grad_bias = dy.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs can be quantized (``recipe``) and observed (``tap``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.recipe: Scheme | None = None
        self.tap: LinearTap | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.recipe is None and self.tap is None:
            return F.linear(x, self.weight, self.bias)
        return QuantLinearFn.apply(x, self.weight, self.bias, self.recipe, self.tap)


def set_recipe(model: nn.Module, recipe: Scheme | None) -> None:
    """Train every ``QuantLinear`` of ``model`` with ``recipe`` (None: plain float GEMMs)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.recipe = recipe


@dataclass
class LayerRecord:
    """One block's numbers for one sampled step."""

    attention_norm: float
    metrics: dict[tuple[str, str], dict[str, float]]  # (role, layout label) -> quant metrics
    nonfinite: dict[str, float]  # role -> NaN/Inf count (from the first scheme)


@dataclass
class _BlockSums:
    sums: dict[tuple[str, str], QuantStats] = field(default_factory=dict)
    attention_norms: list[Tensor] = field(default_factory=list)


class Probes:
    """Measures every block of ``model`` (which has ``.blocks``, each with ``.attn``) on request.

    ``with probes.sample(): <forward and backward of one step>`` then ``probes.records()``.
    Outside ``sample()`` no tap is attached, so nothing is measured or copied.
    """

    def __init__(self, model: nn.Module, schemes: Sequence[Scheme]):
        if not schemes:
            raise ValueError("Probes needs at least one scheme to measure")
        self.blocks = list(model.blocks)
        self.schemes = tuple(schemes)
        self._sums: list[_BlockSums] = []

    @contextmanager
    def sample(self) -> Iterator[None]:
        self._sums = [_BlockSums() for _ in self.blocks]
        try:
            for block, sums in zip(self.blocks, self._sums):
                tap = LinearTap(self.schemes, sums.sums)
                for module in block.modules():
                    if isinstance(module, QuantLinear):
                        module.tap = tap
                block.attn.attention_tap = functools.partial(_record_attention_norm, sums.attention_norms)
            yield
        finally:
            for block in self.blocks:
                for module in block.modules():
                    if isinstance(module, QuantLinear):
                        module.tap = None
                block.attn.attention_tap = None

    def records(self) -> list[LayerRecord]:
        """Per block, the numbers of the last ``sample()``."""
        first = self.schemes[0].role_labels()
        records = []
        for sums in self._sums:
            metrics = {key: stats.metrics() for key, stats in sums.sums.items()}
            norms = sums.attention_norms
            records.append(
                LayerRecord(
                    attention_norm=float(torch.stack(norms).mean()) if norms else float("nan"),
                    metrics=metrics,
                    nonfinite={
                        role: float(metrics[(role, label)]["nonfinite_in"])
                        for role, label in first.items()
                        if (role, label) in metrics
                    },
                )
            )
        return records


def _record_attention_norm(norms: list[Tensor], attention: Tensor) -> None:
    """Frobenius norm of each head's N x N matrix, averaged over heads and batch."""
    norms.append(torch.linalg.matrix_norm(attention.detach(), ord="fro").mean())


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
                f"{layout[0]}x{layout[1]} blocks, bigger than the tensor; use more tokens per step "
                f"(batch_size * seq_len = {tokens}) or a wider model, or a smaller layout"
            )
