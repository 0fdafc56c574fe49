"""Bit-exact agreement with an independent oracle: ml_dtypes casts with block scaling in numpy.

The oracle re-derives each scale rule from ../shared/SCIENCE.md and the OCP MX spec in numpy and
lets ml_dtypes round the elements, so no code is shared with precision_suite.numerics.quantization.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_suite import quantize
from precision_suite.numerics import strategies as pst
from precision_suite.numerics.code_tables import codes
from precision_suite.numerics.formats import BF16, E2M1, E4M3, E5M2, ElementType, Format
from precision_suite.numerics.quantization import round_by_bits, round_to_element

F32 = np.float32
FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
# OCP MX's FP6 element, declared here only: a format the package does not ship
E3M2 = ElementType("e3m2", exp_bits=3, man_bits=2, bias=3, max=28.0)
# each minifloat element with the ml_dtypes type that is its oracle
MINIFLOAT_ORACLES = [
    (E4M3, ml_dtypes.float8_e4m3fn),
    (E5M2, ml_dtypes.float8_e5m2),
    (E2M1, ml_dtypes.float4_e2m1fn),
]


def _blocks(x: np.ndarray, layout) -> tuple[np.ndarray, tuple[int, int]]:
    rows, cols = x.shape
    r, c = (rows, cols) if layout == "tensor" else layout
    padded = np.zeros((-(-rows // r) * r, -(-cols // c) * c), dtype=F32)
    padded[:rows, :cols] = x
    return padded.reshape(padded.shape[0] // r, r, padded.shape[1] // c, c), (rows, cols)


def _unblock(b: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return b.reshape(b.shape[0] * b.shape[1], -1)[: shape[0], : shape[1]]


def _cast(y: np.ndarray, dtype, fmax: float) -> np.ndarray:
    # ml_dtypes returns NaN past the max; saturating quantizers clamp first.
    return np.clip(y, -fmax, fmax).astype(dtype).astype(F32)


def oracle_fp8(x: np.ndarray, fmt: str, layout) -> np.ndarray:
    dtype, fmax = FP8[fmt]
    b, shape = _blocks(x, layout)
    amax = np.abs(b).max(axis=(1, 3), keepdims=True)
    s = np.maximum(amax / F32(fmax), F32(2.0**-126)).astype(F32)
    return _unblock(_cast(b / s, dtype, fmax) * s, shape)


def oracle_mxfp8(x: np.ndarray, layout) -> np.ndarray:
    b, shape = _blocks(x, layout)
    amax = np.abs(b).max(axis=(1, 3), keepdims=True)
    # OCP MX v1.0: shared exponent floor(log2(amax)) - emax(E4M3) with emax = 8.
    with np.errstate(divide="ignore"):
        shared = np.where(amax > 0, np.floor(np.log2(amax.astype(np.float64))), 0) - 8
    s = np.exp2(np.clip(shared, -127, 127)).astype(F32)
    return _unblock(_cast(b / s, ml_dtypes.float8_e4m3fn, 448.0) * s, shape)


def oracle_nvfp4(x: np.ndarray, layout) -> np.ndarray:
    b, shape = _blocks(x, layout)
    amax = np.abs(b).max(axis=(1, 3), keepdims=True)
    tensor_scale = max(F32(amax.max()) / F32(6.0 * 448.0), F32(2.0**-126))
    block_scale = _cast((amax / F32(6.0) / tensor_scale).astype(F32), ml_dtypes.float8_e4m3fn, 448.0)
    s = (block_scale * tensor_scale).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s > 0, b / np.where(s > 0, s, 1), 0).astype(F32)
    return _unblock(_cast(y, ml_dtypes.float4_e2m1fn, 6.0) * s, shape)


def _ours(x: np.ndarray, fmt: str, layout) -> np.ndarray:
    return quantize(torch.from_numpy(x), fmt, layout).dequantized.numpy()


def _assert_bits_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    mismatch = ours.view(np.uint32) != ref.view(np.uint32)
    assert not mismatch.any(), (
        f"{mismatch.sum()} mismatches, first at {np.argwhere(mismatch)[0]}: ours {ours[mismatch][0]!r} oracle {ref[mismatch][0]!r}"
    )


def _wide(seed: int, shape=(256, 384)) -> np.ndarray:
    """Wide random data: log-uniform magnitudes over 60 binades, random signs, some zeros."""
    rng = np.random.default_rng(seed)
    x = rng.choice([-1.0, 1.0], size=shape) * np.exp2(rng.uniform(-30, 30, size=shape))
    x[rng.random(shape) < 0.02] = 0.0
    return x.astype(F32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", [(1, 128), (128, 1), (128, 128), "tensor", (3, 50)])
def test_fp8_blocks_match_oracle_on_wide_data(fmt, layout):
    for seed in range(3):
        x = _wide(seed)
        _assert_bits_equal(_ours(x, fmt, layout), oracle_fp8(x, fmt, layout))


@pytest.mark.parametrize("layout", [(1, 32), (32, 1)])
def test_mxfp8_matches_oracle_on_wide_data(layout):
    for seed in range(3):
        x = _wide(
            seed, shape=(256, 300)
        )  # 300 does not divide by 32: padded blocks too; large enough for the fused path
        _assert_bits_equal(_ours(x, "mxfp8", layout), oracle_mxfp8(x, layout))


@pytest.mark.parametrize("layout", [(1, 16), (16, 1)])
def test_nvfp4_matches_oracle_on_wide_data(layout):
    for seed in range(3):
        # NVFP4 spans fewer binades per tensor (E4M3 block scales): 12 binades keep most blocks alive.
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal((320, 210)) * np.exp2(rng.uniform(-6, 6, size=(320, 210)))).astype(F32)
        _assert_bits_equal(_ours(x, "nvfp4", layout), oracle_nvfp4(x, layout))


def all_finite_values(dtype) -> np.ndarray:
    """Every finite value of an 8- or 16-bit ml_dtypes type, from all its bit patterns."""
    width = np.uint8 if np.dtype(dtype).itemsize == 1 else np.uint16
    values = np.arange(np.iinfo(width).max + 1, dtype=width).view(dtype).astype(np.float32)
    return values[np.isfinite(values)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_fp8_bit_pattern_and_every_midpoint(fmt):
    """Each finite FP8 value, each midpoint between neighbours (ties) and its float32 neighbours,
    in a block whose amax is the format max (scale exactly 1)."""
    dtype, fmax = FP8[fmt]
    grid = np.unique(all_finite_values(dtype))
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(F32)
    probes = np.concatenate([grid, mids, np.nextafter(mids, F32(np.inf)), np.nextafter(mids, F32(-np.inf))])
    row = np.concatenate([probes, [F32(fmax)]]).astype(F32)[None, :]
    ours = _ours(row, fmt, "tensor")
    _assert_bits_equal(ours, row.astype(dtype).astype(F32))
    assert np.array_equal(_ours(grid[None, :], fmt, "tensor"), grid[None, :]), (
        "grid values must be fixed points"
    )


def test_every_bf16_bit_pattern_and_ties():
    grid = np.unique(all_finite_values(ml_dtypes.bfloat16))
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(F32)
    probes = np.concatenate([grid, mids, np.nextafter(mids, F32(np.inf)), np.nextafter(mids, F32(-np.inf))])[
        None, :
    ]
    _assert_bits_equal(_ours(probes, "bf16", "tensor"), probes.astype(ml_dtypes.bfloat16).astype(F32))


@settings(max_examples=60, deadline=None)
@given(
    x=pst.tensors(shape=pst.shapes(max_rows=160, max_cols=160, max_rank=2), min_log2=-140, max_log2=60),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    layout=pst.layouts(max_block=40),
)
def test_fp8_matches_oracle_property(x, fmt, layout):
    _assert_bits_equal(_ours(x.numpy(), fmt, layout), oracle_fp8(x.numpy(), fmt, layout))


@pytest.mark.parametrize(
    "element, dtype", [*MINIFLOAT_ORACLES, (BF16, ml_dtypes.bfloat16)], ids=lambda v: getattr(v, "name", "")
)
@pytest.mark.parametrize("rounding", [round_to_element, round_by_bits], ids=["torch-cast", "bit-arithmetic"])
def test_both_rounding_paths_match_ml_dtypes_on_every_value_and_tie(element, dtype, rounding):
    """torch's cast (where the element has a torch type) and the bit arithmetic (any minifloat:
    what a newly declared format uses) round every grid value, midpoint and neighbour alike."""
    grid = np.unique(all_finite_values(dtype))
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(F32)
    probes = np.concatenate([grid, mids, np.nextafter(mids, F32(np.inf)), np.nextafter(mids, F32(-np.inf))])
    probes = np.clip(probes, -element.max, element.max).astype(F32)
    ours = rounding(torch.from_numpy(probes), element).numpy()
    _assert_bits_equal(ours, probes.astype(dtype).astype(F32))


@pytest.mark.parametrize(
    "element, dtype",
    [*MINIFLOAT_ORACLES, (E3M2, ml_dtypes.float6_e3m2fn)],
    ids=lambda v: getattr(v, "name", ""),
)
def test_bit_arithmetic_rounds_any_float32_like_ml_dtypes(element, dtype):
    """Beyond the ties: 2**22 random float32 bit patterns within +-max, and every float32 of the
    two binades around the element's smallest normal, where the quantum stops shrinking (2**24
    values, both signs)."""
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, size=2**22, dtype=np.uint32).view(F32)
    random = random[np.isfinite(random) & (np.abs(random) <= element.max)]
    boundary = np.arange(
        *np.array([2.0 ** (element.emin - 1), 2.0 ** (element.emin + 1)], F32).view(np.uint32),
        dtype=np.uint32,
    ).view(F32)
    probes = np.concatenate([random, boundary, -boundary, np.array([0.0, -0.0], F32)])
    ours = round_by_bits(torch.from_numpy(probes), element).numpy()
    _assert_bits_equal(ours, probes.astype(dtype).astype(F32))


def test_a_new_format_is_a_declaration():
    """An FP6 E3M2 format (OCP MX's element type) declared in two lines quantizes bit for bit like
    ml_dtypes' float6_e3m2fn with the amax block scale: no new code path."""
    fp6 = Format("fp6_e3m2", E3M2, "amax")
    x = _wide(0, shape=(64, 256)) * F32(1e-3)
    for layout in [(1, 32), (32, 1)]:
        b, shape = _blocks(x, layout)
        s = np.maximum(np.abs(b).max(axis=(1, 3), keepdims=True) / F32(28.0), F32(2.0**-126)).astype(F32)
        expected = _unblock(_cast(b / s, ml_dtypes.float6_e3m2fn, 28.0) * s, shape)
        _assert_bits_equal(quantize(torch.from_numpy(x), fp6, layout).dequantized.numpy(), expected)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_amax_block_scales_are_float32_quotients_rounded_as_ieee_division(fmt):
    """The amax scale rule divides in float64 and rounds to float32 (on CUDA a float32 division
    by a scalar goes through the reciprocal: one ulp off in half the blocks, measured on an H200).
    That must be numpy's correctly rounded float32 division, over every float32 exponent."""
    from precision_suite.numerics.formats import FORMATS
    from precision_suite.numerics.quantization import TINY_SCALE, block_scales

    rng = np.random.default_rng(1)
    amax = rng.integers(1, 0x7F7FFFFF, size=1 << 20, dtype=np.int64).astype(np.uint32).view(np.float32)
    scales = block_scales(torch.from_numpy(amax), FORMATS[fmt]).numpy()
    quotient = np.divide(amax, np.float32(FORMATS[fmt].element.max), dtype=np.float32)
    expected = np.maximum(quotient, np.float32(TINY_SCALE))
    assert np.array_equal(scales.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize(
    "torch_dtype, dtype",
    [
        (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        (torch.float8_e5m2, ml_dtypes.float8_e5m2),
        (torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
        (torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz),
    ],
    ids=str,
)
def test_the_code_tables_of_the_observation_round_like_ml_dtypes(torch_dtype, dtype):
    """The tables the observation checks a model's own casts with (numerics.code_tables.codes): each
    code's value is ml_dtypes', and the float32 values whose interval holds a code are exactly those
    ml_dtypes' round-to-nearest-even (saturating at +-max) maps to that code's value: every grid
    value, midpoint and neighbour, 2**16 random float32 bit patterns, values past the max."""
    table = codes(torch_dtype, torch.device("cpu"))
    value = np.arange(256, dtype=np.uint8).view(dtype).astype(F32)
    np.testing.assert_array_equal(table.value.numpy(), value)  # NaN codes: NaN, whatever the payload
    fmax = float(np.nanmax(value[np.isfinite(value)]))
    grid = np.unique(all_finite_values(dtype))
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(F32)
    random = np.random.default_rng(0).integers(0, 2**32, size=2**16, dtype=np.uint32).view(F32)
    probes = np.concatenate(
        [
            grid,
            mids,
            np.nextafter(mids, F32(np.inf)),
            np.nextafter(mids, F32(-np.inf)),
            random[np.isfinite(random)],
            np.array([fmax * 2, -fmax * 2, 3e38, -3e38, 0.0, -0.0], F32),
        ]
    ).astype(F32)
    nearest = np.clip(probes, -fmax, fmax).astype(dtype).astype(F32)
    low, high = table.low.numpy(), table.high.numpy()
    for chunk in np.array_split(np.arange(probes.size), 16):
        v = probes[chunk, None]
        inside = (low[None, :] <= v) & (v <= high[None, :])
        assert np.array_equal(inside, value[None, :] == nearest[chunk, None])
