"""A history record: what a history keeps of one run at one commit (`summarize`).

A **record** is one case's run at one commit on one host, reduced to its headline series
(`HEADLINE_METRICS`, per layer, tensor and layout as the run measured them):

- `trained_<metric>`: the median over the run's finite trained points (every sampled step after
  the first; the loss at every training step after the first), in the metric's own units: the
  statistic the trained comparison judges a series by (`ensemble.compare.series_median_z`).
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

The noise levels come from the seeds and twins measured at regeneration, floored by the
metric table's smallest meaningful spread (`Space.min_spread`; Poisson's 1 for counts). A case
without a baseline (a user's model with none) records no noise: its series are drawn, not searched.

**Detection space.** Each metric is compared in its space's `detection` transform: the space its
comparison uses (log of the norm and loss, log of 1 - cos), except counts, which take Anscombe's
variance-stabilising 2 sqrt(count + 3/8), where Poisson noise has spread 1 at every level.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import xarray as xr

from precision_suite.numerics.metric_table import SPACES
from precision_suite.verdicts.ensemble.first_point import FIRST_STEP_SAFETY
from precision_suite.verdicts.ensemble.series import numel_like, time_dim
from precision_suite.verdicts.findings import TIME_DIMS

HISTORY_SCHEMA_VERSION = (
    1  # the record layout below; bump on any change (jobs/history_store.py refuses others)
)
HEADLINE_METRICS = ("attention_norm", "underflow", "distortion", "loss")
KINDS = ("trained", "replay")


def _trained_median(da: xr.DataArray) -> xr.DataArray:
    """The median over trained points (all but the first) of each series."""
    along = time_dim(da)
    return da.isel({along: slice(1, None)}).median(along, skipna=True)


def _last_point(da: xr.DataArray) -> xr.DataArray:
    return da.isel({time_dim(da): -1}, drop=True)


def summarize(
    run: xr.Dataset,
    *,
    ensemble: xr.Dataset | None = None,
    replay: xr.Dataset | None = None,
    stored_replay: xr.Dataset | None = None,
) -> xr.Dataset:
    """The record of `run` (module docstring), with its noise from the case's baseline `ensemble`
    and the replay delta of `replay` against `stored_replay` when given."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells: pairs the run does not measure
        return _summarize(run, ensemble, replay, stored_replay)


def _summarize(
    run: xr.Dataset, ensemble: xr.Dataset | None, replay: xr.Dataset | None, stored_replay: xr.Dataset | None
) -> xr.Dataset:
    variables: dict[str, xr.DataArray] = {}
    for metric in HEADLINE_METRICS:
        if metric not in run.data_vars or not any(d in TIME_DIMS for d in run[metric].dims):
            continue
        da = run[metric].astype(np.float64)
        median = _trained_median(da)
        variables[f"trained_{metric}"] = median.assign_attrs(
            description=f"median of {metric} over the run's finite trained points"
        )
        along = time_dim(da)
        # measured: any point is a number or Inf, the first (untrained) one included, so that a run
        # whose every trained point is NaN counts as diverged, not as unmeasured
        variables[f"trained_{metric}_nonfinite"] = (
            (~np.isfinite(da.isel({along: slice(1, None)})))
            .mean(along)
            .where(da.notnull().any(along))
            .assign_attrs(
                description="fraction of the trained points that are NaN or Inf (NaN: a cell the run does not measure)"
            )
        )
        if ensemble is not None and metric in ensemble.data_vars and "seed" in ensemble[metric].dims:
            variables.update(_trained_noise(metric, ensemble, median))
        if (
            replay is not None
            and stored_replay is not None
            and metric in replay.data_vars
            and metric in stored_replay.data_vars
        ):
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
    noise = np.sqrt(np.fmax(np.fmax(var.fillna(0.0), pooled), floor**2)).where(pooled.notnull())
    return {
        f"trained_{metric}_noise": noise.transpose(*like.dims).assign_attrs(
            description=f"spread of the baseline seeds' trained medians (at least their pool's), in "
            f"{metric}'s detection space"
        ),
        f"trained_{metric}_noise_dof": dof.where(noise.notnull())
        .transpose(*like.dims)
        .assign_attrs(description="degrees of freedom of the pooled spread"),
    }


def _replay_delta(metric: str, replay: xr.Dataset, stored: xr.Dataset) -> dict[str, xr.DataArray]:
    current, reference = xr.align(
        _last_point(replay[metric].astype(np.float64)),
        _last_point(stored[metric].astype(np.float64)),
        join="inner",
    )
    n = numel_like(replay, current, metric)
    space = SPACES[metric]
    delta = space.detection(current.values, n) - space.detection(reference.values, n)
    if space.is_count:
        noise = max(
            float(json.loads(stored.attrs.get("replay_count_noise", "{}")).get(metric, 0.0)),
            space.detection_min_spread,
        )
    else:
        tolerance = json.loads(stored.attrs.get("replay_tolerance", "{}")).get(metric)
        noise = max(float(tolerance) / FIRST_STEP_SAFETY, space.min_spread) if tolerance else math.nan
    return {
        f"replay_{metric}_delta": current.copy(data=delta).assign_attrs(
            description=f"the replay's last point minus the stored replay's, in {metric}'s detection space"
        ),
        f"replay_{metric}_noise": current.copy(data=np.full(current.shape, noise)).assign_attrs(
            description="the largest change the rounding twins made to the stored replay"
        ),
    }
