"""The one judging engine: the command line and the pytest plugin both call `judge_case`
(through jobs.checking, which draws the chart of a failing or drifting case).

It compares a run with its reference (a seed-ensemble baseline, calibrated; or one saved run,
with the tolerance table) and the case's replay with its stored replay (deterministic), the
recipes against the reference's (the suite's and the observed: `observed.check_recipes`), checks
the built-in invariants (the GEMMs consumed what their recipe declares: `check_operands`, in the
run and its replay) and the threshold rules, excuses the threshold findings a known
violation names (never another finding, never a baseline regression) and saves the obtained dataset beside the
report when the case fails, so the two entry points can never disagree about a case. It returns
verdicts and draws nothing: charts belong to the reports layer above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import save_dataset
from precision_suite.training.matrix import KnownViolation
from precision_suite.verdicts import observed
from precision_suite.verdicts.ensemble.compare import compare_ensemble
from precision_suite.verdicts.findings import CaseVerdict, Finding, verdict
from precision_suite.verdicts.operand_invariant import check_operands
from precision_suite.verdicts.rule_check import check_rules
from precision_suite.verdicts.rules import parse_rule
from precision_suite.verdicts.stored_replays import compare_replay, mark_replayed
from precision_suite.verdicts.tolerances import compare as compare_single_run


def judge_case(
    current: xr.Dataset,
    reference: xr.Dataset | None,
    *,
    rules: Sequence[Any] = (),
    case_rules: Sequence[Any] = (),
    tolerances: Any = None,
    known: Sequence[KnownViolation] = (),
    obtained_path: str | Path | None = None,
    regen_hint: str = "",
    extra_findings: Sequence[Finding] = (),
    replay: xr.Dataset | None = None,
    stored_replay: xr.Dataset | None = None,
) -> CaseVerdict:
    """The verdict of one run. `rules` apply where they match (project rules); `case_rules` were
    written for this case, so one that matches nothing is an error. `reference` with a `seed`
    dimension is judged by `compare_ensemble`, a single run by `tolerances.compare`;
    `replay`, the case's replay from its stored state, by `compare_replay` against
    `stored_replay`."""
    case = str(current.attrs.get("case", "?"))
    findings = list(extra_findings)
    if reference is not None:  # first: a changed recipe is the headline of what follows from it
        findings += observed.check_recipes(current, reference, regen_hint)
        if "seed" in reference.dims:
            findings += compare_ensemble(current, reference, regen_hint)
        else:
            findings += compare_single_run(current, reference, tolerances)
    if stored_replay is not None:
        if replay is None:
            findings.append(
                Finding.error(case, "replay", "a stored replay exists but the replay was not run")
            )
        else:
            findings += compare_replay(replay, stored_replay, regen_hint)
    findings += observed.check_expected(current)
    findings += check_operands(current, case)
    if replay is not None:
        findings += [
            mark_replayed(f, int(replay.attrs["replayed_from"])) for f in check_operands(replay, case)
        ]
    findings += check_rules(current, rules, case)
    findings += check_rules(current, case_rules, case, strict=True)
    outcome = verdict(case, excuse(findings, known))
    if obtained_path is not None and outcome.status in ("fail", "error"):
        save_dataset(current, obtained_path)
    return outcome


def known_violations(given: KnownViolation | Iterable[KnownViolation] | None) -> tuple[KnownViolation, ...]:
    """`given` (one, several or None) as a tuple, each naming a valid rule; ValueError otherwise,
    saying how to name what is excused (a bare reason excuses nothing: it would hide any finding)."""
    if given is None:
        return ()
    listed = tuple(given) if isinstance(given, Iterable) and not isinstance(given, str) else (given,)
    for item in listed:
        if not isinstance(item, KnownViolation):
            raise ValueError(
                f"known violation {item!r} does not name what it excuses; write "
                "KnownViolation(reason, rule='underflow <= 1e-3 @ tensor=gradient') or "
                "KnownViolation(reason, metric='underflow', where={'tensor': 'gradient'})"
            )
        if item.rule:
            try:
                parse_rule(item.rule)
            except ValueError as err:
                raise ValueError(f"known violation {item.reason!r}: rule {item.rule!r}: {err}") from None
    return listed


def excuse(findings: Iterable[Finding], known: Iterable[KnownViolation]) -> list[Finding]:
    """`findings`, each threshold finding that a known violation names marked with its reason
    (and saying so in its message); every other finding as it was."""
    # rules compare in their printed form: "1e-3" in a known violation names the rule "0.001"
    named = [
        (violation, str(parse_rule(violation.rule)) if violation.rule else "")
        for violation in known_violations(known)
    ]
    marked = []
    for finding in findings:
        violation = next(
            (
                v
                for v, rule in named
                if finding.kind == "threshold"
                and (finding.rule == rule if rule else _names_metric(v, finding))
            ),
            None,
        )
        if violation is not None:
            finding = dataclasses.replace(
                finding,
                known=violation.reason,
                message=f"{finding.message} (known violation: {violation.reason})",
            )
        marked.append(finding)
    return marked


def _names_metric(violation: KnownViolation, finding: Finding) -> bool:
    return finding.metric == violation.metric and all(
        key in finding.where and str(finding.where[key]) == str(value)
        for key, value in violation.where.items()
    )


def blocks(outcome: CaseVerdict) -> bool:
    """Whether a verdict fails the job (a test, or the command line's exit status)."""
    return outcome.status in ("fail", "error")
