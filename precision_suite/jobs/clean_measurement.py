"""`diff`'s clean measurement of a changed case (`measure_cleanly`, also run by every `bisect`
step). A case whose runs first differ at a step t > 0: BASE's code keeps its training state before
step t (training.replays.keep_state), and BASE's and HEAD's code each replay the next steps from that
one state, in fresh interpreters with each side's code (jobs/checkouts.py). Their differences are
the change's own, free of what the two runs' earlier steps had already made different (at t = 0 both
runs start from the same state: the free runs' sizes are clean); for a case without a baseline,
BASE's replay under each rounding twin gives the noise HEAD's is judged by.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xarray as xr

from precision_suite.jobs.checkouts import Checkout, replay_side
from precision_suite.jobs.train_specs import load_twins, state_path
from precision_suite.numerics.metric_table import METRICS, SPACES
from precision_suite.training.replays import replay_steps
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.differences import Difference, first_differences, first_of
from precision_suite.verdicts.stored_replays import twin_tolerance


@dataclass(frozen=True)
class Measurement:
    """A changed case measured cleanly: BASE's and HEAD's code each replayed `steps` steps from
    BASE's state before step `start`; the replays' differences (empty: bitwise identical), or
    `problem`, why they could not run. At `start` 0 nothing is replayed: the runs are clean there.
    `base`, `head`: the replays; `tolerance`: their rounding noise, from BASE's replay under each
    rounding twin (measured for a case without a baseline, which it judges)."""

    start: int
    steps: int
    differences: tuple[Difference, ...] = ()
    problem: str = ""
    base: xr.Dataset | None = field(default=None, repr=False, compare=False)
    head: xr.Dataset | None = field(default=None, repr=False, compare=False)
    tolerance: Mapping[str, float] | None = None

    def lines(self, metric: str | None = None) -> list[str]:
        """What `diff` prints under the case's lines: the replays' headline (about `metric` when
        given and changed), then every other metric they changed, indented further."""
        if self.start == 0:
            return [
                "    measured cleanly from step 0: both runs start from the same state, so their "
                "differences there are the change's own (no replay)"
            ]
        if self.problem:
            return [f"    no clean measurement from BASE's state at step {self.start}: {self.problem}"]
        replayed = (
            f"step {self.start}" if self.steps == 1 else f"steps {self.start}-{self.start + self.steps - 1}"
        )
        headline = f"    measured from BASE's state at step {self.start} (both codes replay {replayed})"
        first = first_of(self.differences, metric) or first_of(self.differences)
        if first is None:
            return [
                f"{headline}: bitwise identical; the runs' difference comes from what a replay does not "
                "carry (an earlier change at a step the probes did not sample, optimizer moments, "
                "buffers, the process's own state)"
            ]
        when = f"{first.when()}: " if first.step not in (None, self.start) else ""
        return [f"{headline}: {when}{first.describe()}", *other_lines(self.differences, first, " " * 8)]

    def stored(self) -> xr.Dataset | None:
        """BASE's replay as a stored replay (verdicts.stored_replays) HEAD's is judged against, when
        its twins' tolerance was measured."""
        if self.base is None or self.head is None or self.tolerance is None:
            return None
        counts = {m: v for m, v in self.tolerance.items() if SPACES[m].is_count}
        rest = {m: v for m, v in self.tolerance.items() if not SPACES[m].is_count}
        return self.base.assign_attrs(
            replayed_from=self.start,
            replay_of="BASE",
            replay_tolerance=json.dumps(rest, sort_keys=True),
            replay_count_noise=json.dumps(counts, sort_keys=True),
        )


def other_lines(differences: Sequence[Difference], first: Difference, indent: str) -> list[str]:
    """A line per changed metric but `first`, then the raw variables (module sums...) in one."""
    lines = [
        f"{indent}{d.when() + ': ' if d.when() else ''}{d.describe()}"
        for d in differences
        if d.metric in METRICS and d is not first
    ]
    raw = [d.metric for d in differences if d.metric not in METRICS and d is not first]
    if raw:
        lines.append(f"{indent}also changed: {', '.join(raw)}")
    return lines


def measure_cleanly(
    base: Checkout,
    head: Checkout,
    specs: Sequence[RunSpec],
    differences: Mapping[str, Sequence[Difference]],
    folder: Path,
    with_twins: Sequence[str] = (),
) -> dict[str, Measurement]:
    """case -> its clean measurement, for every case whose runs first differ at a step
    (`differences`: case -> `first_differences` of its runs). After step 0, BASE's code keeps its state before that step and replays from it (and,
    for the cases `with_twins`, under each rounding twin: the replay's noise), then HEAD's code
    replays from the same state; a replay that cannot run is the case's `problem`, never an error
    of the command. At step 0 nothing runs: both runs started from the same state."""
    starts = {
        case: first.step
        for case, found in differences.items()
        if (first := first_of(found)) is not None and first.step is not None
    }
    measured = {case: Measurement(0, 0) for case, start in starts.items() if start == 0}
    todo = [spec for spec in specs if starts.get(case_id(spec), 0) > 0]
    base_replays: dict[str, xr.Dataset] = {}
    problems: dict[str, str] = {}
    twins: dict[str, list[xr.Dataset]] = {}
    for twinned in (False, True):  # the cases without a baseline pay for their replay's twins
        group = [spec for spec in todo if (case_id(spec) in with_twins) == twinned]
        if not group:
            continue
        out = folder / ("base-replays-twins" if twinned else "base-replays")
        replays, failed = replay_side(
            base,
            group,
            out,
            f"keeping the state and replaying {len(group)} case(s)"
            + (" (and under each rounding twin)" if twinned else ""),
            "--keep-state-at",
            ",".join(str(starts[case_id(spec)]) for spec in group),
            *(["--twins"] if twinned else []),
        )
        base_replays.update(replays)
        problems.update(failed)
        for spec in group:
            (folder / "states").mkdir(parents=True, exist_ok=True)
            state = state_path(out, case_id(spec))
            if state.is_file():
                shutil.copy(state, state_path(folder / "states", case_id(spec)))
            if twinned:
                twins[case_id(spec)] = load_twins(out, case_id(spec))
    kept = [spec for spec in todo if case_id(spec) in base_replays]
    head_replays, head_problems = (
        replay_side(
            head,
            kept,
            folder / "head-replays",
            f"replaying {len(kept)} case(s) from BASE's state",
            "--replay-from",
            str(folder / "states"),
        )
        if kept
        else ({}, {})
    )
    problems.update(head_problems)
    for spec in todo:
        case, start = case_id(spec), starts[case_id(spec)]
        if case in problems:
            measured[case] = Measurement(start, replay_steps(spec, start), problem=problems[case])
            continue
        tolerance = twin_tolerance([base_replays[case]], twins[case]) if twins.get(case) else None
        measured[case] = Measurement(
            start,
            replay_steps(spec, start),
            tuple(first_differences(base_replays[case], head_replays[case])),
            base=base_replays[case],
            head=head_replays[case],
            tolerance=tolerance,
        )
    return measured
