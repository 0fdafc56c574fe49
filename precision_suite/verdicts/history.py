"""Numerics over commits: what a history record keeps of one run, and where its series step.

A **record** is one case's run at one commit on one host, reduced to its headline series
(`HEADLINE_METRICS`, per layer, tensor and layout as the run measured them):

- `trained_<metric>`: the median over the run's finite trained points (every sampled step after
  the first; the loss at every training step after the first), in the metric's own units: the
  statistic the trained comparison judges a series by (`ensemble.series_median_z`).
  `trained_<metric>_nonfinite`: the fraction of those points that are NaN or Inf.
- `trained_<metric>_noise`: how far that median moves between runs that differ by seed alone. On
  one host a commit that changes any number re-rolls a short run as far as another seed does
  (chaos), so this is the size of a meaningless change of the trained series. It is the spread
  of the baseline seeds' medians, at least the mean over the cell's pool (same metric, tensor and
  layout, every layer): four seeds give one cell 3 degrees of freedom, the pool 3 per layer
  (`trained_<metric>_noise_dof`), as in the ensemble comparison.
- `replay_<metric>_delta`: the replay from the baseline's stored state against the stored replay,
  at its last point. Replays do not wander with chaos: unchanged code gives rounding-size deltas
  on any host, so these are the series worth tracking for small changes. Each commit's delta is
  its own code's rounding against one fixed reference, so rounding changes do not add up over
  commits; a delta that drifts is a change of the numbers.
- `replay_<metric>_noise`: the largest change the rounding twins made to that replay
  (`replay_tolerance / FIRST_STEP_SAFETY`; for counts the `k` of the count model): a largest
  change, not a spread, so steps against it are conservative.

The noise levels come from the seeds and twins measured at regeneration (issue 12), floored by the
metric table's smallest meaningful spread (`Space.min_spread`; Poisson's 1 for counts). A case
without a baseline (a user's model with none) records no noise: its series are drawn, not searched.

**Detection space.** Each metric is compared in its space's `detection` transform: the space its
comparison uses (log of the norm and loss, log of 1 - cos), except counts, which take Anscombe's
variance-stabilising 2 sqrt(count + 3/8), where Poisson noise has spread 1 at every level.

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

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ruptures
import xarray as xr
from scipy.stats import t as student_t

from precision_suite.numerics.metric_table import SPACES
from precision_suite.verdicts.ensemble import FALSE_ALARM_RATE, FIRST_STEP_SAFETY, numel_like, time_dim, z_threshold
from precision_suite.verdicts.findings import TIME_DIMS, format_where, to_python

HISTORY_SCHEMA_VERSION = 1  # the record layout below; bump on any change (jobs/history.py refuses others)
HEADLINE_METRICS = ("attention_norm", "underflow", "distortion", "loss")
KINDS = ("trained", "replay")


def _trained_median(da: xr.DataArray) -> xr.DataArray:
    """The median over trained points (all but the first) of each series."""
    along = time_dim(da)
    return da.isel({along: slice(1, None)}).median(along, skipna=True)


def _last_point(da: xr.DataArray) -> xr.DataArray:
    return da.isel({time_dim(da): -1}, drop=True)


def summarize(run: xr.Dataset, *, ensemble: xr.Dataset | None = None, replay: xr.Dataset | None = None,
              stored_replay: xr.Dataset | None = None) -> xr.Dataset:
    """The record of `run` (module docstring), with its noise from the case's baseline `ensemble`
    and the replay delta of `replay` against `stored_replay` when given."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells: pairs the run does not measure
        return _summarize(run, ensemble, replay, stored_replay)


def _summarize(run: xr.Dataset, ensemble: xr.Dataset | None, replay: xr.Dataset | None,
               stored_replay: xr.Dataset | None) -> xr.Dataset:
    variables: dict[str, xr.DataArray] = {}
    for metric in HEADLINE_METRICS:
        if metric not in run.data_vars or not any(d in TIME_DIMS for d in run[metric].dims):
            continue
        da = run[metric].astype(np.float64)
        median = _trained_median(da)
        variables[f"trained_{metric}"] = median.assign_attrs(
            description=f"median of {metric} over the run's finite trained points")
        along = time_dim(da)
        # measured: any point is a number or Inf, the first (untrained) one included, so that a run
        # whose every trained point is NaN counts as diverged, not as unmeasured
        variables[f"trained_{metric}_nonfinite"] = (~np.isfinite(da.isel({along: slice(1, None)}))).mean(along).where(
            da.notnull().any(along)).assign_attrs(
            description="fraction of the trained points that are NaN or Inf (NaN: a cell the run does not measure)")
        if ensemble is not None and metric in ensemble.data_vars and "seed" in ensemble[metric].dims:
            variables.update(_trained_noise(metric, ensemble, median))
        if replay is not None and stored_replay is not None and metric in replay.data_vars \
                and metric in stored_replay.data_vars:
            variables.update(_replay_delta(metric, replay, stored_replay))
    if "numel" in run.data_vars:
        variables["numel"] = run["numel"]
    return xr.Dataset(variables, attrs={"history_schema_version": HISTORY_SCHEMA_VERSION})


def _trained_noise(metric: str, ensemble: xr.Dataset, like: xr.DataArray) -> dict[str, xr.DataArray]:
    """`trained_<metric>_noise` and its degrees of freedom. Four seeds give a cell's spread 3
    degrees of freedom, too few for a Bonferroni threshold; so, as the ensemble comparison does,
    each cell's variance is at least the mean variance of its pool (the same metric, tensor and
    layout over every layer), whose degrees of freedom are those of the pool's cells together."""
    members = _trained_median(ensemble[metric].astype(np.float64))
    members, like = xr.align(members, like, join="right", exclude=["seed"])
    y = members.copy(data=SPACES[metric].detection(members.values, numel_like(ensemble, members, metric)))
    dof_cell = (y.notnull().sum("seed") - 1).clip(min=0)
    var = y.var("seed", ddof=1).where(dof_cell >= 1)
    pool = ["layer"] if "layer" in var.dims else []
    pooled = var.mean(pool).broadcast_like(var)  # NaN where no cell of the pool is measured
    dof = dof_cell.where(var.notnull()).sum(pool).broadcast_like(var)
    floor = SPACES[metric].detection_min_spread
    noise = np.sqrt(np.fmax(np.fmax(var.fillna(0.0), pooled), floor ** 2)).where(pooled.notnull())
    return {f"trained_{metric}_noise": noise.transpose(*like.dims).assign_attrs(
                description=f"spread of the baseline seeds' trained medians (at least their pool's), in "
                            f"{metric}'s detection space"),
            f"trained_{metric}_noise_dof": dof.where(noise.notnull()).transpose(*like.dims).assign_attrs(
                description="degrees of freedom of the pooled spread")}


def _replay_delta(metric: str, replay: xr.Dataset, stored: xr.Dataset) -> dict[str, xr.DataArray]:
    current, reference = xr.align(_last_point(replay[metric].astype(np.float64)),
                                  _last_point(stored[metric].astype(np.float64)), join="inner")
    n = numel_like(replay, current, metric)
    space = SPACES[metric]
    delta = space.detection(current.values, n) - space.detection(reference.values, n)
    if space.is_count:
        noise = max(float(json.loads(stored.attrs.get("replay_count_noise", "{}")).get(metric, 0.0)),
                    space.detection_min_spread)
    else:
        tolerance = json.loads(stored.attrs.get("replay_tolerance", "{}")).get(metric)
        noise = max(float(tolerance) / FIRST_STEP_SAFETY, space.min_spread) if tolerance else math.nan
    return {f"replay_{metric}_delta": current.copy(data=delta).assign_attrs(
                description=f"the replay's last point minus the stored replay's, in {metric}'s detection space"),
            f"replay_{metric}_noise": current.copy(data=np.full(current.shape, noise)).assign_attrs(
                description="the largest change the rounding twins made to the stored replay")}


# --------------------------------------------------------------------------- steps


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
        return (f"{self.series}: {self.before:.4g} -> {self.after:.4g}{unit} "
                f"({self.size:+.1f} noise units)")


def step_penalty(n_series: int, n_epochs: int, dof: float = math.inf, rate: float = FALSE_ALARM_RATE) -> float:
    """PELT's penalty per change, in squared noise units (module docstring): the two-sided
    quantile, Bonferroni-corrected over `n_series` series and the `n_epochs - 1` places a change
    can go, of the normal distribution for a known noise level, of Student's t with `dof` degrees
    of freedom for one estimated from seeds (the split statistic is then F(1, dof))."""
    tests = max(n_series, 1) * max(n_epochs - 1, 1)
    if math.isinf(dof):
        return z_threshold(tests, rate) ** 2
    return float(student_t.isf(rate / (2.0 * tests), max(dof, 1.0))) ** 2


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
    """Every series of a case's history (records concatenated along `commit`): each variable is
    read once as a (commit, cell) array, then cut into its cells' columns."""
    found = []
    for metric in HEADLINE_METRICS:
        for kind in KINDS:
            name = f"trained_{metric}" if kind == "trained" else f"replay_{metric}_delta"
            if name not in history.data_vars:
                continue
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

            values, noise, dof, nonfinite = columns(da), variable("noise"), variable("noise_dof"), variable("nonfinite")
            levels = np.full(values.shape[1], np.nan) if noise is None else np.nanmedian(noise, axis=0)
            if kind == "trained":
                numel = columns(numel_like(history, da, metric))
                y = SPACES[metric].detection(values, numel)
                dofs = np.full(values.shape[1], np.inf) if dof is None else np.nanmedian(dof, axis=0)
            coords = [da[d].values for d in groups]
            for k, index in enumerate(np.ndindex(*[da.sizes[d] for d in groups])):
                broken = None if nonfinite is None else nonfinite[:, k]
                if not np.isfinite(values[:, k]).any() and not (broken is not None and np.nanmax(broken, initial=0) > 0):
                    continue
                where = {d: to_python(c[i]) for d, c, i in zip(groups, coords, index)}
                level = float(levels[k])
                if kind == "trained":
                    found.append(Series(kind, metric, where, values[:, k], y[:, k], level, float(dofs[k]), broken))
                else:
                    found.append(Series(kind, metric, where, values[:, k] / level if level > 0 else values[:, k] * np.nan,
                                        values[:, k], level))
    return found


def find_steps(series: Sequence[Series], rate: float = FALSE_ALARM_RATE) -> list[Step]:
    """The steps of every series of one case, largest first: where its trained points turn
    non-finite, and, for a series with a noise level, where PELT changes its level (each step's
    levels the medians of the segments on either side of it)."""
    searched = [s for s in series if s.noise > 0]
    steps = [step for s in series for step in _nonfinite_steps(s)]
    for s in searched:
        changes = change_points(s.y, s.noise, lambda n: step_penalty(len(searched), n, s.dof, rate))
        bounds = [0, *changes, s.y.size]
        for i, index in enumerate(changes, start=1):
            before, after = slice(bounds[i - 1], index), slice(index, bounds[i + 1])
            steps.append(Step(s.kind, s.metric, s.where, index, _median(s.shown[before]), _median(s.shown[after]),
                              (_median(s.y[after]) - _median(s.y[before])) / s.noise))
    return sorted(steps, key=lambda step: -abs(step.size))


def _nonfinite_steps(s: Series) -> list[Step]:
    """A step of infinite size at each commit whose trained points turn NaN or Inf where the
    previous measured commit had none: a run that diverges has no level to step to."""
    if s.nonfinite is None:
        return []
    measured = np.flatnonzero(np.isfinite(s.nonfinite))
    return [Step(s.kind, s.metric, s.where, int(i), float(s.nonfinite[j]), float(s.nonfinite[i]), math.inf)
            for j, i in zip(measured[:-1], measured[1:]) if s.nonfinite[i] > 0 and s.nonfinite[j] == 0]


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


def case_history(case: str, host: str, host_label: str, commits: list[dict[str, Any]], data: xr.Dataset,
                 rate: float = FALSE_ALARM_RATE) -> CaseHistory:
    """The history of one case on one host: its records along `commit`, oldest first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells: series some commits lack
        series = case_series(data)
    return CaseHistory(case, host, host_label, commits, series, find_steps(series, rate))
