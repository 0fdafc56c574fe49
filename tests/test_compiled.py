"""The compiled quantizers (quantization.fused) compute what the eager ones do, on hard inputs.

Compiled graphs round with bit arithmetic (inductor's float8 cast is a scalar loop) and derive MX
and power-of-two scales from exponent bits (inductor's frexp and ldexp are scalar loops), so these
tests hold them to the eager path, itself held to ml_dtypes in tests/test_oracle.py: NaN, +-Inf,
zeros, all-zero and subnormal blocks, every format and orientation.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite import quant_error, quantize
from precision_suite.numerics import quantization
from precision_suite.numerics.formats import BF16, E2M1, E4M3, E5M2, get_format
from precision_suite.numerics.quantization import round_by_bits

CASES = [
    ("e4m3", (1, 128)),
    ("e4m3", (128, 1)),
    ("e4m3", (128, 128)),
    ("e5m2", (1, 128)),
    ("e5m2", (128, 1)),
    ("mxfp8", (1, 32)),
    ("mxfp8", (32, 1)),
    ("nvfp4", (1, 16)),
    ("nvfp4", (16, 1)),
    ("bf16", "tensor"),
]


def hard_tensor(seed: int = 0) -> torch.Tensor:
    """256 x 384 (compiled, above COMPILE_MIN_NUMEL): 80 binades across rows, a band of rows of
    float32 subnormals, all-zero rows and columns, NaN and +-Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 384, generator=g) * torch.exp2(torch.randint(-40, 40, (256, 1), generator=g).float())
    x[64:96] = torch.randn(32, 384, generator=g) * 2.0**-135
    x[100:140], x[:, 200:240] = 0.0, 0.0
    x[3, 5], x[7, 300], x[150, 17] = float("nan"), float("inf"), -float("inf")
    return x


@pytest.mark.parametrize("fmt, layout", CASES, ids=lambda v: v if isinstance(v, str) else f"{v[0]}x{v[1]}")
def test_compiled_quantizers_agree_with_eager_bit_for_bit(fmt, layout, monkeypatch):
    x = hard_tensor()
    compiled_q, compiled_m = quantize(x, fmt, layout), quant_error(x, fmt, layout)
    assert not quantization._compile_failed, "torch.compile fell back to eager: nothing was compared"
    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "0")
    eager_q, eager_m = quantize(x, fmt, layout), quant_error(x, fmt, layout)
    assert torch.equal(compiled_q.scales.view(torch.int32), eager_q.scales.view(torch.int32))
    a, b = compiled_q.dequantized, eager_q.dequantized
    assert torch.equal(a.isnan(), b.isnan())  # a NaN's payload may differ, nothing else
    assert torch.equal(
        torch.where(a.isnan(), 0.0, a).view(torch.int32), torch.where(b.isnan(), 0.0, b).view(torch.int32)
    )
    for key in ("underflow", "zeros_after", "overflow", "nonfinite_in", "numel", "scale_min", "scale_max"):
        assert compiled_m[key] == eager_m[key], key
    for key in ("distortion", "sqnr_db", "mse"):  # float64 sums, summed in another order
        assert compiled_m[key] == pytest.approx(eager_m[key], rel=1e-12), key


@pytest.mark.parametrize("element", [E4M3, E5M2, E2M1, BF16], ids=lambda e: e.name)
def test_the_bit_arithmetic_keeps_every_nan_a_nan(element):
    """Quiet, signalling and all-ones NaNs (a vectorised max returns all ones) stay NaN: a carry
    out of the payload must not wrap them around to zero."""
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -1, -0x00400000], dtype=torch.int32).view(
        torch.float32
    )
    assert torch.isnan(round_by_bits(nans, element)).all()


def test_mx_scales_follow_ocp_on_every_binade():
    """E8M0 scale 2**clamp(floor(log2(amax)) - 8, -127, 127) for amax in every float32 binade,
    subnormals included, computed exactly from powers of two; an all-zero block takes frexp's
    convention (exponent 0: scale 2**-9)."""
    k = torch.arange(-149, 128)
    amax = torch.cat([torch.exp2(k.double()), torch.exp2(k.double()) * 1.75]).float()
    amax = torch.cat([amax[amax > 0], torch.zeros(1)]).reshape(-1, 1, 1, 1)
    scales = quantization.block_scales(amax, get_format("mxfp8"))
    floor_log2 = torch.where(
        amax > 0, torch.floor(torch.log2(amax.double())), torch.tensor(-1.0, dtype=torch.float64)
    )
    expected = torch.exp2(torch.clamp(floor_log2 - 8, -127, 127)).float()
    assert torch.equal(scales.view(torch.int32), expected.view(torch.int32))
