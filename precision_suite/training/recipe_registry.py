"""The recipes a name stands for: the named recipes (each with its source, as torchao's recipe
configs carry theirs), any measurement scheme name (``e4m3:tensor``, ``bf16``), and the user's own
from TOML ``[recipes.NAME]`` tables, which reach spawned and remote workers through an environment
variable. recipes.py declares what a recipe is."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from precision_suite.numerics.accumulation import parse_accumulation
from precision_suite.training.probes import get_scheme
from precision_suite.training.recipes import HIGH_PRECISION, ROUNDINGS, Gemm, Operand, Recipe

# user recipes from a config reach spawned and remote workers through this variable (JSON)
RECIPES_ENV = "PRECISION_SUITE_RECIPES"


def _nvfp4_training() -> Recipe:
    weight = Operand("nvfp4", (16, 16))  # one quantized weight serves fprop and dgrad
    return Recipe(
        "nvfp4-training",
        fprop=Gemm(Operand("nvfp4", (1, 16)), weight),
        dgrad=Gemm(Operand("nvfp4", (1, 16), "stochastic"), weight),
        wgrad=Gemm(Operand("nvfp4", (16, 1), "stochastic"), Operand("nvfp4", (16, 1)), hadamard=16),
        source="NVIDIA, Pretraining Large Language Models with NVFP4 (arXiv 2509.25149), section 4: "
        "16x16 2-D weight scaling, 16x16 random Hadamard transforms on the wgrad inputs, "
        "stochastic rounding of gradients, round-to-nearest elsewhere; two-level scales "
        "(E4M3 per 16 elements, FP32 per tensor)",
    )


def _fp8_hybrid() -> Recipe:
    forward, gradient = Operand("e4m3", "tensor"), Operand("e5m2", "tensor")
    return Recipe(
        "fp8-hybrid",
        fprop=Gemm(forward, forward),
        dgrad=Gemm(gradient, forward),
        wgrad=Gemm(gradient, forward),
        source="Micikevicius et al., FP8 Formats for Deep Learning (arXiv 2209.05433); Transformer "
        "Engine's Format.HYBRID: E4M3 forward, E5M2 gradients, one scale per tensor (here the "
        "current amax, not delayed scaling)",
    )


def _on_hopper(recipe: Recipe, name: str, fprop: str, backward: str, source: str) -> Recipe:
    """`recipe`'s operands with fprop accumulated as `fprop` and dgrad, wgrad as `backward`."""
    fast, slow = parse_accumulation(fprop), parse_accumulation(backward)
    return dataclasses.replace(
        recipe,
        name=name,
        source=source,
        fprop=dataclasses.replace(recipe.fprop, accumulation=fast),
        dgrad=dataclasses.replace(recipe.dgrad, accumulation=slow),
        wgrad=dataclasses.replace(recipe.wgrad, accumulation=slow),
    )


_FP8_BLOCK = Recipe.from_scheme(
    get_scheme("fp8-block"),
    "DeepSeek-V3 (arXiv 2412.19437) section 3.3 / Ling 2.0: E4M3, 1x128 activation "
    "and gradient tiles, 128x128 weight blocks",
)
NAMED_RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        _FP8_BLOCK,
        _fp8_hybrid(),
        Recipe.from_scheme(
            get_scheme("mxfp8"),
            "OCP Microscaling Formats (MX) v1.0: E4M3 elements, E8M0 scale per 32 along the reduction",
        ),
        Recipe.from_scheme(
            get_scheme("nvfp4"),
            "NVFP4 blocks of 16 along the reduction, round to nearest, "
            "no Hadamard transform (compare nvfp4-training)",
        ),
        _nvfp4_training(),
        # The FP8 recipes as an H100 accumulates them (numerics/accumulation.py)
        _on_hopper(
            _fp8_hybrid(),
            "fp8-hybrid-hopper",
            "hopper-fast",
            "hopper-promoted:128",
            "fp8-hybrid's operands accumulated as Transformer Engine's Float8CurrentScaling recipe does by "
            "default (transformer_engine/common/recipe: fp8_gemm_fprop use_split_accumulator=False, dgrad and "
            "wgrad True; the module defaults _2X_ACC_FPROP/DGRAD/WGRAD of pytorch/module/base.py agree) and "
            "as torchao's default float8 training does (torchao/float8/config.py, Float8LinearConfig: "
            "tensorwise scales, E4M3 input and weight, E5M2 grad_output, gemm_config_output "
            "use_fast_accum=True, grad_input and grad_weight False): fprop one fast tensor-core chain, dgrad "
            "and wgrad promoted every 128 (cuBLAS's split accumulator)",
        ),
        _on_hopper(
            _FP8_BLOCK,
            "fp8-block-hopper",
            "hopper-promoted:128",
            "hopper-promoted:128",
            "fp8-block's operands accumulated as DeepSeek-V3 trains (arXiv 2412.19437 section 3.3.2: "
            "promotion to FP32 every N_C = 128 elements, each partial sum scaled by its block scales; DeepGEMM) "
            "and as Transformer Engine's Float8BlockScaling recipe forces on all three GEMMs "
            "(use_split_accumulator=True)",
        ),
    )
}
RECIPE_EXAMPLES = f"{', '.join(NAMED_RECIPES)}, bf16, or <format>:<layout> such as e4m3:tensor"


def get_recipe(name: str) -> Recipe:
    """A named recipe, a user recipe (``RECIPES_ENV``), or a measurement scheme's recipe."""
    if name in NAMED_RECIPES:
        return NAMED_RECIPES[name]
    user = _user_recipes()
    if name in user:
        return user[name]
    try:
        scheme = get_scheme("bf16:tensor" if name == "bf16" else name)
    except ValueError as error:
        raise ValueError(
            f"unknown recipe {name!r}: use fp32, {RECIPE_EXAMPLES}, or declare it in a "
            f"[recipes.NAME] table of the config ({error})"
        ) from None
    return Recipe.from_scheme(scheme)  # a scheme's layout that cannot be a recipe's says why


def recipes_from_toml(table: Mapping[str, Any], where: str) -> dict[str, Recipe]:
    """Recipes from a config's ``[recipes.NAME]`` tables::

        [recipes.my-hybrid]
        source = "why and where from"
        fprop = { a = "e4m3:tensor", b = "e4m3:tensor", accumulate = "hopper-fast" }
        dgrad = { a = "e5m2:tensor", b = "e4m3:tensor", accumulate = "hopper-promoted:128" }
        wgrad = { a = "e5m2:1x128:stochastic", b = "fp32", hadamard = 0 }

    (``accumulate``: "fp32", the default, "hopper-fast", "hopper-promoted[:N]".)

    ValueError names the table and field at fault."""
    recipes = {}
    for name, body in table.items():
        context = f"{where}: [recipes.{name}]"
        if not isinstance(body, Mapping):
            raise ValueError(f"{context} must be a table")
        unknown = sorted(set(body) - {"source", "fprop", "dgrad", "wgrad"})
        if unknown:
            raise ValueError(
                f"{context} has unknown key(s) {', '.join(unknown)}; allowed: source, fprop, dgrad, wgrad"
            )
        try:
            gemms = {gemm: _gemm(body.get(gemm), f"{context} {gemm}") for gemm in ("fprop", "dgrad", "wgrad")}
            recipes[name] = Recipe(str(name), source=str(body.get("source", "")), **gemms)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{context}: {error}") from None
        if name in NAMED_RECIPES:
            raise ValueError(f"{context}: {name!r} is a built-in recipe; pick another name")
    return recipes


def recipes_environment(recipes: Mapping[str, Recipe]) -> dict[str, str]:
    """Environment that makes ``recipes`` known to ``get_recipe`` in a worker process."""
    return (
        {RECIPES_ENV: json.dumps({name: {"source": r.source, **r.describe()} for name, r in recipes.items()})}
        if recipes
        else {}
    )


def _user_recipes() -> dict[str, Recipe]:
    text = os.environ.get(RECIPES_ENV)
    return recipes_from_toml(json.loads(text), RECIPES_ENV) if text else {}


def _gemm(value: Any, context: str) -> Gemm:
    if (
        not isinstance(value, Mapping)
        or set(value) - {"a", "b", "hadamard", "accumulate"}
        or not {"a", "b"} <= set(value)
    ):
        raise ValueError(
            f'{context} must be a table {{ a = "<fmt>:<layout>[:stochastic]", b = ..., '
            f'hadamard = 0, accumulate = "fp32" }}, got {value!r}'
        )
    hadamard = value.get("hadamard", 0)
    if not isinstance(hadamard, int) or isinstance(hadamard, bool) or hadamard < 0:
        raise ValueError(f"{context} hadamard must be a non-negative integer, got {hadamard!r}")
    try:
        accumulation = parse_accumulation(value.get("accumulate", "fp32"))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{context} accumulate: {error}") from None
    return Gemm(_operand(value["a"]), _operand(value["b"]), hadamard, accumulation)


def _operand(text: Any) -> Operand:
    if not isinstance(text, str):
        raise ValueError(f'an operand is written "<fmt>:<layout>[:stochastic]" or "fp32", got {text!r}')
    parts = text.split(":")
    if parts[0] == HIGH_PRECISION and len(parts) == 1:
        return Operand(HIGH_PRECISION)
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ROUNDINGS):
        raise ValueError(
            f'operand {text!r}: write "<fmt>:<layout>" (e4m3:1x128, nvfp4:16x16, e5m2:tensor), '
            'optionally ":stochastic", or "fp32"'
        )
    return Operand(parts[0], parts[1], parts[2] if len(parts) == 3 else "nearest")
