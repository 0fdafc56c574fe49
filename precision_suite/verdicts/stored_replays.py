"""The stored replay of a case and the deterministic comparison of a new replay against it.

A case's replay (training.replays) trains its seed-0 run's last steps again from a stored state;
`baselines/replays/<case>.nc` holds that state, the baseline's own replay from it and the rounding
tolerances its rounding twins measured (`replay_tolerance`, `replay_count_noise`), built by
`build_replay`. `compare_replay` judges every point of a new replay as the ensemble judges a run's
first point (verdicts.ensemble.first_point.point_finding): both start from the same numbers, so
they agree within the twins' rounding unless the code changed, in either direction.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import xarray as xr

from precision_suite.files import safe_filename
from precision_suite.numerics.metric_table import SPACES
from precision_suite.training.replays import split_state
from precision_suite.verdicts.baseline_files import BaselineError, default_regen_hint, load_baseline
from precision_suite.verdicts.ensemble.first_point import (
    counts_moved_together,
    first_step_count_noise,
    first_step_tolerance,
    point_finding,
)
from precision_suite.verdicts.ensemble.series import all_series
from precision_suite.verdicts.findings import Finding

REPLAY_FOLDER = "replays"  # beside the case's ensemble baseline
REPLAY_ATTRS = ("replayed_from", "replay_tolerance", "replay_count_noise")
REPLAY_WHERE = "replayed_from"  # the key a replay finding's `where` carries (charts draw it apart)


def replay_path(baseline_dir: str | os.PathLike, case: str) -> Path:
    return Path(baseline_dir) / REPLAY_FOLDER / f"{safe_filename(case)}.nc"


def build_replay(replay: xr.Dataset, twins: Sequence[xr.Dataset], state: xr.Dataset) -> xr.Dataset:
    """The stored replay: the baseline's replay, its state, and the rounding tolerances measured
    from the same replay under each rounding twin."""
    return replay.assign(state.data_vars).assign_attrs(
        replay_tolerance=json.dumps(first_step_tolerance([replay], twins), sort_keys=True),
        replay_count_noise=json.dumps(first_step_count_noise([replay], twins), sort_keys=True),
    )


def load_replay(
    baseline_dir: str | os.PathLike,
    case: str,
    *,
    expected_spec: str | None = None,
    regen_hint: str | None = None,
) -> xr.Dataset:
    """The stored replay of `case`; BaselineError saying how to create it when it is missing,
    corrupt, made for another spec or lacks its tolerances."""
    path = replay_path(baseline_dir, case)
    hint = regen_hint or default_regen_hint(case)
    ds = load_baseline(path, expected_spec=expected_spec, regen_hint=hint)
    missing = [name for name in REPLAY_ATTRS if name not in ds.attrs]
    if missing:
        raise BaselineError(
            f"replay {path} lacks attribute(s) {', '.join(missing)}; recreate it with: {hint}"
        )
    return ds


def stored_metrics(stored: xr.Dataset) -> xr.Dataset:
    """The stored replay's measurements, without its state."""
    return split_state(stored)[0]


def compare_replay(current: xr.Dataset, stored: xr.Dataset, regen_hint: str = "") -> list[Finding]:
    """Findings of a new replay against the stored one (`compare_points` with the stored replay's
    twin tolerances), each marked as found in the replay. The stored replay is the baseline's, or
    the run's its `replay_of` attribute names (`diff`: BASE's)."""
    start = int(stored.attrs["replayed_from"])
    name = str(stored.attrs.get("replay_of", "baseline"))
    tolerance = {
        **json.loads(stored.attrs["replay_tolerance"]),
        **json.loads(stored.attrs["replay_count_noise"]),
    }
    findings = compare_points(
        current,
        split_state(stored)[0],
        tolerance,
        "replayed step",
        f"{'the ' if name == 'baseline' else ''}{name}'s replay from step {start}",
        regen_hint,
        reference_name=name,
    )
    return [mark_replayed(f, start) for f in findings]


def compare_points(
    current: xr.Dataset,
    reference: xr.Dataset,
    tolerance: Mapping[str, float],
    point: str,
    against: str,
    regen_hint: str = "",
    reference_name: str = "baseline",
) -> list[Finding]:
    """Every point `current` shares with `reference`, a run from the same start (a replay of the
    same state, the same seed's first step), judged deterministically: per series its first point
    beyond `tolerance` (by metric: the rounding twins' largest difference in its space, or a count
    metric's count noise), and per count metric and point the case-level sum
    (`counts_moved_together`). A change in either direction fails."""
    case = str(current.attrs.get("case", reference.attrs.get("case", "?")))
    reference = reference[[name for name in reference.data_vars if name in SPACES]].expand_dims(seed=[0])
    findings: list[Finding] = []
    for s in all_series(current, reference):
        tol = float(tolerance.get(s.metric, 0.0))
        for g, where in enumerate(s.groups):
            for t, time in enumerate(s.times):
                found = point_finding(
                    case,
                    s,
                    g,
                    where,
                    0,
                    t,
                    tol,
                    f"{point} {time}",
                    against,
                    regen_hint,
                    reference_name=reference_name,
                )
                if found is not None:
                    findings.append(found)
                    break
        if SPACES[s.metric].is_count:
            for t, time in enumerate(s.times):
                found = counts_moved_together(
                    case, s, 0, t, tol, f"{point} {time}", against, regen_hint, reference_name=reference_name
                )
                if found is not None:
                    findings.append(found)
                    break
    return findings


def twin_tolerance(runs: Sequence[xr.Dataset], twins: Sequence[xr.Dataset]) -> dict[str, float]:
    """The deterministic tolerances of `compare_points` from runs and their rounding twins:
    per metric the largest difference in its space (times the safety factor), per count metric
    its count noise."""
    return {**first_step_tolerance(runs, twins), **first_step_count_noise(runs, twins)}


def mark_replayed(finding: Finding, start: int) -> Finding:
    """`finding`, its `where` saying it was found in the replay from step `start`."""
    return dataclasses.replace(finding, where={REPLAY_WHERE: start, **finding.where})


def is_replay_finding(finding: Finding) -> bool:
    return REPLAY_WHERE in (finding.where or {})
