"""`compare_ensemble`: a run against its seed-ensemble baseline (the package docstring): the
first point of a member seed, each series' median trained z, and the case-level mean z.
`ensemble_band` gives charts the accepted band of one series."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

# Student's t quantile from scipy.special: the same numbers as scipy.stats.t, a third of its import time
from scipy.special import stdtrit

from precision_suite.numerics.metric_table import METRICS, SPACES
from precision_suite.verdicts.ensemble.first_point import counts_moved_together, first_point_finding
from precision_suite.verdicts.ensemble.series import (
    FALSE_ALARM_RATE,
    Series,
    all_series,
    check_ensemble,
    ensemble_seeds,
    metric_series,
    n_statistics,
    numel_like,
    series_finding,
    spread,
    trained_threshold,
)
from precision_suite.verdicts.findings import Finding


def compare_ensemble(
    current: xr.Dataset, ensemble: xr.Dataset, regen_hint: str = "", rate: float = FALSE_ALARM_RATE
) -> list[Finding]:
    """Findings of one run against a seed ensemble (module docstring): "regression" for a change
    in the bad direction or any change at the first point, "drift" for the good direction."""
    check_ensemble(ensemble)
    case = str(current.attrs.get("case", ensemble.attrs.get("case", "?")))
    seeds = ensemble_seeds(ensemble)
    seed = json.loads(current.attrs.get("spec", "{}")).get("seed")
    member = seeds.index(seed) if seed in seeds else None
    tol0 = {
        **json.loads(ensemble.attrs["first_step_tolerance"]),
        **json.loads(ensemble.attrs["first_step_count_noise"]),
    }  # disjoint: counts and the rest
    case_series = all_series(current, ensemble)
    z_crit = trained_threshold(n_statistics(case_series), rate)
    findings: list[Finding] = []
    for s in case_series:
        findings += _judge_series(
            case, s, member, seed, float(tol0.get(s.metric, 0.0)), z_crit, len(seeds), regen_hint
        )
        if member is not None and SPACES[s.metric].is_count and s.ens_y.shape[2] > 0:
            if (
                together := counts_moved_together(
                    case,
                    s,
                    member,
                    0,
                    float(tol0.get(s.metric, 0.0)),
                    "first point",
                    f"seed {seed} of the baseline",
                    regen_hint,
                    seed,
                )
            ) is not None:
                findings.append(together)
    spreads = json.loads(ensemble.attrs["trained_mean_z_spread"])
    for s in case_series:
        if (
            s.metric in spreads
            and (moved := _trained_moved_together(case, s, *spreads[s.metric], len(spreads), rate))
            is not None
        ):
            findings.append(moved)
    return findings


def _judge_series(
    case: str, s: Series, member: int | None, seed: Any, tol0: float, z_crit: float, k: int, regen_hint: str
) -> list[Finding]:
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
            findings.append(
                series_finding(
                    case,
                    "regression",
                    s,
                    where,
                    t,
                    g,
                    math.inf,
                    z_crit,
                    "non-finite where every seed of the baseline is finite",
                )
            )
            continue
        if member is not None and s.ens_y.shape[2] > 0:
            if (first := first_point_finding(case, s, g, where, member, seed, tol0, regen_hint)) is not None:
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
        detail = (
            f"median over the {points.size} trained points {median_z:+.1f} spreads from the "
            f"{k}-seed mean (this point), band ±{z_crit:.1f}; {beyond} of {points.size} "
            f"points beyond"
        )
        findings.append(series_finding(case, kind, s, where, t, g, median_z, z_crit, detail))
    return findings


def series_median_z(s: Series) -> np.ndarray:
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
    return {
        metric: (float(np.sqrt(np.mean(np.square(v)))), len(v)) for metric, v in values.items() if len(v) >= 2
    }


def mean_z_band(sigma: float, n: int, n_metrics: int, rate: float = FALSE_ALARM_RATE) -> float:
    """The band of a case-level mean z: a new run's mean z over the spread measured from `n` null
    runs is Student-t with `n` degrees of freedom; two-sided, Bonferroni over the case's metrics.
    This family of tests has its own `rate`: with the series' tests a case false-alarms at most at
    twice FALSE_ALARM_RATE."""
    return float(stdtrit(n, 1.0 - rate / (2.0 * max(n_metrics, 1)))) * sigma


def _trained_moved_together(
    case: str, s: Series, sigma: float, n: int, n_metrics: int, rate: float
) -> Finding | None:
    medians = series_median_z(s)
    ok = np.flatnonzero(np.isfinite(medians))
    if ok.size == 0 or not sigma > 0:
        return None
    m, band = float(medians[ok].mean()), mean_z_band(sigma, int(n), n_metrics, rate)
    if abs(m) <= band:
        return None
    g = int(ok[np.argmax(np.sign(m) * medians[ok])])  # the series that moved most that way
    kind = "regression" if m > 0 else "drift"
    detail = (
        f"trained points, case level: the {ok.size} series of {s.metric} moved together, mean of their "
        f"median z {m:+.2f} spreads, band ±{band:.2f} (Student t from {int(n)} runs of other seeds, "
        f"spread {sigma:.2f}); this series moved most ({medians[g]:+.1f})"
    )
    return series_finding(case, kind, s, s.groups[g], len(s.times) - 1, g, m, band, detail)


def ensemble_band(
    metric: str, current: xr.Dataset, ensemble: xr.Dataset, where: Mapping[str, Any]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(lower, upper) accepted values of one series over time, for charts; None if not compared."""
    if metric not in SPACES or metric not in ensemble.data_vars or metric not in current.data_vars:
        return None
    s = metric_series(metric, current, ensemble)
    g = (
        None
        if s is None
        else next((i for i, w in enumerate(s.groups) if all(w.get(k) == v for k, v in where.items())), None)
    )
    if g is None:
        return None
    z = trained_threshold(n_statistics(all_series(current, ensemble)))
    mean, sd = spread(s, 1)
    numel = numel_like(current, current[metric])
    n = None if numel is None else numel.reshape(len(s.groups), -1)[g]
    space = SPACES[metric]
    low, high = space.inverse(mean[g] - z * sd[g], n), space.inverse(mean[g] + z * sd[g], n)
    return np.fmin(low, high), np.fmax(low, high)
