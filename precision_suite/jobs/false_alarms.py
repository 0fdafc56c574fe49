"""`precision-suite calibrate`: false alarms counted on this host. Every selected case runs under
perturbations that must not fail it (its host's rounding twins, `jobs.twins`, and held-out seeds)
and is judged against its baseline ensemble, and every baseline seed is judged against the others;
its replay runs under every rounding twin and is judged against the stored replay, and again
against a tolerance measured without that twin (held out: the stored tolerance was measured from
the same twins). The false alarms counted per metric are written beside the baselines
(verdicts.alarm_statement states them in every later report)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import safe_filename, save_dataset, write_json
from precision_suite.jobs.checking import judge_case, report_folder
from precision_suite.jobs.execution import Task
from precision_suite.jobs.reference import Reference, load_project, load_references
from precision_suite.jobs.selection import Selection, regen_command, selected_specs
from precision_suite.jobs.train import describe, placement, run_tasks
from precision_suite.jobs.twins import rounding_twins
from precision_suite.jobs.usage import EXIT_OK, EXIT_REGRESSION
from precision_suite.numerics.metric_table import SPACES
from precision_suite.reports import reports
from precision_suite.training.replays import replay_spec
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.alarm_statement import measured_path
from precision_suite.verdicts.ensemble.build import leave_one_out
from precision_suite.verdicts.ensemble.power import detectable_change
from precision_suite.verdicts.ensemble.series import FALSE_ALARM_RATE, ensemble_seeds
from precision_suite.verdicts.findings import CaseVerdict, verdict
from precision_suite.verdicts.stored_replays import build_replay, compare_replay, stored_metrics

# (label, RunSpec changes, environment) of one perturbation
Perturbation = tuple[str, Mapping[str, Any], Mapping[str, str]]


@dataclass
class _Tally:
    """Every verdict of a calibration, and a row per verdict: its case, perturbation, status and
    false alarms per metric."""

    verdicts: list[CaseVerdict] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, case: str, label: str, outcome: CaseVerdict) -> None:
        alarms = [f for f in outcome.findings if f.kind in ("regression", "drift")]
        self.verdicts.append(outcome)
        self.rows.append(
            {
                "case": case,
                "perturbation": label,
                "status": outcome.status,
                "false_alarms": {m: sum(f.metric == m for f in alarms) for m in SPACES},
            }
        )


def calibrate(
    selection: Selection,
    held_out_seeds: Sequence[int],
    *,
    baseline_dir: str,
    rules_file: str,
    report_dir: str | None,
    charts: str,
    workers: int | None,
    scheduler: str | None,
) -> int:
    """Run the calibration of the selected cases, write its report and `calibration.json` beside
    the baselines, print the false alarms and the smallest detected changes; the exit status."""
    specs = selected_specs(selection)
    where = placement(workers, scheduler)
    references = load_references(
        specs,
        load_project(rules_file),
        baseline_dir,
        lambda case: regen_command(selection, baseline_dir, case),
    )
    # judged without the hint to regenerate: every alarm of a calibration is false by construction
    references = {case: dataclasses.replace(ref, regen_hint="") for case, ref in references.items()}
    twins = [(twin.name, twin.spec_changes, twin.env) for twin in rounding_twins()]
    perturbations = twins + [(f"seed {seed}", {"seed": seed}, {}) for seed in held_out_seeds]
    runs_to_judge = [
        (spec, label, Task(dataclasses.replace(spec, **changes), env, f"{case_id(spec)} {label}"))
        for spec in specs
        for label, changes, env in perturbations
    ]
    replays_to_judge = _twin_replay_tasks(specs, references, twins)
    tasks = [task for _, _, task in runs_to_judge] + [task for _, _, task in replays_to_judge]
    print(
        f"calibrating {len(specs)} case(s) x {len(perturbations)} perturbations and {len(replays_to_judge)} "
        f"replays {describe(where, len(tasks))}",
        file=sys.stderr,
    )
    results = run_tasks(tasks, where)
    results, replayed = results[: len(runs_to_judge)], results[len(runs_to_judge) :]
    twin_replays = {(case, label): ds for (case, label, _), ds in zip(replays_to_judge, replayed)}
    folder = report_folder(report_dir)
    tally = _Tally()
    for (spec, label, _), ds in zip(runs_to_judge, results):
        case = case_id(spec)
        ds = ds.assign_attrs(case=f"{case} [{label}]")
        save_dataset(ds, folder / "results" / f"{safe_filename(ds.attrs['case'])}.nc")
        # held-out seeds have no replay: their runs alone are judged
        reference = (
            references[case]
            if (case, label) in twin_replays
            else dataclasses.replace(references[case], stored_replay=None)
        )
        tally.add(
            case, label, judge_case(ds, reference, folder, charts, replay=twin_replays.get((case, label)))
        )
    _judge_replays_without_their_twin(tally, references, twin_replays)
    _judge_members_left_out(tally, references, folder, charts)
    detectable = {
        case_id(spec): detectable_change(ds, references[case_id(spec)].baseline)
        for spec, ds in zip(specs, results[:: len(perturbations)])
    }
    failing = _write(tally, results, references, detectable, folder, charts, baseline_dir)
    members = len(tally.rows) - len(runs_to_judge) - len(replays_to_judge)
    print(
        f"{len(tally.rows)} judged: {len(runs_to_judge)} perturbed runs (with their replays), "
        f"{len(replays_to_judge)} replays against a tolerance measured without their twin, {members} members "
        f"left out of their ensemble; {len(failing)} with a FAIL/DRIFT/ERROR (known violations aside)"
    )
    for row in failing:
        print(f"  {row['status'].upper():5} {row['case']} [{row['perturbation']}]")
    for metric in SPACES:
        print(f"{metric:15} false alarms {sum(row['false_alarms'][metric] for row in tally.rows)}")
    for case, changes in detectable.items():
        print(f"smallest detected change, {case}:")
        for metric, text in changes.items():
            print(f"  {metric:15} {text}")
    print(
        f"report: {folder / 'index.html'}; table: {folder / 'calibration.json'}; "
        f"summary for later run reports: {measured_path(baseline_dir)} (commit it)"
    )
    return EXIT_REGRESSION if failing else EXIT_OK


def _twin_replay_tasks(
    specs: Sequence[RunSpec], references: Mapping[str, Reference], twins: Sequence[Perturbation]
) -> list[tuple[str, str, Task]]:
    """(case, twin label, task) of each case's replay under each rounding twin (the replay keeps
    its stored seed)."""
    tasks = []
    for spec in specs:
        stored = references[case_id(spec)].stored_replay
        if stored is None:
            continue
        for label, changes, env in twins:
            tasks.append(
                (
                    case_id(spec),
                    label,
                    Task(
                        dataclasses.replace(replay_spec(spec, stored), **changes),
                        env,
                        f"{case_id(spec)} replay, {label}",
                        replay_from=stored,
                    ),
                )
            )
    return tasks


def _judge_replays_without_their_twin(
    tally: _Tally, references: Mapping[str, Reference], twin_replays: Mapping[tuple[str, str], xr.Dataset]
) -> None:
    """Each twin's replay against a tolerance measured from the other twins only."""
    for case, reference in references.items():
        if reference.stored_replay is None:
            continue
        for label in [label for c, label in twin_replays if c == case]:
            others = [ds for (c, other), ds in twin_replays.items() if c == case and other != label]
            held_out = build_replay(stored_metrics(reference.stored_replay), others, xr.Dataset())
            findings = compare_replay(twin_replays[(case, label)], held_out)
            tally.add(
                case,
                f"replay, {label} left out of the tolerance",
                verdict(f"{case} [replay, {label} left out]", findings),
            )


def _judge_members_left_out(
    tally: _Tally, references: Mapping[str, Reference], folder: Path, charts: str
) -> None:
    """Free held-out runs, no training: each member of an ensemble judged against the others."""
    for case, reference in references.items():
        if len(ensemble_seeds(reference.baseline)) < 3:
            continue  # one seed left: no spread to judge by
        for seed, member, others in leave_one_out(reference.baseline):
            label = f"seed {seed} left out"
            member = member.assign_attrs(case=f"{case} [{label}]")
            against_others = dataclasses.replace(reference, baseline=others, stored_replay=None)
            tally.add(case, label, judge_case(member, against_others, folder, charts))


def _write(
    tally: _Tally,
    results: Sequence[xr.Dataset],
    references: Mapping[str, Reference],
    detectable: Mapping[str, Any],
    folder: Path,
    charts: str,
    baseline_dir: str,
) -> list[dict[str, Any]]:
    """The report, `calibration.json` in it and the measured summary beside the baselines (so
    every later run report can state it); the rows with an alarm."""
    failing = [row for row in tally.rows if row["status"] in ("fail", "error", "drift")]
    measured = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fingerprint": _host_fingerprint(results[0]) if results else {},
        "cases": sorted(references),
        "perturbations": sorted({row["perturbation"] for row in tally.rows}),
        "runs": len(tally.rows),
        "runs_with_alarms": len(failing),
        "false_alarms": {m: sum(row["false_alarms"][m] for row in tally.rows) for m in SPACES},
    }
    sensitivity = {
        "design_false_alarm_rate": FALSE_ALARM_RATE,
        "measured": measured,
        "detectable_change": detectable,
    }
    reports.write_report(tally.verdicts, folder, charts=charts, sensitivity=sensitivity)
    write_json({"runs": tally.rows, **sensitivity}, folder / "calibration.json")
    write_json(measured, measured_path(baseline_dir))
    return failing


def _host_fingerprint(ds: xr.Dataset) -> dict[str, Any]:
    """The host a calibration measured: a run's fingerprint without its own thread count."""
    return {k: v for k, v in json.loads(ds.attrs["fingerprint"]).items() if k != "threads"}
