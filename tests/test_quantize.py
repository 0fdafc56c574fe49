"""Laws of quantize-dequantize, stated as hypothesis properties over shapes, magnitudes and layouts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from precision_suite import get_format, quantize
from precision_suite.numerics import strategies as pst
from precision_suite.numerics.layouts import as_2d, to_blocks
from test_oracle import all_finite_values

SETTINGS = settings(max_examples=60, deadline=None)
ELEMENT_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "bf16": ml_dtypes.bfloat16,
}


@st.composite
def cases(draw, formats=None, **tensor_kwargs):
    """(x, fmt, layout) with a layout valid for the format."""
    fmt = draw(pst.formats(formats))
    layout = draw(pst.layouts(fmt, max_block=48))
    x = draw(pst.tensors(shape=pst.shapes(max_rows=150, max_cols=150), **tensor_kwargs))
    return x, fmt, layout


def _element_grid(fmt: str) -> np.ndarray:
    return np.unique(all_finite_values(ELEMENT_DTYPES[get_format(fmt).element.name]))


def _per_element_scale(q, x) -> torch.Tensor:
    """Broadcast each block's scale back onto the elements of the 2-D view."""
    x2d = as_2d(x)
    blocks = to_blocks(torch.zeros_like(x2d), q.layout)
    s = q.scales[:, None, :, None].expand_as(blocks)
    return s.reshape(blocks.shape[0] * blocks.shape[1], -1)[: x2d.shape[0], : x2d.shape[1]]


@SETTINGS
@given(case=cases(formats=("e4m3", "e5m2", "mxfp8", "nvfp4")))
def test_every_value_is_a_grid_point_times_its_block_scale(case):
    x, fmt, layout = case
    q = quantize(x, fmt, layout)
    s = _per_element_scale(q, x)
    y = as_2d(q.dequantized)
    live = s > 0
    # y = fl(g * s) for a grid value g; y / s itself may be off by an ulp, so take the nearest g.
    grid = torch.from_numpy(_element_grid(fmt))
    ratio = y[live] / s[live]
    g = grid[(ratio[:, None] - grid[None, :]).abs().argmin(dim=1)]
    assert torch.equal(g * s[live], y[live])
    assert (y[~live] == 0).all(), "a block with a zero scale is flushed to zero"


@SETTINGS
@given(case=cases(formats=("e4m3", "e5m2", "mxfp8", "bf16"), min_log2=-100), pow2_scale=st.booleans())
def test_quantizing_twice_changes_nothing(case, pow2_scale):
    """Not a law for NVFP4: re-quantizing moves the tensor amax, hence the FP32 tensor scale."""
    x, fmt, layout = case
    once = quantize(x, fmt, layout, pow2_scale=pow2_scale).dequantized
    twice = quantize(once, fmt, layout, pow2_scale=pow2_scale).dequantized
    assert torch.equal(once, twice)


@SETTINGS
@given(case=cases(formats=("e4m3", "e5m2", "mxfp8", "nvfp4", "bf16")))
def test_sign_symmetry_and_zero_stays_zero(case):
    x, fmt, layout = case
    q = quantize(x, fmt, layout).dequantized
    assert torch.equal(quantize(-x, fmt, layout).dequantized, -q)
    assert (q[x == 0] == 0).all()
    assert (quantize(torch.zeros_like(x), fmt, layout).dequantized == 0).all()


@SETTINGS
@given(
    case=cases(formats=("e4m3", "e5m2", "mxfp8"), min_log2=-60, max_log2=60),
    k=st.integers(-20, 20),
    data=st.data(),
)
def test_power_of_two_times_a_block_scales_its_output_exactly(case, k, data):
    """Per-block formats: multiply one block by 2**k; its output is the old output times 2**k.

    Normal-range magnitudes only: the law breaks where a scale hits the float32 floor."""
    x, fmt, layout = case
    x2d = as_2d(x)
    blocks = to_blocks(x2d, layout).clone()
    i = data.draw(st.integers(0, blocks.shape[0] - 1))
    j = data.draw(st.integers(0, blocks.shape[2] - 1))
    blocks[i, :, j, :] *= 2.0**k
    rows, cols = x2d.shape
    y2d = blocks.reshape(blocks.shape[0] * blocks.shape[1], -1)[:rows, :cols]
    before = to_blocks(as_2d(quantize(x2d, fmt, layout).dequantized), layout)
    after = to_blocks(as_2d(quantize(y2d, fmt, layout).dequantized), layout)
    expected = before.clone()
    expected[i, :, j, :] *= 2.0**k
    assert torch.equal(after, expected)


@SETTINGS
@given(case=cases(formats=("nvfp4",), min_log2=-30, max_log2=30), k=st.integers(-20, 20))
def test_nvfp4_power_of_two_times_the_tensor_scales_exactly(case, k):
    """NVFP4's FP32 tensor scale couples blocks, so its law is stated for the whole tensor."""
    x, fmt, layout = case
    assert torch.equal(
        quantize(x * 2.0**k, fmt, layout).dequantized, quantize(x, fmt, layout).dequantized * 2.0**k
    )


@SETTINGS
@given(case=cases(formats=("e4m3", "e5m2", "mxfp8")), data=st.data())
def test_blocks_are_independent(case, data):
    x, fmt, layout = case
    x2d = as_2d(x)
    assume(layout != "tensor")
    blocks = to_blocks(x2d, layout).clone()
    assume(blocks.shape[0] * blocks.shape[2] > 1)
    i = data.draw(st.integers(0, blocks.shape[0] - 1))
    j = data.draw(st.integers(0, blocks.shape[2] - 1))
    blocks[i, :, j, :] = torch.randn_like(blocks[i, :, j, :]) * 1e4
    rows, cols = x2d.shape
    y2d = blocks.reshape(blocks.shape[0] * blocks.shape[1], -1)[:rows, :cols]
    before = to_blocks(as_2d(quantize(x2d, fmt, layout).dequantized), layout)
    after = to_blocks(as_2d(quantize(y2d, fmt, layout).dequantized), layout)
    others = torch.ones(blocks.shape[0], blocks.shape[2], dtype=torch.bool)
    others[i, j] = False
    assert torch.equal(before.permute(0, 2, 1, 3)[others], after.permute(0, 2, 1, 3)[others])


@SETTINGS
@given(
    x=pst.tensors(shape=pst.shapes(max_rows=300, max_cols=300, max_rank=2)),
    fmt_block=st.sampled_from([("e4m3", 128), ("e5m2", 128), ("mxfp8", 32), ("nvfp4", 16)]),
)
def test_column_tiles_are_row_tiles_of_the_transpose(x, fmt_block):
    fmt, b = fmt_block
    col = quantize(x, fmt, (b, 1))
    row = quantize(x.T.contiguous(), fmt, (1, b))
    assert torch.equal(col.dequantized, row.dequantized.T)
    assert torch.equal(col.scales, row.scales.T)


@SETTINGS
@given(
    case=cases(formats=("e4m3", "e5m2", "mxfp8", "nvfp4", "bf16")),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_output_keeps_shape_and_dtype(case, dtype):
    x, fmt, layout = case
    q = quantize(x.to(dtype), fmt, layout)
    assert q.dequantized.shape == x.shape and q.dequantized.dtype == dtype
    assert q.scales.dtype == torch.float32


def test_padding_never_changes_a_scale():
    """A 130 x 130 tensor in (128, 128) blocks: the padded blocks' scales are those of the data."""
    x = torch.randn(130, 130)
    q = quantize(x, "e4m3", (128, 128))
    for bi, rows in enumerate((slice(0, 128), slice(128, 130))):
        for bj, cols in enumerate((slice(0, 128), slice(128, 130))):
            assert q.scales[bi, bj] == x[rows, cols].abs().max() / 448.0


def test_nonfinite_inputs_do_not_poison_their_block():
    x = torch.randn(4, 128)
    x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), -float("inf")
    q = quantize(x, "e4m3", (1, 128))
    clean = quantize(torch.where(torch.isfinite(x), x, 0.0), "e4m3", (1, 128))
    assert torch.isnan(q.dequantized[0, 3])
    assert q.dequantized[1, 5] == 448.0 * q.scales[1, 0] and q.dequantized[2, 7] == -448.0 * q.scales[2, 0]
    finite = torch.isfinite(x)
    assert torch.equal(q.dequantized[finite], clean.dequantized[finite])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: quantize(torch.ones(4), "fp9", (1, 128)), "unknown format 'fp9'"),
        (lambda: quantize(torch.ones(4), "e4m3", "rows"), "unknown layout 'rows'"),
        (lambda: quantize(torch.ones(4), "e4m3", (0, 128)), "must be positive"),
        (lambda: quantize(torch.ones(4), "mxfp8", (1, 128)), "must be (1, 32), (32, 1) or (32, 32)"),
        (lambda: quantize(torch.ones(4, dtype=torch.int32), "e4m3", (1, 128)), "x.float()"),
        (lambda: quantize([1.0, 2.0], "e4m3", (1, 128)), "must be a torch.Tensor"),
    ],
)
def test_bad_input_names_the_problem(call, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_empty_tensor_gives_empty_result():
    q = quantize(torch.empty(0, 128), "e4m3", (1, 128))
    assert q.dequantized.shape == (0, 128) and q.scales.numel() == 0


def test_layout_strings_and_defaults():
    from precision_suite.numerics.layouts import layout_label, parse_layout

    assert parse_layout("128x1") == (128, 1)
    assert parse_layout(None, "mxfp8") == (1, 32)
    assert parse_layout(None, "e4m3") == (1, 128)
    assert [
        layout_label("e4m3", (1, 128)),
        layout_label("e4m3", (128, 1)),
        layout_label("mxfp8", (32, 1)),
        layout_label("e5m2", "tensor"),
    ] == ["1x128", "128x1", "mxfp8", "e5m2:tensor"]


@SETTINGS
@given(
    x=pst.tensors(shape=pst.shapes(max_rows=100, max_cols=100, max_rank=2)),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
)
def test_row_and_column_layouts_are_blocks_spanning_the_whole_axis(x, fmt):
    """ "row" is one scale per row: the block (1, columns) of this tensor; "column" is (rows, 1)."""
    rows, cols = as_2d(x).shape
    for word, block in (("row", (1, cols)), ("column", (rows, 1))):
        q, by_block = quantize(x, fmt, word), quantize(x, fmt, block)
        assert torch.equal(q.dequantized.view(torch.int32), by_block.dequantized.view(torch.int32))
        assert torch.equal(q.scales, by_block.scales)
