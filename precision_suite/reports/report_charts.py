"""The charts of a report folder: each failing (or, with charts="all", every) case's figures A and B
and observed quantization error, the overview (figure A across variants, figure B once, the
accumulation law in K), and the charts verdicts name (drift charts) copied in, so that the folder
stands alone. Paths returned are relative to the report folder."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import xarray as xr

from precision_suite.files import atomic_file, safe_filename
from precision_suite.numerics.accumulation_error import error_law
from precision_suite.reports.canvas import save_figure
from precision_suite.reports.figures import (
    plot_accumulation_law,
    plot_attention_norm,
    plot_observed_quant_error,
    plot_quant_error,
)
from precision_suite.verdicts.rule_check import run_spec


def adopt_charts(out: Path, case: str, paths: Sequence) -> tuple[list[str], list[str]]:
    adopted, missing = [], []
    for raw in paths or ():
        source = Path(raw)
        if not source.is_file():
            missing.append(str(raw))
            continue
        try:
            adopted.append(source.resolve().relative_to(out.resolve()).as_posix())
            continue
        except ValueError:
            pass
        target = out / "charts" / f"{safe_filename(case)}-{source.name}"
        _copy(source, target)
        adopted.append(target.relative_to(out).as_posix())
    return adopted, missing


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(target) as handle, source.open("rb") as original:
        shutil.copyfileobj(original, handle)


def draw_case_charts(out: Path, case: str, ds: xr.Dataset) -> list[str]:
    drawn = []
    if "attention_norm" in ds.data_vars:
        drawn.append(
            _save(
                out,
                f"{safe_filename(case)}-attention-norm.png",
                plot_attention_norm({str(ds.attrs.get("case", case)): ds}),
            )
        )
    if "underflow" in ds.data_vars and "distortion" in ds.data_vars:
        drawn.append(_save(out, _quant_error_chart(case).removeprefix("charts/"), plot_quant_error(ds)))
    if "observed_underflow" in ds.data_vars:
        drawn.append(
            _save(out, f"{safe_filename(case)}-observed-quant-error.png", plot_observed_quant_error(ds))
        )
    return drawn


def draw_overviews(out: Path, datasets: Mapping[str, xr.Dataset], drawn: set[str]) -> list[str]:
    """The papers' two figures: figure A per (model, recipe), one line per attention variant, and
    figure B once, of the run that best shows it (`_figure_b_case`: a copy of its case chart where
    `drawn` holds it, the same figure); where runs measured their GEMMs' accumulation error, its law
    in K with their GEMMs on it."""
    groups: dict[tuple[str, str], dict[str, xr.Dataset]] = {}
    for case, ds in datasets.items():
        if "attention_norm" not in ds.data_vars:
            continue
        spec = run_spec(ds)
        key = (str(spec.get("model", "?")), str(spec.get("recipe", "?")))
        groups.setdefault(key, {})[str(spec.get("attention", case))] = ds
    overview = [
        _save(
            out,
            f"overview-{safe_filename(model)}-{safe_filename(recipe)}-attention-norm.png",
            plot_attention_norm(group),
        )
        for (model, recipe), group in sorted(groups.items())
        if len(group) > 1
    ]
    case = _figure_b_case(datasets)
    if case is not None:
        name, drawn_for_case = f"overview-{safe_filename(case)}-quant-error.png", _quant_error_chart(case)
        if drawn_for_case in drawn:
            _copy(out / drawn_for_case, out / "charts" / name)
            overview.append(f"charts/{name}")
        else:
            overview.append(_save(out, name, plot_quant_error(datasets[case])))
    accumulating = {case: ds for case, ds in datasets.items() if "accumulation_sums" in ds.data_vars}
    if accumulating:  # the law measured afresh (0.3 s, eager), the runs' GEMMs drawn on it
        overview.append(
            _save(out, "overview-accumulation-law.png", plot_accumulation_law(error_law(), accumulating))
        )
    return overview


def _quant_error_chart(case: str) -> str:
    return f"charts/{safe_filename(case)}-quant-error.png"


def _figure_b_case(datasets: Mapping[str, xr.Dataset]) -> str | None:
    """The case figure B is drawn of: the first (in case order) trained in low precision, as in
    the paper, else the first with quantization metrics at all; None when no run has them."""
    measured = [
        case
        for case in sorted(datasets)
        if {"underflow", "distortion", "tokens"} <= set(datasets[case].variables)
        and np.isfinite(datasets[case]["underflow"].values).any()
    ]
    low_precision = [
        case for case in measured if run_spec(datasets[case]).get("recipe") not in (None, "fp32")
    ]
    return (low_precision or measured or [None])[0]


def _save(out: Path, name: str, fig) -> str:
    save_figure(fig, out / "charts" / name)
    return f"charts/{name}"
