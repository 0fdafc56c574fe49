"""The per-module variables a run dataset stores of what quantized its GEMMs, with their CF
attributes: the model's own quantization as observed (training/observation.py), the accumulation
error of the FP8 GEMMs a run emulated or observed, and the suite's recipe each module trained with,
as data. `views.run_dataset` assembles them; the module view keeps them as they are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from precision_suite.numerics.metrics import SUM_FIELDS
from precision_suite.training.observed_operands import GEMMS, StepObservation
from precision_suite.training.recipes import GEMM_OPERANDS, Recipe


class ObservedSteps(NamedTuple):
    """What the model's own quantization did (training/observation.py), over (step, module, ...)."""

    sums: np.ndarray  # (step, module, operand, sum_field) float64: sums of the observed quantizations
    formats: np.ndarray  # (step, module, operand) str: "<fmt>:<granularity>", "" where none was seen
    blocks: np.ndarray  # (step, module, operand) str: the block one scale covers, "RxC" or "tensor"
    scales: np.ndarray  # (step, module, operand) str: the scale's kind
    targets: (
        np.ndarray
    )  # (step, module, operand) float64: the scale's target (observed_operands.scale_target), NaN: none
    shapes: np.ndarray  # (step, module, operand) str: the operand's "RxC" in the suite's orientation
    gemms: np.ndarray  # (step, module, gemm) int64: scaled GEMMs observed
    accumulation: np.ndarray  # (step, module, gemm) str: "fast", "precise" or "" (not said)
    unconsumed: np.ndarray  # (step, module) int64: elements cast to 8 bits that no observed GEMM took


class AccumulationSteps(NamedTuple):
    """The accumulation error of the FP8 GEMMs a run emulated or observed, over (step, module, gemm)."""

    sums: np.ndarray  # (step, module, gemm, accumulation, accumulation_field) float64: ERROR_FIELDS sums
    modes: np.ndarray  # (step, module, gemm) str: the mode the GEMM ran with, "" where none was recorded
    reductions: np.ndarray  # (step, module, gemm) int64: K, the products summed per output (0: none)


def observed_steps(
    observations: Sequence[StepObservation], n_steps: int, where: Mapping[str, int]
) -> ObservedSteps:
    """Each sampled step's observation as arrays over (step, module, operand or GEMM), the modules
    placed by `where` (name -> index)."""
    shape = (n_steps, len(where))
    operand_index = {name: i for i, name in enumerate(GEMM_OPERANDS)}
    gemm_index = {name: i for i, name in enumerate(GEMMS)}
    sums = np.zeros((*shape, len(GEMM_OPERANDS), len(SUM_FIELDS)))
    formats = np.full((*shape, len(GEMM_OPERANDS)), "", dtype=object)
    scales = np.full((*shape, len(GEMM_OPERANDS)), "", dtype=object)
    blocks = np.full((*shape, len(GEMM_OPERANDS)), "", dtype=object)
    gemms = np.zeros((*shape, len(GEMMS)), dtype=np.int64)
    accumulation = np.full((*shape, len(GEMMS)), "", dtype=object)
    targets = np.full((*shape, len(GEMM_OPERANDS)), np.nan)
    shapes = np.full((*shape, len(GEMM_OPERANDS)), "", dtype=object)
    unconsumed = np.zeros(shape, dtype=np.int64)
    for i, step in enumerate(observations):
        for item in step.operands:
            m, o, g = where[item.module], operand_index[item.operand], gemm_index[item.gemm]
            if item.stats is not None:
                sums[i, m, o] += item.stats.sums.double().cpu().numpy()
            formats[i, m, o] = _joined(formats[i, m, o], item.text)
            scales[i, m, o] = _joined(scales[i, m, o], item.scale)
            blocks[i, m, o] = _joined(blocks[i, m, o], item.block)
            shapes[i, m, o] = _joined(shapes[i, m, o], item.shape)
            targets[i, m, o] = np.fmax(targets[i, m, o], item.target)  # several GEMMs: the largest
            if item.operand.endswith(".a") and item.quantized_gemm:  # one GEMM, two operands
                gemms[i, m, g] += 1
                if item.fast_accumulation is not None:
                    mode = "fast" if item.fast_accumulation else "precise"
                    accumulation[i, m, g] = _joined(accumulation[i, m, g], mode)
        for module, numel in step.unconsumed.items():
            unconsumed[i, where[module]] = numel
    return ObservedSteps(sums, formats, blocks, scales, targets, shapes, gemms, accumulation, unconsumed)


def _joined(listed: str, text: str) -> str:
    """`listed` ("a|b") with `text` added once: a module called twice in a step may quantize twice."""
    parts = [part for part in listed.split("|") if part]
    return "|".join(parts if text in parts else [*parts, text])


def observed_variables(observed: ObservedSteps) -> dict[str, Any]:
    """The per-module variables of the observed quantization (the recipe, GEMM counts, sums)."""
    per_operand, per_gemm = ("step", "module", "operand"), ("step", "module", "gemm")
    return {
        "observed_sums": (
            (*per_operand, "sum_field"),
            observed.sums,
            {
                "long_name": "additive sums of the observed quantization per module",
                "units": "1",
                "description": "sum_field sums of each GEMM operand the model's own code quantized, against "
                "the high-precision tensor it came from (0 where none was observed)",
            },
        ),
        "observed_format": (
            per_operand,
            observed.formats,
            {
                "long_name": "observed operand format",
                "units": "1",
                "description": "<element format>:<scale granularity> of each operand the module's scaled "
                "GEMMs consumed, in recipe vocabulary (tensor, row, column, RxC blocks); "
                "several joined by |; empty where none was observed",
            },
        ),
        "observed_block": (
            per_operand,
            observed.blocks,
            {
                "long_name": "observed scaling block",
                "units": "1",
                "description": "rows x columns one scale of the operand covers (x as tokens x in, W as out x in, "
                "dy as tokens x out), or tensor",
            },
        ),
        "observed_scale": (
            per_operand,
            observed.scales,
            {
                "long_name": "observed scale kind",
                "units": "1",
                "description": "dtype of each operand's scale, with pow2 when every scale is a power of two",
            },
        ),
        "observed_target": (
            per_operand,
            observed.targets,
            {
                "long_name": "observed scale target",
                "units": "1",
                "description": "where the operand's scale maps each block's amax, as a fraction of the format's "
                "largest finite value (1.0: amax -> 448 in E4M3), the median over blocks to 2 "
                "significant digits; with power-of-two scales the upper end of the bracket "
                "(T/2, T] they leave, a power of two; NaN where none was observed",
            },
        ),
        "observed_shape": (
            per_operand,
            observed.shapes,
            {
                "long_name": "observed operand shape",
                "units": "1",
                "description": "rows x columns of the operand as the recipes describe it (a block clips to it); "
                "not part of the recipe",
            },
        ),
        "observed_gemms": (
            per_gemm,
            observed.gemms,
            {
                "long_name": "observed scaled GEMMs",
                "units": "1",
                "description": "GEMMs (fprop, dgrad, wgrad) the module ran on the sampled step with a quantized "
                "operand: scaled GEMMs and matrix products of dequantized casts (fake quantization)",
            },
        ),
        "observed_accumulation": (
            per_gemm,
            observed.accumulation,
            {
                "long_name": "observed GEMM accumulation flag",
                "units": "1",
                "description": "fast (use_fast_accum) or precise, as the GEMM call said; empty where it did not",
            },
        ),
        "observed_unconsumed": (
            ("step", "module"),
            observed.unconsumed,
            {
                "long_name": "elements cast to 8 bits that no observed GEMM consumed",
                "units": "1",
                "description": "casts whose GEMM the suite could not see (a kernel inside a compiled graph or an "
                "extension), or that fed no GEMM",
            },
        ),
    }


def accumulation_variables(accumulation: AccumulationSteps) -> dict[str, Any]:
    """The per-module variables of the accumulation error (its sums, the mode as run, K)."""
    per_gemm = ("step", "module", "gemm")
    return {
        "accumulation_sums": (
            (*per_gemm, "accumulation", "accumulation_field"),
            accumulation.sums,
            {
                "long_name": "additive sums of the GEMM accumulation error per module",
                "units": "1",
                "description": "float64 sums (accumulation_field) of each GEMM accumulated as an H100's FP8 tensor "
                "cores do (numerics/accumulation.py) against the float64 product of the same quantized "
                "operands: sum (C - R)^2 and sum R^2 over the finite outputs, outputs left out, outputs; "
                "a layer's error is its modules' sums added, then the ratio; 0 where not measured",
            },
        ),
        "accumulation_mode": (
            per_gemm,
            accumulation.modes,
            {
                "long_name": "accumulation of the GEMM as it ran",
                "units": "1",
                "description": "hopper-fast or hopper-promoted:N: the recipe's accumulate, or the use_fast_accum flag "
                "of the model's own scaled GEMM (fast: hopper-fast, else hopper-promoted:128, cuBLAS's "
                "split accumulator); several joined by |; empty where no FP8 GEMM accumulated so",
            },
        ),
        "accumulation_k": (
            per_gemm,
            accumulation.reductions,
            {
                "long_name": "GEMM reduction length K",
                "units": "1",
                "description": "products summed per output of the GEMM (fprop: in features, dgrad: out features, "
                "wgrad: tokens); the largest where a module ran it with several; 0 where not measured",
            },
        ),
    }


def recipe_variables(recipes: Sequence[Recipe | None]) -> dict[str, Any]:
    """The suite's recipe per module as data: each GEMM operand's format:layout[:stochastic] and each
    GEMM's accumulation, as `Recipe.describe` (and a `[recipes.NAME]` table) writes them."""
    described = [recipe.describe() if recipe is not None else None for recipe in recipes]
    operands = np.array(
        [
            [d[gemm][side] if d else "" for gemm, side in (o.split(".") for o in GEMM_OPERANDS)]
            for d in described
        ],
        dtype=object,
    ).reshape(len(recipes), len(GEMM_OPERANDS))
    accumulation = np.array(
        [[d[gemm]["accumulate"] if d else "" for gemm in GEMMS] for d in described], dtype=object
    ).reshape(len(recipes), len(GEMMS))
    return {
        "recipe_operand": (
            ("module", "operand"),
            operands,
            {
                "long_name": "recipe operand format",
                "units": "1",
                "description": "format:layout[:stochastic] of each GEMM operand in the suite's recipe the module "
                "trained with, or fp32; empty where the module had no recipe of the suite's",
            },
        ),
        "recipe_accumulation": (
            ("module", "gemm"),
            accumulation,
            {
                "long_name": "recipe GEMM accumulation",
                "units": "1",
                "description": "fp32, hopper-fast or hopper-promoted:N: the accumulate of each GEMM in the suite's "
                "recipe the module trained with; empty where the module had no recipe of the suite's",
            },
        ),
    }
