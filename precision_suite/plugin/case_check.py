"""One `precision_check` of the pytest plugin: the case's dataset (trained once per session, or the
one handed in), its reference and replay, or under --precision-regen its new baseline, judged and
charted by the one engine the command line uses (jobs.checking.judge_and_chart); the test fails
on a blocking verdict, with one line per finding.

Imported by the fixture on its first call, so that a pytest session that never checks a case
loads none of it (nor xarray, torch or matplotlib)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from precision_suite.plugin import (
    BASELINE_PROPERTY,
    CASE_PROPERTY,
    CHART_PROPERTY,
    STATUS_PROPERTY,
    PrecisionSettings,
    RunCache,
    as_spec,
)

if TYPE_CHECKING:
    import xarray as xr

    from precision_suite.jobs.reference import Reference
    from precision_suite.training.matrix import KnownViolation
    from precision_suite.training.runs import RunSpec
    from precision_suite.verdicts.findings import CaseVerdict, Finding
    from precision_suite.verdicts.project_config import ProjectConfig
    from precision_suite.verdicts.rules import Rule


def check_case(
    node: pytest.Item,
    settings: PrecisionSettings,
    runner: RunCache,
    spec_or_dataset: Any,
    rules: Iterable[Any] | None,
    tolerances: Mapping[str, Any] | None,
    known_violation: KnownViolation | Iterable[KnownViolation] | None = None,
) -> CaseVerdict:
    # lazy: xarray, torch and matplotlib load with the first precision check, not with pytest
    from precision_suite.files import safe_filename
    from precision_suite.jobs.checking import judge_and_chart
    from precision_suite.jobs.reference import Reference
    from precision_suite.verdicts import judge
    from precision_suite.verdicts.baseline_files import default_regen_hint, in_default_matrix

    project, call_rules, known, ds = _prepare(
        node, settings, runner, spec_or_dataset, rules, tolerances, known_violation
    )
    case = str(ds.attrs["case"])
    hint = f"pytest '{node.nodeid}' --precision-regen"
    if in_default_matrix(case):
        hint += f"  (or: {default_regen_hint(case)})"
    spec = None if _is_dataset(spec_or_dataset) else as_spec(spec_or_dataset)
    replay = None
    if settings.regen:
        reference = Reference(case, project.rules, regen_hint=hint)
        errors = _regenerate_unless_refused(
            node, settings, ds, None if spec is None else runner.with_device(spec), project, call_rules, known
        )
    else:
        reference, replay = _reference_and_replay(runner, settings, ds, spec, project, hint)
        errors = reference.errors()
    # charts and obtained files are named per test: two tests of one case never share one
    name = safe_filename(node.nodeid)
    outcome = judge_and_chart(
        ds,
        dataclasses.replace(reference, tolerances=(project.tolerances, tolerances or {})),
        case_rules=call_rules,
        known=known,
        replay=replay,
        extra_findings=errors,
        chart_path=settings.report_dir / "charts" / f"{name}.png",
        obtained_path=settings.report_dir / "obtained" / f"{name}.nc",
    )
    node.user_properties.append((CASE_PROPERTY, case))
    node.user_properties.append((STATUS_PROPERTY, outcome.status))
    for chart in outcome.charts:
        node.user_properties.append((CHART_PROPERTY, chart))
    if judge.blocks(outcome):
        pytest.fail(failure_message(outcome), pytrace=False)
    return outcome


def _prepare(
    node: pytest.Item,
    settings: PrecisionSettings,
    runner: RunCache,
    spec_or_dataset: Any,
    rules: Iterable[Any] | None,
    tolerances: Mapping[str, Any] | None,
    known_violation: KnownViolation | Iterable[KnownViolation] | None,
) -> tuple[ProjectConfig, tuple[Rule, ...], tuple[KnownViolation, ...], xr.Dataset]:
    """(the project's configuration, the call's rules, its known violations, the dataset to check);
    the test fails unchecked, with one line saying what is wrong, when one of them is unusable."""
    from precision_suite.verdicts import judge
    from precision_suite.verdicts.baseline_files import REQUIRED_ATTRS
    from precision_suite.verdicts.rules import parse_rules
    from precision_suite.verdicts.tolerances import resolve_tolerances

    problem = None  # pytest.fail is called outside the except blocks: no chained traceback
    try:
        project = settings.project()
        call_rules = parse_rules(rules)
        known = judge.known_violations(known_violation)
        resolve_tolerances(project.tolerances, tolerances)
    except (ValueError, RuntimeError) as err:
        problem = f"precision check configuration: {err}"
    if problem:
        _fail_unchecked(node, spec_or_dataset, problem)
    ds = spec_or_dataset
    if not _is_dataset(spec_or_dataset):
        try:
            ds = runner(spec_or_dataset)
        except (ValueError, TypeError) as err:  # a bad spec: say what is wrong, no deep traceback
            problem = f"precision run of {spec_or_dataset!r}: {err}"
    if problem:
        _fail_unchecked(node, spec_or_dataset, problem)
    missing = [name for name in REQUIRED_ATTRS if name not in ds.attrs]
    if missing:
        _fail_unchecked(
            node,
            spec_or_dataset,
            f"precision check: the dataset lacks attribute(s) {', '.join(missing)}; "
            "pass a RunSpec or a dataset made by precision_suite.run",
        )
    return project, call_rules, known, ds


def _reference_and_replay(
    runner: RunCache,
    settings: PrecisionSettings,
    ds: xr.Dataset,
    spec: RunSpec | None,
    project: ProjectConfig,
    hint: str,
) -> tuple[Reference, xr.Dataset | None]:
    """The case's Reference (what could not be loaded: its `errors`) and, for a spec whose case
    stores a replay (training.replays.replay_start), its replay from the stored state."""
    from precision_suite.jobs.reference import REQUIRED, SKIPPED, load_reference
    from precision_suite.training.replays import replay_start

    replays = spec is not None and replay_start(spec) is not None
    reference = load_reference(
        str(ds.attrs["case"]),
        ds.attrs["spec"],
        baseline_dir=settings.baseline_dir,
        project=project,
        regen_hint=hint,
        replay=REQUIRED if replays else SKIPPED,
        schema_version=int(ds.attrs["schema_version"]),
        strict=False,
    )
    if reference.stored_replay is None:
        return reference, None
    try:
        return reference, runner.replay(spec, reference.stored_replay)
    except ValueError as err:  # the stored state does not fit the spec's model
        return dataclasses.replace(reference, stored_replay=None, missing={"replay": str(err)}), None


def _regenerate_unless_refused(
    node: pytest.Item,
    settings: PrecisionSettings,
    ds: xr.Dataset,
    spec: RunSpec | None,
    project: ProjectConfig,
    call_rules: tuple[Rule, ...],
    known: tuple[KnownViolation, ...],
) -> list[Finding]:
    """Under --precision-regen: write the case's seed-ensemble baseline, unless the run breaks its
    rules (it is not golden) or no spec says how to train it; the refusal as an error finding."""
    from precision_suite.verdicts import judge
    from precision_suite.verdicts.baseline_files import baseline_path
    from precision_suite.verdicts.findings import Finding, verdict
    from precision_suite.verdicts.rule_check import check_rules

    case = str(ds.attrs["case"])
    before = check_rules(ds, project.rules, case) + check_rules(ds, call_rules, case, strict=True)
    if judge.blocks(verdict(case, judge.excuse(before, known))):
        return [
            Finding.error(
                case,
                "baseline",
                f"baseline {baseline_path(settings.baseline_dir, case)} "
                "not written: a run that breaks its rules is not golden",
            )
        ]
    if spec is None:
        return [
            Finding.error(
                case,
                "baseline",
                "--precision-regen needs a RunSpec (a baseline is a seed "
                "ensemble of the spec), not a dataset",
            )
        ]
    _regenerate(node, spec, settings.baseline_dir)
    return []


def _is_dataset(value: Any) -> bool:
    import xarray as xr  # lazy: only once a precision check runs

    return isinstance(value, xr.Dataset)


def _fail_unchecked(node: pytest.Item, spec_or_dataset: Any, problem: str) -> NoReturn:
    """Fail a check that could not be made; its JUnit XML properties still say so ("error")."""
    from precision_suite.training.runs import case_id  # lazy: torch, only for a failing check

    try:  # the case this check was for, as far as its spec tells
        case = (
            str(spec_or_dataset.attrs.get("case", "?"))
            if hasattr(spec_or_dataset, "attrs")
            else case_id(as_spec(spec_or_dataset))
        )
    except (AttributeError, TypeError, ValueError):
        case = "?"
    node.user_properties.append((CASE_PROPERTY, case))
    node.user_properties.append((STATUS_PROPERTY, "error"))
    pytest.fail(problem, pytrace=False)


def _regenerate(node: pytest.Item, spec: RunSpec, baseline_dir: Path) -> None:
    """Write the seed-ensemble baseline, unless it already holds these numbers (no git churn)."""
    from precision_suite.jobs.regenerate import regenerate  # lazy: torch, only under --precision-regen

    for path, written in regenerate([spec], baseline_dir):
        if written:
            node.user_properties.append((BASELINE_PROPERTY, str(path)))


def failure_message(outcome: CaseVerdict) -> str:
    lines = [
        f"precision check of {outcome.case}: {outcome.status.upper()} ({len(outcome.findings)} finding(s))"
    ]
    lines += [f"  [{f.kind}] {f.message}" for f in outcome.findings]
    lines += [f"  chart: {chart}" for chart in outcome.charts]
    return "\n".join(lines)
