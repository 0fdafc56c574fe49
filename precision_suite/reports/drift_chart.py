"""The drift chart of a failing or drifting case: the current run against its baseline (or its
thresholds) for every metric with findings, worst panels first, a first-point finding zoomed
beside its panel."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from precision_suite.numerics.metric_table import METRICS
from precision_suite.reports.canvas import X_LABELS, axis_label, new_figure, palette, save_figure
from precision_suite.verdicts.ensemble.compare import ensemble_band
from precision_suite.verdicts.findings import severity
from precision_suite.verdicts.rule_check import run_spec
from precision_suite.verdicts.tolerances import tolerance_band

MAX_DRIFT_LINES = 6  # layers drawn per drift panel; more would hide each other
# drift panels per chart, worst first: a case with hundreds of findings would get a chart of dozens
# of panels that no one scrolls through; the rest are named on the chart and listed in the report
MAX_DRIFT_PANELS = 6
# A count panel (fractions of counted elements, NaN/Inf counts) goes logarithmic when its values
# span this ratio (a decade) or, for fractions, stay below TINY_FRACTION: on a linear axis from
# zero, 2 elements of 458,752 against none cannot be seen.
COUNT_DECADE = 10.0
TINY_FRACTION = 1e-3
ZOOM_WIDTH = 0.35  # the first-point zoom panel's width, relative to its drift panel
# (metric, reference values over time) -> (lower, upper) edges of the accepted band, or None
ToleranceBand = Callable[[str, np.ndarray], "tuple[np.ndarray, np.ndarray] | None"]


@dataclass(frozen=True)
class _DriftPanel:
    """One drift panel: a metric at one fixed selection of its non-layer, non-step coordinates."""

    metric: str
    fixed: tuple[tuple[str, object], ...]
    findings: tuple

    @property
    def title(self) -> str:
        return " ".join([self.metric] + [str(value) for _, value in self.fixed])


def plot_drift(
    current: xr.Dataset,
    baseline: xr.Dataset | None,
    findings: Sequence,
    path: str | os.PathLike | None = None,
    band: ToleranceBand | None = None,
    names: tuple[str, str] = ("current", "baseline"),
) -> Figure:
    """Drift chart of one case: current run against its baseline for every metric with findings;
    `names` call the two in legends and title (`diff`: HEAD and BASE with their commits).

    One panel per failing metric selection (e.g. underflow of gradient 128x1); in it, one colour
    per offending layer: current solid, baseline dashed, the accepted tolerance band shaded,
    threshold bounds dotted, and each offending (layer, step) marked with a red cross.
    `baseline` may be None for threshold-only findings. `band(metric, reference)` returns the
    band edges over the steps (None: no band); the default is
    `precision_suite.verdicts.tolerances.tolerance_band` with the default tolerances.
    """
    case = current.attrs.get("case", "run")
    every_panel = _drift_panels(current, findings)
    panels, left_out = every_panel[:MAX_DRIFT_PANELS], every_panel[MAX_DRIFT_PANELS:]
    if band is None:
        band = tolerance_band
    first_points = [_first_point_findings(panel, current) for panel in panels]
    # a first-point finding gets a zoom panel beside its drift panel: at the scale of a whole
    # run a change of a few elements at step 0 is a hair's breadth
    width_ratios = (1.0, ZOOM_WIDTH) if any(first_points) else (1.0,)
    fig, axes = new_figure(
        len(panels) or 1, len(width_ratios), panel_size=(9.0, 3.6), width_ratios=width_ratios
    )
    if not panels:
        ax = axes[0][0]
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no per-metric findings to chart", ha="center", va="center", transform=ax.transAxes)
    for row, panel, first in zip(axes, panels, first_points):
        series = _draw_drift_panel(row[0], panel, current, baseline, band, names)
        if first:
            _draw_first_point_zoom(row[1], panel, first, series, current, baseline, names)
        elif len(row) > 1:
            row[1].set_visible(False)
    if left_out:
        titles = ", ".join(panel.title for panel in left_out[:4]) + (", ..." if len(left_out) > 4 else "")
        fig.text(
            0.01,
            0.0,
            f"{len(left_out)} more panel(s) with findings not drawn ({titles}); "
            "every finding is in the report's table",
            fontsize=8,
            ha="left",
            va="bottom",
            color="tab:red",
        )
    kind = f"against {names[1]}" if baseline is not None else "against its thresholds"
    fig.suptitle(
        f"{case}: {names[0]} {kind}"
        + (f" (the {len(panels)} worst of {len(every_panel)} panels)" if left_out else "")
    )
    if path is not None:
        save_figure(fig, path)
    return fig


def _drift_panels(current: xr.Dataset, findings: Sequence) -> list[_DriftPanel]:
    grouped: dict[tuple, list] = {}
    for finding in findings:
        # the observed recipe's findings (a format, a GEMM count) are words, not a series to draw
        if (
            finding.kind == "error"
            or finding.metric not in current.data_vars
            or finding.metric not in METRICS
        ):
            continue
        dims = current[finding.metric].dims
        where = dict(finding.where or {})
        fixed = tuple(
            (dim, where[dim]) for dim in dims if dim in where and dim not in ("layer", "step", "train_step")
        )
        grouped.setdefault((finding.metric, fixed), []).append(finding)
    panels = [_DriftPanel(metric, fixed, tuple(group)) for (metric, fixed), group in grouped.items()]
    # worst first (sorted is stable: equally bad panels keep the findings' order)
    return sorted(
        panels, key=lambda panel: min(severity(f.kind, f.score, f.known, f.tolerance) for f in panel.findings)
    )


def _draw_drift_panel(
    ax: Axes,
    panel: _DriftPanel,
    current: xr.Dataset,
    baseline: xr.Dataset | None,
    band: ToleranceBand,
    names: tuple[str, str],
) -> list[tuple[str, dict]]:
    """Draw one drift panel; returns the (label, selection) of each series drawn."""
    var = current[panel.metric].sel(dict(panel.fixed))
    x_dim = next((d for d in ("step", "train_step") if d in var.dims), None)
    reference = None
    if baseline is not None and panel.metric in baseline.data_vars:
        reference = baseline[panel.metric].sel(dict(panel.fixed))
    # the band is the comparison's; threshold findings carry a bound, drawn as a line instead
    compared = any(f.kind in ("regression", "drift") for f in panel.findings)

    if "layer" in var.dims:
        offending = sorted({int(f.where["layer"]) for f in panel.findings if "layer" in (f.where or {})})
        layers = offending or [int(v) for v in var["layer"].values]
        series = [(f"layer {layer}", {"layer": layer}) for layer in layers[:MAX_DRIFT_LINES]]
        if len(layers) > MAX_DRIFT_LINES:
            ax.text(
                0.99,
                0.01,
                f"+{len(layers) - MAX_DRIFT_LINES} more offending layers",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=8,
            )
    else:
        series = [(panel.metric, {})]

    xs = var[x_dim].values if x_dim else np.zeros(1)
    band_labelled = False  # one legend entry for every series' band
    for colour, (label, where) in zip(palette(len(series)), series):
        ax.plot(
            xs, np.atleast_1d(var.sel(where).values), color=colour, linewidth=2.2, label=f"{label} {names[0]}"
        )
        if reference is not None and "seed" in reference.dims:
            # a seed ensemble: every seed faint, the accepted band shaded, the current run bold
            ref_x = reference[x_dim].values if x_dim else xs
            for i, seed in enumerate(reference["seed"].values):
                ax.plot(
                    ref_x,
                    np.atleast_1d(reference.sel(where).sel(seed=seed).values.astype(float)),
                    color=colour,
                    linewidth=0.8,
                    alpha=0.35,
                    label=f"{label} {names[1]} seeds" if i == 0 else None,
                )
            edges = (
                ensemble_band(panel.metric, current, baseline, {**dict(panel.fixed), **where})
                if compared
                else None
            )
        elif reference is not None:
            ref = np.atleast_1d(reference.sel(where).values.astype(float))
            ref_x = reference[x_dim].values if x_dim else xs
            ax.plot(ref_x, ref, color=colour, linestyle="--", label=f"{label} {names[1]}")
            edges = band(panel.metric, ref) if compared else None
        else:
            edges = None
        if reference is not None:
            if edges is not None:
                # a band never suggests an impossible value (a negative fraction, a cosine > 1)
                low, high = _valid_range(panel.metric)
                ax.fill_between(
                    ref_x,
                    np.clip(edges[0], low, high),
                    np.clip(edges[1], low, high),
                    color=colour,
                    alpha=0.15,
                    linewidth=0,
                    label=None if band_labelled else "shaded: accepted band",
                )
                band_labelled = True

    for bound in sorted(
        {float(f.reference) for f in panel.findings if f.kind == "threshold" and f.reference is not None}
    ):
        ax.axhline(bound, color="tab:red", linestyle=":", linewidth=1.2, label=f"bound {bound:g}")
    marks_x, marks_y = [], []
    for finding in panel.findings:
        where = finding.where or {}
        marks_x.append(where.get(x_dim, xs[-1]) if x_dim else xs[-1])
        marks_y.append(float(finding.value))
    ax.scatter(marks_x, marks_y, marker="X", s=60, color="tab:red", zorder=5, label="offending point")

    ax.set_title(panel.title)
    ax.set_xlabel(X_LABELS.get(x_dim, ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: a replay spans two or three
    ax.set_ylabel(axis_label(panel.metric))
    if panel.metric == "attention_norm":
        ax.set_yscale("log")
    elif _is_count(panel.metric):
        _set_count_scale(ax, panel.metric, _numel(current, {**dict(panel.fixed), **series[0][1]}))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return series


def _is_count(metric: str) -> bool:
    """Fractions of counted elements (underflow, zeros_after, overflow) and counts (nonfinite)."""
    return metric in METRICS and METRICS[metric].is_count


def _is_fraction(metric: str) -> bool:
    return METRICS[metric].valid_range == (0.0, 1.0)


def _numel(ds: xr.Dataset, where: Mapping[str, object]) -> int | None:
    """Elements behind one cell, `numel(layer, tensor)` at `where`; None where the dataset has none."""
    if "numel" not in ds.data_vars:
        return None
    numel = ds["numel"]
    if "seed" in numel.dims:  # a seed ensemble: every seed counts the same elements
        numel = numel.isel(seed=0, drop=True)
    if any(dim not in where for dim in numel.dims):  # e.g. a per-module panel, numel per layer
        return None
    count = int(numel.sel({dim: where[dim] for dim in numel.dims}))
    return count if count > 0 else None


def _set_count_scale(ax: Axes, metric: str, numel: int | None) -> None:
    """A symlog y axis for a count panel whose values span decades or, as fractions, are tiny.

    Its linear part ends at one element (1/numel for a fraction, 1 for a count), so zero and a
    single element are both visible instead of zero falling off a log axis.
    """
    values = np.concatenate([np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()])
    values = values[np.isfinite(values) & (values >= 0)]
    positive = values[values > 0]
    if positive.size == 0:
        return
    fraction = _is_fraction(metric)
    one_element = (1.0 / numel if numel else positive.min()) if fraction else 1.0
    spans_decades = positive.max() / max(values.min(), one_element) >= COUNT_DECADE
    if spans_decades or (fraction and positive.max() < TINY_FRACTION):
        ax.set_yscale("symlog", linthresh=one_element, linscale=0.5)
        ax.set_ylim(bottom=0.0)
        ax.text(
            0.99,
            0.02,
            "log axis, linear below one element",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=7,
            color="0.4",
        )


def _first_point_findings(panel: _DriftPanel, current: xr.Dataset) -> list:
    """The panel's findings at the run's first sampled point (step 0)."""
    var = current[panel.metric]
    x_dim = next((d for d in ("step", "train_step") if d in var.dims), None)
    if x_dim is None:
        return []
    first = var[x_dim].values[0]
    return [f for f in panel.findings if (f.where or {}).get(x_dim) == first]


def _draw_first_point_zoom(
    ax: Axes,
    panel: _DriftPanel,
    findings: Sequence,
    series: Sequence[tuple[str, dict]],
    current: xr.Dataset,
    baseline: xr.Dataset | None,
    names: tuple[str, str],
) -> None:
    """The first point of each offending series at a scale where its change shows: the current
    value against the baseline's (the member seed's when the run is one, the other seeds faint),
    counts annotated as "k of n elements"."""
    var = current[panel.metric].sel(dict(panel.fixed))
    x_dim = next(d for d in ("step", "train_step") if d in var.dims)
    offending = {int(f.where["layer"]) for f in findings if "layer" in f.where}
    drawn = [(label, where) for label, where in series if not offending or where.get("layer") in offending]
    reference = None
    if baseline is not None and panel.metric in baseline.data_vars:
        reference = baseline[panel.metric].sel(dict(panel.fixed)).isel({x_dim: 0})
    seed = run_spec(current).get("seed")
    member = (
        seed
        if reference is not None and "seed" in reference.dims and seed in reference["seed"].values
        else None
    )

    def point(value: float, where: Mapping[str, object]) -> tuple[float, str]:
        """(y, label) of one value: in elements for a count whose numel is known."""
        numel = _numel(current, {**dict(panel.fixed), **where}) if _is_count(panel.metric) else None
        if numel is None:
            return value, f"{value:.4g}"
        count = value * numel if _is_fraction(panel.metric) else value
        return count, f"{count:,.0f} of {numel:,} elements"

    colours = dict(zip((label for label, _ in series), palette(len(series))))  # the drift panel's
    for x, (label, where) in enumerate(drawn):
        colour = colours[label]
        if reference is not None:
            ref = reference.sel(where)
            others = [s for s in ref["seed"].values if s != member] if "seed" in ref.dims else []
            ys = [point(float(ref.sel(seed=s)), where)[0] for s in others]
            ax.scatter(
                [x] * len(ys),
                ys,
                s=18,
                color=colour,
                alpha=0.35,
                label=f"other {names[1]} seeds" if x == 0 and ys else None,
            )
            if "seed" not in ref.dims or member is not None:
                ref_y, ref_text = point(float(ref.sel(seed=member) if member is not None else ref), where)
                ref_label = f"{names[1]} seed {member} (this run's seed)" if member is not None else names[1]
                ax.scatter(
                    [x],
                    [ref_y],
                    s=90,
                    facecolors="none",
                    edgecolors=colour,
                    linewidths=1.8,
                    label=ref_label if x == 0 else None,
                )
                ax.annotate(
                    ref_text, (x, ref_y), xytext=(8, -10), textcoords="offset points", fontsize=8, color="0.3"
                )
        cur_y, cur_text = point(float(var.sel(where).isel({x_dim: 0})), where)
        ax.scatter(
            [x], [cur_y], s=60, marker="X", color="tab:red", zorder=5, label=names[0] if x == 0 else None
        )
        ax.annotate(
            cur_text, (x, cur_y), xytext=(8, 4), textcoords="offset points", fontsize=8, color="tab:red"
        )
    ax.set_xticks(range(len(drawn)), [label for label, _ in drawn])
    ax.margins(x=0.6, y=0.3)
    counted = _is_count(panel.metric) and _numel(current, {**dict(panel.fixed), **drawn[0][1]})
    ax.set_ylabel("elements" if counted else axis_label(panel.metric))
    ax.set_title(f"first point ({x_dim} {var[x_dim].values[0]}), zoomed", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, frameon=False)


def _valid_range(metric: str) -> tuple[float, float]:
    declared = METRICS[metric].valid_range if metric in METRICS else None
    return declared if declared is not None else (-np.inf, np.inf)
