"""Judging runs for a command or a test: the project's rules, the references, the one judging
engine (verdicts.judge) with the drift chart of a failing or drifting case drawn here, above it,
and the report that lists the verdicts."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import safe_filename
from precision_suite.jobs.usage import DEFAULT_REPORT_ROOT, DEFAULT_RULES_FILE, EXIT_OK, EXIT_REGRESSION, UsageError
from precision_suite.reports import reports
from precision_suite.reports.charts import plot_drift
from precision_suite.training import matrix
from precision_suite.training.replays import replay_start
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts import baselines, calibration, checks, ensemble, judge, replays
from precision_suite.verdicts.findings import CaseVerdict, Finding


class PrecisionChartWarning(UserWarning):
    """A chart of a failing or drifting case could not be drawn (the verdict still stands)."""


def judge_and_chart(current: xr.Dataset, reference: xr.Dataset | None, *,
                    chart_path: str | Path | None = None, **judging: Any) -> CaseVerdict:
    """`verdicts.judge.judge_case(current, reference, **judging)`, and a drift chart at
    `chart_path` of any case with a finding other than an error (None: no chart); findings of
    its replay get a chart of the replay against the stored one beside it (`-replay` added)."""
    outcome = judge.judge_case(current, reference, **judging)
    if chart_path is None:
        return outcome
    chart_path, charts = Path(chart_path), []
    drawn = [f for f in outcome.findings if f.kind != "error"]
    of_run = [f for f in drawn if not replays.is_replay_finding(f)]
    of_replay = [f for f in drawn if replays.is_replay_finding(f)]
    if of_run and _draw(current, reference, of_run, chart_path):
        charts.append(str(chart_path))
    replay_chart = chart_path.with_name(f"{chart_path.stem}-replay{chart_path.suffix}")
    if of_replay:
        replay = judging["replay"]
        label = f"{current.attrs.get('case', '')} replay from step {replay.attrs.get('replayed_from')}"
        # no band: the replay's tolerance is a rounding allowance, drawn in the findings' text
        if _draw(replay.assign_attrs(case=label), judging["stored_replay"], of_replay, replay_chart,
                 band=lambda metric, reference: None):
            charts.append(str(replay_chart))
    return dataclasses.replace(outcome, charts=tuple(charts)) if charts else outcome


def _draw(current: xr.Dataset, reference: xr.Dataset | None, findings: list[Finding], path: Path,
          band: Any = None) -> bool:
    try:
        plot_drift(current, reference, findings, path=path, band=band)
    except Exception as err:  # a broken chart must not hide the numerics verdict
        warnings.warn(PrecisionChartWarning(f"no chart for {current.attrs.get('case')}: "
                                            f"{type(err).__name__}: {err}"), stacklevel=3)
        return False
    return True


def judge_case(case: str, current: xr.Dataset, reference: xr.Dataset | None, rules: Sequence[Any],
               tolerances: Mapping[str, Any] | Sequence[Mapping[str, Any]], report_dir: Path,
               charts: str, regen_hint: str = "", replay: xr.Dataset | None = None,
               stored_replay: xr.Dataset | None = None) -> CaseVerdict:
    """The verdict of one case of a command (and of its replay against the stored one, when the
    case has one); chart and obtained files are named by the dataset's case label (calibrate
    labels its perturbations); `charts="none"` draws no drift chart."""
    name = safe_filename(str(current.attrs.get("case", case)))
    try:
        return judge_and_chart(current, reference, rules=rules, tolerances=tolerances,
                               known=matrix.KNOWN_VIOLATIONS.get(case, ()),
                               chart_path=None if charts == "none" else report_dir / "charts" / f"{name}-drift.png",
                               obtained_path=report_dir / "obtained" / f"{name}.nc",
                               regen_hint=regen_hint, replay=replay, stored_replay=stored_replay)
    except ValueError as exc:  # a tolerance override that does not make sense
        raise UsageError(f"tolerances: {exc}") from None


def load_rules(pyproject: str) -> tuple[tuple, dict]:
    """Threshold rules and tolerance overrides from [tool.precision_suite]; none if no file."""
    if not Path(pyproject).is_file() and pyproject != DEFAULT_RULES_FILE:
        raise UsageError(f"--rules {pyproject} does not exist; give the pyproject.toml that "
                         "holds [tool.precision_suite]")
    try:
        config = checks.load_project_config(pyproject)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"{exc}; fix the rule (grammar in docs/baselines.md)") from None
    return config.rules, dict(config.tolerances)


def load_reference(baseline_dir: str, case: str, spec_json: str, regen_hint: str) -> xr.Dataset:
    """The seed-ensemble baseline of `case`; UsageError saying how to create it."""
    try:
        return baselines.load_ensemble(baselines.baseline_path(baseline_dir, case),
                                       expected_spec=spec_json, regen_hint=regen_hint)
    except baselines.BaselineError as exc:
        raise UsageError(str(exc)) from None


def load_stored_replays(specs: Sequence[RunSpec], baseline_dir: str, regen_hint: Callable[[str], str]
                        ) -> dict[str, xr.Dataset]:
    """The stored replay of every spec that has one (a built-in model, run long enough:
    training.replays.replay_start), by case id; UsageError saying how to create a missing one."""
    stored = {}
    for spec in specs:
        if replay_start(spec) is None:
            continue
        case = case_id(spec)
        try:
            stored[case] = replays.load_replay(baseline_dir, case, expected_spec=spec.to_json(),
                                               regen_hint=regen_hint(case))
        except baselines.BaselineError as exc:
            raise UsageError(str(exc)) from None
    return stored


def sensitivity(references: Mapping[str, xr.Dataset], datasets: Mapping[str, xr.Dataset],
                baseline_dir: str) -> dict[str, Any]:
    """What a report states about its comparison: the designed false-alarm rate, the rate
    `calibrate` measured on these baselines (if it was run), the smallest change detected."""
    try:
        measured = calibration.read_measured(baseline_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return {"design_false_alarm_rate": ensemble.FALSE_ALARM_RATE, "measured": measured,
            "detectable_change": {case: ensemble.detectable_change(ds, references[case])
                                  for case, ds in datasets.items()
                                  if case in references and "seed" in references[case].dims}}


def finish(verdicts: Sequence[CaseVerdict], datasets: Mapping[str, xr.Dataset], report_dir: Path,
           charts: str, sensitivity: Mapping[str, Any] | None = None) -> int:
    """Write the report, print a line per verdict; the exit status (1 when any verdict blocks)."""
    reports.write_report(verdicts, report_dir, datasets=datasets, charts=charts, sensitivity=sensitivity)
    for verdict in verdicts:
        # a finding's message names its case for the plugin's reports; this line already does
        first = f": {verdict.findings[0].message.removeprefix(verdict.case + ': ')}" if verdict.findings else ""
        more = f" (+{len(verdict.findings) - 1} more)" if len(verdict.findings) > 1 else ""
        print(f"{verdict.status.upper():5} {verdict.case}{first}{more}")
        if verdict.known:
            print(f"      known violation, not failing the run: {verdict.known}")
    print(f"report: {report_dir / 'index.html'}")
    return EXIT_REGRESSION if any(judge.blocks(v) for v in verdicts) else EXIT_OK


def report_dir(given: str | None) -> Path:
    """The report folder: `given` (created), or a new timestamped one under reports/."""
    if given is None:
        return reports.new_report_dir(DEFAULT_REPORT_ROOT)
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    return path
