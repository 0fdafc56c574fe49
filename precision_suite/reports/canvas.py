"""What every chart shares: a figure on its own canvas, fixed colours and axes, deterministic files.

Every chart builds a `matplotlib.figure.Figure` directly (Agg canvas, no pyplot global state), so
charts are safe in threads, pytest workers and programs that use pyplot for other things. Output
is deterministic: fixed size and dpi, fixed colours, and `save_figure` strips the timestamps and
software tags that would otherwise change the bytes of every file.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from precision_suite.files import atomic_file
from precision_suite.numerics.metric_table import METRICS

DPI = 100
PANEL_SIZE = (4.6, 3.4)  # inches per panel: readable at a glance, small enough to embed in HTML
PNG_COLOURS = 256  # PNGs are stored with a palette: far fewer bytes, no visible change
X_LABELS = {"step": "training step", "tokens": "tokens seen", "train_step": "training step"}


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Write `fig` atomically (temp file + rename) with byte-identical output for equal figures.

    The format follows the suffix (.png, .svg, .pdf). PNGs get a palette of PNG_COLOURS colours
    (lines, text and shaded bands need no more) and zlib's best compression (docs/performance.md).
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "Producer": None}}
    if fmt != "png" and fmt not in metadata:
        raise ValueError(f"save_figure: unsupported file type {path.name!r}; use .png, .svg or .pdf")
    _lay_out_once(fig)
    with atomic_file(path) as handle, matplotlib.rc_context({"svg.hashsalt": "precision-suite"}):
        if fmt == "png":
            _save_palette_png(fig, handle)
        else:
            fig.savefig(handle, format=fmt, dpi=DPI, metadata=metadata[fmt])
    return path


def _lay_out_once(fig: Figure) -> None:
    """Run the figure's layout engine once and fix the result: savefig with an engine set draws the
    figure twice (once only to lay it out) and lays it out in both draws, the larger part of a
    chart's time. The same bytes, 15% faster."""
    engine = fig.get_layout_engine()
    if engine is not None:
        engine.execute(fig)
        fig.set_layout_engine(None)


def _save_palette_png(fig: Figure, handle) -> None:
    from PIL import Image  # matplotlib's own dependency; lazy: only palette PNGs need it

    rendered = io.BytesIO()
    fig.savefig(rendered, format="png", dpi=DPI)
    rendered.seek(0)
    # median cut is deterministic, so equal figures still give identical bytes; PIL writes no
    # timestamp or software tag
    image = Image.open(rendered).convert("RGB")
    # optimize: fewer bytes for a little more time per chart
    image.quantize(PNG_COLOURS, method=Image.Quantize.MEDIANCUT).save(handle, format="png", optimize=True)


def new_figure(
    rows: int,
    cols: int,
    panel_size: tuple[float, float] = PANEL_SIZE,
    width_ratios: Sequence[float] | None = None,
) -> tuple[Figure, list[list[Axes]]]:
    width = panel_size[0] * (sum(width_ratios) if width_ratios else cols)
    fig = Figure(figsize=(width, panel_size[1] * rows + 0.8), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, width_ratios=width_ratios)
    return fig, [list(row) for row in axes]


def palette(n: int, sequential: bool = False) -> list:
    """Fixed colours: qualitative for variants, ordered (viridis) for layers, like the seeds."""
    if sequential:
        cmap = matplotlib.colormaps["viridis"]
        return [cmap(v) for v in np.linspace(0.9, 0.1, n)] if n > 1 else [cmap(0.5)]
    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def figure_legend(fig: Figure, source: Axes) -> None:
    """One legend under the panels, outside every axes, so it never covers data."""
    handles, labels = source.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 7), frameon=False)


def set_x_axis(ax: Axes, x: str) -> None:
    ax.set_xlabel(X_LABELS[x])
    if x == "tokens":  # 150000 tokens as "150k": long plain numbers run into each other
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))


def note_hidden_points(ax: Axes, count: int, what: str) -> None:
    if count:
        ax.text(
            0.01,
            0.99,
            f"{count} {what} point(s) not drawn",
            transform=ax.transAxes,
            ha="left",
            va="top",
            fontsize=8,
            color="tab:red",
        )


def axis_label(metric: str) -> str:
    return METRICS[metric].axis_label if metric in METRICS else metric
