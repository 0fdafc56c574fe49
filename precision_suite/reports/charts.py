"""Charts of run datasets: figure A (attention norm), figure B (quantization error), drift charts.

Every function builds a `matplotlib.figure.Figure` directly (Agg canvas, no pyplot global state),
so charts are safe in threads, pytest workers and programs that use pyplot for other things.
Output is deterministic: fixed size and dpi, fixed colours, and `save_figure` strips the
timestamps and software tags that would otherwise change the bytes of every file.

Figures follow the seed figures (SCIENCE.md): figure A is one panel per layer with a line per
attention variant on a log y axis; figure B is a 2 x 3 grid of underflow (top) and distortion
(bottom) for activations (1, 128), gradients (1, 128) and gradient transpose (128, 1), a line per
layer, over tokens seen.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from precision_suite.files import atomic_file
from precision_suite.numerics.metric_table import METRICS
from precision_suite.verdicts.baselines import tolerance_band
from precision_suite.verdicts.checks import run_spec
from precision_suite.verdicts.ensemble import ensemble_band
from precision_suite.verdicts.findings import severity
from precision_suite.verdicts.history import CaseHistory

DPI = 100
PANEL_SIZE = (4.6, 3.4)  # inches per panel: readable at a glance, small enough to embed in HTML
MAX_DRIFT_LINES = 6  # layers drawn per drift panel; more would hide each other
# drift panels per chart, worst first: a case with hundreds of findings made 17-panel charts of
# 1.2 MB that no one scrolls through; the rest are named on the chart and listed in the report
MAX_DRIFT_PANELS = 6
PNG_COLOURS = 256  # PNGs are stored with a palette: a third of the bytes, no visible change
# A count panel (fractions of counted elements, NaN/Inf counts) goes logarithmic when its values
# span this ratio (a decade) or, for fractions, stay below TINY_FRACTION: on a linear axis from
# zero, 2 elements of 458,752 against none cannot be seen.
COUNT_DECADE = 10.0
TINY_FRACTION = 1e-3
ZOOM_WIDTH = 0.35  # the first-point zoom panel's width, relative to its drift panel

X_LABELS = {"step": "training step", "tokens": "tokens seen", "train_step": "training step"}

# figure B panels: (tensor coordinate, layout label, title as in the Ling 2.0 figure)
QUANT_PANELS = (
    ("activation", "1x128", "activations {metric} (1,128)"),
    ("gradient", "1x128", "gradients {metric} (1,128)"),
    ("gradient_transpose", "128x1", "gradient transpose {metric} (128,1)"),
)
QUANT_ROWS = ("underflow", "distortion")

# (metric, reference values over time) -> (lower, upper) edges of the accepted band, or None
ToleranceBand = Callable[[str, np.ndarray], "tuple[np.ndarray, np.ndarray] | None"]


def plot_attention_norm(datasets: Mapping[str, xr.Dataset], layers: Sequence[int] | None = None,
                        x: str = "step", path: str | os.PathLike | None = None) -> Figure:
    """Figure A: attention norm (log y) over `x`, one panel per layer, one line per dataset.

    `datasets` maps a line label (usually the attention variant) to a run dataset. Default layers:
    an early one (layer 1 where the model has it) and the last. A softmax run that records N gets
    its bound sqrt(N) drawn dotted in its colour.
    """
    if not datasets:
        raise ValueError("plot_attention_norm: `datasets` is empty; pass {label: run dataset}")
    if x not in ("step", "tokens"):
        raise ValueError(f"plot_attention_norm: x={x!r} is not supported; use 'step' or 'tokens'")
    for label, ds in datasets.items():
        _require_variables(ds, ("attention_norm",), f"dataset {label!r}")
    first = next(iter(datasets.values()))
    layers = default_attention_layers(first) if layers is None else list(layers)
    for label, ds in datasets.items():
        _require_layers(ds, layers, f"dataset {label!r}")

    fig, axes = _new_figure(1, len(layers))
    colours = _palette(len(datasets))
    for ax, layer in zip(axes[0], layers):
        hidden = 0
        for colour, (label, ds) in zip(colours, datasets.items()):
            values = ds["attention_norm"].sel(layer=layer).values.astype(float)
            hidden += int(np.count_nonzero(~(np.isfinite(values) & (values > 0))))
            ax.plot(ds[x].values, values, color=colour, label=label, linewidth=1.6)
        for colour, (label, ds) in zip(colours, datasets.items()):
            bound = _softmax_bound(ds)
            if bound is not None:  # each row of softmax(S) is a probability vector
                ax.axhline(bound, color=colour, linestyle=":", linewidth=1.2,
                           label=f"{label} bound √N = {bound:.4g}")
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}")
        _set_x_axis(ax, x)
        ax.set_ylabel(METRICS["attention_norm"].axis_label)
        ax.grid(True, which="major", alpha=0.3)
        _note_hidden_points(ax, hidden, "NaN/Inf/non-positive")
    fig.suptitle(f"Attention norm per layer: {_describe_runs(datasets)}")
    _figure_legend(fig, axes[0][0])
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_quant_error(ds: xr.Dataset, layers: Sequence[int] | None = None,
                     path: str | os.PathLike | None = None) -> Figure:
    """Figure B: 2 x 3 grid of underflow (top) and distortion (bottom), a line per layer.

    Columns: activations (1, 128), gradients (1, 128), gradient transpose (128, 1); x is tokens
    seen. Default layers: every 4th (0, 4, 8, ...). A (tensor, layout) pair the run did not
    measure is shown as an empty panel that says so.
    """
    _require_variables(ds, QUANT_ROWS + ("tokens",), f"dataset {ds.attrs.get('case', '')!r}")
    layers = [int(v) for v in ds["layer"].values[::4]] if layers is None else list(layers)
    _require_layers(ds, layers, f"dataset {ds.attrs.get('case', '')!r}")

    fig, axes = _new_figure(len(QUANT_ROWS), len(QUANT_PANELS))
    colours = _palette(len(layers), sequential=True)
    tokens = ds["tokens"].values
    for row, metric in zip(axes, QUANT_ROWS):
        for ax, (tensor, layout, title) in zip(row, QUANT_PANELS):
            ax.set_title(title.format(metric=metric))
            _set_x_axis(ax, "tokens")
            ax.set_ylabel(METRICS[metric].axis_label)
            ax.grid(True, alpha=0.3)
            ax.ticklabel_format(axis="y", useOffset=False)  # 0.99968, not 1e-5 + 9.996e-1
            values = _select_pair(ds[metric], tensor, layout)
            if values is None or not np.isfinite(values.values).any():
                ax.text(0.5, 0.5, f"{tensor} {layout}\nnot measured in this run",
                        ha="center", va="center", transform=ax.transAxes, color="0.4")
                continue
            hidden = 0
            for colour, layer in zip(colours, layers):
                line = values.sel(layer=layer).values.astype(float)
                hidden += int(np.count_nonzero(~np.isfinite(line)))
                ax.plot(tokens, line, color=colour, label=f"layer {layer}", linewidth=1.4)
            _note_hidden_points(ax, hidden, "NaN/Inf")
    fig.suptitle(f"FP8 quantization error per layer: {ds.attrs.get('case', 'run')}")
    legend_source = next((ax for row in axes for ax in row if ax.get_lines()), None)
    if legend_source is not None:
        _figure_legend(fig, legend_source)
    if path is not None:
        save_figure(fig, path)
    return fig


@dataclass(frozen=True)
class _DriftPanel:
    """One drift panel: a metric at one fixed selection of its non-layer, non-step coordinates."""

    metric: str
    fixed: tuple[tuple[str, object], ...]
    findings: tuple

    @property
    def title(self) -> str:
        return " ".join([self.metric] + [str(value) for _, value in self.fixed])


def plot_drift(current: xr.Dataset, baseline: xr.Dataset | None, findings: Sequence,
               path: str | os.PathLike | None = None, band: ToleranceBand | None = None) -> Figure:
    """Drift chart of one case: current run against its baseline for every metric with findings.

    One panel per failing metric selection (e.g. underflow of gradient 128x1); in it, one colour
    per offending layer: current solid, baseline dashed, the accepted tolerance band shaded,
    threshold bounds dotted, and each offending (layer, step) marked with a red cross.
    `baseline` may be None for threshold-only findings. `band(metric, reference)` returns the
    band edges over the steps (None: no band); the default is
    `precision_suite.verdicts.baselines.tolerance_band` with the default tolerances.
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
    fig, axes = _new_figure(len(panels) or 1, len(width_ratios), panel_size=(9.0, 3.6),
                            width_ratios=width_ratios)
    if not panels:
        ax = axes[0][0]
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no per-metric findings to chart", ha="center", va="center",
                transform=ax.transAxes)
    for row, panel, first in zip(axes, panels, first_points):
        series = _draw_drift_panel(row[0], panel, current, baseline, band)
        if first:
            _draw_first_point_zoom(row[1], panel, first, series, current, baseline)
        elif len(row) > 1:
            row[1].set_visible(False)
    if left_out:
        names = ", ".join(panel.title for panel in left_out[:4]) + (", ..." if len(left_out) > 4 else "")
        fig.text(0.01, 0.0, f"{len(left_out)} more panel(s) with findings not drawn ({names}); "
                 "every finding is in the report's table", fontsize=8, ha="left", va="bottom",
                 color="tab:red")
    kind = "against its baseline" if baseline is not None else "against its thresholds"
    fig.suptitle(f"{case}: current run {kind}"
                 + (f" (the {len(panels)} worst of {len(every_panel)} panels)" if left_out else ""))
    if path is not None:
        save_figure(fig, path)
    return fig


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Write `fig` atomically (temp file + rename) with byte-identical output for equal figures.

    The format follows the suffix (.png, .svg, .pdf). PNGs get a palette of PNG_COLOURS colours
    (lines, text and shaded bands need no more) and zlib's best compression: a third of the bytes.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "Producer": None}}
    if fmt != "png" and fmt not in metadata:
        raise ValueError(f"save_figure: unsupported file type {path.name!r}; use .png, .svg or .pdf")
    with atomic_file(path) as handle, matplotlib.rc_context({"svg.hashsalt": "precision-suite"}):
        if fmt == "png":
            _save_palette_png(fig, handle)
        else:
            fig.savefig(handle, format=fmt, dpi=DPI, metadata=metadata[fmt])
    return path


def _save_palette_png(fig: Figure, handle) -> None:
    from PIL import Image  # matplotlib's own dependency; lazy: only palette PNGs need it

    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=DPI)
    rendered.seek(0)
    # median cut is deterministic, so equal figures still give identical bytes; PIL writes no
    # timestamp or software tag
    image = Image.open(rendered).convert("RGB")
    # optimize: 10% fewer bytes for 0.1 s more per chart
    image.quantize(PNG_COLOURS, method=Image.Quantize.MEDIANCUT).save(handle, format="png", optimize=True)


# --------------------------------------------------------------------------- helpers


def _new_figure(rows: int, cols: int, panel_size: tuple[float, float] = PANEL_SIZE,
                width_ratios: Sequence[float] | None = None) -> tuple[Figure, list[list[Axes]]]:
    width = panel_size[0] * (sum(width_ratios) if width_ratios else cols)
    fig = Figure(figsize=(width, panel_size[1] * rows + 0.8), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, width_ratios=width_ratios)
    return fig, [list(row) for row in axes]


def _palette(n: int, sequential: bool = False) -> list:
    """Fixed colours: qualitative for variants, ordered (viridis) for layers, like the seeds."""
    if sequential:
        cmap = matplotlib.colormaps["viridis"]
        return [cmap(v) for v in np.linspace(0.9, 0.1, n)] if n > 1 else [cmap(0.5)]
    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _figure_legend(fig: Figure, source: Axes) -> None:
    """One legend under the panels, outside every axes, so it never covers data."""
    handles, labels = source.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 7),
                   frameon=False)


def _set_x_axis(ax: Axes, x: str) -> None:
    ax.set_xlabel(X_LABELS[x])
    if x == "tokens":  # 150000 tokens as "150k": long plain numbers run into each other
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))


def _note_hidden_points(ax: Axes, count: int, what: str) -> None:
    if count:
        ax.text(0.01, 0.99, f"{count} {what} point(s) not drawn", transform=ax.transAxes,
                ha="left", va="top", fontsize=8, color="tab:red")


def _require_variables(ds: xr.Dataset, names: Sequence[str], what: str) -> None:
    missing = [n for n in names if n not in ds.variables]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}; charts need run datasets made by "
                         "precision_suite.run (schema in docs/architecture.md)")


def _require_layers(ds: xr.Dataset, layers: Sequence[int], what: str) -> None:
    available = [int(v) for v in ds["layer"].values]
    unknown = [layer for layer in layers if layer not in available]
    if unknown or not layers:
        raise ValueError(f"{what}: layers {unknown or '[]'} not available; choose from "
                         f"{available[0]}..{available[-1]}" if available else f"{what} has no layers")


def default_attention_layers(ds: xr.Dataset) -> list[int]:
    """The layers figure A draws: a shallow one (layer 1 where the model has 3 or more) and the last."""
    layers = [int(v) for v in ds["layer"].values]
    early = 1 if 1 in layers and len(layers) > 2 else layers[0]
    return sorted({early, layers[-1]})


def _softmax_bound(ds: xr.Dataset) -> float | None:
    """sqrt(N) for a softmax run that records N (SCIENCE.md: ||softmax(S)||_F <= sqrt(N))."""
    if run_spec(ds).get("attention") != "softmax" or "N" not in ds.attrs:
        return None
    return float(np.sqrt(float(ds.attrs["N"])))


def _describe_runs(datasets: Mapping[str, xr.Dataset]) -> str:
    """Title text: the case for one run; the spec fields the runs share for several."""
    if len(datasets) == 1:
        return str(next(iter(datasets.values())).attrs.get("case", next(iter(datasets))))
    specs = [run_spec(ds) for ds in datasets.values()]
    shared = [f"{field} {specs[0][field]}" for field in ("model", "recipe")
              if field in specs[0] and all(s.get(field) == specs[0][field] for s in specs)]
    return ", ".join(shared + [f"{len(datasets)} runs"])


def _select_pair(var: xr.DataArray, tensor: str, layout: str) -> xr.DataArray | None:
    if tensor not in var["tensor"].values or layout not in var["layout"].values:
        return None
    return var.sel(tensor=tensor, layout=layout)


def _drift_panels(current: xr.Dataset, findings: Sequence) -> list[_DriftPanel]:
    grouped: dict[tuple, list] = {}
    for finding in findings:
        if finding.kind == "error" or finding.metric not in current.data_vars:
            continue
        dims = current[finding.metric].dims
        where = dict(finding.where or {})
        fixed = tuple((dim, where[dim]) for dim in dims
                      if dim in where and dim not in ("layer", "step", "train_step"))
        grouped.setdefault((finding.metric, fixed), []).append(finding)
    panels = [_DriftPanel(metric, fixed, tuple(group)) for (metric, fixed), group in grouped.items()]
    # worst first (sorted is stable: equally bad panels keep the findings' order)
    return sorted(panels, key=lambda panel: min(severity(f.kind, f.score, f.known) for f in panel.findings))


def _draw_drift_panel(ax: Axes, panel: _DriftPanel, current: xr.Dataset,
                      baseline: xr.Dataset | None, band: ToleranceBand) -> list[tuple[str, dict]]:
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
            ax.text(0.99, 0.01, f"+{len(layers) - MAX_DRIFT_LINES} more offending layers",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    else:
        series = [(panel.metric, {})]

    xs = var[x_dim].values if x_dim else np.zeros(1)
    band_labelled = False  # one legend entry for every series' band
    for colour, (label, where) in zip(_palette(len(series)), series):
        ax.plot(xs, np.atleast_1d(var.sel(where).values), color=colour, linewidth=2.2,
                label=f"{label} current")
        if reference is not None and "seed" in reference.dims:
            # a seed ensemble: every seed faint, the accepted band shaded, the current run bold
            ref_x = reference[x_dim].values if x_dim else xs
            for i, seed in enumerate(reference["seed"].values):
                ax.plot(ref_x, np.atleast_1d(reference.sel(where).sel(seed=seed).values.astype(float)),
                        color=colour, linewidth=0.8, alpha=0.35,
                        label=f"{label} baseline seeds" if i == 0 else None)
            edges = ensemble_band(panel.metric, current, baseline, {**dict(panel.fixed), **where}) \
                if compared else None
        elif reference is not None:
            ref = np.atleast_1d(reference.sel(where).values.astype(float))
            ref_x = reference[x_dim].values if x_dim else xs
            ax.plot(ref_x, ref, color=colour, linestyle="--", label=f"{label} baseline")
            edges = band(panel.metric, ref) if compared else None
        else:
            edges = None
        if reference is not None:
            if edges is not None:
                # a band never suggests an impossible value (a negative fraction, a cosine > 1)
                low, high = _valid_range(panel.metric)
                ax.fill_between(ref_x, np.clip(edges[0], low, high), np.clip(edges[1], low, high),
                                color=colour, alpha=0.15, linewidth=0,
                                label=None if band_labelled else "shaded: accepted band")
                band_labelled = True

    for bound in sorted({float(f.reference) for f in panel.findings
                         if f.kind == "threshold" and f.reference is not None}):
        ax.axhline(bound, color="tab:red", linestyle=":", linewidth=1.2, label=f"bound {bound:g}")
    marks_x, marks_y = [], []
    for finding in panel.findings:
        where = finding.where or {}
        marks_x.append(where.get(x_dim, xs[-1]) if x_dim else xs[-1])
        marks_y.append(float(finding.value))
    ax.scatter(marks_x, marks_y, marker="X", s=60, color="tab:red", zorder=5,
               label="offending point")

    ax.set_title(panel.title)
    ax.set_xlabel(X_LABELS.get(x_dim, ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: a replay spans two or three
    ax.set_ylabel(_axis_label(panel.metric))
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
        ax.text(0.99, 0.02, "log axis, linear below one element", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=7, color="0.4")


def _first_point_findings(panel: _DriftPanel, current: xr.Dataset) -> list:
    """The panel's findings at the run's first sampled point (step 0)."""
    var = current[panel.metric]
    x_dim = next((d for d in ("step", "train_step") if d in var.dims), None)
    if x_dim is None:
        return []
    first = var[x_dim].values[0]
    return [f for f in panel.findings if (f.where or {}).get(x_dim) == first]


def _draw_first_point_zoom(ax: Axes, panel: _DriftPanel, findings: Sequence,
                           series: Sequence[tuple[str, dict]], current: xr.Dataset,
                           baseline: xr.Dataset | None) -> None:
    """The first point of each offending series at a scale where its change shows: the current
    value against the baseline's (the member seed's when the run is one, the other seeds faint),
    counts annotated as "k of n elements"."""
    var = current[panel.metric].sel(dict(panel.fixed))
    x_dim = next(d for d in ("step", "train_step") if d in var.dims)
    offending = {int(f.where["layer"]) for f in findings if "layer" in f.where}
    drawn = [(label, where) for label, where in series
             if not offending or where.get("layer") in offending]
    reference = None
    if baseline is not None and panel.metric in baseline.data_vars:
        reference = baseline[panel.metric].sel(dict(panel.fixed)).isel({x_dim: 0})
    seed = run_spec(current).get("seed")
    member = seed if reference is not None and "seed" in reference.dims \
        and seed in reference["seed"].values else None

    def point(value: float, where: Mapping[str, object]) -> tuple[float, str]:
        """(y, label) of one value: in elements for a count whose numel is known."""
        numel = _numel(current, {**dict(panel.fixed), **where}) if _is_count(panel.metric) else None
        if numel is None:
            return value, f"{value:.4g}"
        count = value * numel if _is_fraction(panel.metric) else value
        return count, f"{count:,.0f} of {numel:,} elements"

    colours = dict(zip((label for label, _ in series), _palette(len(series))))  # the drift panel's
    for x, (label, where) in enumerate(drawn):
        colour = colours[label]
        if reference is not None:
            ref = reference.sel(where)
            others = [s for s in ref["seed"].values if s != member] if "seed" in ref.dims else []
            ys = [point(float(ref.sel(seed=s)), where)[0] for s in others]
            ax.scatter([x] * len(ys), ys, s=18, color=colour, alpha=0.35,
                       label="other baseline seeds" if x == 0 and ys else None)
            if "seed" not in ref.dims or member is not None:
                ref_y, ref_text = point(float(ref.sel(seed=member) if member is not None else ref), where)
                ref_label = f"baseline seed {member} (this run's seed)" if member is not None else "baseline"
                ax.scatter([x], [ref_y], s=90, facecolors="none", edgecolors=colour, linewidths=1.8,
                           label=ref_label if x == 0 else None)
                ax.annotate(ref_text, (x, ref_y), xytext=(8, -10), textcoords="offset points",
                            fontsize=8, color="0.3")
        cur_y, cur_text = point(float(var.sel(where).isel({x_dim: 0})), where)
        ax.scatter([x], [cur_y], s=60, marker="X", color="tab:red", zorder=5,
                   label="current" if x == 0 else None)
        ax.annotate(cur_text, (x, cur_y), xytext=(8, 4), textcoords="offset points", fontsize=8,
                    color="tab:red")
    ax.set_xticks(range(len(drawn)), [label for label, _ in drawn])
    ax.margins(x=0.6, y=0.3)
    counted = _is_count(panel.metric) and _numel(current, {**dict(panel.fixed), **drawn[0][1]})
    ax.set_ylabel("elements" if counted else _axis_label(panel.metric))
    ax.set_title(f"first point ({x_dim} {var[x_dim].values[0]}), zoomed", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, frameon=False)


def _axis_label(metric: str) -> str:
    return METRICS[metric].axis_label if metric in METRICS else metric


def _valid_range(metric: str) -> tuple[float, float]:
    declared = METRICS[metric].valid_range if metric in METRICS else None
    return declared if declared is not None else (-np.inf, np.inf)


# --------------------------------------------------------------------------- history

MAX_HISTORY_TICKS = 25  # commit labels on a history chart's x axis; more would overlap
HISTORY_COLUMNS = 2


def plot_history(case: CaseHistory, path: str | os.PathLike | None = None) -> Figure:
    """A case's headline series over commits, two panels a row: the trained loss and attention norm
    per layer, the largest replay delta of each metric in noise units, then underflow beside
    distortion for each tensor and layout the run measures, a line per layer. A group with a
    detected step draws the stepped series bold over its others in grey, each step a dashed line
    at its commit labelled with its size."""
    panels = _history_panels(case)
    rows = -(-len(panels) // HISTORY_COLUMNS)
    # fixed margins, not the constrained layout of the other charts: its measuring of every label
    # was two thirds of a history report's time (the commit labels sit under the last row only)
    width, height = HISTORY_COLUMNS * max(4.6, 0.11 * len(case.commits) + 2.0), 2.4 * rows + 1.6
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, HISTORY_COLUMNS, squeeze=False, gridspec_kw=dict(
        left=0.75 / width, right=1 - 0.25 / width, top=1 - 0.85 / height, bottom=0.75 / height, hspace=0.5, wspace=0.3))
    x = np.arange(len(case.commits))
    labels = [c["commit"][:7] for c in case.commits]
    every = max(1, int(np.ceil(len(x) / MAX_HISTORY_TICKS)))
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels):] + [ax for ax, panel in zip(flat, panels) if panel is None]:
        ax.set_axis_off()
    for ax, (title, lines, steps, unit) in ((ax, panel) for ax, panel in zip(flat, panels) if panel is not None):
        colours = _palette(len(lines), sequential=True)
        highlighted = any(bold for _, _, bold in lines)
        for (label, y, bold), colour in zip(lines, colours):
            ax.plot(x, y, marker="o" if bold else None, markersize=2.5, linewidth=1.6 if bold else 0.8,
                    color="0.65" if highlighted and not bold else colour, label=label if bold else None,
                    zorder=3 if bold else 2)
        for step in steps:
            ax.axvline(step.index - 0.5, color="#b00020", linestyle="--", linewidth=1)
            ax.annotate(f"{labels[step.index]}: {step.size:+.0f}σ", (step.index - 0.5, 1.0),
                        xycoords=("data", "axes fraction"), fontsize=7, color="#b00020",
                        ha="left", va="top", rotation=90)
        ax.set_title(title, fontsize=8, loc="left")
        ax.set_ylabel(unit, fontsize=7)
        ax.tick_params(labelsize=7)
        if highlighted and sum(bold for _, _, bold in lines) <= 8:
            ax.legend(fontsize=6, loc="best", frameon=False)
        ax.set_xticks(x[::every], labels[::every], rotation=90, fontsize=6)
    # commit labels under the lowest panel of each column only: the text is most of a chart's time
    drawn = [i for i, panel in enumerate(panels) if panel is not None]
    for i in drawn:
        if any(j > i and j % HISTORY_COLUMNS == i % HISTORY_COLUMNS for j in drawn):
            flat[i].tick_params(labelbottom=False)
    fig.suptitle(f"{case.case} on {case.host_label}: {len(case.commits)} commits, {len(case.steps)} step(s)",
                 fontsize=10)
    if path is not None:
        save_figure(fig, path)
    return fig


def _history_panels(case: CaseHistory) -> list[tuple[str, list[tuple[str, np.ndarray, bool]], list, str] | None]:
    """(title, [(label, values, stepped)], steps, y label) per panel, in drawing order (None: a gap)."""
    stepped = {(s.kind, s.metric, tuple(s.where.items())) for s in case.steps}
    groups: dict[tuple[str, tuple], list] = {}
    for s in case.series:
        if s.kind == "trained":
            groups.setdefault((s.metric, tuple((d, v) for d, v in s.where.items() if d != "layer")), []).append(s)
    panels = {}
    for (metric, rest), members in groups.items():
        keys = [("trained", m.metric, tuple(m.where.items())) for m in members]
        where = ", ".join(f"{d} {v}" for d, v in rest)
        steps = [st for st in case.steps if st.kind == "trained" and st.metric == metric
                 and all(st.where.get(d) == v for d, v in rest)]
        lines = [(f"layer {m.where['layer']}" if "layer" in m.where else metric, m.shown, k in stepped)
                 for m, k in zip(members, keys)]
        panels[metric, rest] = (f"{metric}{' (' + where + ')' if where else ''}: trained median", lines, steps,
                                _axis_label(metric))
    replay = [s for s in case.series if s.kind == "replay"]
    if replay:
        lines = []
        for metric in dict.fromkeys(s.metric for s in replay):
            shown = np.abs(np.vstack([s.shown for s in replay if s.metric == metric]))
            finite = np.isfinite(shown).any(axis=0)
            lines.append((metric, np.where(finite, np.nanmax(np.where(np.isfinite(shown), shown, -np.inf), axis=0),
                                           np.nan), True))
        panels["replay", ()] = ("replay against the stored replay: largest |delta| per metric", lines,
                                [st for st in case.steps if st.kind == "replay"], "noise units")
    # the loss and the attention norm first, the replay deltas, then underflow beside distortion
    first = [key for key in (("loss", ()), ("attention_norm", ()), ("replay", ())) if key in panels]
    pairs = sorted({rest for metric, rest in panels if metric in ("underflow", "distortion")})
    order = first + [None] * (len(first) % HISTORY_COLUMNS)  # each underflow beside its distortion
    order += [(metric, rest) for rest in pairs for metric in ("underflow", "distortion")]
    return [None if key is None else
            panels.get(key, (f"{key[0]} ({', '.join(f'{d} {v}' for d, v in key[1])}): not measured", [], [], ""))
            for key in order]
