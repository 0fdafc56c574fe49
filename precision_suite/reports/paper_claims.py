"""The two seed figures' claims, checked on a reproduction's datasets.

`precision-suite reproduce figure-a|figure-b` trains a figure's runs (jobs/figure_runs.py), then
`reports.reproduction.write_reproduction` writes the figure, the datasets and a note that states
each qualitative claim of the paper (../shared/SCIENCE.md) and whether this reproduction shows it,
with the numbers: `figure_a_claims` and `figure_b_claims` compute every verdict from the
datasets, so a note can never claim more than the data shows.

The runs (measured choices, docs/cli.md; their RunSpecs are in jobs/figure_runs.py):

- figure A: a 4-block GPT on Shakespeare bytes with N = 196 tokens per sequence, the paper's
  ImageNet ViT token count (224/16 patches), so `x/sqrt(N)` is the figure's `x/14`. The digits
  ViT has at most N = 64: with the same trained scores a twin's norm ratio is exactly sqrt(N),
  4 or 8 there, so it cannot show the paper's tenfold gap. lr 3e-3 lets the unscaled
  polynomials' norms grow within 200 steps, as they do over the paper's 300 epochs.
- figure B: the default 18-block GPT, 300 steps, the paper's layers 0, 4, 8, 12, 16, every GEMM
  operand measured as the FP8 block recipe (Ling 2.0's) quantizes it. It trains in float32:
  training through the emulated FP8 GEMMs as well costs several times the CPU time
  (docs/performance.md) and gave the same verdict on every claim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xarray as xr

from precision_suite.reports.figures import (
    QUANT_PANELS,
    default_attention_layers,
)

# figure A: every variant of the paper's figure; each unscaled polynomial with its scaled twin
FIGURE_A_VARIANTS = ("softmax", "x/1", "x/sqrt(N)", "x^3/1", "x^3/sqrt(N)")
SCALED_TWINS = {"x/1": "x/sqrt(N)", "x^3/1": "x^3/sqrt(N)"}
FIGURE_B_LAYERS = (0, 4, 8, 12, 16)  # the Ling 2.0 figure's layers (of 20; the GPT has 18)

# Thresholds that turn the papers' words into checks (choices, stated in every claim's text)
END_FRACTION = 0.1  # "by the end": the median over the samples in the last 10% of the steps
TWIN_FACTOR = 10.0  # "far lower than their unscaled twins"
LARGE_NORM = 100.0  # "the largest norms (10^2 to 10^3+)"
GROWTH_DIFFERENCE = 2.0  # "deeper layers show different growth": growth ratios 2x apart
TINY_UNDERFLOW = 1e-2  # "(1,128) underflow is tiny (about 1e-4 .. 1e-2)"
FAR_LARGER = 10.0  # "gradient transpose underflow is far larger"
SPIKE_FACTOR = 5.0  # "spiky": a step at least 5x the median step of its layer
NEAR_ONE = 0.999  # "distortion stays near 0.999+"
TAIL_FRACTION = 2 / 3  # tail layers: the last third of the depth


@dataclass(frozen=True)
class Claim:
    """One qualitative claim of a paper, checked on a reproduction's datasets."""

    key: str  # stable name for tests and machines, e.g. "softmax_bounded"
    text: str  # the claim and the check that decides it
    holds: bool
    numbers: dict[str, float] = field(default_factory=dict)  # the measured values behind `holds`


# --------------------------------------------------------------------------- figure A claims


def figure_a_claims(datasets: Mapping[str, xr.Dataset], layers: Sequence[int] | None = None) -> list[Claim]:
    """The claims of figure A (SCIENCE.md) on runs keyed by attention variant.

    `datasets` needs every variant of FIGURE_A_VARIANTS; `layers` default to the shallow and the
    deep layer the figure draws (figures.default_attention_layers).
    """
    missing = [v for v in FIGURE_A_VARIANTS if v not in datasets]
    if missing:
        raise ValueError(
            f"figure_a_claims: datasets lack the variant(s) {', '.join(missing)}; "
            f"pass {{variant: run dataset}} for {', '.join(FIGURE_A_VARIANTS)}"
        )
    for variant, ds in datasets.items():
        _require(ds, ("attention_norm",), f"figure_a_claims: dataset {variant!r}")
    softmax = datasets["softmax"]
    if "N" not in softmax.attrs:
        raise ValueError(
            "figure_a_claims: the softmax dataset has no attribute N (tokens per "
            "sequence); use a dataset made by precision_suite.run"
        )
    layers = default_attention_layers(softmax) if layers is None else [int(layer) for layer in layers]
    end = {
        (v, layer): _end_value(datasets[v]["attention_norm"].sel(layer=layer))
        for v in FIGURE_A_VARIANTS
        for layer in layers
    }
    return [
        _softmax_bounded(softmax),
        _twins_apart(end, layers),
        _unscaled_largest(end, layers),
        _depth_changes_growth(datasets, layers),
    ]


def _softmax_bounded(softmax: xr.Dataset) -> Claim:
    bound = math.sqrt(float(softmax.attrs["N"]))
    largest = float(np.nanmax(softmax["attention_norm"].values))
    return Claim(
        "softmax_bounded",
        "softmax stays bounded: ||softmax(S)||_F <= sqrt(N) at every sampled step and layer",
        bool(largest <= bound * (1 + 1e-9)),  # the bound is exact; allow float rounding
        {"softmax largest norm": largest, "sqrt(N)": bound},
    )


def _twins_apart(end: Mapping[tuple[str, int], float], layers: Sequence[int]) -> Claim:
    ratios = {
        f"{unscaled} ÷ {scaled}, layer {layer}": end[unscaled, layer] / end[scaled, layer]
        for unscaled, scaled in SCALED_TWINS.items()
        for layer in layers
    }
    return Claim(
        "scaled_twins_apart",
        f"the /sqrt(N) variants stay far lower than their unscaled twins: x/1 and x^3/1 "
        f"at least {TWIN_FACTOR:g}x x/sqrt(N) and x^3/sqrt(N) by the end (median of the "
        f"last {END_FRACTION:.0%} of steps), in each layer drawn",
        all(ratio >= TWIN_FACTOR for ratio in ratios.values()),
        ratios,
    )


def _unscaled_largest(end: Mapping[tuple[str, int], float], layers: Sequence[int]) -> Claim:
    numbers, holds = {}, True
    for layer in layers:
        ranked = sorted(FIGURE_A_VARIANTS, key=lambda v: -end[v, layer])
        holds &= set(ranked[:2]) == set(SCALED_TWINS) and all(
            end[v, layer] >= LARGE_NORM for v in SCALED_TWINS
        )
        numbers.update({f"{v}, layer {layer}": end[v, layer] for v in FIGURE_A_VARIANTS})
    return Claim(
        "unscaled_largest",
        f"x/1 and x^3/1 have the largest norms, {LARGE_NORM:g} and more, by the end, in each layer drawn",
        bool(holds),
        numbers,
    )


def _depth_changes_growth(datasets: Mapping[str, xr.Dataset], layers: Sequence[int]) -> Claim:
    shallow, deep = min(layers), max(layers)

    def growth(variant: str, layer: int) -> float:
        series = datasets[variant]["attention_norm"].sel(layer=layer)
        return _end_value(series) / float(series.values[0])

    ratios = {
        f"{v}: growth in layer {deep} ÷ growth in layer {shallow}": growth(v, deep) / growth(v, shallow)
        for v in FIGURE_A_VARIANTS
    }
    differing = sum(
        abs(math.log(r)) >= math.log(GROWTH_DIFFERENCE) for r in ratios.values() if r > 0 and math.isfinite(r)
    )
    return Claim(
        "depth_changes_growth",
        f"deeper layers grow differently from shallow ones: layer {deep}'s growth (end / "
        f"first step) at least {GROWTH_DIFFERENCE:g}x above or below layer {shallow}'s "
        "for most variants",
        differing > len(ratios) / 2,
        {**ratios, "variants that differ": float(differing)},
    )


# --------------------------------------------------------------------------- figure B claims


def figure_b_claims(ds: xr.Dataset, layers: Sequence[int] = FIGURE_B_LAYERS) -> list[Claim]:
    """The claims of figure B (SCIENCE.md) on one FP8-block run, over the layers drawn."""
    _require(ds, ("underflow", "distortion"), "figure_b_claims: the dataset")
    available = {int(v) for v in ds["layer"].values}
    unknown = [layer for layer in layers if layer not in available]
    if unknown or not layers:
        raise ValueError(
            f"figure_b_claims: layers {unknown or '[]'} not in the run "
            f"(layers {min(available)}..{max(available)})"
        )
    panels = {}  # panel name -> metric -> values (step, layer), in the order the figure draws them
    for tensor, layout, _title in QUANT_PANELS:
        name = _panel_name(tensor, layout)
        if tensor not in ds["tensor"].values or layout not in ds["layout"].values:
            raise ValueError(
                f"figure_b_claims: the run did not measure {tensor} under {layout}; "
                "train it with the fp8-block measurements (the default)"
            )
        panels[name] = {
            metric: ds[metric]
            .sel(tensor=tensor, layout=layout, layer=list(layers))
            .transpose("step", "layer")
            .values.astype(float)
            for metric in ("underflow", "distortion")
        }
    layers = [int(layer) for layer in layers]
    tail = TAIL_FRACTION * (max(available) + 1)
    act, grad, transpose = panels.values()
    claims = [_tiny_underflow(act, grad)]
    claims += _transpose_underflow(grad["underflow"], transpose["underflow"], layers, tail)
    claims += _distortion(panels, layers, tail)
    return claims


def _tiny_underflow(act: dict, grad: dict) -> Claim:
    numbers = {
        "activation (1,128) largest": float(np.nanmax(act["underflow"])),
        "gradient (1,128) largest": float(np.nanmax(grad["underflow"])),
        "activation (1,128) median": float(np.nanmedian(act["underflow"])),
        "gradient (1,128) median": float(np.nanmedian(grad["underflow"])),
    }
    return Claim(
        "tiny_1x128_underflow",
        f"(1,128) underflow of activations and gradients is tiny: at most {TINY_UNDERFLOW:g} "
        "at every step and layer drawn (the paper: about 1e-4 to 1e-2)",
        numbers["activation (1,128) largest"] <= TINY_UNDERFLOW
        and numbers["gradient (1,128) largest"] <= TINY_UNDERFLOW,
        numbers,
    )


def _transpose_underflow(
    gradient: np.ndarray, transpose: np.ndarray, layers: Sequence[int], tail: float
) -> list[Claim]:
    grad_median, transpose_median = np.nanmedian(gradient, axis=0), np.nanmedian(transpose, axis=0)
    largest = np.nanmax(transpose, axis=0)
    above = {
        f"layer {layer}: gradient transpose ÷ gradient (median over steps)": _ratio(t, g)
        for layer, t, g in zip(layers, transpose_median, grad_median)
    }
    overall = _ratio(np.nanmedian(transpose), np.nanmedian(gradient))
    spikes = {
        f"layer {layer}: largest ÷ median step": _ratio(m, median)
        for layer, m, median in zip(layers, largest, transpose_median)
    }
    worst = layers[int(np.nanargmax(largest))]
    medians = {
        f"layer {layer}: gradient transpose median": float(t) for layer, t in zip(layers, transpose_median)
    }
    largest_steps = {f"layer {layer}: largest step": float(m) for layer, m in zip(layers, largest)}
    return [
        Claim(
            "transpose_above_gradient",
            "(128,1) gradient-transpose underflow is above the (1,128) gradient's in every layer "
            "drawn (median over steps)",
            all(ratio > 1 for ratio in above.values()),
            {**above, **medians},
        ),
        Claim(
            "transpose_far_larger",
            f"... and far larger: at least {FAR_LARGER:g}x the gradient's (median over steps and "
            "layers drawn)",
            overall >= FAR_LARGER,
            {"gradient transpose ÷ gradient": overall},
        ),
        Claim(
            "transpose_spiky",
            f"(128,1) gradient-transpose underflow is spiky: in some layer drawn a step reaches "
            f"{SPIKE_FACTOR:g}x the layer's median step",
            any(ratio >= SPIKE_FACTOR for ratio in spikes.values()),
            spikes,
        ),
        Claim(
            "transpose_worst_in_tail",
            "(128,1) gradient-transpose underflow is worst in tail layers: the layer drawn with "
            f"the largest step is in the last third of the depth (layer >= {math.ceil(tail)})",
            worst >= tail,
            {"worst layer": float(worst), **largest_steps},
        ),
    ]


def _distortion(panels: Mapping[str, dict], layers: Sequence[int], tail: float) -> list[Claim]:
    medians = {
        f"{name}: median distortion": float(np.nanmedian(p["distortion"])) for name, p in panels.items()
    }
    lowest = {name: float(np.nanmin(p["distortion"])) for name, p in panels.items()}
    deepest_panel = min(lowest, key=lowest.get)
    distortion = panels[deepest_panel]["distortion"]
    deepest_layer = layers[int(np.unravel_index(np.nanargmin(distortion), distortion.shape)[1])]
    return [
        Claim(
            "distortion_near_one",
            f"distortion (cosine similarity) stays near 1: the median of every panel >= {NEAR_ONE:g}",
            all(value >= NEAR_ONE for value in medians.values()),
            medians,
        ),
        Claim(
            "transpose_distortion_dips",
            "distortion dips in tail layers, deepest in the gradient transpose: the lowest "
            "distortion drawn is in the (128,1) panel, in a layer of the last third",
            deepest_panel == _panel_name("gradient_transpose", "128x1") and deepest_layer >= tail,
            {
                **{f"{name}: lowest distortion": value for name, value in lowest.items()},
                "layer of the lowest": float(deepest_layer),
            },
        ),
    ]


# --------------------------------------------------------------------------- helpers


def _panel_name(tensor: str, layout: str) -> str:
    """'gradient_transpose', '128x1' -> 'gradient transpose (128,1)', as the paper titles panels."""
    return f"{tensor.replace('_', ' ')} ({layout.replace('x', ',')})"


def _require(ds: xr.Dataset, names: Sequence[str], what: str) -> None:
    missing = [name for name in names if name not in ds.variables]
    if missing:
        raise ValueError(
            f"{what} lacks {', '.join(missing)}; use datasets made by "
            "precision_suite.run (schema in docs/architecture.md)"
        )


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; infinite where the denominator is 0 (nothing underflowed)."""
    return float(numerator / denominator) if denominator > 0 else math.inf


def _end_value(series: xr.DataArray) -> float:
    """The value "by the end": the median over the sampled steps in the last END_FRACTION of the
    run (one sampled step alone can be a spike)."""
    steps = series["step"].values
    first, last = int(steps[0]), int(steps[-1])
    window = series.values[steps >= last - END_FRACTION * (last - first)]
    return float(np.nanmedian(window.astype(float)))
