"""Calibration runs: every selected case under perturbations that must not fail it (its host's
rounding twins, `jobs.twins`, and held-out seeds), judged against its baseline ensemble, and every
baseline seed judged against the others; its replay under every rounding twin, judged against the
stored replay, and again against a tolerance measured without that twin (held out: the stored
tolerance was measured from the same twins); the false alarms counted per metric are written beside
the baselines (verdicts.calibration states them in every later report)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

import xarray as xr

from precision_suite.files import safe_filename, save_dataset, write_json
from precision_suite.jobs import judging
from precision_suite.jobs.execution import Task
from precision_suite.jobs.reference import load_project, load_references
from precision_suite.jobs.selection import Selection, regen_command, selected_specs
from precision_suite.jobs.train import describe, placement, run_tasks
from precision_suite.jobs.usage import EXIT_OK, EXIT_REGRESSION
from precision_suite.numerics.metric_table import SPACES
from precision_suite.reports import reports
from precision_suite.training.replays import replay_spec
from precision_suite.training.runs import case_id
from precision_suite.jobs.twins import rounding_twins
from precision_suite.verdicts import calibration, ensemble, replays
from precision_suite.verdicts.findings import CaseVerdict, verdict


def calibrate(selection: Selection, held_out_seeds: Sequence[int], *, baseline_dir: str, rules_file: str,
              report_dir: str | None, charts: str, workers: int | None, scheduler: str | None) -> int:
    """Run the calibration of the selected cases, write its report and `calibration.json` beside
    the baselines, print the false alarms and the smallest detected changes; the exit status."""
    specs = selected_specs(selection)
    where = placement(workers, scheduler)
    references = load_references(specs, load_project(rules_file), baseline_dir,
                                 lambda case: regen_command(selection, baseline_dir, case))
    # judged without the hint to regenerate: every alarm of a calibration is false by construction
    references = {case: dataclasses.replace(ref, regen_hint="") for case, ref in references.items()}
    stored_replays = {case: ref.stored_replay for case, ref in references.items()
                      if ref.stored_replay is not None}
    twins = [(twin.name, twin.spec_changes, twin.env) for twin in rounding_twins()]
    perturbations = twins + [(f"seed {seed}", {"seed": seed}, {}) for seed in held_out_seeds]
    runs_to_judge = [(spec, label, Task(dataclasses.replace(spec, **changes), env, f"{case_id(spec)} {label}"))
                     for spec in specs for label, changes, env in perturbations]
    # each case's replay under each rounding twin (the replay keeps its stored seed)
    replays_to_judge = [(case_id(spec), label, Task(dataclasses.replace(replay_spec(spec, stored_replays[case_id(spec)]), **changes),
                                                    env, f"{case_id(spec)} replay, {label}",
                                                    replay_from=stored_replays[case_id(spec)]))
                        for spec in specs if case_id(spec) in stored_replays for label, changes, env in twins]
    tasks = [task for _, _, task in runs_to_judge] + [task for _, _, task in replays_to_judge]
    print(f"calibrating {len(specs)} case(s) x {len(perturbations)} perturbations and {len(replays_to_judge)} "
          f"replays {describe(where, len(tasks))}", file=sys.stderr)
    results = run_tasks(tasks, where)
    results, replayed = results[:len(runs_to_judge)], results[len(runs_to_judge):]
    twin_replays = {(case, label): ds for (case, label, _), ds in zip(replays_to_judge, replayed)}
    folder = judging.report_dir(report_dir)
    verdicts: list[CaseVerdict] = []
    table: list[dict[str, Any]] = []
    for (spec, label, _), ds in zip(runs_to_judge, results):
        case = case_id(spec)
        ds = ds.assign_attrs(case=f"{case} [{label}]")
        save_dataset(ds, folder / "results" / f"{safe_filename(ds.attrs['case'])}.nc")
        # held-out seeds have no replay: their runs alone are judged
        reference = references[case] if (case, label) in twin_replays else \
            dataclasses.replace(references[case], stored_replay=None)
        _tabulate(table, verdicts, case, label,
                  judging.judge_case(ds, reference, folder, charts, replay=twin_replays.get((case, label))))
    for case, stored in stored_replays.items():  # each twin's replay against the tolerance of the others
        for label in [label for c, label in twin_replays if c == case]:
            others = [ds for (c, other), ds in twin_replays.items() if c == case and other != label]
            held_out = replays.build_replay(replays.stored_metrics(stored), others, xr.Dataset())
            findings = replays.compare_replay(twin_replays[(case, label)], held_out)
            _tabulate(table, verdicts, case, f"replay, {label} left out of the tolerance",
                      verdict(f"{case} [replay, {label} left out]", findings))
    for case, reference in references.items():  # free held-out runs: each member against the rest
        if len(ensemble.ensemble_seeds(reference.baseline)) < 3:
            continue  # one seed left: no spread to judge by
        for seed, member, others in ensemble.leave_one_out(reference.baseline):
            label = f"seed {seed} left out"
            member = member.assign_attrs(case=f"{case} [{label}]")
            against_others = dataclasses.replace(reference, baseline=others, stored_replay=None)
            _tabulate(table, verdicts, case, label, judging.judge_case(member, against_others, folder, charts))
    detectable = {case_id(spec): ensemble.detectable_change(ds, references[case_id(spec)].baseline)
                  for spec, ds in zip(specs, results[::len(perturbations)])}
    alarms_by_metric = {m: sum(row["false_alarms"][m] for row in table) for m in SPACES}
    failing = [row for row in table if row["status"] in ("fail", "error", "drift")]
    measured = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "fingerprint": _host_fingerprint(results[0]) if results else {},
                "cases": sorted(references), "perturbations": sorted({row["perturbation"] for row in table}),
                "runs": len(table), "runs_with_alarms": len(failing), "false_alarms": alarms_by_metric}
    sensitivity = {"design_false_alarm_rate": ensemble.FALSE_ALARM_RATE, "measured": measured,
                   "detectable_change": detectable}
    reports.write_report(verdicts, folder, charts=charts, sensitivity=sensitivity)
    write_json({"runs": table, **sensitivity}, folder / "calibration.json")
    # beside the baselines it measured, so every later run report can state it
    write_json(measured, calibration.measured_path(baseline_dir))
    members = len(table) - len(runs_to_judge) - len(replays_to_judge)
    print(f"{len(table)} judged: {len(runs_to_judge)} perturbed runs (with their replays), {len(replays_to_judge)} "
          f"replays against a tolerance measured without their twin, {members} members left out of their "
          f"ensemble; {len(failing)} with a FAIL/DRIFT/ERROR (known violations aside)")
    for row in failing:
        print(f"  {row['status'].upper():5} {row['case']} [{row['perturbation']}]")
    for metric, count in alarms_by_metric.items():
        print(f"{metric:15} false alarms {count}")
    for case, changes in detectable.items():
        print(f"smallest detected change, {case}:")
        for metric, text in changes.items():
            print(f"  {metric:15} {text}")
    print(f"report: {folder / 'index.html'}; table: {folder / 'calibration.json'}; "
          f"summary for later run reports: {calibration.measured_path(baseline_dir)} (commit it)")
    return EXIT_REGRESSION if failing else EXIT_OK


def _host_fingerprint(ds: xr.Dataset) -> dict[str, Any]:
    """The host a calibration measured: a run's fingerprint without its own thread count."""
    return {k: v for k, v in json.loads(ds.attrs["fingerprint"]).items() if k != "threads"}


def _tabulate(table: list[dict[str, Any]], verdicts: list[CaseVerdict], case: str, label: str,
              outcome: CaseVerdict) -> None:
    alarms = [f for f in outcome.findings if f.kind in ("regression", "drift")]
    verdicts.append(outcome)
    table.append({"case": case, "perturbation": label, "status": outcome.status,
                  "false_alarms": {m: sum(f.metric == m for f in alarms) for m in SPACES}})
