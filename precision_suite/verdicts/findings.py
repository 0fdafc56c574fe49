"""The verdict types every check reports (a leaf module: imports nothing of the package).

A `Finding` is one thing a check found; a `CaseVerdict` is a case's outcome. The rules (rules.py),
the operand invariant (operand_invariant.py), the baseline comparisons (tolerances.py, ensemble/,
stored_replays.py) and the judging engine (judge.py) all speak these types.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FINDING_KINDS = ("regression", "drift", "threshold", "error")
COORD_KEYS = ("module", "layer", "tensor", "layout")
TIME_DIMS = ("step", "train_step")
# Which cases a report draws charts of: failing, drifting and erroring ones, every one, or none.
# Here (numpy only) so that the command line lists them without importing matplotlib.
CHART_CHOICES = ("failing", "all", "none")


# --------------------------------------------------------------------------- verdict types


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing a check found about a case.

    kind: "regression" | "drift" (baseline comparison), "threshold" (a rule), "error" (the check
    could not be made). where: the coordinates, e.g. {"layer": 3, "tensor": "gradient",
    "layout": "1x128", "step": 30}. value: the current number; reference: the baseline value or the
    rule's bound; tolerance: the accepted deviation in the metric's comparison space (NaN for
    rules and errors). rule: the text of the rule that found it (threshold findings). known: the
    reason of the known violation that excuses it (a threshold finding that then fails nothing).
    """

    case: str
    kind: str
    metric: str
    where: Mapping[str, Any]
    value: float
    reference: float
    tolerance: float
    message: str
    score: float = math.nan  # ensemble comparison: spreads from the seeds' mean (bad direction +)
    rule: str = ""
    known: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"Finding.kind {self.kind!r} is unknown; use one of {', '.join(FINDING_KINDS)}")

    @classmethod
    def error(cls, case: str, metric: str, message: str) -> Finding:
        """A check of `metric` that could not be made (no numbers); the message names the case."""
        return cls(
            case=case,
            kind="error",
            metric=metric,
            where={},
            value=math.nan,
            reference=math.nan,
            tolerance=math.nan,
            message=f"{case}: {message}",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; non-finite numbers become the strings "nan", "inf", "-inf"."""
        return {
            "case": self.case,
            "kind": self.kind,
            "metric": self.metric,
            "where": dict(self.where),
            "value": _json_number(self.value),
            "reference": _json_number(self.reference),
            "tolerance": _json_number(self.tolerance),
            "score": _json_number(self.score),
            "message": self.message,
            "rule": self.rule,
            "known": self.known,
        }


@dataclass(frozen=True, slots=True)
class CaseVerdict:
    """The outcome of one case. status: "pass" | "drift" | "known" (its only failing findings are
    excused by known violations) | "fail" | "error"; known: their reasons, for a "known" case."""

    case: str
    status: str
    findings: tuple[Finding, ...] = ()
    charts: tuple[str, ...] = ()
    known: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "status": self.status,
            "known": self.known,
            "findings": [f.to_dict() for f in self.findings],
            "charts": list(self.charts),
        }


def verdict(case: str, findings: Iterable[Finding], charts: Iterable[str] = ()) -> CaseVerdict:
    """Status from the findings: any regression or threshold a known violation does not excuse ->
    fail; else any error -> error; else any excused threshold -> known; else any drift -> drift;
    else pass. A definite failure outranks "could not check"."""
    findings = tuple(findings)
    kinds = {f.kind for f in findings if not f.known}
    reasons = dict.fromkeys(f.known for f in findings if f.known)  # each reason once, in order
    if kinds & {"regression", "threshold"}:
        status = "fail"
    elif "error" in kinds:
        status = "error"
    elif reasons:
        status = "known"
    elif "drift" in kinds:
        status = "drift"
    else:
        status = "pass"
    # the finding that decided first: what the command line prints, the report and summary.md lead with
    ordered = tuple(sorted(findings, key=lambda f: severity(f.kind, f.score, f.known, f.tolerance)))
    return CaseVerdict(
        case=case,
        status=status,
        findings=ordered,
        charts=tuple(str(c) for c in charts),
        known="; ".join(reasons) if status == "known" else "",
    )


def severity(kind: str, score: Any, known: str = "", tolerance: Any = math.nan) -> tuple[bool, float]:
    """Sort key of a finding, worst first: the kinds that fail a case (regression, threshold,
    error; not one a known violation excuses) before the rest, then how far beyond its tolerance
    it is (|score| / tolerance, both in the metric's comparison space; |score| where no tolerance
    is known). A finding without a finite score (a rule's, an invariant's, a changed recipe, an
    error) has no tolerance to be within: it ranks first."""
    size = _number(score)
    size = abs(size) if math.isfinite(size) else math.inf
    if math.isfinite(size) and math.isfinite(_number(tolerance)) and _number(tolerance) > 0:
        size /= _number(tolerance)
    return (bool(known) or kind not in ("regression", "error", "threshold"), -size)


def _number(value: Any) -> float:
    """A finding's number (a float, or a JSON summary's "nan"/"inf" string) as a float."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def distinct(*values: float, digits: int = 4) -> list[str]:
    """`values` with `digits` significant digits, or as many more as it takes (up to 12) for
    values that differ to read differently: never "0.9996 vs baseline 0.9996"."""
    different = len({repr(float(v)) for v in values})  # repr: the shortest text of each float
    for places in range(digits, 13):
        shown = [f"{float(v):.{places}g}" for v in values]
        if len(set(shown)) == different:
            return shown
    return [repr(float(v)) for v in values]


def format_where(where: Mapping[str, Any]) -> str:
    """'layer 3, tensor gradient, layout 1x128, step 30' (layer first, time last)."""
    order = [k for k in COORD_KEYS if k in where]
    order += [k for k in where if k not in order and k not in TIME_DIMS]
    order += [k for k in TIME_DIMS if k in where]
    return ", ".join(f"{k} {where[k]}" for k in order) or "the whole run"


def _json_number(value: float) -> float | str:
    value = float(value)
    return value if math.isfinite(value) else str(value)


def to_python(value: Any) -> Any:
    """A numpy scalar as the plain Python value (for `where` dicts and JSON)."""
    return value.item() if isinstance(value, np.generic) else value
