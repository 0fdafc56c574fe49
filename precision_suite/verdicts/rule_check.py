"""The check of threshold and growth rules (verdicts.rules: their grammar) on a run: each rule's
selected cells, per layer or per module (views.module_view), bounds evaluated with the run's own
numbers (its spec's fields and the dataset's attributes), findings of verdicts.findings."""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from precision_suite.verdicts.findings import COORD_KEYS, TIME_DIMS, Finding, format_where, to_python
from precision_suite.verdicts.rules import BoundRule, GrowthRule, Rule, evaluate_expression, parse_rules

if TYPE_CHECKING:  # xarray is only needed for annotations; keeps this module cheap to import
    import xarray as xr


def run_names(ds: xr.Dataset) -> dict[str, float]:
    """Numbers a bound expression may use: numeric spec fields, then numeric dataset attrs."""
    names: dict[str, float] = {}
    for key, value in {**run_spec(ds), **ds.attrs}.items():
        if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
            names[str(key)] = float(value)
    return names


def run_spec(ds: xr.Dataset) -> dict[str, Any]:
    try:
        spec = json.loads(ds.attrs.get("spec", "{}"))
    except (TypeError, ValueError):
        return {}
    return spec if isinstance(spec, dict) else {}


def check_rules(
    ds: xr.Dataset,
    rules: Iterable[str | Mapping[str, Any] | Rule],
    case: str | None = None,
    *,
    strict: bool = False,
) -> list[Finding]:
    """Findings (kind "threshold", or "error" for a rule that cannot be applied) of `rules` on `ds`.

    A rule whose spec selectors (e.g. attention=softmax) do not match the run does not apply, nor
    does one with spec selectors on a run without a spec (a user's model recorded by instrument()),
    unless strict=True (rules written for this very case). A selector that is neither a dimension
    nor a field of the run's spec is an error. A rule whose
    coordinate selectors match nothing is skipped, or an error with strict=True. Cells NaN at every
    step (pairs the run does not measure) are skipped; a NaN among measured steps violates the
    rule, and a rule whose every selected cell is NaN is an error: it checks nothing.
    """
    case = case if case is not None else str(ds.attrs.get("case", "?"))
    findings: list[Finding] = []
    for rule in parse_rules(rules):
        try:
            findings.extend(_check_rule(ds, rule, case, strict))
        except ValueError as err:
            findings.append(Finding.error(case, rule.metric, f"rule '{rule}' cannot be checked: {err}"))
    return findings


def _check_rule(ds: xr.Dataset, rule: Rule, case: str, strict: bool) -> list[Finding]:
    if not _applies(ds, rule, strict):
        return []
    recorded = ds
    if _per_module(ds, rule):
        # lazy: views loads torch (metrics); the plugin reads rules at every pytest session's start
        from precision_suite.training.views import module_view

        ds = module_view(ds)
    da = _selected_cells(ds, rule, strict)
    if da is None:
        return []
    time_dims = [d for d in da.dims if d in TIME_DIMS]
    if len(time_dims) != 1:
        raise ValueError(f"{rule.metric} needs exactly one time dimension (step or train_step)")
    time_dim = time_dims[0]
    group_dims = [d for d in da.dims if d != time_dim]
    da = da.transpose(*group_dims, time_dim)
    values = da.values.astype(np.float64).reshape(-1, da.sizes[time_dim])
    measured = ~np.all(np.isnan(values), axis=1)
    if not measured.any():
        if strict or not _unmeasured_by_design(recorded, da):
            raise ValueError(
                f"every selected cell of {rule.metric} is NaN: the run did not measure it "
                "(e.g. attention that no probe saw); the rule checks nothing"
            )
        return []
    if isinstance(rule, GrowthRule):
        first_time = to_python(da[time_dim].values[0])
        violated, step_index, observed, reference, detail = _growth(
            rule, values, measured, run_names(ds), f"{time_dim} {first_time}"
        )
    else:
        violated, step_index, observed, reference, detail = _bound(
            rule, values, measured, run_names(ds), time_dim
        )
    findings = []
    sizes = [da.sizes[d] for d in group_dims]
    for g in np.flatnonzero(violated):
        where = {
            d: to_python(da[d].values[i])
            for d, i in zip(group_dims, np.unravel_index(g, sizes) if sizes else ())
        }
        where[time_dim] = to_python(da[time_dim].values[step_index[g]])
        findings.append(
            Finding(
                case,
                "threshold",
                rule.metric,
                where,
                float(observed[g]),
                float(reference[g]),
                math.nan,
                f"{case}: rule '{rule}' violated at {format_where(where)}: {detail(g)}",
                rule=str(rule),
            )
        )
    return findings


# (violated per cell, the step each is reported at, its value, its bound, the finding's detail of a cell)
Violations = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Callable[[int], str]]


def _applies(ds: xr.Dataset, rule: Rule, strict: bool) -> bool:
    """Whether the rule's spec selectors (e.g. attention=softmax) match the run; ValueError for a
    selector that is neither a dimension nor a field of the run's spec."""
    spec = run_spec(ds)
    for key, wanted in rule.select:
        if key in COORD_KEYS or key in ds.dims:
            continue
        if key not in spec:
            # a run without a spec (recorded from a user's model by instrument()) has no such field:
            # project-wide rules about spec fields do not apply to it; in a spec it is a typo
            if spec or strict:
                raise ValueError(
                    f"{key!r} is neither a dimension ({', '.join(COORD_KEYS)}) nor a spec field "
                    f"({', '.join(sorted(spec)) or 'no spec'})"
                )
            return False
        if not _spec_matches(spec[key], wanted):
            return False
    return True


def _selected_cells(ds: xr.Dataset, rule: Rule, strict: bool) -> xr.DataArray | None:
    """The rule's metric at the coordinates it selects; None where a selector matches nothing
    (ValueError with `strict`)."""
    if rule.metric not in ds.data_vars:
        raise ValueError(f"the run has no metric {rule.metric!r}; it has {', '.join(map(str, ds.data_vars))}")
    da = ds[rule.metric]
    index: dict[str, list[Any]] = {}
    for key, wanted in rule.select:
        if key in COORD_KEYS or key in da.dims:
            if key not in da.dims:
                raise ValueError(f"{rule.metric} has no {key} dimension (its dims: {', '.join(da.dims)})")
            present = _matching_coords(da[key].values, wanted, glob=key == "module")
            if not present:
                if strict:
                    raise ValueError(
                        f"{key}={'|'.join(wanted)} matches nothing; the run has "
                        f"{key} {', '.join(str(v) for v in da[key].values)}"
                    )
                return None
            index[key] = present
    return da.sel(index)


def _growth(
    rule: GrowthRule, values: np.ndarray, measured: np.ndarray, names: Mapping[str, float], first_time: str
) -> Violations:
    """Cells (rows of `values`, one column per time point) whose last value exceeds the factor times
    their first."""
    factor = _resolve(rule.factor, names)
    first, observed = values[:, 0], values[:, -1]
    reference = factor * first
    with np.errstate(invalid="ignore"):
        violated = measured & ~(observed <= reference)
    step_index = np.full(len(values), values.shape[1] - 1)

    def detail(g: int) -> str:
        return (
            f"{rule.metric} grew from {values[g, 0]:.6g} at {first_time} to "
            f"{float(observed[g]):.6g}, above {factor:g} x first = {float(reference[g]):.6g}"
        )

    return violated, step_index, observed, reference, detail


def _bound(
    rule: BoundRule, values: np.ndarray, measured: np.ndarray, names: Mapping[str, float], time_dim: str
) -> Violations:
    """Cells with a checked step beyond the bound, each reported at its worst step: the largest
    value for <=, the smallest for >=, NaN worst of all."""
    bound = _resolve(rule.bound, names)
    n_steps = values.shape[1]
    offset = n_steps - 1 if rule.steps == "last" else 0
    checked = values[:, offset:]
    with np.errstate(invalid="ignore"):
        bad = ~(checked <= bound) if rule.op == "<=" else ~(checked >= bound)
    bad &= measured[:, None]
    violated = bad.any(axis=1)
    severity = np.where(np.isnan(checked), np.inf, checked if rule.op == "<=" else -checked)
    step_index = offset + np.argmax(np.where(bad, severity, -np.inf), axis=1)
    observed = values[np.arange(len(values)), step_index]
    reference = np.full(len(values), bound)

    def detail(g: int) -> str:
        text = f"{rule.metric} = {float(observed[g]):.6g}, bound {rule.op} {float(reference[g]):.6g}"
        n_checked = n_steps - offset
        if n_checked > 1:
            text += f"; {int(bad[g].sum())} of {n_checked} {time_dim}s violate"
        return text

    return violated, step_index, observed, reference, detail


def _resolve(bound: float | str, names: Mapping[str, float]) -> float:
    return bound if isinstance(bound, float) else evaluate_expression(bound, names)


def _matching_coords(coords: np.ndarray, wanted: Sequence[str], glob: bool = False) -> list[Any]:
    if glob:
        return [to_python(c) for c in coords if any(fnmatch.fnmatchcase(str(c), w) for w in wanted)]
    return [to_python(c) for c in coords if str(to_python(c)) in wanted]


def _unmeasured_by_design(ds: xr.Dataset, da: xr.DataArray) -> bool:
    """True for (tensor, layout) pairs the run's schemes do not measure (no element counted), which
    a project-wide rule may select on some runs; NaN attention or losses are never by design."""
    if "layout" not in da.dims:
        return False
    if "module_sums" not in ds:
        return True  # a dataset without counts cannot tell; rules keep skipping such pairs
    counted = ds["module_sums"].sel(sum_field="numel", tensor=da["tensor"].values, layout=da["layout"].values)
    return not bool((counted > 0).any())


def _per_module(ds: xr.Dataset, rule: Rule) -> bool:
    """Check per module when the rule selects modules, or when the run has no per-layer view."""
    if any(key == "module" for key, _ in rule.select):
        return True
    return "module_sums" in ds and "layer" not in ds.dims


def _spec_matches(value: Any, wanted: Sequence[str]) -> bool:
    for option in wanted:
        if str(value) == option:
            return True
        try:
            if float(value) == float(option):
                return True
        except (TypeError, ValueError):
            continue
    return False
