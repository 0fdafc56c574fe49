"""quant_error: definitions from ../shared/SCIENCE.md, ranges, pooling, NaN/Inf, bad input."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_suite import quant_error, quant_stats, quantize
from precision_suite.numerics import metrics, quantization
from precision_suite.numerics import strategies as pst
from precision_suite.numerics.metrics import reconstruction_stats

SETTINGS = settings(max_examples=50, deadline=None)


@SETTINGS
@given(
    x=pst.tensors(shape=pst.shapes(max_rows=120, max_cols=200), nonfinite=True),
    fmt=pst.formats(),
    data=st.data(),
)
def test_metrics_stay_in_range(x, fmt, data):
    layout = data.draw(pst.layouts(fmt))
    m = quant_error(x, fmt, layout)
    for key in ("underflow", "zeros_after", "overflow"):
        assert 0.0 <= m[key] <= 1.0, key
    assert m["underflow"] <= m["zeros_after"], "every underflowed element is a zero after"
    if torch.isfinite(x).any():
        assert -1.0 <= m["distortion"] <= 1.0
    else:  # nothing measurable is not a perfect reconstruction
        assert math.isnan(m["distortion"]) and math.isnan(m["sqnr_db"])
    assert m["mse"] >= 0.0 or math.isnan(m["mse"])
    assert m["nonfinite_in"] == int((~torch.isfinite(x)).sum())
    assert m["numel"] == x.numel()


@SETTINGS
@given(
    x=pst.tensors(shape=pst.shapes(max_rows=100, max_cols=260), min_log2=-60, max_log2=60),
    fmt=pst.formats(),
    data=st.data(),
)
def test_metrics_match_their_definitions_in_float64(x, fmt, data):
    """Recompute each metric in numpy float64 from x and its reconstruction."""
    layout = data.draw(pst.layouts(fmt))
    m = quant_error(x, fmt, layout)
    a = x.double().numpy().ravel()
    b = quantize(x, fmt, layout).dequantized.double().numpy().ravel()
    assert m["underflow"] == np.mean((a != 0) & (b == 0))
    assert m["zeros_after"] == np.mean(b == 0)
    err = np.sum((a - b) ** 2)
    assert m["mse"] == pytest.approx(err / a.size, rel=1e-12, abs=0)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na and nb:
        assert m["distortion"] == pytest.approx(min(np.dot(a, b) / (na * nb), 1.0), rel=1e-12)
    if err and na:
        assert m["sqnr_db"] == pytest.approx(20 * np.log10(na / np.sqrt(err)), rel=1e-9)


@SETTINGS
@given(
    x=pst.tensors(shape=pst.shapes(max_rows=100, max_cols=260), min_log2=-60, max_log2=60, nonfinite=True),
    fmt=pst.formats(),
    data=st.data(),
)
def test_the_sums_of_someone_elses_quantization_match_their_definitions(x, fmt, data):
    """reconstruction_stats (the observation's sums of a model's own quantization, which counts in
    float arithmetic where everything is finite) against the definitions in numpy float64: the
    reconstruction is the suite's quantization of x, sometimes with a NaN or Inf planted in it, and
    the scaled values are x times a drawn factor, so that some round past the format's max."""
    layout = data.draw(pst.layouts(fmt))
    x_hat = quantize(torch.nan_to_num(x), fmt, layout).dequantized.contiguous()
    if data.draw(st.booleans()):
        x_hat.view(-1)[data.draw(st.integers(0, x.numel() - 1))] = data.draw(
            st.sampled_from([math.nan, math.inf])
        )
    scaled = x * data.draw(st.sampled_from([0.0, 1.0, 2.0**20]))
    threshold = 464.0
    # the sums are taken a chunk of elements at a time: chunks of a few elements cross every boundary
    chunk = data.draw(st.sampled_from([1, 7, 128, metrics._RECONSTRUCTION_CHUNK]))
    with mock.patch.object(metrics, "_RECONSTRUCTION_CHUNK", chunk):
        m = reconstruction_stats(x, x_hat, scaled, threshold).metrics()
    a, b, s = (t.double().numpy().ravel() for t in (x, x_hat, scaled))
    finite = np.isfinite(a)
    assert m["nonfinite_in"] == np.sum(~finite)
    assert m["underflow"] == np.mean((a != 0) & (b == 0))  # NaN is not zero
    assert m["zeros_after"] == np.mean(b == 0)
    assert m["overflow"] == np.mean((np.abs(s) > threshold) | ~np.isfinite(b))
    a, b = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    if finite.any():
        err = np.sum((a - b) ** 2)
        if np.isfinite(err):
            assert m["mse"] == pytest.approx(err / finite.sum(), rel=1e-12, abs=0)
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na and nb and np.isfinite(nb):
            assert m["distortion"] == pytest.approx(min(np.dot(a, b) / (na * nb), 1.0), rel=1e-12)


def test_e4m3_underflow_is_exactly_the_science_md_threshold():
    """SCIENCE.md: an E4M3 value rounds to zero iff |x / s| <= 2**-10 (ties to even)."""
    amax = 3.0
    s = amax / 448.0
    rng = np.random.default_rng(0)
    ratios = np.exp2(rng.uniform(-14, -6, size=127))  # around the 2**-10 boundary
    ratios[:3] = [2.0**-10, np.nextafter(2.0**-10, 1), np.nextafter(2.0**-10, 0)]
    x = torch.tensor(np.concatenate([[amax], ratios * s]), dtype=torch.float32)[None, :]
    scaled = (x / torch.tensor(s, dtype=torch.float32)).abs()
    expected = float(((scaled <= 2.0**-10) & (x != 0)).sum()) / x.numel()
    assert quant_error(x, "e4m3", (1, 128))["underflow"] == expected
    assert 0 < expected < 1


def test_underflow_counts_only_lost_values_but_zeros_after_counts_all_zeros():
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0
    x[0, 1] = 1e-5  # flushed: 1e-5 < 2**-10 with s = 1
    m = quant_error(x, "e4m3", (1, 128))
    assert m["underflow"] == 1 / 128
    assert m["zeros_after"] == 127 / 128


def test_overflow_counts_saturation_not_the_amax_element():
    """With s = amax/448 nothing saturates; MX's power-of-two scale lets up to 2**9 * s through,
    and everything past 464 * s (448 plus half an ulp) is clipped."""
    x = torch.linspace(1.0, 511.0, 32)[None, :]  # one MX block, shared exponent floor(log2 511) - 8 = 0
    assert quant_error(x, "e4m3", (1, 32))["overflow"] == 0.0
    expected = float((x > 464.0).sum()) / x.numel()
    assert quant_error(x, "mxfp8", (1, 32))["overflow"] == expected > 0


def test_distortion_is_computed_in_float64():
    """Nearly exact reconstructions: a float32 cosine can exceed 1; ours stays <= 1 and agrees
    with numpy float64."""
    x = torch.randn(512, 512) * 1e3
    m = quant_error(x, "bf16", "tensor")
    a = x.double().numpy().ravel()
    b = quantize(x, "bf16", "tensor").dequantized.double().numpy().ravel()
    assert m["distortion"] <= 1.0
    assert m["distortion"] == pytest.approx(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-13)


def test_pooled_stats_equal_the_concatenated_tensor():
    """Sums add: pooling two tensors equals quantizing both as one (row tiles keep blocks apart)."""
    a, b = torch.randn(64, 256), torch.randn(32, 256) * 1e-3
    pooled = (quant_stats(a, "e4m3", (1, 128)) + quant_stats(b, "e4m3", (1, 128))).metrics()
    whole = quant_error(torch.cat([a, b]), "e4m3", (1, 128))
    for key in whole:
        assert pooled[key] == pytest.approx(whole[key], rel=1e-12), key


def test_nan_and_inf_are_counted_not_crashed_on():
    x = torch.randn(8, 128)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -float("inf")
    m = quant_error(x, "e4m3", (1, 128))
    assert m["nonfinite_in"] == 3
    assert m["overflow"] == 3 / x.numel(), "NaN stays non-finite, +-Inf saturates: all three count"
    clean = quant_error(torch.where(torch.isfinite(x), x, 0.0), "e4m3", (1, 128))
    assert m["distortion"] == pytest.approx(clean["distortion"], rel=1e-12)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_a_tensor_with_no_finite_element_scores_nan_not_perfect(fill):
    m = quant_error(torch.full((4, 128), fill), "e4m3", (1, 128))
    assert m["nonfinite_in"] == 4 * 128
    assert math.isnan(m["distortion"]) and math.isnan(m["sqnr_db"]) and math.isnan(m["mse"])


@pytest.mark.parametrize("fmt", ["e4m3", "mxfp8", "nvfp4"])
def test_the_default_layout_is_the_formats_own(fmt):
    x = torch.randn(64, 256)
    own = {"e4m3": (1, 128), "mxfp8": (1, 32), "nvfp4": (1, 16)}[fmt]
    assert quant_error(x, fmt) == quant_error(x, fmt, own)
    assert torch.equal(quantize(x, fmt).dequantized, quantize(x, fmt, own).dequantized)


def test_exact_reconstruction_has_infinite_sqnr_and_unit_distortion():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0]])
    m = quant_error(x, "e4m3", "tensor")
    assert m["sqnr_db"] == math.inf and m["distortion"] == 1.0 and m["mse"] == 0.0


def test_all_zero_tensor():
    m = quant_error(torch.zeros(4, 128), "e4m3", (1, 128))
    assert m["underflow"] == 0.0 and m["zeros_after"] == 1.0 and m["distortion"] == 1.0


def test_empty_tensor_is_a_clear_error():
    with pytest.raises(ValueError, match="empty"):
        quant_error(torch.empty(0, 4))


@pytest.mark.slow
@pytest.mark.parametrize("fmt, layout", [("e4m3", (1, 128)), ("mxfp8", (32, 1))])
def test_compiled_pass_agrees_with_eager(fmt, layout, monkeypatch):
    """The fused (torch.compile) pass used for large tensors gives the eager numbers: counts
    exactly, float64 sums to reduction-order rounding."""
    x = torch.randn(1024, 1536) * torch.exp2(torch.randint(-30, 30, (1024, 1)).float())
    x[5, 7] = float("nan")
    compiled = quant_error(x, fmt, layout)
    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "0")
    eager = quant_error(x, fmt, layout)
    assert not quantization._compile_failed, "torch.compile fell back to eager: nothing was compared"
    for key in eager:
        assert compiled[key] == pytest.approx(eager[key], rel=1e-12), key
