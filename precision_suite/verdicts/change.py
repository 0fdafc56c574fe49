"""The verdict on a change: HEAD's run judged by the same engine and noise as `run` judges any run,
with what BASE's run already shows set aside (`diff`, `bisect`).

Both runs are trained on one host with the same spec and seed, so they are bitwise identical
unless the code changed the numbers. What judges a change, per case (`Gate`):

- the case's baseline, when it has one: HEAD and BASE are each judged against it as `run` judges
  (seed ensemble, rounding twins at the first point, the stored replay, rules, invariants, the
  observed recipe), and a finding of HEAD's that BASE's run has too (the same check of the same
  series) is set aside as BASE's: a stale baseline does not fail a change that did not cause it;
- else (a new case, a user's model without baselines) BASE's own rounding twins, measured now:
  HEAD's first point against BASE's within the twins' rounding (`compare_points`), the clean
  replay (both codes replaying from BASE's state at the first step that differs) within the same
  replay's twins, and the observed recipe against BASE's;
- `strict`: any change of the numbers fails, whatever its size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import xarray as xr

from precision_suite.verdicts.findings import TIME_DIMS, Finding
from precision_suite.verdicts.stored_replays import REPLAY_WHERE, compare_points

ALSO_IN_BASE = "BASE's run shows it too"


def first_point(ds: xr.Dataset) -> xr.Dataset:
    """The run's first sampled step and first training step: where two runs of one seed start
    from the same numbers."""
    return ds.isel({dim: [0] for dim in TIME_DIMS if dim in ds.dims})


def first_point_findings(head: xr.Dataset, base: xr.Dataset, tolerance: Mapping[str, float]) -> list[Finding]:
    """HEAD's first point against BASE's, within the rounding twins' `tolerance`."""
    return compare_points(
        first_point(head),
        first_point(base),
        tolerance,
        "first point at step",
        "BASE's run",
        reference_name="BASE",
    )


def set_aside_base(head: Iterable[Finding], base: Iterable[Finding]) -> list[Finding]:
    """HEAD's findings, those that BASE's run has too (same kind, metric and series) marked as
    BASE's (`known`), so that they show but fail nothing."""
    shown_by_base = {_series_key(f) for f in base if not f.known}
    return [
        dataclasses.replace(f, known=ALSO_IN_BASE, message=f"{f.message} ({ALSO_IN_BASE})")
        if not f.known and _series_key(f) in shown_by_base
        else f
        for f in head
    ]


def strict_finding(case: str, first_change: str) -> Finding:
    """The strict gate's finding: the numbers changed at all."""
    return Finding(
        case,
        "regression",
        "numerics",
        {},
        float("nan"),
        float("nan"),
        0.0,
        f"{case}: numerics changed and the strict gate fails any change: {first_change}",
    )


def _series_key(finding: Finding) -> tuple[Any, ...]:
    where = {k: v for k, v in finding.where.items() if k not in (*TIME_DIMS, REPLAY_WHERE)}
    return finding.kind, finding.metric, finding.rule, tuple(sorted((k, str(v)) for k, v in where.items()))


def gate_text(strict: bool, baselines: Sequence[str], twins: Sequence[str]) -> str:
    """What judged the cases, for the output: the mode and, per noise model, how many cases."""
    if strict:
        return "strict: any change of the numbers fails"
    parts = []
    if baselines:
        parts.append(
            f"{len(baselines)} case(s) against their baseline's noise (seed ensemble, rounding "
            "twins, stored replay), what BASE's run shows set aside"
        )
    if twins:
        parts.append(
            f"{len(twins)} case(s) without a baseline against BASE's rounding twins measured now "
            "(first point, clean replay)"
        )
    return "beyond noise: " + ("; ".join(parts) or "no case changed")
