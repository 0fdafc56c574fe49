"""The single-run comparison: a run against one reference run (a saved result for `compare`,
BASE's run for `diff`), metric by metric, with one tolerance and one bad direction per metric.

`compare` judges every metric in its own space (log for norms, absolute for fractions, relative
change of 1 - cos for distortion, dB for SQNR, relative for loss) with the tolerances of
`DEFAULT_TOLERANCES`, overridden by the project's [tool.precision_suite] tolerances and the
command line's --fail. docs/baselines.md gives the reason for each number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from precision_suite.numerics.metric_table import METRICS, QUANT_METRICS, observed_name
from precision_suite.verdicts.findings import TIME_DIMS, Finding, distinct, format_where, to_python

TOLERANCE_SPACES = ("log", "absolute", "one_minus_cos_relative", "db", "relative")


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How one metric is compared with its baseline.

    space: where the difference is taken:
      "log"                     ln(current) - ln(baseline)
      "absolute"                current - baseline
      "one_minus_cos_relative"  change of e = 1 - value, relative to max(e_baseline, floor)
      "db"                      current - baseline, both already in dB
      "relative"                (current - baseline) / max(|baseline|, floor)
    tol: the largest accepted |difference| in that space.
    bad: the direction of the difference that is a regression, "up" or "down" (for
      one_minus_cos_relative it is the direction of 1 - value).
    floor: denominator floor of the relative spaces, so a near-zero baseline cannot turn noise
      into a huge relative change.
    trained: the tolerance after the first time point (sampled step or training step). At the
      first point the model is its seeded initialisation and only rounding differs between
      machines; after it, training amplifies those differences (a chaotic trajectory), so later
      points agree less. None: `tol` everywhere.
    """

    space: str
    tol: float
    bad: str
    floor: float = 0.0
    trained: float | None = None

    def at(self, n_times: int) -> np.ndarray:
        """The tolerance at each of `n_times` time points: `tol` first, then `trained`."""
        later = self.tol if self.trained is None else self.trained
        return np.array([self.tol] + [later] * (n_times - 1), dtype=np.float64)

    def __post_init__(self) -> None:
        if self.space not in TOLERANCE_SPACES:
            raise ValueError(
                f"Tolerance.space {self.space!r} is unknown; use one of {', '.join(TOLERANCE_SPACES)}"
            )
        if self.bad not in ("up", "down"):
            raise ValueError(f"Tolerance.bad {self.bad!r} is unknown; use 'up' or 'down'")
        if not (self.tol >= 0 and np.isfinite(self.tol)):
            raise ValueError(f"Tolerance.tol must be a finite number >= 0, got {self.tol!r}")
        if not (self.floor >= 0 and np.isfinite(self.floor)):
            raise ValueError(f"Tolerance.floor must be a finite number >= 0, got {self.floor!r}")
        if self.trained is not None and not (self.trained >= 0 and np.isfinite(self.trained)):
            raise ValueError(f"Tolerance.trained must be a finite number >= 0 or None, got {self.trained!r}")


def _declared(
    metric: str, space: str, tol: float, floor: float = 0.0, trained: float | None = None
) -> Tolerance:
    """A default tolerance whose bad direction is the metric table's (for one_minus_cos_relative,
    the direction of 1 - value, opposite to the cosine's)."""
    bad = METRICS[metric].bad
    if space == "one_minus_cos_relative":
        bad = "up" if bad == "down" else "down"
    return Tolerance(space, tol, bad, floor=floor, trained=trained)


# The one table of defaults; docs/baselines.md explains every number. Metrics the metric table
# does not compare (mse, accuracy) are not listed.
# `trained` values: 1.5x the largest difference measured between 1 and 2 CPU threads over the whole
# default matrix (docs/baselines.md, "Measured spread").
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "attention_norm": _declared("attention_norm", "log", 0.05, trained=1.1),
    "underflow": _declared("underflow", "absolute", 5e-4, trained=0.04),
    "zeros_after": _declared("zeros_after", "absolute", 5e-4, trained=0.04),
    "overflow": _declared("overflow", "absolute", 1e-4, trained=3.5e-3),
    "distortion": _declared("distortion", "one_minus_cos_relative", 0.10, floor=1e-7, trained=1.1),
    "sqnr_db": _declared("sqnr_db", "db", 0.5, trained=8.0),
    "loss": _declared("loss", "relative", 0.02, floor=1e-12, trained=0.4),
    "nonfinite": _declared("nonfinite", "absolute", 0.0),
}
# the model's own quantization (observed_<metric>) is compared as the probes' same metric is
DEFAULT_TOLERANCES.update(
    {
        observed_name(metric): DEFAULT_TOLERANCES[metric]
        for metric in QUANT_METRICS
        if metric in DEFAULT_TOLERANCES
    }
)

ToleranceOverride = Tolerance | float | int | Mapping[str, Any] | None
ToleranceOverrides = Mapping[str, ToleranceOverride]


def resolve_tolerances(*overrides: ToleranceOverrides | None) -> dict[str, Tolerance]:
    """DEFAULT_TOLERANCES with each mapping of overrides applied in order (later wins).

    An override value is a `Tolerance`, a number (new `tol`, same space and direction), a mapping
    of Tolerance fields to change (e.g. {"tol": 0.1, "floor": 1e-6}), or None (do not compare
    that metric).
    """
    table: dict[str, Tolerance | None] = dict(DEFAULT_TOLERANCES)
    for override in overrides:
        for metric, value in (override or {}).items():
            table[metric] = _apply_override(metric, table.get(metric), value)
    return {metric: tol for metric, tol in table.items() if tol is not None}


def _apply_override(metric: str, current: Tolerance | None, value: ToleranceOverride) -> Tolerance | None:
    if value is None or isinstance(value, Tolerance):
        return value
    if isinstance(value, bool):
        raise ValueError(f"tolerance for {metric!r}: expected a number, a table or none, got {value!r}")
    if isinstance(value, (int, float)):
        changes: dict[str, Any] = {"tol": float(value), "trained": None}  # one number: every time point
    elif isinstance(value, Mapping):
        changes = dict(value)
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Tolerance)})
        if unknown:
            raise ValueError(
                f"tolerance for {metric!r}: unknown field(s) {', '.join(unknown)}; "
                "use tol, trained, floor, space, bad"
            )
    else:
        raise ValueError(f"tolerance for {metric!r}: expected a number, a table or none, got {value!r}")
    if current is None:
        try:
            return Tolerance(**changes)
        except TypeError:
            raise ValueError(
                f"metric {metric!r} has no default tolerance; give all of space, tol "
                f"and bad (e.g. {{space = 'absolute', tol = 1e-3, bad = 'up'}})"
            ) from None
    return dataclasses.replace(current, **changes)


def tolerances_from_config(table: Mapping[str, Any]) -> ToleranceOverrides:
    """The `tolerances` sub-table of [tool.precision_suite], validated against the defaults."""
    overrides = table.get("tolerances", {})
    if not isinstance(overrides, Mapping):
        raise ValueError("[tool.precision_suite] tolerances must be a table: metric = number or table")
    resolve_tolerances(overrides)  # raises a clear error now rather than at the first comparison
    return dict(overrides)


def compare(
    current: xr.Dataset,
    baseline: xr.Dataset,
    tolerances: ToleranceOverrides | Sequence[ToleranceOverrides] | None = None,
) -> list[Finding]:
    """Findings of `current` against `baseline`, metric by metric, on their common coordinates.

    `tolerances`: overrides of DEFAULT_TOLERANCES (see `resolve_tolerances`), or a sequence of
    them applied in order (e.g. the project's, then the test's).

    Per (metric, non-time coordinates) at most one "regression" (worst step moving in the bad
    direction beyond tolerance) and one "drift" (worst step moving the good way beyond it).
    Current NaN/Inf where the baseline is finite is a regression; cells NaN in both (not
    measured) are ignored; mismatched metrics or coordinates are "error" findings.
    """
    case = str(current.attrs.get("case", baseline.attrs.get("case", "?")))
    findings: list[Finding] = []
    layers = [tolerances] if tolerances is None or isinstance(tolerances, Mapping) else list(tolerances)
    for metric, tol in resolve_tolerances(*layers).items():
        in_current, in_baseline = metric in current.data_vars, metric in baseline.data_vars
        if not (in_current or in_baseline):
            continue
        if in_current != in_baseline:
            where_missing = "current run" if in_baseline else "baseline"
            findings.append(
                Finding.error(
                    case,
                    metric,
                    f"{metric} is missing from the {where_missing}; "
                    "the run schema changed, regenerate the baseline",
                )
            )
            continue
        cur, base = current[metric], baseline[metric]
        if cur.dims != base.dims:
            findings.append(
                Finding.error(
                    case,
                    metric,
                    f"{metric} has dims {cur.dims} in the current run but {base.dims} in the baseline",
                )
            )
            continue
        mismatch = _coordinate_mismatch(cur, base)
        if mismatch:
            findings.append(
                Finding.error(
                    case,
                    metric,
                    f"{metric}: coordinates differ from the baseline "
                    f"({mismatch}); compared on the common ones only",
                )
            )
        cur, base = xr.align(cur, base, join="inner")
        findings.extend(_compare_metric(case, metric, cur, base, tol))
    return findings


def deviation(tol: Tolerance, current: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """Signed difference in the tolerance's space, oriented so that positive is the bad direction."""
    c, b = np.asarray(current, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if tol.space == "log":
            d = np.log(c) - np.log(b)
        elif tol.space in ("absolute", "db"):
            d = c - b
        elif tol.space == "one_minus_cos_relative":
            d = ((1.0 - c) - (1.0 - b)) / np.maximum(1.0 - b, tol.floor)
        else:  # relative
            d = (c - b) / np.maximum(np.abs(b), tol.floor)
    return d if tol.bad == "up" else -d


def tolerance_band(
    metric: str, reference: np.ndarray, tol: Tolerance | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(lower, upper) values of `metric` that `compare` accepts around `reference`, for charts.

    `reference` runs over time along its last axis (`Tolerance.at`); `tol` defaults to the table's.
    None when the metric has no tolerance (it is not compared, so there is no band).
    """
    spec = tol or DEFAULT_TOLERANCES.get(metric)
    if spec is None:
        return None
    b = np.asarray(reference, dtype=np.float64)
    t = spec.at(b.shape[-1] if b.ndim else 1).reshape(b.shape[-1:] if b.ndim else ())
    if spec.space == "log":
        return b * np.exp(-t), b * np.exp(t)
    if spec.space in ("absolute", "db"):
        return b - t, b + t
    scale = 1.0 - b if spec.space == "one_minus_cos_relative" else np.abs(b)
    width = t * np.maximum(scale, spec.floor)
    return b - width, b + width


def _compare_metric(
    case: str, metric: str, cur: xr.DataArray, base: xr.DataArray, tol: Tolerance
) -> list[Finding]:
    time_dims = [d for d in cur.dims if d in TIME_DIMS]
    group_dims = [d for d in cur.dims if d not in TIME_DIMS]
    order = group_dims + time_dims
    c = cur.transpose(*order).values.astype(np.float64)
    b = base.transpose(*order).values.astype(np.float64)
    n_groups = int(np.prod([cur.sizes[d] for d in group_dims], dtype=np.int64))
    c, b = c.reshape(n_groups, -1), b.reshape(n_groups, -1)

    tols = tol.at(c.shape[1])[None, :]  # per time point: rounding first, then training
    score = deviation(tol, c, b)
    equal = (c == b) | (np.isnan(c) & np.isnan(b))
    score[equal] = 0.0
    finite_c = np.isfinite(c)
    score[~finite_c & ~equal] = np.inf  # a new NaN/Inf, or a different non-finite value
    # measured now, unmeasured (NaN) in the baseline; against an infinite baseline the
    # deviation itself says which way (e.g. SQNR falling from +inf, an exact reconstruction)
    score[finite_c & np.isnan(b)] = -np.inf
    score[np.isnan(score)] = np.inf  # not comparable in this space (e.g. log of a negative)

    findings = []
    for kind, beyond, pick in (("regression", score > tols, np.argmax), ("drift", score < -tols, np.argmin)):
        for g in np.flatnonzero(beyond.any(axis=1)):
            masked = np.where(beyond[g], score[g], 0.0)
            t = int(pick(masked))
            where = _where(cur, group_dims, time_dims, g, t)
            findings.append(
                Finding(
                    case=case,
                    kind=kind,
                    metric=metric,
                    where=where,
                    value=float(c[g, t]),
                    reference=float(b[g, t]),
                    tolerance=float(tols[0, t]),
                    score=float(score[g, t]),
                    message=_comparison_message(
                        case,
                        kind,
                        metric,
                        where,
                        c[g, t],
                        b[g, t],
                        dataclasses.replace(tol, tol=float(tols[0, t])),
                        int(beyond[g].sum()),
                        beyond.shape[1],
                    ),
                )
            )
    return findings


def _where(
    da: xr.DataArray, group_dims: list[str], time_dims: list[str], group: int, time: int
) -> dict[str, Any]:
    sizes = [da.sizes[d] for d in group_dims]
    index = dict(zip(group_dims, np.unravel_index(group, sizes) if sizes else ()))
    if time_dims:
        index[time_dims[0]] = time
    return {dim: to_python(da[dim].values[i]) for dim, i in index.items()}


def _comparison_message(
    case: str,
    kind: str,
    metric: str,
    where: Mapping[str, Any],
    value: float,
    reference: float,
    tol: Tolerance,
    n_beyond: int,
    n_steps: int,
) -> str:
    what = "regressed" if kind == "regression" else "drifted (better)"
    if not np.isfinite(value) and np.isfinite(reference):
        change = "non-finite where the baseline is finite"
    elif np.isfinite(value) and not np.isfinite(reference):
        change = "measured now, non-finite in the baseline"
    else:
        change = _describe_change(tol, value, reference)
    steps = f"; {n_beyond} of {n_steps} steps beyond tolerance" if n_steps > 1 else ""
    shown, baseline = distinct(value, reference)
    return (
        f"{case}: {metric} {what} at {format_where(where)}: {shown} vs baseline {baseline} ({change}){steps}"
    )


def _describe_change(tol: Tolerance, value: float, reference: float) -> str:
    d = float(deviation(dataclasses.replace(tol, bad="up"), np.array(value), np.array(reference)))
    if tol.space == "log":
        return f"log change {d:+.3g}, tolerance ±{tol.tol:g} (x{np.exp(tol.tol):.3g})"
    if tol.space == "db":
        return f"{d:+.3g} dB, tolerance ±{tol.tol:g} dB"
    if tol.space == "absolute":
        return f"{d:+.3g}, tolerance ±{tol.tol:g}"
    if tol.space == "one_minus_cos_relative":
        return f"1-cos changed {d:+.1%}, tolerance ±{tol.tol:.1%}"
    return f"{d:+.2%}, tolerance ±{tol.tol:.2%}"


def _coordinate_mismatch(cur: xr.DataArray, base: xr.DataArray) -> str:
    parts = []
    for dim in cur.dims:
        a, b = [to_python(v) for v in cur[dim].values], [to_python(v) for v in base[dim].values]
        in_a, in_b = set(a), set(b)
        only_cur = [v for v in a if v not in in_b]  # lists keep the order
        only_base = [v for v in b if v not in in_a]
        if only_cur:
            parts.append(f"{dim} {only_cur} only in the current run")
        if only_base:
            parts.append(f"{dim} {only_base} only in the baseline")
    return "; ".join(parts)
