"""A seed ensemble and the series of a run against it, in each metric's comparison space.

An ensemble is K runs of one case along `seed` with the attributes ENSEMBLE_ATTRS
(`check_ensemble`). A `Series` is one metric of the current run and of the ensemble as
(group, time) arrays, in the metric's space (numerics.metric_table.Space); `spread` is the
spread a point is judged by (the package docstring), and `series_finding` the finding about one
point of a series. The false-alarm rate and its thresholds are here too: every check uses them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import xarray as xr

from precision_suite.numerics.metric_table import METRICS, SPACES, Space
from precision_suite.verdicts.alarm_statement import DESIGN_FALSE_ALARM_RATE
from precision_suite.verdicts.findings import TIME_DIMS, Finding, distinct, format_where, to_python

FALSE_ALARM_RATE = DESIGN_FALSE_ALARM_RATE  # per case, Bonferroni over its series
MEDIAN_MARKOV = 2  # P(median of T points beyond c) <= 2 P(one point beyond c): see trained_threshold
ENSEMBLE_ATTRS = ("ensemble_seeds", "first_step_tolerance", "first_step_count_noise", "trained_mean_z_spread")


class EnsembleError(ValueError):
    """A baseline that is not a usable seed ensemble."""


def z_threshold(n_statistics: int, rate: float = FALSE_ALARM_RATE) -> float:
    """Two-sided Bonferroni threshold in spreads for `n_statistics` tests at a case rate `rate`."""
    return NormalDist().inv_cdf(1.0 - rate / (2.0 * max(n_statistics, 1)))


def trained_threshold(n_series: int, rate: float = FALSE_ALARM_RATE) -> float:
    """The band of a series' median z, in spreads. Bonferroni over the series of the case, and a
    factor MEDIAN_MARKOV: the median of T points exceeds c only if at least half of them do, so
    (Markov on their count) P(median > c) <= T / ceil(T/2) * P(z > c) <= 2 P(z > c), whatever the
    correlation between the points of one trajectory."""
    return z_threshold(MEDIAN_MARKOV * n_series, rate)


def ensemble_seeds(ds: xr.Dataset) -> list[int]:
    return [int(s) for s in ds["seed"].values] if "seed" in ds.dims else []


def check_ensemble(ds: xr.Dataset, path: object = "baseline") -> None:
    """Raise EnsembleError unless `ds` is a seed ensemble with at least two seeds."""
    if "seed" not in ds.dims:
        raise EnsembleError(f"{path} holds a single run, not a seed ensemble (an old baseline)")
    if ds.sizes["seed"] < 2:
        raise EnsembleError(
            f"{path} holds {ds.sizes['seed']} seed; an ensemble needs at least 2 "
            "to measure the spread between seeds"
        )
    missing = [name for name in ENSEMBLE_ATTRS if name not in ds.attrs]
    if missing:  # first_step_count_noise: baselines made before the rounding twins
        raise EnsembleError(
            f"{path} lacks the {' and '.join(missing)} attribute(s) (made by an older "
            "version, before its rounding twins were measured)"
        )


def time_dim(da: xr.DataArray) -> str:
    """The dimension a metric's points run along (`step`, or `train_step` for the loss)."""
    return next(d for d in da.dims if d in TIME_DIMS)


def numel_like(ds: xr.Dataset, da: xr.DataArray, metric: str | None = None) -> np.ndarray | None:
    """Elements counted behind each cell of a fraction metric (`metric`, default `da`'s name),
    broadcast to `da` (None: not a count)."""
    metric = str(da.name) if metric is None else metric
    if (
        metric not in SPACES
        or not SPACES[metric].is_count
        or metric == "nonfinite"
        or METRICS[metric].counted_by not in ds.data_vars
    ):
        return None
    numel = ds[METRICS[metric].counted_by]
    if "seed" in numel.dims:
        numel = numel.isel(seed=0, drop=True)
    return numel.broadcast_like(da).transpose(*da.dims).values.astype(np.float64)


@dataclass
class Series:
    """One metric's arrays: ensemble (K, G, T) and current (G, T), in the comparison space."""

    metric: str
    groups: list[dict[str, Any]]
    times: list[Any]
    time_dim: str
    ens_y: np.ndarray
    cur_y: np.ndarray
    cur_values: np.ndarray
    ens_values: np.ndarray
    pool: np.ndarray  # (G,) pool index: same metric, tensor and layout
    numel: np.ndarray | None  # (G, T) elements behind each point of a fraction; None: not one


def metric_series(metric: str, current: xr.Dataset, ensemble: xr.Dataset) -> Series | None:
    cur, ens = xr.align(current[metric], ensemble[metric], join="inner", exclude=["seed"])
    along = time_dim(cur)
    group_dims = [d for d in cur.dims if d != along]
    cur = cur.transpose(*group_dims, along)
    ens = ens.transpose("seed", *group_dims, along)
    sizes = [cur.sizes[d] for d in group_dims]
    n_groups = int(np.prod(sizes, dtype=np.int64))
    if n_groups == 0 or cur.sizes[along] == 0:
        return None
    c = cur.values.astype(np.float64).reshape(n_groups, -1)
    e = ens.values.astype(np.float64).reshape(ens.sizes["seed"], n_groups, -1)
    numel = numel_like(current, cur)
    numel = None if numel is None else numel.reshape(n_groups, -1)
    groups = []
    pool_keys: dict[tuple, int] = {}
    pool = np.zeros(n_groups, dtype=np.int64)
    # each coordinate read once: indexing the DataArray anew for every group of every series would
    # be most of the time of judging a case
    coords = [(d, cur[d].values) for d in group_dims]
    for g, index in enumerate(np.ndindex(*sizes) if sizes else [()]):
        where = {d: to_python(values[i]) for (d, values), i in zip(coords, index)}
        groups.append(where)
        key = tuple((d, v) for d, v in where.items() if d != "layer")
        pool[g] = pool_keys.setdefault(key, len(pool_keys))
    return Series(
        metric,
        groups,
        [to_python(t) for t in cur[along].values],
        along,
        SPACES[metric].transform(e, numel),
        SPACES[metric].transform(c, numel),
        c,
        e,
        pool,
        numel,
    )


def all_series(current: xr.Dataset, ensemble: xr.Dataset) -> list[Series]:
    """One Series per compared metric that both datasets hold."""
    return [
        s
        for metric in SPACES
        if metric in current.data_vars and metric in ensemble.data_vars
        if (s := metric_series(metric, current, ensemble)) is not None
    ]


def n_statistics(series: Sequence[Series]) -> int:
    """Statistics a case is judged by: one per series (its median over the trained points)."""
    return sum(s.cur_y.shape[0] for s in series)


def spread(s: Series, first_trained: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean, spread) per point in the comparison space, spread as in the module docstring."""
    k = s.ens_y.shape[0]
    finite = np.isfinite(s.ens_y)
    ens = np.where(finite, s.ens_y, np.nan)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN points: unmeasured pairs
        mean = np.nanmean(ens, axis=0)
        var = np.nanvar(ens, axis=0, ddof=1)
    var = np.where(finite.sum(axis=0) >= 2, var, np.nan)
    floor = SPACES[s.metric].floor_variance(mean)
    # pooled: the mean over the pool's trained points of the seeds' own variance beyond the count
    # noise, so that series counting a few elements (Poisson variance ~1/count in y) do not widen
    # the band of well-counted ones. A mean, not a robust median: layers of one pool differ in
    # spread (deep layers wander more), and a median pool false-alarms there (docs/baselines.md)
    excess = np.fmax(var - floor, 0.0)
    pooled = np.zeros_like(var)
    for p in np.unique(s.pool):
        rows = s.pool == p
        trained = excess[rows][:, first_trained:]
        value = float(np.nanmean(trained)) if np.isfinite(trained).any() else 0.0
        pooled[rows] = value
    total = np.fmax(var, pooled + floor)
    return mean, np.sqrt(total * (1.0 + 1.0 / k))


def series_finding(
    case: str,
    kind: str,
    s: Series,
    where: Mapping[str, Any],
    t: int,
    g: int,
    score: float,
    tolerance: float,
    detail: str,
    member_seed: Any = None,
    deterministic: bool = False,
    reference_name: str = "baseline",
) -> Finding:
    """A finding of series `g` at point `t`. `deterministic`: a comparison of the same start (a
    first point, a replay), which fails in either direction: worded "changed", with worse or
    better where the metric has a bad direction (score: positive is the bad direction's)."""
    where = {**where, s.time_dim: s.times[t]}
    value = float(s.cur_values[g, t])
    ens = s.ens_values[:, g, t]
    finite = ens[np.isfinite(ens)]
    reference = float(np.median(finite)) if finite.size else math.nan
    if finite.size > 1:
        value_text, reference_text, low, high = distinct(value, reference, finite.min(), finite.max())
        seeds_text = f" ({low}..{high} over {finite.size} seeds)"
    else:  # one row (a stored replay) or none
        value_text, reference_text = distinct(value, reference)
        seeds_text = "" if finite.size else " (no finite seed)"
    if deterministic:
        # a new NaN/Inf (an infinite score) is worse whatever the metric's direction
        direction = (
            math.inf
            if not math.isfinite(score)
            else score * METRICS[s.metric].bad_sign
            if METRICS[s.metric].bad is not None
            else 0.0
        )
        what = "changed (worse)" if direction > 0 else "changed (better)" if direction < 0 else "changed"
    else:
        what = "regressed" if kind == "regression" else "drifted (better)"
    message = (
        f"{case}: {s.metric} {what} at {format_where(where)}: {value_text} vs {reference_name} "
        f"{reference_text}{seeds_text}; {detail}"
    )
    return Finding(
        case=case,
        kind=kind,
        metric=s.metric,
        where=where,
        value=value,
        reference=reference,
        tolerance=float(tolerance),
        message=message,
        score=float(score),
    )


def describe_change(space: Space, d: float, signed: bool = True) -> str:
    fmt = "+.3g" if signed else ".3g"
    if space.kind == "db":
        return f"{d:{fmt}} dB"
    if space.is_count:
        return f"count x{math.exp(d):.3g}" if signed else f"count factor {math.exp(d):.3g}"
    return f"x{math.exp(d):.4g}" if signed else f"factor {math.exp(d):.4g}"
