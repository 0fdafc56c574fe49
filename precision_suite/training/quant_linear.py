"""A recipe on a model's linear layers: ``QuantLinearFn`` runs a linear layer's three GEMMs on the
recipe's operands (recipes.py declares them), with the H100's accumulation emulated where a GEMM
declares it; ``set_recipe`` puts a recipe on a model's ``nn.Linear`` layers without editing it. While
an observer is installed (the recorder's, on sampled steps) the GEMMs hand it each operand they
received (the arguments of their own matrix products, ``model_modes.GemmArguments``) beside the live
tensor, and each emulated GEMM its operands and result."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from precision_suite.numerics.accumulation import Accumulation, scaled_gemm
from precision_suite.numerics.accumulation_error import accumulation_error_sums, error_sums_by_mode
from precision_suite.numerics.formats import get_format
from precision_suite.training.model_modes import GemmArguments, gemm_received, unobserved
from precision_suite.training.probes import Scheme
from precision_suite.training.recipes import REDUCTION_AXIS, Operand, Recipe

# (layer, operand name such as "fprop.b", live tensor, consumed tensor, declared operand)
OperandObserver = Callable[[nn.Module | None, str, Tensor, Tensor, Operand], None]
# Process-wide, not a context variable: autograd runs a CUDA backward on a thread of its own.
_observers: list[OperandObserver] = []


def add_operand_observer(observer: OperandObserver) -> Callable[[], None]:
    """Hand `observer` every operand QuantLinearFn consumes, until the returned function is called.
    The recorder installs one on sampled steps; with none installed the GEMMs pay one list test."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


def _observe(layer: nn.Module | None, recipe: Recipe, *operands: tuple[str, Tensor, Tensor]) -> None:
    for observer in list(_observers):
        for where, live, consumed in operands:
            observer(layer, where, live, consumed, recipe.operand(where))


# (layer, recipe, GEMM name, (live, consumed) of a, of b, the GEMM's float32 result)
GemmObserver = Callable[
    [nn.Module | None, Recipe, str, tuple[Tensor, Tensor], tuple[Tensor, Tensor], Tensor], None
]
_gemm_observers: list[GemmObserver] = []


def add_gemm_observer(observer: GemmObserver) -> Callable[[], None]:
    """Hand `observer` every GEMM QuantLinearFn emulates (a hopper accumulation) with the operands it
    consumed and its result, until the returned function is called (the recorder's accumulation
    error, on sampled steps)."""
    _gemm_observers.append(observer)
    return lambda: _gemm_observers.remove(observer)


# Each GEMM's operands as stored, (M, K) and (K, N) as they are or transposed
_TRANSPOSED = {"fprop": (False, True), "dgrad": (False, False), "wgrad": (True, False)}
Consumed = tuple[Tensor, Tensor]  # (live tensor, what the GEMM consumed), as stored


def emulated_gemm(
    recipe: Recipe, gemm: str, a: Consumed, b: Consumed, accumulation: Accumulation | None = None
) -> Tensor:
    """GEMM `gemm` ("fprop": x W^T, "dgrad": dy W, "wgrad": dy^T x) of `recipe` from its consumed
    FP8 operands, accumulated as `accumulation` says (default: the recipe's; numerics/accumulation.py)."""
    accumulation = accumulation or getattr(recipe, gemm).accumulation
    with unobserved():  # the suite's emulation (its casts to FP8 codes), not the model's own quantization
        return scaled_gemm(
            *_oriented_factors(recipe, gemm, a, b),
            accumulation.mode,
            accumulation.interval,
            elements=_elements(recipe, gemm),
        )


def gemm_error_sums(
    recipe: Recipe,
    gemm: str,
    a: Consumed,
    b: Consumed,
    accumulations: Sequence[Accumulation],
    computed: Mapping[Accumulation, Tensor] | None = None,
    sampled: bool = False,
) -> list[Tensor | None]:
    """`accumulation_error_sums` of GEMM `gemm` of `recipe` under each of `accumulations`: how far
    it lands from the float64 product of the operands it consumed (fp32 needs no FP8 operands);
    None for a hopper mode the hardware cannot run with the operands' scales (`runs_on`).
    `computed`: results of the GEMM already at hand (`emulated_gemm`'s), not computed again.
    `sampled`: the hopper modes on `accumulation_error.output_subset`'s outputs (`error_sums_by_mode`)."""
    fp32 = Accumulation()
    sums: dict[Accumulation, Tensor | None] = {}
    if fp32 in accumulations:
        transpose_a, transpose_b = _TRANSPOSED[gemm]
        sums[fp32] = accumulation_error_sums(
            _orient(a[1].detach(), transpose_a), _orient(b[1].detach(), transpose_b), 1.0, 1.0, "fp32"
        )
    hopper = list(dict.fromkeys(accumulation for accumulation in accumulations if accumulation.hopper))
    if hopper:
        with unobserved():  # the suite's emulation (its casts to FP8 codes), not the model's own quantization
            measured = error_sums_by_mode(
                *_oriented_factors(recipe, gemm, a, b),
                hopper,
                elements=_elements(recipe, gemm),
                computed=computed,
                sampled=sampled,
            )
        sums.update(zip(hopper, measured))
    return [sums[accumulation if accumulation.hopper else fp32] for accumulation in accumulations]


def reduction_length(gemm: str, a: Consumed) -> int:
    """K of GEMM `gemm` ("fprop", "dgrad", "wgrad") from its operand a as stored: in, out or tokens."""
    return a[1].shape[REDUCTION_AXIS[f"{gemm}.a"]]


def _orient(x: Tensor, transpose: bool) -> Tensor:
    return x.mT if transpose else x


def _oriented_factors(
    recipe: Recipe, gemm: str, a: Consumed, b: Consumed
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(elements of a, elements of b, scales of a, scales of b), a as (M, K) and b as (K, N)."""
    declared = getattr(recipe, gemm)
    (elements_a, scales_a), (elements_b, scales_b) = declared.a.factors(*a), declared.b.factors(*b)
    transpose_a, transpose_b = _TRANSPOSED[gemm]
    return (
        _orient(elements_a, transpose_a),
        _orient(elements_b, transpose_b),
        _orient(scales_a, transpose_a),
        _orient(scales_b, transpose_b),
    )


def _emulated(layer: nn.Module | None, recipe: Recipe, gemm: str, a: Consumed, b: Consumed) -> Tensor:
    """`emulated_gemm` of a layer's GEMM, shown to the GEMM observers; its consumed operands count
    as the arguments of a matrix product (`gemm_received`: the emulation's own run unobserved)."""
    transpose_a, transpose_b = _TRANSPOSED[gemm]
    gemm_received(_orient(a[1], transpose_a), _orient(b[1], transpose_b))
    out = emulated_gemm(recipe, gemm, a, b)
    with unobserved():  # measuring code: its products are not the GEMM's
        for observer in list(_gemm_observers):
            observer(layer, recipe, gemm, a, b, out)
    return out


def _elements(recipe: Recipe, gemm: str) -> tuple[str, str]:
    declared = getattr(recipe, gemm)
    return get_format(declared.a.fmt).element.name, get_format(declared.b.fmt).element.name


def _emulates(recipe: Recipe | None, gemm: str) -> bool:
    return recipe is not None and getattr(recipe, gemm).accumulation.hopper


def _product(
    layer: nn.Module | None,
    recipe: Recipe | None,
    gemm: str,
    a: Consumed,
    b: Consumed,
    bias: Tensor | None = None,
) -> Tensor:
    """GEMM `gemm` of a layer from its consumed operands (+ bias): emulated where the recipe's
    accumulation says, else torch's float32 product (addmm with a bias, as F.linear computes)."""
    if _emulates(recipe, gemm):
        out = _emulated(layer, recipe, gemm, a, b).to(a[0].dtype)
        return out if bias is None else out + bias
    transpose_a, transpose_b = _TRANSPOSED[gemm]
    a_used, b_used = _orient(a[1], transpose_a), _orient(b[1], transpose_b)
    return a_used @ b_used if bias is None else torch.addmm(bias, a_used, b_used)


def _layer_gemm(
    layer: nn.Module | None,
    recipe: Recipe | None,
    gemm: str,
    a: Consumed,
    b: Consumed,
    bias: Tensor | None = None,
) -> Tensor:
    """`_product`; on a sampled step (operand observers installed) the observers are handed, beside
    each live tensor, what the GEMM's matrix products themselves received (`GemmArguments`), not
    what the quantizer returned: a product of another tensor is a mismatch. One that ran none the
    capture sees hands them an empty operand (every element counted)."""
    if recipe is None or not _observers:
        return _product(layer, recipe, gemm, a, b, bias)
    with GemmArguments() as received:
        out = _product(layer, recipe, gemm, a, b, bias)
    transpose_a, transpose_b = _TRANSPOSED[gemm]
    reported = []
    for call_a, call_b in received.calls or [(a[1].new_empty(0, 0), b[1].new_empty(0, 0))]:
        reported += [
            (f"{gemm}.a", a[0], _orient(call_a, transpose_a)),
            (f"{gemm}.b", b[0], _orient(call_b, transpose_b)),
        ]
    _observe(layer, recipe, *reported)
    return out


class QuantLinearFn(torch.autograd.Function):
    """y = x W^T + b whose three GEMMs consume the recipe's quantized operands (module docstring).
    `layer`: the module it runs for, named to operand observers."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        recipe: Recipe | None,
        generator: torch.Generator | None = None,
        layer: nn.Module | None = None,
    ):
        x2d = x.reshape(-1, x.shape[-1])
        if recipe is not None:
            x_used = recipe.fprop.a.apply(x2d, generator)
            weight_used = recipe.fprop.b.apply(weight, generator)
        else:
            x_used, weight_used = x2d, weight
        y = _layer_gemm(layer, recipe, "fprop", (x2d, x_used), (weight, weight_used), bias)
        # the originals are saved: the backward GEMMs quantize them their own way, except a weight
        # that dgrad takes as fprop did (a square or tensor-wide block): reused
        ctx.save_for_backward(x2d, weight, weight_used)
        ctx.recipe, ctx.generator, ctx.x_shape, ctx.has_bias = recipe, generator, x.shape, bias is not None
        ctx.layer = layer
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x2d, weight, weight_used = ctx.saved_tensors
        recipe, generator = ctx.recipe, ctx.generator
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        dy_rows, x_rows = dy, x2d  # wgrad's operands before quantization
        if recipe is not None:
            dy_dgrad = recipe.dgrad.a.apply(dy, generator)
            weight_dgrad = (
                weight_used if recipe.dgrad.b == recipe.fprop.b else recipe.dgrad.b.apply(weight, generator)
            )
            if recipe.wgrad.hadamard:
                matrix = recipe.hadamard_matrix(dy.device)
                dy_rows, x_rows = recipe.rotate_tokens(dy, matrix), recipe.rotate_tokens(x2d, matrix)
            dy_wgrad = recipe.wgrad.a.apply(dy_rows, generator)
            x_wgrad = recipe.wgrad.b.apply(x_rows, generator)
        else:
            dy_dgrad = dy_wgrad = dy
            weight_dgrad, x_wgrad = weight, x2d
        grad_x = _layer_gemm(ctx.layer, recipe, "dgrad", (dy, dy_dgrad), (weight, weight_dgrad)).reshape(
            ctx.x_shape
        )
        grad_weight = _layer_gemm(ctx.layer, recipe, "wgrad", (dy_rows, dy_wgrad), (x_rows, x_wgrad))
        grad_bias = dy.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None


class QuantLinear(nn.Linear):
    """``nn.Linear`` whose GEMMs can be quantized (``recipe``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.recipe: Recipe | None = None
        self.generator: torch.Generator | None = None  # stochastic rounding's, seeded by set_recipe

    def forward(self, x: Tensor) -> Tensor:
        if self.recipe is None:
            return F.linear(x, self.weight, self.bias)
        return QuantLinearFn.apply(x, self.weight, self.bias, self.recipe, self.generator, self)


def recipe_layers(model: nn.Module) -> list[nn.Linear]:
    """The layers a recipe quantizes: the model's ``QuantLinear`` layers, or every ``nn.Linear``
    of a model that has none (see ``set_recipe``)."""
    quant_linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return quant_linears or [m for m in model.modules() if isinstance(m, nn.Linear)]


def set_recipe(model: nn.Module, recipe: Recipe | Scheme | None, seed: int = 0) -> None:
    """Train the GEMMs of ``model`` with ``recipe`` (None: plain float GEMMs).

    Models with ``QuantLinear`` layers (the built-in ones) choose which GEMMs are quantized: only
    those. In a model without any (a user's), every ``nn.Linear`` gets the recipe through an
    instance-level ``forward``, so the model's code and classes stay as they are. Layer i's
    stochastic rounding draws from a generator seeded with (seed, i): runs are deterministic.
    """
    if isinstance(recipe, Scheme):
        recipe = Recipe.from_scheme(recipe)
    layers = recipe_layers(model)
    for index, module in enumerate(layers):
        generator = None
        if recipe is not None and recipe.uses_stochastic_rounding():
            generator = torch.Generator(device=module.weight.device).manual_seed(seed * 1_000_003 + index)
        if isinstance(module, QuantLinear):
            module.recipe, module.generator = recipe, generator
            continue
        module.__dict__.pop("forward", None)
        if recipe is not None:
            module.forward = functools.partial(_recipe_forward, module, recipe, generator)


def own_quantization(model: nn.Module) -> list[str]:
    """The layers `set_recipe` would take from a model although they compute their own way: an
    ``nn.Linear`` subclass with a forward of its own (torchao's Float8Linear, a LoRA layer), as
    "name (Class from module)". A recipe on such a model would silently replace their numerics."""
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        return []
    return [
        f"{name} is a {type(module).__name__} ({type(module).__module__})"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward
    ]


def layer_recipe(module: nn.Module) -> Recipe | None:
    """The recipe `set_recipe` put on `module` (None: plain float GEMMs)."""
    if isinstance(module, QuantLinear):
        return module.recipe
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _recipe_forward:
        return forward.args[1]
    return None


def _recipe_forward(
    module: nn.Linear, recipe: Recipe, generator: torch.Generator | None, x: Tensor
) -> Tensor:
    return QuantLinearFn.apply(x, module.weight, module.bias, recipe, generator, module)
