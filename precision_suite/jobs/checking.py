"""Checking cases for a command or a test: each case judged by the one judging engine
(verdicts.judge) against its Reference (jobs.reference), the drift chart of a failing or drifting
case drawn here (verdicts draws nothing), the report listing the verdicts, a line per verdict and
the exit status. The `run`, `compare` and `report` commands are this on trained runs against
their baselines (`run_cases`), on saved results against saved results (`compare_results`) and on
saved results, against baselines when given (`report_results`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import safe_filename, save_dataset
from precision_suite.jobs import results, train
from precision_suite.jobs.reference import (
    REQUIRED,
    SKIPPED,
    Reference,
    load_project,
    load_reference,
    load_references,
)
from precision_suite.jobs.selection import Selection, regen_command, selected_specs
from precision_suite.jobs.usage import DEFAULT_REPORT_ROOT, EXIT_OK, EXIT_REGRESSION, UsageError
from precision_suite.reports import reports
from precision_suite.reports.drift_chart import plot_drift
from precision_suite.training import matrix
from precision_suite.training.matrix import KnownViolation
from precision_suite.training.runs import case_id
from precision_suite.verdicts import judge
from precision_suite.verdicts.alarm_statement import read_measured
from precision_suite.verdicts.baseline_files import default_regen_hint
from precision_suite.verdicts.ensemble.power import detectable_change
from precision_suite.verdicts.ensemble.series import FALSE_ALARM_RATE
from precision_suite.verdicts.findings import CaseVerdict, Finding
from precision_suite.verdicts.stored_replays import is_replay_finding


def run_cases(
    selection: Selection,
    *,
    baseline_dir: str,
    rules_file: str,
    report_dir: str | None,
    charts: str,
    workers: int | None,
    scheduler: str | None,
    save_results: str | None,
) -> int:
    """Train the selection, judge each case against its baseline and the rules, write a report."""
    specs = selected_specs(selection)
    where = train.placement(workers, scheduler)
    if save_results and Path(save_results).resolve() == Path(baseline_dir).resolve():
        raise UsageError(
            f"--save-results {save_results} is the baseline folder: results would "
            "replace baselines before they are judged; save them elsewhere and use "
            "`precision-suite baseline update` to regenerate baselines"
        )
    project = load_project(rules_file)
    # every baseline and stored replay is read before the first minute of training
    references = load_references(
        specs, project, baseline_dir, lambda case: regen_command(selection, baseline_dir, case)
    )
    stored_replays = {
        case: ref.stored_replay for case, ref in references.items() if ref.stored_replay is not None
    }
    folder = report_folder(report_dir)
    verdicts, datasets = [], {}
    trained, replayed = train.train_and_replay(specs, stored_replays, where)
    for spec, ds in zip(specs, trained):
        case = case_id(spec)
        if save_results:
            save_dataset(ds, results.result_path(save_results, case))
            if case in replayed:
                save_dataset(replayed[case], results.replay_result_path(save_results, case))
        verdicts.append(judge_case(ds, references[case], folder, charts, replay=replayed.get(case)))
        datasets[case] = ds
    return finish(
        verdicts, datasets, folder, charts, comparison_sensitivity(references, datasets, baseline_dir)
    )


def compare_results(
    base_location: str,
    new_location: str,
    fail: Sequence[str],
    *,
    rules_file: str,
    report_dir: str | None,
    charts: str,
) -> int:
    """Judge saved results NEW against BASE, case by case."""
    base = results.load_results(base_location, "BASE")
    new = results.load_results(new_location, "NEW")
    pairs = results.pair_results(base, new, base_location, new_location)
    project = load_project(rules_file)
    layered = (project.tolerances, results.parse_fail_rules(fail))  # --fail applies over the project's
    folder = report_folder(report_dir)
    verdicts = [
        judge_case(current, Reference(case, project.rules, layered, baseline), folder, charts)
        for case, (baseline, current) in pairs.items()
    ]
    return finish(verdicts, {case: current for case, (_, current) in pairs.items()}, folder, charts)


def report_results(
    locations: Sequence[str],
    *,
    baseline_dir: str | None,
    rules_file: str,
    report_dir: str | None,
    charts: str,
) -> int:
    """A report of saved results (shards merged), compared with baselines when a folder is given."""
    datasets = results.merge_shards(locations)
    project = load_project(rules_file)
    folder = report_folder(report_dir)
    references = {
        case: load_reference(
            case,
            ds.attrs.get("spec"),
            baseline_dir=baseline_dir,
            project=project,
            regen_hint=default_regen_hint(case),
            baseline=SKIPPED if baseline_dir is None else REQUIRED,
        )
        for case, ds in datasets.items()
    }
    verdicts = [judge_case(ds, references[case], folder, charts) for case, ds in datasets.items()]
    if baseline_dir is None:
        return finish(verdicts, datasets, folder, charts)
    return finish(
        verdicts, datasets, folder, charts, comparison_sensitivity(references, datasets, baseline_dir)
    )


class PrecisionChartWarning(UserWarning):
    """A chart of a failing or drifting case could not be drawn (the verdict still stands)."""


def judge_and_chart(
    current: xr.Dataset,
    reference: Reference,
    *,
    chart_path: str | Path | None = None,
    obtained_path: str | Path | None = None,
    replay: xr.Dataset | None = None,
    case_rules: Sequence[Any] = (),
    known: Sequence[KnownViolation] = (),
    extra_findings: Sequence[Finding] = (),
    drawn_against: xr.Dataset | None = None,
    names: tuple[str, str] = ("current", "baseline"),
) -> CaseVerdict:
    """The verdict of `current` (and of its `replay`) against `reference` (`verdicts.judge.judge_case`),
    and a drift chart at `chart_path` of any case with a finding other than an error (None: no
    chart), drawn against the reference's baseline (or `drawn_against`: BASE's run, in `diff`) with
    the two runs called `names`; findings of its replay get a chart of the replay against the
    stored one beside it (`-replay` added)."""
    outcome = judge.judge_case(
        current,
        reference.baseline,
        rules=reference.rules,
        case_rules=case_rules,
        tolerances=list(reference.tolerances),
        known=known,
        obtained_path=obtained_path,
        regen_hint=reference.regen_hint,
        extra_findings=extra_findings,
        replay=replay,
        stored_replay=reference.stored_replay,
    )
    if chart_path is None:
        return outcome
    chart_path, charts = Path(chart_path), []
    drawn = [f for f in outcome.findings if f.kind != "error"]
    of_run = [f for f in drawn if not is_replay_finding(f)]
    of_replay = [f for f in drawn if is_replay_finding(f)]
    against = reference.baseline if drawn_against is None else drawn_against
    if of_run and _draw(current, against, of_run, chart_path, names=names):
        charts.append(str(chart_path))
    replay_chart = chart_path.with_name(f"{chart_path.stem}-replay{chart_path.suffix}")
    if of_replay:
        label = f"{current.attrs.get('case', '')} replay from step {replay.attrs.get('replayed_from')}"
        # no band: the replay's tolerance is a rounding allowance, drawn in the findings' text
        if _draw(
            replay.assign_attrs(case=label),
            reference.stored_replay,
            of_replay,
            replay_chart,
            band=lambda metric, reference: None,
            names=(f"{names[0]} replay", f"{names[1]} replay"),
        ):
            charts.append(str(replay_chart))
    return dataclasses.replace(outcome, charts=tuple(charts)) if charts else outcome


def _draw(
    current: xr.Dataset,
    reference: xr.Dataset | None,
    findings: list[Finding],
    path: Path,
    band: Any = None,
    names: tuple[str, str] = ("current", "baseline"),
) -> bool:
    try:
        plot_drift(current, reference, findings, path=path, band=band, names=names)
    except Exception as err:  # a broken chart must not hide the numerics verdict
        warnings.warn(
            PrecisionChartWarning(f"no chart for {current.attrs.get('case')}: {type(err).__name__}: {err}"),
            stacklevel=3,
        )
        return False
    return True


def judge_case(
    current: xr.Dataset,
    reference: Reference,
    report_dir: Path,
    charts: str,
    replay: xr.Dataset | None = None,
    **drawing: Any,
) -> CaseVerdict:
    """The verdict of one case of a command (and of its replay against the stored one, when the
    case has one); chart and obtained files are named by the dataset's case label (calibrate
    labels its perturbations); `charts="none"` draws no drift chart. `drawing`: judge_and_chart's
    extra_findings, drawn_against and names (`diff`)."""
    name = safe_filename(str(current.attrs.get("case", reference.case)))
    try:
        return judge_and_chart(
            current,
            reference,
            known=matrix.KNOWN_VIOLATIONS.get(reference.case, ()),
            chart_path=None if charts == "none" else report_dir / "charts" / f"{name}-drift.png",
            obtained_path=report_dir / "obtained" / f"{name}.nc",
            replay=replay,
            **drawing,
        )
    except ValueError as exc:  # a tolerance override that does not make sense
        raise UsageError(f"tolerances: {exc}") from None


def comparison_sensitivity(
    references: Mapping[str, Reference], datasets: Mapping[str, xr.Dataset], baseline_dir: str
) -> dict[str, Any]:
    """What a report states about its comparison: the designed false-alarm rate, the rate
    `calibrate` measured on these baselines (if it was run), the smallest change detected."""
    try:
        measured = read_measured(baseline_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ensembles = {
        case: reference.baseline
        for case, reference in references.items()
        if reference.baseline is not None and "seed" in reference.baseline.dims
    }
    return {
        "design_false_alarm_rate": FALSE_ALARM_RATE,
        "measured": measured,
        "detectable_change": {
            case: detectable_change(ds, ensembles[case]) for case, ds in datasets.items() if case in ensembles
        },
    }


def finish(
    verdicts: Sequence[CaseVerdict],
    datasets: Mapping[str, xr.Dataset],
    report_dir: Path,
    charts: str,
    sensitivity: Mapping[str, Any] | None = None,
    title: str = "",
    context: Sequence[str] = (),
) -> int:
    """Write the report (`title` and `context` lines say what it compares: `diff`), print a line
    per verdict, its decisive finding first; the exit status (1 when any verdict blocks)."""
    reports.write_report(
        verdicts,
        report_dir,
        datasets=datasets,
        charts=charts,
        sensitivity=sensitivity,
        title=title,
        context=context,
    )
    for verdict in verdicts:
        # a finding's message names its case for the plugin's reports; this line already does
        first = (
            f": {verdict.findings[0].message.removeprefix(verdict.case + ': ')}" if verdict.findings else ""
        )
        more = f" (+{len(verdict.findings) - 1} more)" if len(verdict.findings) > 1 else ""
        print(f"{verdict.status.upper():5} {verdict.case}{first}{more}")
        if verdict.known:
            print(f"      known violation, not failing the run: {verdict.known}")
    print(f"report: {report_dir / 'index.html'}")
    return EXIT_REGRESSION if any(judge.blocks(v) for v in verdicts) else EXIT_OK


def report_folder(given: str | None) -> Path:
    """The report folder: `given` (created), or a new timestamped one under reports/."""
    if given is None:
        return reports.new_report_dir(DEFAULT_REPORT_ROOT)
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    return path
