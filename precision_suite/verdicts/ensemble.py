"""Seed-ensemble baselines and the calibrated comparison of a run against them.

Short training is chaotic: after a few steps another CPU's rounding moves a run as far as another
seed does, so one reference trajectory cannot tell noise from change. A baseline therefore holds
K runs of its case that differ only in seed (dimension `seed`), and a run is judged two ways:

- **first point** (sampled step 0, training step 0) of a seed the ensemble holds: the seeded
  initialisation, deterministic up to rounding. It must match that member within the rounding
  noise measured when the baseline was made from its rounding twins: the same first step under
  every setting that changes only how kernels round (`jobs.twins`: ATen's unvectorized and
  narrower vector kernels, MKL's compatible path, 2 threads, eager), which is what another host
  changes too. Beyond it, a change in *either* direction fails: the computation itself changed,
  and the author regenerates on purpose. Counts (fractions times their elements) get a count
  model, since the elements that rounding moves sit on a quantization boundary, the more of them
  the more are counted: a count may move by `FIRST_STEP_SAFETY * k * sqrt(count + 1)` elements,
  `k` the largest such change the twins made in the case (at least `FIRST_STEP_FLIPS`). The sum
  of a count metric's changes over the case is held to the noise of that sum as well
  (`counts_moved_together`): rounding moves counts both ways, a wrong scale moves all one way.
- **trained points** (and every point of a seed outside the ensemble): against the ensemble's
  spread, per series (metric x layer x tensor x layout) in the metric's own space (`SPACES`).
  Each point's z is its distance from the K-seed mean in spreads; the variance of a point is the
  larger of its own K-seed variance and the pooled one: the seeds' variance beyond the count
  noise, averaged over every trained point of the same metric, tensor and layout (K is small:
  the pool has hundreds of degrees of freedom and keeps one quiet series from false-alarming),
  plus the floor (Poisson noise of the counted elements for fractions), so a change is as
  visible at 1e-5 as at 1e-2 once the same number of elements is counted.
  A series is judged by the **median of its trained points' z** (persistence). A seed's
  trajectory has excursions: a loss spike moves every layer at one step by tens of spreads
  (measured: docs/baselines.md, leave-one-seed-out), which no K-seed spread predicts; a change of
  the code moves the series at most of its steps. The median ignores fewer than half of the
  points, whatever they do, and shifts fully with a systematic change. Its band is Bonferroni-
  corrected over the case's series (`trained_threshold`), so the false-alarm rate of the whole
  case is at most `FALSE_ALARM_RATE` under the Gaussian model of each point, whatever the
  correlation between the points of one trajectory (measured, not assumed: docs/baselines.md).
  A new NaN/Inf where every seed measured a number fails at any point.
- **trained points, case level**: a change that moves every series of a metric a little, each
  within its band, moves the mean of their median z by as much while the series' own noise
  averages out (`case_mean_z`). Its band is a Student t quantile times the spread of that mean
  over runs that differ by seed alone, measured at regeneration (held-out seeds
  `MEAN_Z_HELD_OUT_SEEDS` and each member left out of the others; `trained_mean_z_spread`), not
  assumed: the series of one trajectory move together (a loss spike moves every layer).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import xarray as xr
from scipy.stats import t as student_t

from precision_suite.verdicts.calibration import DESIGN_FALSE_ALARM_RATE
from precision_suite.verdicts.findings import Finding, TIME_DIMS, format_where, to_python
from precision_suite.numerics.metric_table import METRICS, SPACES, Space

# Four seeds: each costs a full training run per case on regeneration, and the pooled spread
# (below) supplies the degrees of freedom that four seeds alone do not.
ENSEMBLE_SEEDS = (0, 1, 2, 3)
FALSE_ALARM_RATE = DESIGN_FALSE_ALARM_RATE  # per case, Bonferroni over its series
MEDIAN_MARKOV = 2  # P(median of T points beyond c) <= 2 P(one point beyond c): see trained_threshold
FIRST_STEP_SAFETY = 4.0  # x the largest rounding difference the twins made
# At the first point the same elements are quantized on every machine; rounding moves a few of them
# across the zero (or saturation) boundary: a count may always move by this many elements.
FIRST_STEP_FLIPS = 2.0
ENSEMBLE_ATTRS = ("ensemble_seeds", "first_step_tolerance", "first_step_count_noise", "trained_mean_z_spread")
# Seeds trained at regeneration beside the ensemble and judged against it: with each member left
# out of the others, the null samples of the case-level mean z (`trained_mean_z_spread`)
MEAN_Z_HELD_OUT_SEEDS = (4, 5)
DETECTABLE_MIN_COUNT = 10  # detectable_change reports count series from this many elements up


class EnsembleError(ValueError):
    """A baseline that is not a usable seed ensemble."""


def z_threshold(n_statistics: int, rate: float = FALSE_ALARM_RATE) -> float:
    """Two-sided Bonferroni threshold in spreads for `n_statistics` tests at a case rate `rate`."""
    return NormalDist().inv_cdf(1.0 - rate / (2.0 * max(n_statistics, 1)))


# --------------------------------------------------------------------------- building


def ensemble_seeds(ds: xr.Dataset) -> list[int]:
    return [int(s) for s in ds["seed"].values] if "seed" in ds.dims else []


def make_ensemble(runs: Sequence[xr.Dataset], first_step_tolerance: Mapping[str, float],
                  first_step_count_noise: Mapping[str, float],
                  trained_mean_z_spread: Mapping[str, Sequence[float]] | None = None) -> xr.Dataset:
    """K runs of one case (one per seed) as one dataset with a `seed` dimension. Without
    `trained_mean_z_spread` (see `mean_z_spread`) the case-level trained check is not made."""
    seeds = [int(json.loads(r.attrs["spec"])["seed"]) for r in runs]
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        raise EnsembleError(f"an ensemble needs at least 2 distinct seeds, got {seeds}")
    ds = xr.concat(list(runs), dim=xr.DataArray(seeds, dims="seed", name="seed"),
                   data_vars="all", coords="minimal", compat="override", combine_attrs="override")
    spec = json.loads(runs[0].attrs["spec"])
    spec.pop("seed")
    ds.attrs["spec"] = json.dumps(spec, sort_keys=True)
    ds.attrs["ensemble_seeds"] = json.dumps(seeds)
    ds.attrs["first_step_tolerance"] = json.dumps(dict(first_step_tolerance), sort_keys=True)
    ds.attrs["first_step_count_noise"] = json.dumps(dict(first_step_count_noise), sort_keys=True)
    ds.attrs["trained_mean_z_spread"] = json.dumps({m: list(v) for m, v in (trained_mean_z_spread or {}).items()},
                                                   sort_keys=True)
    return ds


def first_step_tolerance(references: Sequence[xr.Dataset], twins: Sequence[xr.Dataset]) -> dict[str, float]:
    """Per metric that is not a count, FIRST_STEP_SAFETY x the largest difference (in the metric's
    space) between a run and its rounding twin (same seed) at the points they share (a baseline's
    first point; every point of a replay), floored by the metric's `first_step_floor`."""
    largest = {metric: 0.0 for metric, space in SPACES.items() if not space.is_count}
    for reference, twin, metric in _twin_pairs(references, twins, list(largest)):
        a, b = _shared_points(reference, twin, metric)
        d = np.abs(SPACES[metric].transform(a.values) - SPACES[metric].transform(b.values))
        d = d[np.isfinite(d)]
        if d.size:
            largest[metric] = max(largest[metric], float(d.max()))
    return {metric: max(FIRST_STEP_SAFETY * value, SPACES[metric].first_step_floor)
            for metric, value in largest.items()}


def first_step_count_noise(references: Sequence[xr.Dataset], twins: Sequence[xr.Dataset]) -> dict[str, float]:
    """Per count metric, the largest `|count_twin - count| / sqrt(count + 1)` at the points a run
    and its rounding twin share, over every series and twin: the `k` of the count model (module
    docstring)."""
    counts = [metric for metric, space in SPACES.items() if space.is_count]
    largest = {metric: 0.0 for metric in counts}
    for reference, twin, metric in _twin_pairs(references, twins, counts):
        a, b = _shared_points(reference, twin, metric)
        numel = numel_like(reference, a)
        c = a.values * (1.0 if numel is None else numel)
        d = np.abs(b.values * (1.0 if numel is None else numel) - c) / np.sqrt(np.abs(c) + 1.0)
        d = d[np.isfinite(d)]
        if d.size:
            largest[metric] = max(largest[metric], float(d.max()))
    return largest


def _twin_pairs(references: Sequence[xr.Dataset], twins: Sequence[xr.Dataset],
                metrics: Sequence[str]) -> Iterator[tuple[xr.Dataset, xr.Dataset, str]]:
    by_seed = {int(json.loads(r.attrs["spec"])["seed"]): r for r in references}
    for twin in twins:
        reference = by_seed[int(json.loads(twin.attrs["spec"])["seed"])]
        for metric in metrics:
            if metric in reference.data_vars and metric in twin.data_vars:
                yield reference, twin, metric


def _shared_points(reference: xr.Dataset, twin: xr.Dataset, metric: str) -> tuple[xr.DataArray, xr.DataArray]:
    """`metric` of both runs on the coordinates they share: a first-step twin has one time point."""
    a, b = xr.align(reference[metric], twin[metric], join="inner")
    return a.astype(np.float64), b.astype(np.float64)


def count_allowance(count_noise: float, count: np.ndarray | float) -> np.ndarray | float:
    """How many elements a first-point count may move by rounding alone (module docstring)."""
    return np.maximum(FIRST_STEP_FLIPS, FIRST_STEP_SAFETY * count_noise * np.sqrt(np.abs(count) + 1.0))


def time_dim(da: xr.DataArray) -> str:
    """The dimension a metric's points run along (`step`, or `train_step` for the loss)."""
    return next(d for d in da.dims if d in TIME_DIMS)


def numel_like(ds: xr.Dataset, da: xr.DataArray, metric: str | None = None) -> np.ndarray | None:
    """Elements counted behind each cell of a fraction metric (`metric`, default `da`'s name),
    broadcast to `da` (None: not a count)."""
    metric = str(da.name) if metric is None else metric
    if "numel" not in ds.data_vars or metric not in SPACES or not SPACES[metric].is_count \
            or metric == "nonfinite":
        return None
    numel = ds["numel"]
    if "seed" in numel.dims:
        numel = numel.isel(seed=0, drop=True)
    return numel.broadcast_like(da).transpose(*da.dims).values.astype(np.float64)


def leave_one_out(ensemble: xr.Dataset) -> list[tuple[int, xr.Dataset, xr.Dataset]]:
    """(seed, that member as a run, the other members as an ensemble) for every member: K free
    held-out runs to measure false alarms with (calibrate), no training needed. Needs K >= 3."""
    seeds = ensemble_seeds(ensemble)
    if len(seeds) < 3:
        raise EnsembleError(f"leaving one seed out of {len(seeds)} leaves no spread to judge by")
    spec = json.loads(ensemble.attrs["spec"])
    out = []
    for seed in seeds:
        rest = [s for s in seeds if s != seed]
        others = ensemble.sel(seed=rest).assign_attrs(ensemble_seeds=json.dumps(rest))
        member = ensemble.sel(seed=seed, drop=True).assign_attrs(spec=json.dumps({**spec, "seed": seed},
                                                                                 sort_keys=True))
        for name in ENSEMBLE_ATTRS:
            member.attrs.pop(name, None)
        out.append((seed, member, others))
    return out


# --------------------------------------------------------------------------- judging


def check_ensemble(ds: xr.Dataset, path: object = "baseline") -> None:
    """Raise EnsembleError unless `ds` is a seed ensemble with at least two seeds."""
    if "seed" not in ds.dims:
        raise EnsembleError(f"{path} holds a single run, not a seed ensemble (an old baseline)")
    if ds.sizes["seed"] < 2:
        raise EnsembleError(f"{path} holds {ds.sizes['seed']} seed; an ensemble needs at least 2 "
                            "to measure the spread between seeds")
    missing = [name for name in ENSEMBLE_ATTRS if name not in ds.attrs]
    if missing:  # first_step_count_noise: baselines made before the rounding twins
        raise EnsembleError(f"{path} lacks the {' and '.join(missing)} attribute(s) (made by an older "
                            "version, before its rounding twins were measured)")


@dataclass
class _Series:
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


def _series(metric: str, current: xr.Dataset, ensemble: xr.Dataset) -> _Series | None:
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
    # each coordinate read once: indexing the DataArray anew for every group of every series took
    # most of the time of judging a case
    coords = [(d, cur[d].values) for d in group_dims]
    for g, index in enumerate(np.ndindex(*sizes) if sizes else [()]):
        where = {d: to_python(values[i]) for (d, values), i in zip(coords, index)}
        groups.append(where)
        key = tuple((d, v) for d, v in where.items() if d != "layer")
        pool[g] = pool_keys.setdefault(key, len(pool_keys))
    return _Series(metric, groups, [to_python(t) for t in cur[along].values], along,
                   SPACES[metric].transform(e, numel), SPACES[metric].transform(c, numel), c, e, pool, numel)


def _n_statistics(series: Sequence[_Series]) -> int:
    """Statistics a case is judged by: one per series (its median over the trained points)."""
    return sum(s.cur_y.shape[0] for s in series)


def trained_threshold(n_series: int, rate: float = FALSE_ALARM_RATE) -> float:
    """The band of a series' median z, in spreads. Bonferroni over the series of the case, and a
    factor MEDIAN_MARKOV: the median of T points exceeds c only if at least half of them do, so
    (Markov on their count) P(median > c) <= T / ceil(T/2) * P(z > c) <= 2 P(z > c), whatever the
    correlation between the points of one trajectory."""
    return z_threshold(MEDIAN_MARKOV * n_series, rate)


def compare_ensemble(current: xr.Dataset, ensemble: xr.Dataset, regen_hint: str = "",
                     rate: float = FALSE_ALARM_RATE) -> list[Finding]:
    """Findings of one run against a seed ensemble (module docstring): "regression" for a change
    in the bad direction or any change at the first point, "drift" for the good direction."""
    check_ensemble(ensemble)
    case = str(current.attrs.get("case", ensemble.attrs.get("case", "?")))
    seeds = ensemble_seeds(ensemble)
    seed = json.loads(current.attrs.get("spec", "{}")).get("seed")
    member = seeds.index(seed) if seed in seeds else None
    tol0 = {**json.loads(ensemble.attrs["first_step_tolerance"]),
            **json.loads(ensemble.attrs["first_step_count_noise"])}  # disjoint: counts and the rest
    case_series = all_series(current, ensemble)
    z_crit = trained_threshold(_n_statistics(case_series), rate)
    findings: list[Finding] = []
    for s in case_series:
        findings += _judge_series(case, s, member, seed, float(tol0.get(s.metric, 0.0)), z_crit,
                                  len(seeds), regen_hint)
        if member is not None and SPACES[s.metric].is_count and s.ens_y.shape[2] > 0:
            if (together := counts_moved_together(case, s, member, 0, float(tol0.get(s.metric, 0.0)), "first point",
                                                  f"seed {seed} of the baseline", regen_hint, seed)) is not None:
                findings.append(together)
    spreads = json.loads(ensemble.attrs["trained_mean_z_spread"])
    for s in case_series:
        if s.metric in spreads and (moved := _trained_moved_together(case, s, *spreads[s.metric],
                                                                     len(spreads), rate)) is not None:
            findings.append(moved)
    return findings


def series_median_z(s: _Series) -> np.ndarray:
    """Per series (G,), the median z of its trained points (after the first), bad direction
    positive; NaN for a series without any."""
    mean, sd = spread(s, 1)
    z = METRICS[s.metric].bad_sign * (s.cur_y - mean) / sd
    z[:, :1] = np.nan
    z[~np.isfinite(z)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a series with no trained point
        return np.nanmedian(z, axis=1) if z.shape[1] > 1 else np.full(z.shape[0], np.nan)


def case_mean_z(current: xr.Dataset, ensemble: xr.Dataset) -> dict[str, float]:
    """Per compared metric, the mean over the case's series of their median trained z: a change
    that moves every series a little moves it by as much, while the series' own noise averages."""
    out = {}
    for s in all_series(current, ensemble):
        medians = series_median_z(s)
        medians = medians[np.isfinite(medians)]
        if medians.size:
            out[s.metric] = float(medians.mean())
    return out


def mean_z_spread(samples: Sequence[Mapping[str, float]]) -> dict[str, tuple[float, int]]:
    """Per metric, (sqrt of the mean square, count) of the case-level mean z of runs that differ
    from the ensemble by seed alone (held-out seeds, members left out): its spread under no change,
    with the degrees of freedom the band's t quantile needs (the null mean is 0, not estimated)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for metric, m in sample.items():
            values.setdefault(metric, []).append(m)
    return {metric: (float(np.sqrt(np.mean(np.square(v)))), len(v)) for metric, v in values.items() if len(v) >= 2}


def mean_z_band(sigma: float, n: int, n_metrics: int, rate: float = FALSE_ALARM_RATE) -> float:
    """The band of a case-level mean z: a new run's mean z over the spread measured from `n` null
    runs is Student-t with `n` degrees of freedom; two-sided, Bonferroni over the case's metrics.
    This family of tests has its own `rate`: with the series' tests a case false-alarms at most at
    twice FALSE_ALARM_RATE."""
    return float(student_t.ppf(1.0 - rate / (2.0 * max(n_metrics, 1)), df=n)) * sigma


def _trained_moved_together(case: str, s: _Series, sigma: float, n: int, n_metrics: int,
                            rate: float) -> Finding | None:
    medians = series_median_z(s)
    ok = np.flatnonzero(np.isfinite(medians))
    if ok.size == 0 or not sigma > 0:
        return None
    m, band = float(medians[ok].mean()), mean_z_band(sigma, int(n), n_metrics, rate)
    if abs(m) <= band:
        return None
    g = int(ok[np.argmax(np.sign(m) * medians[ok])])  # the series that moved most that way
    kind = "regression" if m > 0 else "drift"
    detail = (f"trained points, case level: the {ok.size} series of {s.metric} moved together, mean of their "
              f"median z {m:+.2f} spreads, band ±{band:.2f} (Student t from {int(n)} runs of other seeds, "
              f"spread {sigma:.2f}); this series moved most ({medians[g]:+.1f})")
    return _finding(case, kind, s, s.groups[g], len(s.times) - 1, g, m, band, detail)


def all_series(current: xr.Dataset, ensemble: xr.Dataset) -> list[_Series]:
    """One _Series per compared metric that both datasets hold."""
    return [s for metric in SPACES if metric in current.data_vars and metric in ensemble.data_vars
            if (s := _series(metric, current, ensemble)) is not None]


def spread(s: _Series, first_trained: int) -> tuple[np.ndarray, np.ndarray]:
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


def _judge_series(case: str, s: _Series, member: int | None, seed: Any, tol0: float, z_crit: float,
                  k: int, regen_hint: str) -> list[Finding]:
    sign = METRICS[s.metric].bad_sign
    first_trained = 1 if member is not None else 0
    mean, sd = spread(s, 1)
    findings: list[Finding] = []
    for g, where in enumerate(s.groups):
        cur_y, cur_v = s.cur_y[g], s.cur_values[g]
        ens_finite = np.isfinite(s.ens_y[:, g]).any(axis=0)
        # a new NaN/Inf where the ensemble measured a number
        broken = ~np.isfinite(cur_y) & ens_finite & ~np.isinf(cur_v)
        broken |= np.isnan(cur_v) & ens_finite
        if broken.any():
            t = int(np.flatnonzero(broken)[0])
            findings.append(_finding(case, "regression", s, where, t, g, math.inf, z_crit,
                                     "non-finite where every seed of the baseline is finite"))
            continue
        if member is not None and s.ens_y.shape[2] > 0:
            if (first := _first_point_finding(case, s, g, where, member, seed, tol0, regen_hint)) is not None:
                findings.append(first)
        z = sign * (cur_y - mean[g]) / sd[g]
        points = np.flatnonzero(np.isfinite(z))
        points = points[points >= first_trained]
        if points.size == 0:
            continue
        # the median point: where the series sits for at least half of its trained points
        order = points[np.argsort(z[points], kind="stable")]
        t = int(order[(order.size - 1) // 2])
        median_z = float(np.median(z[points]))
        if abs(median_z) <= z_crit:
            continue
        kind = "regression" if median_z > 0 else "drift"
        beyond = int(np.sum(np.sign(median_z) * z[points] > z_crit))  # on the median's side
        detail = (f"median over the {points.size} trained points {median_z:+.1f} spreads from the "
                  f"{k}-seed mean (this point), band ±{z_crit:.1f}; {beyond} of {points.size} "
                  f"points beyond")
        findings.append(_finding(case, kind, s, where, t, g, median_z, z_crit, detail))
    return findings


def _first_point_finding(case: str, s: _Series, g: int, where: Mapping[str, Any], member: int, seed: Any,
                         tol0: float, regen_hint: str) -> Finding | None:
    """A regression if the first point moved beyond rounding from the member of the run's seed."""
    return point_finding(case, s, g, where, member, 0, tol0, "first point", f"seed {seed} of the baseline",
                         regen_hint, member_seed=seed)


def point_finding(case: str, s: _Series, g: int, where: Mapping[str, Any], member: int, t: int, tol0: float,
                  point: str, against: str, regen_hint: str, member_seed: Any = None) -> Finding | None:
    """A regression if point `t` of series `g` moved beyond rounding from the reference run
    `member` (a deterministic comparison: the same start on both sides): counts by the count
    model in elements, every other metric by `tol0` in its space; a new NaN/Inf fails."""
    space = SPACES[s.metric]
    hint = _changed_hint(regen_hint)
    numel = 1.0 if s.numel is None else float(s.numel[g, t])
    ref_v, cur_v = s.ens_values[member, g, t], s.cur_values[g, t]
    if np.isfinite(ref_v) and not np.isfinite(cur_v):
        return _finding(case, "regression", s, where, t, g, math.inf, tol0,
                        f"{point} is non-finite where {against} is finite; {hint}", member_seed=member_seed)
    if space.is_count:
        ref, cur = ref_v * numel, cur_v * numel
        allowed = float(count_allowance(tol0, ref))
        if not (np.isfinite(ref) and np.isfinite(cur)) or abs(cur - ref) <= allowed:
            return None
        of = "" if s.numel is None else f" of {numel:,.0f}"
        detail = (f"{point} changed beyond rounding: {cur:,.0f}{of} elements against {ref:,.0f} in {against}, "
                  f"{cur - ref:+,.0f} where the rounding twins allow ±{allowed:,.1f}; {hint}")
        return _finding(case, "regression", s, where, t, g, cur - ref, allowed, detail, member_seed=member_seed)
    d = s.cur_y[g, t] - s.ens_y[member, g, t]
    if not np.isfinite(d) or abs(d) <= tol0:
        return None
    detail = (f"{point} changed beyond rounding ({_y_change(space, d)}, rounding tolerance "
              f"{_y_change(space, tol0, signed=False)}) against {against}: {hint}")
    return _finding(case, "regression", s, where, t, g, d, tol0, detail, member_seed=member_seed)


def counts_moved_together(case: str, s: _Series, member: int, t: int, count_noise: float, point: str,
                          against: str, regen_hint: str, member_seed: Any = None) -> Finding | None:
    """The case-level deterministic check of a count metric at point `t`: the sum of every
    series' change against the rounding noise of that sum, each series' noise taken as its
    allowance / FIRST_STEP_SAFETY and the series as independent. Another host moves each count
    by up to its allowance, up in some series and down in others; a wrong block scale moves a few
    elements in each series, within its allowance, but every one the same way."""
    numel = np.ones(len(s.groups)) if s.numel is None else s.numel[:, t]
    ref, cur = s.ens_values[member, :, t] * numel, s.cur_values[:, t] * numel
    ok = np.flatnonzero(np.isfinite(ref) & np.isfinite(cur))
    if ok.size < 2:
        return None
    change = cur[ok] - ref[ok]
    noise = np.sqrt(np.sum((count_allowance(count_noise, ref[ok]) / FIRST_STEP_SAFETY) ** 2))
    z = float(change.sum() / noise)
    if abs(z) <= FIRST_STEP_SAFETY:
        return None
    g = int(ok[np.argmax(np.abs(change))])  # the finding points at the series that moved most
    detail = (f"{point}: the case's {s.metric} counts moved together, {change.sum():+,.0f} elements over "
              f"{ok.size} series against {ref[ok].sum():,.0f} in {against}: {z:+.1f} "
              f"times the rounding twins' noise of that sum, beyond ±{FIRST_STEP_SAFETY:g}; "
              f"{_changed_hint(regen_hint)}")
    return _finding(case, "regression", s, s.groups[g], t, g, z, FIRST_STEP_SAFETY, detail, member_seed=member_seed)


def _changed_hint(regen_hint: str) -> str:
    return "the computation itself changed; if intended, regenerate" + (f" with: {regen_hint}" if regen_hint else "")


def _y_change(space: Space, d: float, signed: bool = True) -> str:
    fmt = "+.3g" if signed else ".3g"
    if space.kind == "db":
        return f"{d:{fmt}} dB"
    if space.is_count:
        return f"count x{math.exp(d):.3g}" if signed else f"count factor {math.exp(d):.3g}"
    return f"x{math.exp(d):.4g}" if signed else f"factor {math.exp(d):.4g}"


def _finding(case: str, kind: str, s: _Series, where: Mapping[str, Any], t: int, g: int,
             score: float, tolerance: float, detail: str, member_seed: Any = None) -> Finding:
    where = {**where, s.time_dim: s.times[t]}
    value = float(s.cur_values[g, t])
    ens = s.ens_values[:, g, t]
    finite = ens[np.isfinite(ens)]
    reference = float(np.median(finite)) if finite.size else math.nan
    seeds_text = (f" ({finite.min():.4g}..{finite.max():.4g} over {finite.size} seeds)" if finite.size > 1
                  else "" if finite.size else " (no finite seed)")  # one row: a stored replay
    what = "regressed" if kind == "regression" else "drifted (better)"
    message = (f"{case}: {s.metric} {what} at {format_where(where)}: {value:.4g} vs baseline "
               f"{reference:.4g}{seeds_text}; {detail}")
    return Finding(case=case, kind=kind, metric=s.metric, where=where, value=value,
                   reference=reference, tolerance=float(tolerance), message=message,
                   score=float(score))


def ensemble_band(metric: str, current: xr.Dataset, ensemble: xr.Dataset,
                  where: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """(lower, upper) accepted values of one series over time, for charts; None if not compared."""
    if metric not in SPACES or metric not in ensemble.data_vars or metric not in current.data_vars:
        return None
    s = _series(metric, current, ensemble)
    g = None if s is None else next((i for i, w in enumerate(s.groups)
                                     if all(w.get(k) == v for k, v in where.items())), None)
    if g is None:
        return None
    z = trained_threshold(_n_statistics(all_series(current, ensemble)))
    mean, sd = spread(s, 1)
    numel = numel_like(current, current[metric])
    n = None if numel is None else numel.reshape(len(s.groups), -1)[g]
    space = SPACES[metric]
    low, high = space.inverse(mean[g] - z * sd[g], n), space.inverse(mean[g] + z * sd[g], n)
    return np.fmin(low, high), np.fmax(low, high)


def detectable_change(current: xr.Dataset, ensemble: xr.Dataset) -> dict[str, str]:
    """Per metric, the median over series of the smallest shift of every trained point that
    the comparison flags, and the first-point tolerance, as readable text. For counts, only the
    series that count at least DETECTABLE_MIN_COUNT elements: below that, count noise alone
    hides any factor (a series of zeros has no change to detect)."""
    tol0 = json.loads(ensemble.attrs["first_step_tolerance"])
    count_noise = json.loads(ensemble.attrs["first_step_count_noise"])
    mean_z = json.loads(ensemble.attrs.get("trained_mean_z_spread", "{}"))
    case_series = all_series(current, ensemble)
    z = trained_threshold(_n_statistics(case_series))
    out = {}
    for s in case_series:
        mean, sd = spread(s, 1)
        trained, counted = (sd[:, 1:], mean[:, 1:]) if sd.shape[1] > 1 else (sd, mean)
        space = SPACES[s.metric]
        where = ""
        if space.is_count:
            trained = np.where(counted >= math.log(DETECTABLE_MIN_COUNT + 0.5), trained, np.nan)
            where = f" (series counting >= {DETECTABLE_MIN_COUNT} elements)"
        if np.isfinite(trained).any():
            text = f"{_y_change(space, z * float(np.nanmedian(trained)), signed=False)}{where}"
        else:
            text = f"no series counts {DETECTABLE_MIN_COUNT} elements"
        if space.is_count:
            k = float(count_noise.get(s.metric, 0.0))
            first = (f"±max({FIRST_STEP_FLIPS:g}, {FIRST_STEP_SAFETY * k:.3g} x sqrt(count + 1)) elements "
                     f"(1 element: ±{float(count_allowance(k, 1.0)):.3g}; 10^4: ±{float(count_allowance(k, 1e4)):.3g})")
        else:
            first = _y_change(space, float(tol0.get(s.metric, 0.0)), signed=False)
        together = ""
        if s.metric in mean_z and mean_z[s.metric][0] > 0:
            band = mean_z_band(mean_z[s.metric][0], int(mean_z[s.metric][1]), len(mean_z))
            together = f", or every series by {band:.2f} spreads (case level)"
        out[s.metric] = f"trained points: {text} ({z:.1f} spreads){together}; first point: {first}"
    return out
