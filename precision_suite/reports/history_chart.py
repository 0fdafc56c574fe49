"""The history chart of one case: its headline series over commits, each detected step marked at
its commit."""

from __future__ import annotations

import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from precision_suite.reports.canvas import DPI, axis_label, palette, save_figure
from precision_suite.verdicts.history_steps import CaseHistory

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
    # would be most of a history report's time (the commit labels sit under the last row only)
    width, height = HISTORY_COLUMNS * max(4.6, 0.11 * len(case.commits) + 2.0), 2.4 * rows + 1.6
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(
        rows,
        HISTORY_COLUMNS,
        squeeze=False,
        gridspec_kw=dict(
            left=0.75 / width,
            right=1 - 0.25 / width,
            top=1 - 0.85 / height,
            bottom=0.75 / height,
            hspace=0.5,
            wspace=0.3,
        ),
    )
    x = np.arange(len(case.commits))
    labels = [c["commit"][:7] for c in case.commits]
    every = max(1, int(np.ceil(len(x) / MAX_HISTORY_TICKS)))
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels) :] + [ax for ax, panel in zip(flat, panels) if panel is None]:
        ax.set_axis_off()
    for ax, (title, lines, steps, unit) in (
        (ax, panel) for ax, panel in zip(flat, panels) if panel is not None
    ):
        colours = palette(len(lines), sequential=True)
        highlighted = any(bold for _, _, bold in lines)
        for (label, y, bold), colour in zip(lines, colours):
            ax.plot(
                x,
                y,
                marker="o" if bold else None,
                markersize=2.5,
                linewidth=1.6 if bold else 0.8,
                color="0.65" if highlighted and not bold else colour,
                label=label if bold else None,
                zorder=3 if bold else 2,
            )
        for step in steps:
            ax.axvline(step.index - 0.5, color="#b00020", linestyle="--", linewidth=1)
            ax.annotate(
                f"{labels[step.index]}: {step.size:+.0f}σ",
                (step.index - 0.5, 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color="#b00020",
                ha="left",
                va="top",
                rotation=90,
            )
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
    fig.suptitle(
        f"{case.case} on {case.host_label}: {len(case.commits)} commits, {len(case.steps)} step(s)",
        fontsize=10,
    )
    if path is not None:
        save_figure(fig, path)
    return fig


def _history_panels(
    case: CaseHistory,
) -> list[tuple[str, list[tuple[str, np.ndarray, bool]], list, str] | None]:
    """(title, [(label, values, stepped)], steps, y label) per panel, in drawing order (None: a gap)."""
    stepped = {(s.kind, s.metric, tuple(s.where.items())) for s in case.steps}
    groups: dict[tuple[str, tuple], list] = {}
    for s in case.series:
        if s.kind == "trained":
            groups.setdefault(
                (s.metric, tuple((d, v) for d, v in s.where.items() if d != "layer")), []
            ).append(s)
    panels = {}
    for (metric, rest), members in groups.items():
        keys = [("trained", m.metric, tuple(m.where.items())) for m in members]
        where = ", ".join(f"{d} {v}" for d, v in rest)
        steps = [
            st
            for st in case.steps
            if st.kind == "trained" and st.metric == metric and all(st.where.get(d) == v for d, v in rest)
        ]
        lines = [
            (f"layer {m.where['layer']}" if "layer" in m.where else metric, m.shown, k in stepped)
            for m, k in zip(members, keys)
        ]
        panels[metric, rest] = (
            f"{metric}{' (' + where + ')' if where else ''}: trained median",
            lines,
            steps,
            axis_label(metric),
        )
    replay = [s for s in case.series if s.kind == "replay"]
    if replay:
        lines = []
        for metric in dict.fromkeys(s.metric for s in replay):
            shown = np.abs(np.vstack([s.shown for s in replay if s.metric == metric]))
            finite = np.isfinite(shown).any(axis=0)
            lines.append(
                (
                    metric,
                    np.where(finite, np.nanmax(np.where(np.isfinite(shown), shown, -np.inf), axis=0), np.nan),
                    True,
                )
            )
        panels["replay", ()] = (
            "replay against the stored replay: largest |delta| per metric",
            lines,
            [st for st in case.steps if st.kind == "replay"],
            "noise units",
        )
    # the loss and the attention norm first, the replay deltas, then underflow beside distortion
    first = [key for key in (("loss", ()), ("attention_norm", ()), ("replay", ())) if key in panels]
    pairs = sorted({rest for metric, rest in panels if metric in ("underflow", "distortion")})
    order = first + [None] * (len(first) % HISTORY_COLUMNS)  # each underflow beside its distortion
    order += [(metric, rest) for rest in pairs for metric in ("underflow", "distortion")]
    return [
        None
        if key is None
        else panels.get(
            key, (f"{key[0]} ({', '.join(f'{d} {v}' for d, v in key[1])}): not measured", [], [], "")
        )
        for key in order
    ]
