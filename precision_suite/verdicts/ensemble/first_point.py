"""The deterministic point check: a point whose run starts from the same numbers as its
reference (a run's first point against the ensemble member of its seed; every point of a replay
against the stored replay) must match it within rounding, in either direction.

The rounding tolerance is measured when the baseline is made, from its rounding twins
(`first_step_tolerance`; counts by the count model, `first_step_count_noise` and
`count_allowance`), and `counts_moved_together` holds the sum of a count metric's changes over
the case to the noise of that sum: rounding moves counts both ways, a wrong scale all one way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from precision_suite.numerics.metric_table import SPACES
from precision_suite.verdicts.ensemble.series import Series, describe_change, numel_like, series_finding
from precision_suite.verdicts.findings import Finding

FIRST_STEP_SAFETY = 4.0  # x the largest rounding difference the twins made
# At the first point the same elements are quantized on every machine; rounding moves a few of them
# across the zero (or saturation) boundary: a count may always move by this many elements.
FIRST_STEP_FLIPS = 2.0


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
    return {
        metric: max(FIRST_STEP_SAFETY * value, SPACES[metric].first_step_floor)
        for metric, value in largest.items()
    }


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


def _twin_pairs(
    references: Sequence[xr.Dataset], twins: Sequence[xr.Dataset], metrics: Sequence[str]
) -> Iterator[tuple[xr.Dataset, xr.Dataset, str]]:
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


def first_point_finding(
    case: str,
    s: Series,
    g: int,
    where: Mapping[str, Any],
    member: int,
    seed: Any,
    tol0: float,
    regen_hint: str,
) -> Finding | None:
    """A regression if the first point moved beyond rounding from the member of the run's seed."""
    return point_finding(
        case,
        s,
        g,
        where,
        member,
        0,
        tol0,
        "first point",
        f"seed {seed} of the baseline",
        regen_hint,
        member_seed=seed,
    )


def point_finding(
    case: str,
    s: Series,
    g: int,
    where: Mapping[str, Any],
    member: int,
    t: int,
    tol0: float,
    point: str,
    against: str,
    regen_hint: str,
    member_seed: Any = None,
    reference_name: str = "baseline",
) -> Finding | None:
    """A regression if point `t` of series `g` moved beyond rounding from the reference run
    `member` (a deterministic comparison: the same start on both sides): counts by the count
    model in elements, every other metric by `tol0` in its space; a new NaN/Inf fails."""
    space = SPACES[s.metric]
    hint = changed_hint(regen_hint)
    numel = 1.0 if s.numel is None else float(s.numel[g, t])
    ref_v, cur_v = s.ens_values[member, g, t], s.cur_values[g, t]
    if np.isfinite(ref_v) and not np.isfinite(cur_v):
        return series_finding(
            case,
            "regression",
            s,
            where,
            t,
            g,
            math.inf,
            tol0,
            f"{point} is non-finite where {against} is finite; {hint}",
            member_seed=member_seed,
            deterministic=True,
            reference_name=reference_name,
        )
    if space.is_count:
        ref, cur = ref_v * numel, cur_v * numel
        allowed = float(count_allowance(tol0, ref))
        if not (np.isfinite(ref) and np.isfinite(cur)) or abs(cur - ref) <= allowed:
            return None
        of = "" if s.numel is None else f" of {numel:,.0f}"
        detail = (
            f"{point} changed beyond rounding: {cur:,.0f}{of} elements against {ref:,.0f} in {against}, "
            f"{cur - ref:+,.0f} where the rounding twins allow ±{allowed:,.1f}; {hint}"
        )
        return series_finding(
            case,
            "regression",
            s,
            where,
            t,
            g,
            cur - ref,
            allowed,
            detail,
            member_seed=member_seed,
            deterministic=True,
            reference_name=reference_name,
        )
    d = s.cur_y[g, t] - s.ens_y[member, g, t]
    if not np.isfinite(d) or abs(d) <= tol0:
        return None
    detail = (
        f"{point} changed beyond rounding ({describe_change(space, d)}, rounding tolerance "
        f"{describe_change(space, tol0, signed=False)}) against {against}: {hint}"
    )
    return series_finding(
        case,
        "regression",
        s,
        where,
        t,
        g,
        d,
        tol0,
        detail,
        member_seed=member_seed,
        deterministic=True,
        reference_name=reference_name,
    )


def counts_moved_together(
    case: str,
    s: Series,
    member: int,
    t: int,
    count_noise: float,
    point: str,
    against: str,
    regen_hint: str,
    member_seed: Any = None,
    reference_name: str = "baseline",
) -> Finding | None:
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
    detail = (
        f"{point}: the case's {s.metric} counts moved together, {change.sum():+,.0f} elements over "
        f"{ok.size} series against {ref[ok].sum():,.0f} in {against}: {z:+.1f} "
        f"times the rounding twins' noise of that sum, beyond ±{FIRST_STEP_SAFETY:g}; "
        f"{changed_hint(regen_hint)}"
    )
    return series_finding(
        case,
        "regression",
        s,
        s.groups[g],
        t,
        g,
        z,
        FIRST_STEP_SAFETY,
        detail,
        member_seed=member_seed,
        deterministic=True,
        reference_name=reference_name,
    )


def changed_hint(regen_hint: str) -> str:
    return "the computation itself changed" + (
        f"; if intended, regenerate with: {regen_hint}" if regen_hint else ""
    )
