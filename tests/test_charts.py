"""Charts are checked for content (panels, lines, data, labels, scales), and for byte determinism."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.collections import PathCollection, PolyCollection

from precision_suite.numerics.metric_table import METRICS, SPACES
from precision_suite.reports import canvas, drift_chart, figures
from precision_suite.verdicts.ensemble.build import make_ensemble
from precision_suite.verdicts.ensemble.compare import compare_ensemble
from precision_suite.verdicts.findings import Finding
from precision_suite.verdicts.rule_check import check_rules
from precision_suite.verdicts.tolerances import compare, tolerance_band
from synthetic_data import make_run_dataset


def _data_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def _texts(ax) -> str:
    return " ".join(t.get_text() for t in ax.texts)


def test_attention_norm_default_layers_one_line_per_variant_log_y():
    variants = {
        name: make_run_dataset(attention=name, depth=12, growth=g)
        for name, g in (("softmax", 0.1), ("x/1", 1.0), ("x^3/sqrt(N)", 0.5))
    }
    fig = figures.plot_attention_norm(variants)
    axes = _data_axes(fig)
    assert [ax.get_title() for ax in axes] == ["layer 1", "layer 11"]  # an early and the last
    for ax, layer in zip(axes, (1, 11)):
        assert ax.get_yscale() == "log"
        assert ax.get_xlabel() == "training step"
        assert "norm" in ax.get_ylabel()
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == list(variants)
        for line, ds in zip(lines, variants.values()):
            np.testing.assert_array_equal(line.get_xdata(), ds["step"].values)
            np.testing.assert_array_equal(line.get_ydata(), ds["attention_norm"].sel(layer=layer).values)
    title = fig.get_suptitle()
    assert "model vit" in title and "recipe fp32" in title
    legend_labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_labels == list(variants)


def test_attention_norm_single_run_title_names_the_case_and_tokens_axis():
    ds = make_run_dataset(depth=4)
    fig = figures.plot_attention_norm({"softmax": ds}, layers=[0, 2, 3], x="tokens")
    axes = _data_axes(fig)
    assert [ax.get_title() for ax in axes] == ["layer 0", "layer 2", "layer 3"]
    assert ds.attrs["case"] in fig.get_suptitle()
    assert axes[0].get_xlabel() == "tokens seen"
    np.testing.assert_array_equal(axes[0].get_lines()[0].get_xdata(), ds["tokens"].values)


def test_softmax_bound_sqrt_n_is_drawn_where_the_run_records_n():
    variants = {name: make_run_dataset(attention=name, depth=4) for name in ("softmax", "x/1")}
    assert not any(
        "bound" in line.get_label()
        for ax in _data_axes(figures.plot_attention_norm(variants))
        for line in ax.get_lines()
    )
    variants["softmax"].attrs["N"] = variants["x/1"].attrs["N"] = 16
    for ax in _data_axes(figures.plot_attention_norm(variants)):
        (bound,) = [line for line in ax.get_lines() if "bound" in line.get_label()]
        assert bound.get_label() == "softmax bound √N = 4"  # only softmax has the bound
        np.testing.assert_array_equal(bound.get_ydata(), [4.0, 4.0])
        assert bound.get_color() == ax.get_lines()[0].get_color()  # drawn in softmax's colour


def test_attention_norm_counts_points_a_log_axis_cannot_draw():
    ds = make_run_dataset(depth=3)
    ds["attention_norm"][1, 1] = np.nan
    ds["attention_norm"][2, 1] = 0.0
    fig = figures.plot_attention_norm({"softmax": ds}, layers=[1])
    assert "2 NaN/Inf/non-positive point(s) not drawn" in _texts(_data_axes(fig)[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"datasets": {}}, "empty"),
        ({"x": "epoch"}, "x='epoch'"),
        ({"layers": [7]}, "layers [7] not available"),
    ],
)
def test_attention_norm_bad_arguments_say_what_to_do(kwargs, message):
    arguments = {"datasets": {"softmax": make_run_dataset(depth=4)}, **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        figures.plot_attention_norm(**arguments)


def test_quant_error_is_a_2x3_grid_over_tokens_with_every_4th_layer():
    ds = make_run_dataset(model="gpt", recipe="fp8-block", depth=18)
    fig = figures.plot_quant_error(ds)
    axes = _data_axes(fig)
    assert [ax.get_title() for ax in axes] == [
        "activations underflow (1,128)",
        "gradients underflow (1,128)",
        "gradient transpose underflow (128,1)",
        "activations distortion (1,128)",
        "gradients distortion (1,128)",
        "gradient transpose distortion (128,1)",
    ]
    pairs = [("activation", "1x128"), ("gradient", "1x128"), ("gradient_transpose", "128x1")] * 2
    metrics = ["underflow"] * 3 + ["distortion"] * 3
    for ax, (tensor, layout), metric in zip(axes, pairs, metrics):
        assert ax.get_xlabel() == "tokens seen"
        assert ax.get_ylabel() == METRICS[metric].axis_label
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == [f"layer {n}" for n in (0, 4, 8, 12, 16)]
        for line, layer in zip(lines, (0, 4, 8, 12, 16)):
            np.testing.assert_array_equal(line.get_xdata(), ds["tokens"].values)
            expected = ds[metric].sel(layer=layer, tensor=tensor, layout=layout).values
            np.testing.assert_array_equal(line.get_ydata(), expected)
    assert ds.attrs["case"] in fig.get_suptitle()


def test_quant_error_panel_of_an_unmeasured_pair_says_so():
    ds = make_run_dataset(depth=4)
    ds["underflow"].loc[dict(tensor="gradient_transpose", layout="128x1")] = np.nan
    fig = figures.plot_quant_error(ds, layers=[0, 3])
    top_right = _data_axes(fig)[2]
    assert top_right.get_lines() == []
    assert "not measured" in _texts(top_right)
    assert len(_data_axes(fig)[5].get_lines()) == 2  # distortion of the same pair is still drawn


def test_quant_error_rejects_a_dataset_without_the_schema():
    ds = make_run_dataset(depth=4).drop_vars("distortion")
    with pytest.raises(ValueError, match="lacks distortion"):
        figures.plot_quant_error(ds)


def _planted_regression():
    baseline = make_run_dataset(model="gpt", recipe="fp8-block", depth=8)
    current = baseline.copy(deep=True)
    cell = dict(layer=4, tensor="gradient_transpose", layout="128x1")
    current["underflow"].loc[cell] = current["underflow"].loc[cell] + 0.05
    return current, baseline, cell


def test_drift_chart_draws_current_baseline_band_and_marks_the_offending_step():
    current, baseline, cell = _planted_regression()
    findings = compare(current, baseline)
    regressions = [f for f in findings if f.kind == "regression"]
    assert [f.metric for f in regressions] == ["underflow"] and regressions[0].where["layer"] == 4
    fig = drift_chart.plot_drift(current, baseline, findings)
    (ax,) = _data_axes(fig)
    assert ax.get_title() == "underflow gradient_transpose 128x1"
    assert current.attrs["case"] in fig.get_suptitle()
    current_line, baseline_line = ax.get_lines()[:2]
    assert current_line.get_label() == "layer 4 current" and baseline_line.get_label() == "layer 4 baseline"
    np.testing.assert_array_equal(current_line.get_ydata(), current["underflow"].sel(cell).values)
    np.testing.assert_array_equal(baseline_line.get_ydata(), baseline["underflow"].sel(cell).values)
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    lower, upper = tolerance_band("underflow", baseline["underflow"].sel(cell).values)
    band_y = band.get_paths()[0].vertices[:, 1]
    # the chart clips the band to what a fraction can be
    assert np.isclose(band_y.min(), max(lower.min(), 0.0)) and np.isclose(band_y.max(), upper.max())
    (marks,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    np.testing.assert_allclose(marks.get_offsets(), [[regressions[0].where["step"], regressions[0].value]])


def test_drift_chart_of_threshold_findings_draws_the_bound_without_a_baseline():
    ds = make_run_dataset(depth=4, growth=1.0)
    findings = check_rules(ds, ["attention_norm <= 20 @ layer=3"])
    assert findings and all(f.kind == "threshold" for f in findings)
    fig = drift_chart.plot_drift(ds, None, findings)
    (ax,) = _data_axes(fig)
    assert ax.get_yscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["layer 3 current", "bound 20"]
    assert "thresholds" in fig.get_suptitle()


def test_drift_chart_draws_the_worst_panels_and_names_the_ones_left_out():
    baseline = make_run_dataset(model="gpt", recipe="fp8-block", depth=4)
    current = baseline.copy(deep=True)
    pairs = [
        (t, lo)
        for t in ("activation", "gradient", "gradient_transpose", "weight")
        for lo in ("1x128", "128x1", "128x128")
    ]
    # one finding per (metric, tensor, layout) panel, more panels than a chart draws, the worst last
    panels = [(metric, pair) for metric in ("underflow", "zeros_after") for pair in pairs]
    findings = [
        Finding(
            current.attrs["case"],
            "drift",
            metric,
            {"layer": 1, "tensor": t, "layout": lo, "step": 10},
            0.5,
            0.4,
            0.1,
            f"{metric} {t} {lo}",
            score=float(i),
        )
        for i, (metric, (t, lo)) in enumerate(panels)
    ]
    assert len(findings) > drift_chart.MAX_DRIFT_PANELS
    fig = drift_chart.plot_drift(current, baseline, findings)
    titles = [ax.get_title() for ax in _data_axes(fig)]
    worst_first = sorted(findings, key=lambda f: -f.score)[: drift_chart.MAX_DRIFT_PANELS]
    assert titles == [f"{f.metric} {f.where['tensor']} {f.where['layout']}" for f in worst_first]
    note = " ".join(t.get_text() for t in fig.texts)
    assert f"{len(findings) - drift_chart.MAX_DRIFT_PANELS} more panel(s) with findings not drawn" in note
    assert f"the {drift_chart.MAX_DRIFT_PANELS} worst of {len(findings)} panels" in fig.get_suptitle()


def test_drift_chart_without_chartable_findings_says_so():
    ds = make_run_dataset(depth=2)
    error = Finding(ds.attrs["case"], "error", "underflow", {}, np.nan, np.nan, np.nan, "no baseline")
    fig = drift_chart.plot_drift(ds, None, [error])
    assert "no per-metric findings" in " ".join(t.get_text() for ax in fig.axes for t in ax.texts)


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_same_input_gives_identical_file_bytes(tmp_path, suffix):
    def draw(name):
        ds = make_run_dataset(model="gpt", depth=9, seed=3)
        return canvas.save_figure(figures.plot_quant_error(ds), tmp_path / f"{name}.{suffix}")

    first, second = draw("a"), draw("b")
    assert first.read_bytes() == second.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files


def test_png_charts_are_palette_images_under_half_the_plain_size(tmp_path):
    from PIL import Image

    fig = figures.plot_quant_error(make_run_dataset(model="gpt", depth=18))
    path = canvas.save_figure(fig, tmp_path / "chart.png")
    plain = tmp_path / "plain.png"
    fig.savefig(plain, dpi=canvas.DPI)
    with Image.open(path) as image, Image.open(plain) as reference:
        assert image.mode == "P" and image.size == reference.size
        # the palette keeps the picture: every pixel within a few levels of the full-colour one
        difference = np.abs(
            np.asarray(image.convert("RGB"), dtype=int) - np.asarray(reference.convert("RGB"), dtype=int)
        )
        assert np.percentile(difference, 99) <= 16
    assert path.stat().st_size < plain.stat().st_size / 2


def test_different_input_gives_different_bytes(tmp_path):
    a = canvas.save_figure(figures.plot_quant_error(make_run_dataset(seed=1)), tmp_path / "a.png")
    b = canvas.save_figure(figures.plot_quant_error(make_run_dataset(seed=2)), tmp_path / "b.png")
    assert a.read_bytes() != b.read_bytes()


def test_save_figure_rejects_unknown_file_types(tmp_path):
    fig = figures.plot_attention_norm({"softmax": make_run_dataset(depth=2)})
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.pdf"):
        canvas.save_figure(fig, tmp_path / "chart.jpeg")


def _step0_regression(elements_now: int):
    """A seed ensemble whose activation underflow is zero at step 0 (20-40 elements of 100,000
    later), and seed 0 rerun with `elements_now` elements underflowing at step 0 of layer 2."""
    cell = dict(tensor="activation", layout="1x128")

    def zero_at_step0(ds):
        ds["underflow"].loc[dict(step=0, **cell)] = 0.0
        return ds

    ensemble = make_ensemble(
        [zero_at_step0(make_run_dataset(seed=s)) for s in (0, 1, 2, 3)],
        {metric: space.first_step_floor for metric, space in SPACES.items() if space.kind != "log_count"},
        {metric: 0.0 for metric, space in SPACES.items() if space.kind == "log_count"},
    )
    current = zero_at_step0(make_run_dataset(seed=0))
    numel = int(current["numel"].sel(layer=2, tensor="activation"))
    current["underflow"].loc[dict(step=0, layer=2, **cell)] = elements_now / numel
    return current, ensemble, numel


def test_a_count_panel_spanning_decades_has_a_symlog_axis_down_to_one_element():
    current, ensemble, numel = _step0_regression(8)
    findings = compare_ensemble(current, ensemble)
    fig = drift_chart.plot_drift(current, ensemble, findings)
    ax = _data_axes(fig)[0]
    assert ax.get_title() == "underflow activation 1x128"
    assert ax.get_yscale() == "symlog"
    assert ax.yaxis.get_transform().linthresh == pytest.approx(1 / numel)  # zero and 1 element both show
    assert ax.get_ylim()[0] == 0.0


def test_a_fraction_panel_within_a_decade_stays_linear():
    current, baseline, _ = _planted_regression()  # 3-9% underflow: a linear axis shows it
    fig = drift_chart.plot_drift(current, baseline, compare(current, baseline))
    assert _data_axes(fig)[0].get_yscale() == "linear"


def test_a_first_point_finding_gets_a_zoom_with_the_member_seed_and_counts_in_elements():
    current, ensemble, numel = _step0_regression(8)
    findings = compare_ensemble(current, ensemble)
    assert [(f.metric, f.where["layer"], f.where["step"]) for f in findings] == [("underflow", 2, 0)]
    fig = drift_chart.plot_drift(current, ensemble, findings)
    panel, zoom = _data_axes(fig)
    assert zoom.get_title() == "first point (step 0), zoomed"
    assert zoom.get_ylabel() == "elements"
    labels = [c.get_label() for c in zoom.collections]
    assert "baseline seed 0 (this run's seed)" in labels and "current" in labels
    points = {c.get_label(): c.get_offsets()[0][1] for c in zoom.collections}
    assert points["current"] == pytest.approx(8) and points["baseline seed 0 (this run's seed)"] == 0
    assert f"8 of {numel:,} elements" in _texts(zoom) and f"0 of {numel:,} elements" in _texts(zoom)
    low, high = zoom.get_ylim()
    assert low < 0 and 8 < high < 20  # the step-0 values fill the zoom


def test_findings_after_the_first_point_get_no_zoom():
    current, baseline, _ = _planted_regression()
    fig = drift_chart.plot_drift(current, baseline, compare(current, baseline))
    assert len(_data_axes(fig)) == 1
