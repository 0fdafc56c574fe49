"""A case's history: its records along `commit`, its series and where they step.

A case's records (verdicts.history_records), concatenated along `commit` in first-parent order,
hold one series per headline metric, cell and kind (trained, replay): `case_series`.

**Steps.** Commits that leave the numbers bitwise identical carry no new evidence (the same run
twice), so a series is first collapsed into its epochs: runs of consecutive commits with equal
values. Over the epochs, in units of the series' noise, PELT (ruptures, l2 cost) finds the
segmentation that minimises the squared residuals plus a penalty per change. Under no change the
epochs of a series are independent draws of that noise; splitting n of them at one place lowers
the squared residuals by a chi-squared(1) variable in noise units, an F(1, dof) one when the noise
is estimated with dof degrees of freedom. The penalty is the square of the two-sided normal
(Student t) quantile Bonferroni-corrected over the case's searched series and the n - 1 places a
change can go (`step_penalty`), so a case shows a false step with probability at most
`FALSE_ALARM_RATE` (more segments add a negligible term). A series whose trained points turn NaN
or Inf has no level to step to: that commit is a step of infinite size.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ruptures
import xarray as xr
from scipy.special import stdtrit  # Student's t quantile (scipy.stats.t's, without its import time)

from precision_suite.numerics.metric_table import SPACES
from precision_suite.verdicts.ensemble.series import FALSE_ALARM_RATE, numel_like, z_threshold
from precision_suite.verdicts.findings import format_where, to_python
from precision_suite.verdicts.history_records import HEADLINE_METRICS, KINDS


@dataclass(frozen=True)
class Step:
    """A detected step of one series: from commit index `index` on, its level moved from `before`
    to `after` (medians over the commits of the segments on either side; trained: the metric's
    units, replay: the delta in noise units), `size` noise units in the detection space. A series
    whose trained points turn non-finite is a step of infinite size, `before` and `after` then
    the fractions of its trained points that are NaN or Inf."""

    kind: str
    metric: str
    where: dict[str, Any]
    index: int
    before: float
    after: float
    size: float

    @property
    def series(self) -> str:
        where = format_where(self.where)
        return f"{self.kind} {self.metric}{' at ' + where if where else ''}"

    @property
    def nonfinite(self) -> bool:
        return math.isinf(self.size)

    def describe(self) -> str:
        if self.nonfinite:
            return f"{self.series}: NaN or Inf at {self.after:.0%} of the trained points (before: {self.before:.0%})"
        unit = "" if self.kind == "trained" else " noise units"
        return f"{self.series}: {self.before:.4g} -> {self.after:.4g}{unit} ({self.size:+.1f} noise units)"


def step_penalty(
    n_series: int, n_epochs: int, dof: float = math.inf, rate: float = FALSE_ALARM_RATE
) -> float:
    """PELT's penalty per change, in squared noise units (module docstring): the two-sided
    quantile, Bonferroni-corrected over `n_series` series and the `n_epochs - 1` places a change
    can go, of the normal distribution for a known noise level, of Student's t with `dof` degrees
    of freedom for one estimated from seeds (the split statistic is then F(1, dof))."""
    tests = max(n_series, 1) * max(n_epochs - 1, 1)
    if math.isinf(dof):
        return z_threshold(tests, rate) ** 2
    return float(-stdtrit(max(dof, 1.0), rate / (2.0 * tests))) ** 2  # t's upper tail: -quantile


def epochs(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index of each run of equal consecutive finite values, their values); NaN skipped."""
    index = np.flatnonzero(np.isfinite(y))
    values = y[index]
    new = np.ones(values.size, dtype=bool)
    new[1:] = values[1:] != values[:-1]
    return index[new], values[new]


def change_points(y: np.ndarray, noise: float, penalty_of: Callable[[int], float]) -> list[int]:
    """Indices of `y` (one value per commit) at which a new level starts; `penalty_of(n_epochs)`."""
    starts, values = epochs(y)
    if values.size < 2 or not noise > 0:
        return []
    signal = (values / noise).reshape(-1, 1)
    ends = ruptures.Pelt(model="l2", min_size=1, jump=1).fit(signal).predict(pen=penalty_of(values.size))
    return [int(starts[end]) for end in ends[:-1]]  # the last end is the series' end


@dataclass
class Series:
    """One series of a case's history: per commit its value in natural units (`shown`) and in the
    detection space (`y`, trained) or noise units (replay), its noise level and that level's
    degrees of freedom (inf: the twins' largest change, taken as known), and per commit the
    fraction of its trained points that are NaN or Inf (NaN: not measured)."""

    kind: str
    metric: str
    where: dict[str, Any]
    shown: np.ndarray
    y: np.ndarray
    noise: float
    dof: float = math.inf
    nonfinite: np.ndarray | None = None


def case_series(history: xr.Dataset) -> list[Series]:
    """Every series of a case's history (records concatenated along `commit`)."""
    found = []
    for metric in HEADLINE_METRICS:
        for kind in KINDS:
            name = f"trained_{metric}" if kind == "trained" else f"replay_{metric}_delta"
            if name in history.data_vars:
                found += _variable_series(history, kind, metric, name)
    return found


def _variable_series(history: xr.Dataset, kind: str, metric: str, name: str) -> list[Series]:
    """The series of one variable of a case's history, a series per cell: the variable is read once
    as a (commit, cell) array, then cut into its cells' columns."""
    groups = [d for d in history[name].dims if d != "commit"]
    da = history[name].transpose("commit", *groups)

    def columns(array: np.ndarray | xr.DataArray | None) -> np.ndarray | None:
        """(commit, cell) values of a variable shaped like `da`."""
        if isinstance(array, xr.DataArray):
            array = array.broadcast_like(da).transpose("commit", *groups).values
        return None if array is None else np.asarray(array, dtype=np.float64).reshape(da.sizes["commit"], -1)

    def variable(suffix: str) -> np.ndarray | None:
        full = f"{kind}_{metric}_{suffix}"
        return columns(history[full]) if full in history.data_vars else None

    values, noise, dof, nonfinite = (
        columns(da),
        variable("noise"),
        variable("noise_dof"),
        variable("nonfinite"),
    )
    levels = np.full(values.shape[1], np.nan) if noise is None else np.nanmedian(noise, axis=0)
    if kind == "trained":
        numel = columns(numel_like(history, da, metric))
        y = SPACES[metric].detection(values, numel)
        dofs = np.full(values.shape[1], np.inf) if dof is None else np.nanmedian(dof, axis=0)
    found = []
    coords = [da[d].values for d in groups]
    for k, index in enumerate(np.ndindex(*[da.sizes[d] for d in groups])):
        broken = None if nonfinite is None else nonfinite[:, k]
        if not np.isfinite(values[:, k]).any() and not (
            broken is not None and np.nanmax(broken, initial=0) > 0
        ):
            continue
        where = {d: to_python(c[i]) for d, c, i in zip(groups, coords, index)}
        level = float(levels[k])
        if kind == "trained":
            found.append(Series(kind, metric, where, values[:, k], y[:, k], level, float(dofs[k]), broken))
        else:
            found.append(
                Series(
                    kind,
                    metric,
                    where,
                    values[:, k] / level if level > 0 else values[:, k] * np.nan,
                    values[:, k],
                    level,
                )
            )
    return found


def find_steps(series: Sequence[Series], rate: float = FALSE_ALARM_RATE) -> list[Step]:
    """The steps of every series of one case, largest first: where its trained points turn
    non-finite, and, for a series with a noise level, where PELT changes its level (each step's
    levels the medians of the segments on either side of it)."""
    searched = [s for s in series if s.noise > 0]
    steps = [step for s in series for step in _nonfinite_steps(s)]
    for s in searched:
        changes = change_points(
            s.y, s.noise, functools.partial(step_penalty, len(searched), dof=s.dof, rate=rate)
        )
        bounds = [0, *changes, s.y.size]
        for i, index in enumerate(changes, start=1):
            before, after = slice(bounds[i - 1], index), slice(index, bounds[i + 1])
            steps.append(
                Step(
                    s.kind,
                    s.metric,
                    s.where,
                    index,
                    _median(s.shown[before]),
                    _median(s.shown[after]),
                    (_median(s.y[after]) - _median(s.y[before])) / s.noise,
                )
            )
    return sorted(steps, key=lambda step: -abs(step.size))


def _nonfinite_steps(s: Series) -> list[Step]:
    """A step of infinite size at each commit whose trained points turn NaN or Inf where the
    previous measured commit had none: a run that diverges has no level to step to."""
    if s.nonfinite is None:
        return []
    measured = np.flatnonzero(np.isfinite(s.nonfinite))
    return [
        Step(s.kind, s.metric, s.where, int(i), float(s.nonfinite[j]), float(s.nonfinite[i]), math.inf)
        for j, i in zip(measured[:-1], measured[1:])
        if s.nonfinite[i] > 0 and s.nonfinite[j] == 0
    ]


def _median(values: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a segment of non-finite values only
        return float(np.nanmedian(np.asarray(values, dtype=np.float64)))


@dataclass
class CaseHistory:
    """One case's records on one host along `commit` (oldest first), its series and their steps."""

    case: str
    host: str
    host_label: str
    commits: list[dict[str, Any]]  # commit, commit_time, subject, branch
    series: list[Series]
    steps: list[Step]


def case_history(
    case: str,
    host: str,
    host_label: str,
    commits: list[dict[str, Any]],
    data: xr.Dataset,
    rate: float = FALSE_ALARM_RATE,
) -> CaseHistory:
    """The history of one case on one host: its records along `commit`, oldest first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells: series some commits lack
        series = case_series(data)
    return CaseHistory(case, host, host_label, commits, series, find_steps(series, rate))
