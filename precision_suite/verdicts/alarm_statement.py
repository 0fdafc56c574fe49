"""What `precision-suite calibrate` measured on a set of baselines, and how reports state it.

calibrate writes `<baseline-dir>/calibration.json` (counts, host, date) beside the baselines it
measured; run reports and the pytest header read it, so every verdict comes with its measured
false-alarm rate next to the designed one. A leaf module: no torch, xarray or matplotlib.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CALIBRATION_FILE = "calibration.json"
DESIGN_FALSE_ALARM_RATE = 1e-3  # per case (ensemble.series.trained_threshold turns it into a band)


def measured_path(baseline_dir: str | os.PathLike) -> Path:
    return Path(baseline_dir) / CALIBRATION_FILE


def read_measured(baseline_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The calibration measured on these baselines; None if calibrate never ran. An unreadable
    file is an error naming the file and how to rewrite it."""
    path = measured_path(baseline_dir)
    if not path.is_file():
        return None
    try:
        measured = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path} is unreadable ({exc}); rewrite it with `precision-suite calibrate`"
        ) from None
    if not isinstance(measured, dict) or not {"runs", "runs_with_alarms"} <= set(measured):
        raise ValueError(
            f"{path} lacks the fields runs and runs_with_alarms; rewrite it with `precision-suite calibrate`"
        )
    return measured


def statement_lines(measured: Mapping[str, Any] | None, rate: float = DESIGN_FALSE_ALARM_RATE) -> list[str]:
    """The designed and the measured false-alarm rate, as sentences."""
    lines = [f"Comparison against seed ensembles: designed false-alarm rate <= {rate:g} per case."]
    if measured:
        host = measured.get("fingerprint") or {}
        lines.append(
            f"Measured by `precision-suite calibrate` on {measured.get('created', '?')} "
            f"({host.get('cpu_capability', '?')}, {host.get('platform', '?')}): "
            f"{measured['runs_with_alarms']} of {measured['runs']} perturbed runs with a "
            f"false alarm ({', '.join(measured.get('perturbations', []))})."
        )
    else:
        lines.append(
            "Not measured on these baselines yet: run `precision-suite calibrate` once on your CI runners."
        )
    return lines
