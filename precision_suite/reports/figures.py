"""The seed figures drawn from run datasets (SCIENCE.md): figure A, the attention norm, one panel
per layer with a line per attention variant on a log y axis; figure B, a 2 x 3 grid of underflow
(top) and distortion (bottom) for activations (1, 128), gradients (1, 128) and gradient transpose
(128, 1), a line per layer, over tokens seen; and the accumulation error's law in K, with the runs'
GEMMs on it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import xarray as xr
from matplotlib.figure import Figure

from precision_suite.numerics.metric_table import METRICS
from precision_suite.reports.canvas import (
    figure_legend,
    new_figure,
    note_hidden_points,
    palette,
    save_figure,
    set_x_axis,
)
from precision_suite.training.views import AS_RUN, module_view
from precision_suite.verdicts.rule_check import run_spec

# figure B panels: (tensor coordinate, layout label, title as in the Ling 2.0 figure)
QUANT_PANELS = (
    ("activation", "1x128", "activations {metric} (1,128)"),
    ("gradient", "1x128", "gradients {metric} (1,128)"),
    ("gradient_transpose", "128x1", "gradient transpose {metric} (128,1)"),
)
QUANT_ROWS = ("underflow", "distortion")


def plot_attention_norm(
    datasets: Mapping[str, xr.Dataset],
    layers: Sequence[int] | None = None,
    x: str = "step",
    path: str | os.PathLike | None = None,
) -> Figure:
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

    fig, axes = new_figure(1, len(layers))
    colours = palette(len(datasets))
    for ax, layer in zip(axes[0], layers):
        hidden = 0
        for colour, (label, ds) in zip(colours, datasets.items()):
            values = ds["attention_norm"].sel(layer=layer).values.astype(float)
            hidden += int(np.count_nonzero(~(np.isfinite(values) & (values > 0))))
            ax.plot(ds[x].values, values, color=colour, label=label, linewidth=1.6)
        for colour, (label, ds) in zip(colours, datasets.items()):
            bound = _softmax_bound(ds)
            if bound is not None:  # each row of softmax(S) is a probability vector
                ax.axhline(
                    bound, color=colour, linestyle=":", linewidth=1.2, label=f"{label} bound √N = {bound:.4g}"
                )
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}")
        set_x_axis(ax, x)
        ax.set_ylabel(METRICS["attention_norm"].axis_label)
        ax.grid(True, which="major", alpha=0.3)
        note_hidden_points(ax, hidden, "NaN/Inf/non-positive")
    fig.suptitle(f"Attention norm per layer: {_describe_runs(datasets)}")
    figure_legend(fig, axes[0][0])
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_quant_error(
    ds: xr.Dataset, layers: Sequence[int] | None = None, path: str | os.PathLike | None = None
) -> Figure:
    """Figure B: 2 x 3 grid of underflow (top) and distortion (bottom), a line per layer.

    Columns: activations (1, 128), gradients (1, 128), gradient transpose (128, 1); x is tokens
    seen. Default layers: every 4th (0, 4, 8, ...). A (tensor, layout) pair the run did not
    measure is shown as an empty panel that says so.
    """
    _require_variables(ds, QUANT_ROWS + ("tokens",), f"dataset {ds.attrs.get('case', '')!r}")
    layers = [int(v) for v in ds["layer"].values[::4]] if layers is None else list(layers)
    _require_layers(ds, layers, f"dataset {ds.attrs.get('case', '')!r}")

    fig, axes = new_figure(len(QUANT_ROWS), len(QUANT_PANELS))
    colours = palette(len(layers), sequential=True)
    tokens = ds["tokens"].values
    for row, metric in zip(axes, QUANT_ROWS):
        for ax, (tensor, layout, title) in zip(row, QUANT_PANELS):
            ax.set_title(title.format(metric=metric))
            set_x_axis(ax, "tokens")
            ax.set_ylabel(METRICS[metric].axis_label)
            ax.grid(True, alpha=0.3)
            ax.ticklabel_format(axis="y", useOffset=False)  # 0.99968, not 1e-5 + 9.996e-1
            values = _select_pair(ds[metric], tensor, layout)
            if values is None or not np.isfinite(values.values).any():
                ax.text(
                    0.5,
                    0.5,
                    f"{tensor} {layout}\nnot measured in this run",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    color="0.4",
                )
                continue
            hidden = 0
            for colour, layer in zip(colours, layers):
                line = values.sel(layer=layer).values.astype(float)
                hidden += int(np.count_nonzero(~np.isfinite(line)))
                ax.plot(tokens, line, color=colour, label=f"layer {layer}", linewidth=1.4)
            note_hidden_points(ax, hidden, "NaN/Inf")
    fig.suptitle(f"FP8 quantization error per layer: {ds.attrs.get('case', 'run')}")
    legend_source = next((ax for row in axes for ax in row if ax.get_lines()), None)
    if legend_source is not None:
        figure_legend(fig, legend_source)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_observed_quant_error(ds: xr.Dataset, path: str | os.PathLike | None = None) -> Figure:
    """Figure B of the model's own quantization (training/observation.py): underflow (top) and
    distortion (bottom) of each GEMM operand its code quantized, a line per layer, titled with
    the observed format; operands it did not quantize are left out."""
    _require_variables(
        ds, ("observed_underflow", "observed_distortion", "tokens"), f"dataset {ds.attrs.get('case', '')!r}"
    )
    rows = ("observed_underflow", "observed_distortion")
    operands = [
        str(o) for o in ds["operand"].values if np.isfinite(ds["observed_distortion"].sel(operand=o)).any()
    ]
    fig, axes = new_figure(len(rows), max(len(operands), 1))
    layers = [int(v) for v in ds["layer"].values]
    colours = palette(len(layers), sequential=True)
    tokens = ds["tokens"].values
    formats = ds["observed_format"] if "observed_format" in ds else None
    for row, metric in zip(axes, rows):
        for ax, operand in zip(row, operands):
            shown = (
                sorted(
                    {
                        part
                        for v in formats.sel(operand=operand).values.ravel()
                        for part in str(v).split("|")
                        if part
                    }
                )
                if formats is not None
                else []
            )
            ax.set_title(f"{metric.removeprefix('observed_')} {operand} ({', '.join(shown)})")
            set_x_axis(ax, "tokens")
            ax.set_ylabel(METRICS[metric].axis_label)
            ax.grid(True, alpha=0.3)
            ax.ticklabel_format(axis="y", useOffset=False)
            for colour, layer in zip(colours, layers):
                ax.plot(
                    tokens,
                    ds[metric].sel(layer=layer, operand=operand).values.astype(float),
                    color=colour,
                    label=f"layer {layer}",
                    linewidth=1.4,
                )
    fig.suptitle(f"the model's own quantization error per layer: {ds.attrs.get('case', 'run')}")
    legend_source = next((ax for row in axes for ax in row if ax.get_lines()), None)
    if legend_source is not None:
        figure_legend(fig, legend_source)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_accumulation_law(
    law: Sequence[Mapping[str, object]],
    datasets: Mapping[str, xr.Dataset] | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """The accumulation error's law in K (SCIENCE.md): `law`, the rows of
    `numerics.accumulation_error.error_law` ({"K", "data", mode: error}), a line per mode and kind of
    data (solid same-sign, dashed mixed-sign) on log-log axes: hopper-fast rises with K,
    hopper-promoted stays flat. `datasets`: runs whose GEMMs were measured (`accumulation_error`),
    each GEMM as it ran drawn as a point at its K, in its mode's colour, at its median over the
    sampled steps."""
    if not law:
        raise ValueError(
            "plot_accumulation_law: `law` is empty; pass numerics.accumulation_error.error_law()"
        )
    modes = [key for key in law[0] if key not in ("K", "data")]
    colours = dict(zip(modes, palette(len(modes))))
    fig, axes = new_figure(1, 1, (7.0, 4.2))
    ax = axes[0][0]
    for kind, style in (("same-sign", "-"), ("mixed-sign", "--")):
        rows = [row for row in law if row["data"] == kind]
        for mode in modes:
            ax.plot(
                [row["K"] for row in rows],
                [row[mode] for row in rows],
                style,
                color=colours[mode],
                marker=".",
                label=f"{mode}, {kind} E4M3",
            )
    for ds in (datasets or {}).values():
        for k, error, mode in _gemms_as_run(ds):
            if mode in colours:
                ax.plot(k, error, "x", color=colours[mode], markersize=6)
    if datasets:
        ax.plot([], [], "x", color="0.3", label="the runs' GEMMs as they ran (median over steps)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("K (products summed per output)")
    ax.set_ylabel(METRICS["accumulation_error"].axis_label)
    ax.grid(True, alpha=0.3, which="both")
    ax.set_title("GEMM accumulation error against float64 of the same FP8 operands")
    handles, labels = ax.get_legend_handles_labels()  # two columns: seven long labels in a row overflow
    fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False, fontsize=8)
    if path is not None:
        save_figure(fig, path)
    return fig


def _gemms_as_run(ds: xr.Dataset) -> list[tuple[int, float, str]]:
    """(K, median accumulation error over the sampled steps, mode) of each GEMM of each module of
    a run, as it ran (`views.AS_RUN`); GEMMs never measured are left out."""
    if "accumulation_sums" not in ds.data_vars:
        return []
    view = module_view(ds)  # errors, K and modes on the view's modules alike
    errors = view["accumulation_error"].sel(accumulation=AS_RUN).transpose("step", "module", "gemm").values
    k = view["accumulation_k"].transpose("step", "module", "gemm").values.max(axis=0)
    modes = view["accumulation_mode"].transpose("step", "module", "gemm").values
    points = []
    for index in np.ndindex(k.shape):
        measured = errors[(slice(None), *index)]
        measured = measured[np.isfinite(measured) & (measured > 0)]
        ran = [str(m) for m in modes[(slice(None), *index)] if str(m)]
        if len(measured) and k[index] > 0 and ran:
            points.append((int(k[index]), float(np.median(measured)), ran[-1].split("|")[0].split(":")[0]))
    return points


def _require_variables(ds: xr.Dataset, names: Sequence[str], what: str) -> None:
    missing = [n for n in names if n not in ds.variables]
    if missing:
        raise ValueError(
            f"{what} lacks {', '.join(missing)}; charts need run datasets made by "
            "precision_suite.run (schema in docs/architecture.md)"
        )


def _require_layers(ds: xr.Dataset, layers: Sequence[int], what: str) -> None:
    available = [int(v) for v in ds["layer"].values]
    unknown = [layer for layer in layers if layer not in available]
    if unknown or not layers:
        raise ValueError(
            f"{what}: layers {unknown or '[]'} not available; choose from {available[0]}..{available[-1]}"
            if available
            else f"{what} has no layers"
        )


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
    shared = [
        f"{field} {specs[0][field]}"
        for field in ("model", "recipe")
        if field in specs[0] and all(s.get(field) == specs[0][field] for s in specs)
    ]
    return ", ".join(shared + [f"{len(datasets)} runs"])


def _select_pair(var: xr.DataArray, tensor: str, layout: str) -> xr.DataArray | None:
    if tensor not in var["tensor"].values or layout not in var["layout"].values:
        return None
    return var.sel(tensor=tensor, layout=layout)
