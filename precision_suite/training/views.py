"""Run datasets from per-module sums, and their two views: per layer and per module.

A run records additive sums (``metrics.SUM_FIELDS``: counts and dot products) per sampled step,
GEMM module, tensor role and layout (``module_sums``). Sums add, so a layer's numbers are its
modules' sums added before any ratio is taken: ``run_dataset`` stores the per-layer metrics
(figure B, what baselines and the calibrated comparison judge) derived exactly that way, and
``module_view`` gives the same metrics per module (rules with ``module=...`` selectors, charts).
Both go through ``metrics.metrics_from_sums``, the one definition of every metric.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from precision_suite.files import SCHEMA_VERSION
from precision_suite.numerics.accumulation_error import ERROR_FIELDS, WHAT_IF, relative_errors
from precision_suite.numerics.metric_table import METRICS, QUANT_METRICS, observed_name
from precision_suite.numerics.metrics import SUM_FIELDS, metrics_from_sums
from precision_suite.training.module_variables import (
    AccumulationSteps,
    ObservedSteps,
    accumulation_variables,
    observed_variables,
    recipe_variables,
)
from precision_suite.training.observed_operands import GEMMS
from precision_suite.training.probes import TENSOR_ROLES
from precision_suite.training.recipes import GEMM_OPERANDS, Recipe

_NUMEL, _NONFINITE = SUM_FIELDS.index("numel"), SUM_FIELDS.index("nonfinite_in")
QUANT_WHERE = ("step", "layer", "tensor", "layout")
OPERAND_VARIABLES = ("operand_mismatch", "operand_numel")  # per module already: the module view keeps them
OBSERVED_VARIABLES = (
    "observed_format",
    "observed_block",
    "observed_scale",
    "observed_target",
    "observed_shape",
    "observed_gemms",
    "observed_accumulation",
    "observed_unconsumed",
)
# the accumulation error's columns: the GEMM as it ran (its recipe's mode, or the flag of the
# model's own scaled GEMM call), then what each mode of WHAT_IF would give on the same operands
AS_RUN = "as-run"
ACCUMULATIONS = (AS_RUN, *(accumulation.text() for accumulation in WHAT_IF))
ACCUMULATION_VARIABLES = (
    "accumulation_mode",
    "accumulation_k",
)  # per module already: the module view keeps them
# the suite's recipe each module trained with (Recipe.describe), per module already: the module view keeps them
RECIPE_VARIABLES = ("recipe_operand", "recipe_accumulation")
_OUTPUTS = ERROR_FIELDS.index("outputs")


class OperandCounts(NamedTuple):
    """What the recorder counted of the operands the recipe's GEMMs consumed."""

    operands: Sequence[str]  # "fprop.a", ..., "wgrad.b"
    mismatch: np.ndarray  # (step, module, operand) int64: elements unlike a fresh quantization
    numel: np.ndarray  # (step, module, operand) int64: elements compared (0: nothing consumed)
    declared: Sequence[str]  # per operand, the declared Operand.text() ("" where none was seen)


def operand_counts(
    steps: Sequence[Mapping[tuple[str, str], tuple[object, int]]],
    declared: Mapping[str, Mapping[str, None]],
    n_steps: int,
    where: Mapping[str, int],
) -> OperandCounts:
    """Each sampled step's (module, operand) -> (elements mismatched, elements compared) as arrays
    over (step, module, operand), the modules placed by `where`; `declared`: operand -> the
    Operand.text()s it was declared as."""
    counts = np.zeros((n_steps, len(where), len(GEMM_OPERANDS), 2), dtype=np.int64)
    index = {name: i for i, name in enumerate(GEMM_OPERANDS)}
    for i, step_counts in enumerate(steps):
        for (module, operand), (mismatched, numel) in step_counts.items():
            counts[i, where[module], index[operand]] = int(mismatched), numel
    texts = ["|".join(declared.get(name, ())) for name in GEMM_OPERANDS]
    return OperandCounts(GEMM_OPERANDS, counts[..., 0], counts[..., 1], texts)


def layer_index(name: str) -> int:
    """The block index in a module name: its first integer part ('blocks.3.attn.qkv' -> 3,
    'model.layers.11.mlp.up_proj' -> 11); -1 outside any block ('head', 'embed')."""
    for part in str(name).split("."):
        if part.isdigit():
            return int(part)
    return -1


def run_dataset(
    steps: Sequence[int],
    modules: Sequence[str],
    labels: Sequence[str],
    sums: np.ndarray,
    attention_modules: Sequence[str],
    attention_norms: np.ndarray,
    first_labels: Sequence[str],
    case: str,
    attrs: Mapping[str, Any],
    operands: OperandCounts | None = None,
    observed: ObservedSteps | None = None,
    accumulation: AccumulationSteps | None = None,
    recipes: Sequence[Recipe | None] | None = None,
) -> xr.Dataset:
    """The schema-3 dataset (docs/architecture.md).

    sums: (step, module, tensor, layout, sum_field), zero where nothing was measured.
    attention_norms: (step, attention module), NaN where nothing was recorded.
    first_labels: per tensor role, the layout label of the first scheme (its NaN/Inf count).
    operands: the consumed operands' counts (docs/runs.md), when recorded.
    observed: the model's own quantization, when any was observed (docs/runs.md).
    accumulation: the accumulation error of the GEMMs accumulated as an H100 does, when any was
      (docs/runs.md); runs whose GEMMs all accumulate in float32 have none of its variables.
    recipes: per module, the suite's recipe it trained with (None: none, plain float GEMMs or the
      model's own quantization), when any module had one.
    """
    module_layer = np.array([layer_index(m) for m in modules], dtype=np.int64)
    attention_layer = np.array([layer_index(m) for m in attention_modules], dtype=np.int64)
    steps = np.asarray(steps, dtype=np.int64)
    sum_dims = ("step", "module", "tensor", "layout", "sum_field")
    data_vars: dict[str, Any] = {
        "module_sums": (
            sum_dims,
            sums,
            {
                "long_name": "additive quantization sums per module",
                "units": "1",
                "description": "counts and float64 dot products (sum_field) of each GEMM operand; a "
                "layer's metrics are its modules' sums added, then turned into ratios",
            },
        ),
    }
    coords: dict[str, Any] = {
        "step": steps,
        "module": np.array(modules, dtype=object),
        "module_layer": (
            "module",
            module_layer,
            {"description": "block index of the module, -1 outside blocks"},
        ),
        "tensor": np.array(TENSOR_ROLES, dtype=object),
        "layout": np.array(labels, dtype=object),
        "sum_field": np.array(SUM_FIELDS, dtype=object),
    }
    if len(attention_modules):
        data_vars["module_attention_norm"] = (
            ("step", "attention_module"),
            attention_norms,
            METRICS["attention_norm"].attrs(),
        )
        coords["attention_module"] = np.array(attention_modules, dtype=object)
        coords["attention_module_layer"] = (
            "attention_module",
            attention_layer,
            {"description": "block index of the attention module"},
        )
    if operands is not None:
        operand_dims = ("step", "module", "operand")
        data_vars["operand_mismatch"] = (operand_dims, operands.mismatch, METRICS["operand_mismatch"].attrs())
        data_vars["operand_numel"] = (
            operand_dims,
            operands.numel,
            {
                "long_name": "consumed operand elements compared",
                "units": "1",
                "description": "elements of each GEMM operand the recipe consumed and the recorder compared "
                "(0: the module consumed no recipe operand)",
            },
        )
        coords["operand"] = np.array(operands.operands, dtype=object)
        coords["operand_declared"] = (
            "operand",
            np.array(operands.declared, dtype=object),
            {"description": "the recipe's declared format:layout[:stochastic] of each operand, or fp32"},
        )
    if observed is not None:
        data_vars.update(observed_variables(observed))
        coords["gemm"] = np.array(GEMMS, dtype=object)
        coords.setdefault("operand", np.array(GEMM_OPERANDS, dtype=object))
    if accumulation is not None:
        data_vars.update(accumulation_variables(accumulation))
        coords["gemm"] = np.array(GEMMS, dtype=object)
        coords["accumulation"] = np.array(ACCUMULATIONS, dtype=object)
        coords["accumulation_field"] = np.array(ERROR_FIELDS, dtype=object)
    if recipes is not None and any(recipes):
        data_vars.update(recipe_variables(recipes))
        coords["gemm"] = np.array(GEMMS, dtype=object)
        coords.setdefault("operand", np.array(GEMM_OPERANDS, dtype=object))
    layers = sorted({int(v) for v in (*module_layer, *attention_layer) if v >= 0})
    if layers:
        coords["layer"] = np.array(layers, dtype=np.int64)
        layer_sums = np.stack([sums[:, module_layer == layer].sum(axis=1) for layer in layers], axis=1)
        data_vars.update(_metric_vars(layer_sums, "layer", first_labels, labels))
        if observed is not None:
            observed_sums = np.stack(
                [observed.sums[:, module_layer == layer].sum(axis=1) for layer in layers], axis=1
            )
            data_vars.update(_observed_metric_vars(observed_sums, "layer"))
        if accumulation is not None:
            pooled = np.stack(
                [accumulation.sums[:, module_layer == layer].sum(axis=1) for layer in layers], axis=1
            )
            data_vars["accumulation_error"] = _accumulation_error(pooled, "layer")
        if len(attention_modules):
            norms = np.stack(
                [_nanmean(attention_norms[:, attention_layer == layer]) for layer in layers], axis=1
            )
            data_vars["attention_norm"] = (("step", "layer"), norms, METRICS["attention_norm"].attrs())
    all_attrs = {
        "schema_version": SCHEMA_VERSION,
        "case": case,
        "nonfinite_layouts": ",".join(first_labels),
        **attrs,
    }
    return xr.Dataset(data_vars, coords=coords, attrs=all_attrs)


def module_view(ds: xr.Dataset) -> xr.Dataset:
    """The run's metrics per module (dims step, module, tensor, layout), attention norms under
    their attention modules' names; attrs as the run's.

    The view's modules are the run's GEMM modules (probed, observed, accumulated: the run's
    ``module``) followed by the attention modules not among them, whatever subset each has; a
    variable is filled where its group has no such module as ``_fill`` says (NaN: not measured).
    """
    if "module_sums" not in ds:
        raise ValueError(
            f"dataset {ds.attrs.get('case', '')!r} has no per-module sums (schema_version "
            f"{ds.attrs.get('schema_version')!r}; per-module numbers need {SCHEMA_VERSION})"
        )
    sums = ds["module_sums"].transpose("step", "module", "tensor", "layout", "sum_field").values
    labels = [str(v) for v in ds["layout"].values]
    gemm_modules = xr.Dataset(
        dict(_metric_vars(sums, "module", _first_labels(ds), labels)),
        coords={
            "step": ds["step"].values,
            "module": ds["module"].values,
            "tensor": ds["tensor"].values,
            "layout": ds["layout"].values,
        },
    )
    present = [
        name
        for name in (*OPERAND_VARIABLES, *OBSERVED_VARIABLES, *ACCUMULATION_VARIABLES, *RECIPE_VARIABLES)
        if name in ds
    ]
    gemm_modules = gemm_modules.assign({name: ds[name].drop_vars("module_layer") for name in present})
    if "observed_sums" in ds:
        sums = ds["observed_sums"].transpose("step", "module", "operand", "sum_field").values
        gemm_modules = gemm_modules.assign(_observed_metric_vars(sums, "module"))
    if "accumulation_sums" in ds:
        sums = (
            ds["accumulation_sums"]
            .transpose("step", "module", "gemm", "accumulation", "accumulation_field")
            .values
        )
        gemm_modules = gemm_modules.assign(accumulation_error=_accumulation_error(sums, "module"))
    gemm_modules = gemm_modules.assign_coords(
        {
            dim: ds[dim].values
            for dim in gemm_modules.dims
            if dim not in gemm_modules.coords and dim in ds.coords
        }
    )
    groups = [gemm_modules]
    if "module_attention_norm" in ds:
        norms = (
            ds["module_attention_norm"]
            .rename(attention_module="module")
            .drop_vars("attention_module_layer", errors="ignore")
        )
        groups.append(norms.to_dataset(name="attention_norm"))
    modules = list(dict.fromkeys(str(m) for group in groups for m in group["module"].values))
    on_modules = [
        group.reindex(
            module=np.array(modules, dtype=object),
            fill_value={name: _fill(group[name]) for name in group.data_vars},
        )
        for group in groups
    ]
    view = xr.merge(on_modules, join="exact", compat="override", combine_attrs="drop")
    view.attrs = dict(ds.attrs)
    if "tokens" in ds.coords:
        view = view.assign_coords(tokens=("step", ds["tokens"].values))
    return view


def _fill(variable: xr.DataArray) -> object:
    """What a per-module variable holds at a module its group lacks: "" for strings (none seen), 0
    for counts (nothing counted), NaN for floats (not measured)."""
    if variable.dtype.kind in "OUS":
        return ""
    if variable.dtype.kind in "iub":
        return 0
    return np.nan


def _metric_vars(
    sums: np.ndarray, where: str, first_labels: Sequence[str], labels: Sequence[str]
) -> dict[str, Any]:
    """Metric variables over (step, <where>, tensor, layout) from sums of that shape (+ sum_field)."""
    metrics = metrics_from_sums(sums)
    dims = ("step", where, "tensor", "layout")
    first = [labels.index(label) for label in first_labels]
    roles = np.arange(len(TENSOR_ROLES))
    first_sums = sums[:, :, roles, first]  # (step, where, tensor, field): the first scheme's layout
    return {
        **{name: (dims, metrics[name], METRICS[name].attrs()) for name in QUANT_METRICS},
        "nonfinite": (dims[:3], first_sums[..., _NONFINITE].astype(np.int64), METRICS["nonfinite"].attrs()),
        "numel": (
            (where, "tensor"),
            first_sums[0, ..., _NUMEL].astype(np.int64),
            {
                "long_name": "elements counted",
                "units": "1",
                "description": f"elements pooled into each {where}'s fractions per step",
            },
        ),
    }


def _accumulation_error(
    sums: np.ndarray, where: str
) -> tuple[tuple[str, ...], np.ndarray, dict[str, object]]:
    """accumulation_error over (step, <where>, gemm, accumulation) from sums of that shape (+ field):
    the ratio of the pooled sums, NaN where nothing was measured."""
    with np.errstate(invalid="ignore"):
        errors = np.where(sums[..., _OUTPUTS] > 0, relative_errors(sums), np.nan)
    return ("step", where, "gemm", "accumulation"), errors, METRICS["accumulation_error"].attrs()


def _observed_metric_vars(sums: np.ndarray, where: str) -> dict[str, Any]:
    """observed_<metric> over (step, <where>, operand) from observed sums of that shape."""
    metrics = metrics_from_sums(sums)
    dims = ("step", where, "operand")
    return {
        **{
            observed_name(name): (dims, metrics[name], METRICS[observed_name(name)].attrs())
            for name in QUANT_METRICS
        },
        "observed_numel": (
            dims,
            sums[..., _NUMEL].astype(np.int64),
            {
                "long_name": "elements of the observed quantizations",
                "units": "1",
                "description": f"elements pooled into each {where}'s observed fractions",
            },
        ),
    }


def _first_labels(ds: xr.Dataset) -> list[str]:
    """Per tensor role, the layout label whose NaN/Inf count the run reports (the first scheme's)."""
    labels = ds.attrs.get("nonfinite_layouts")
    if isinstance(labels, str):
        return labels.split(",")
    raise ValueError(f"dataset {ds.attrs.get('case', '')!r} lacks attribute 'nonfinite_layouts'")


def _nanmean(values: np.ndarray) -> np.ndarray:
    """Mean over the last axis ignoring NaN; NaN (without a warning) where all are NaN."""
    counts = np.sum(~np.isnan(values), axis=-1)
    totals = np.nansum(values, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, totals / np.maximum(counts, 1), np.nan)
