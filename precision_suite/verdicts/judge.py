"""The one judging engine: the command line and the pytest plugin both call `judge_case`
(through jobs.judging, which draws the chart of a failing or drifting case).

It compares a run with its reference (a seed-ensemble baseline, calibrated; or one saved run,
with the tolerance table), checks the threshold rules, excuses a listed known violation (its
threshold findings only, never a baseline regression) and saves the obtained dataset beside the
report when the case fails, so the two entry points can never disagree about a case. It returns
verdicts and draws nothing: charts belong to the reports layer above.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import save_dataset
from precision_suite.verdicts import baselines, checks, ensemble
from precision_suite.verdicts.findings import CaseVerdict, Finding, verdict


def judge_case(current: xr.Dataset, reference: xr.Dataset | None, *, rules: Sequence[Any] = (),
               case_rules: Sequence[Any] = (), tolerances: Any = None, known: str = "",
               obtained_path: str | Path | None = None,
               regen_hint: str = "", extra_findings: Sequence[Finding] = ()) -> CaseVerdict:
    """The verdict of one run. `rules` apply where they match (project rules); `case_rules` were
    written for this case, so one that matches nothing is an error. `reference` with a `seed`
    dimension is judged by `ensemble.compare_ensemble`, a single run by `baselines.compare`."""
    case = str(current.attrs.get("case", "?"))
    findings = list(extra_findings)
    if reference is not None:
        if "seed" in reference.dims:
            findings += ensemble.compare_ensemble(current, reference, regen_hint)
        else:
            findings += baselines.compare(current, reference, tolerances)
    findings += checks.check_rules(current, rules, case)
    findings += checks.check_rules(current, case_rules, case, strict=True)
    outcome = verdict(case, findings)
    blocking = [f for f in findings if f.kind in ("regression", "error")]
    if known and outcome.status == "fail" and not blocking:
        outcome = CaseVerdict(case, "known", outcome.findings, outcome.charts, known)
    if obtained_path is not None and outcome.status in ("fail", "error"):
        save_dataset(current, obtained_path)
    return outcome


def blocks(outcome: CaseVerdict) -> bool:
    """Whether a verdict fails the job (a test, or the command line's exit status)."""
    return outcome.status in ("fail", "error")
