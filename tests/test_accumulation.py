"""The tensor-core accumulation model (numerics/accumulation.py) against mmaemu, bit for bit, and
the law of its error in K.

mmaemu (a test dependency, never a runtime one) is the independent oracle: its float64 reference
model of cuBLAS's FP8 GEMMs on an H100 PCIe (`mmaemu.accumulate`, `splitk=1`: the unsplit GEMMs
our model covers), and its instruction-level chain (`mmaemu.model.dot`) where a promotion
interval other than cuBLAS's 128 is asked for. Shapes stay small because mmaemu's CPU model
is slow, but K reaches 8192.
"""

from __future__ import annotations

import itertools
import math
import warnings
from fractions import Fraction

import mmaemu
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from precision_suite import quantize
from precision_suite.numerics import accumulation, accumulation_error, tensor_core
from precision_suite.numerics.accumulation import (
    Accumulation,
    accumulate,
    full_scales,
    parse_accumulation,
    scaled_gemm,
    split_dequantized,
)
from precision_suite.numerics.accumulation_error import accumulation_error_sums, relative_error

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ELEMENT_OF = {dtype: name for name, dtype in FP8.items()}
PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]  # cuBLAS refuses e5m2 x e5m2
# How the values of one operand are drawn (each along K, the reduction)
DISTRIBUTIONS = (
    "codes",
    "normal",
    "swamp",
    "alternating",
    "runs",
    "sparse",
    "subnormal",
    "saturated",
    "specials",
)
EXAMPLES_PER_MODE = 200  # hypothesis examples per accumulation mode compared bit for bit with mmaemu


def fp8_operand(kind: str, rows: int, k: int, element: str, seed: int) -> torch.Tensor:
    """A (rows, k) float8 tensor of the element, drawn as `kind` says (K along the columns)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = FP8[element]
    grid_max = 448.0 if element == "e4m3" else 57344.0
    codes = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.int32).to(torch.uint8)
    nonfinite = (codes & 0x7F) == 0x7F if element == "e4m3" else (codes & 0x7C) == 0x7C
    finite_codes = torch.where(nonfinite, codes & 0x80, codes)
    random_values = finite_codes.view(dtype).float()
    normal = torch.randn(rows, k, generator=gen) * 2.0 ** torch.randint(-8, 8, (rows, 1), generator=gen)
    if kind == "codes":  # every finite code alike: zeros, subnormals, +-max, both signs
        values = random_values
    elif kind == "normal":
        values = normal
    elif kind == "swamp":  # one large element first, then many small ones
        values = normal * 2.0**-10
        values[:, 0] = grid_max * torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)
    elif kind == "alternating":
        values = normal.abs() * (1 - 2 * (torch.arange(k) % 2))
    elif kind == "runs":  # runs of one value, up to 300 long
        starts = torch.cumsum(torch.randint(1, 300, (k,), generator=gen), 0)
        run = torch.searchsorted(starts, torch.arange(k), right=True).clamp(max=k - 1)
        values = random_values[:, run]
    elif kind == "sparse":
        values = torch.where(torch.rand(rows, k, generator=gen) < 0.9, 0.0, normal)
    elif kind == "subnormal":  # exponent field zero: subnormals and zeros
        mantissa = 0x7 if element == "e4m3" else 0x3
        values = (codes & (0x80 | mantissa)).view(dtype).float()
    elif kind == "saturated":
        values = torch.where(torch.rand(rows, k, generator=gen) < 0.7, grid_max * torch.sign(normal), normal)
    elif kind == "specials":  # a few NaN (and, in E5M2, infinite) codes among random ones
        values = torch.where(
            torch.rand(rows, k, generator=gen) < 0.02, codes.view(dtype).float(), random_values
        )
    else:
        raise ValueError(kind)
    return values.clamp(-grid_max, grid_max).to(dtype) if kind != "specials" else values.to(dtype)


@st.composite
def gemms(draw, max_side: int = 6, max_k: int = 8192):
    """(a (M, K), w (N, K)) float8 operands: b of our GEMM is w.t(), mmaemu's second is w."""
    element_a, element_b = draw(st.sampled_from(PAIRS))
    m, n = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    k = draw(
        st.one_of(st.integers(1, 300), st.integers(1, max_k), st.integers(max_k // 2, max_k))
    )  # a third long
    kinds = draw(st.sampled_from(DISTRIBUTIONS)), draw(st.sampled_from(DISTRIBUTIONS))
    seed = draw(st.integers(0, 2**31 - 1))
    return fp8_operand(kinds[0], m, k, element_a, seed), fp8_operand(kinds[1], n, k, element_b, seed + 1)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def mmaemu_accumulate(a: torch.Tensor, w: torch.Tensor, fast: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # splitk=1 is explicit: the unsplit GEMM
        return mmaemu.accumulate(a, w, use_fast_accum=fast, splitk=1)


@settings(max_examples=EXAMPLES_PER_MODE, deadline=None)
@given(gemms())
def test_hopper_fast_equals_mmaemu_bit_for_bit(operands):
    a, w = operands
    assert torch.equal(bits(accumulate(a, w.t(), "hopper-fast")), bits(mmaemu_accumulate(a, w, fast=True)))


@settings(max_examples=EXAMPLES_PER_MODE, deadline=None)
@given(gemms())
def test_hopper_promoted_equals_mmaemu_bit_for_bit(operands):
    a, w = operands
    assert torch.equal(
        bits(accumulate(a, w.t(), "hopper-promoted")), bits(mmaemu_accumulate(a, w, fast=False))
    )


@settings(max_examples=25, deadline=None)
@given(gemms(max_side=3, max_k=1024), st.sampled_from([32, 64, 96, 256, 4096]))
def test_other_promotion_intervals_equal_mmaemus_chains(operands, chunk):
    """cuBLAS promotes every 128; other intervals against mmaemu's chain (`mmaemu.model.dot`, the
    hopper preset) over each chunk, the chunks added in K order in float32 from +0."""
    a, w = operands
    formats = (ELEMENT_OF[a.dtype], ELEMENT_OF[w.dtype])
    total = torch.zeros(a.shape[0], w.shape[0])
    for start in range(0, a.shape[1], chunk):
        chunk_a = a[:, start : start + chunk].double()[:, None, :].expand(-1, w.shape[0], -1)
        chunk_w = w[:, start : start + chunk].double()[None, :, :].expand(a.shape[0], -1, -1)
        total = total + mmaemu.model.dot(
            chunk_a.contiguous(), chunk_w.contiguous(), preset="hopper", fmt=formats
        )
    ours = accumulate(a, w.t(), "hopper-promoted", chunk)
    # NaN payloads: mmaemu's dot gives the canonical NaN per chain; a sum of them may not be
    assert torch.equal(bits(torch.where(total.isnan(), ours, total)), bits(ours))
    assert torch.equal(total.isnan(), ours.isnan())


def test_fp32_mode_is_torchs_matmul():
    a, w = fp8_operand("normal", 5, 300, "e4m3", 0), fp8_operand("normal", 7, 300, "e4m3", 1)
    assert torch.equal(accumulate(a, w.t(), "fp32"), a.float() @ w.float().t())


@settings(max_examples=40, deadline=None)
@given(
    gemms(max_k=2048),
    st.floats(2.0**-20, 2.0**10),
    st.floats(2.0**-20, 2.0**10),
    st.sampled_from(["hopper-fast", "hopper-promoted"]),
)
def test_tensor_scales_equal_mmaemus_scaled_mm(operands, scale_a, scale_b, mode):
    """Scales constant along K multiply the accumulator once: torch._scaled_mm's fp32 output as
    mmaemu computes it (mat2 column-major: w.t(); shapes padded to torch's multiples of 16)."""
    a, w = operands
    pad_k, pad_n = -a.shape[1] % 16, -w.shape[0] % 16
    a = torch.nn.functional.pad(a.float(), (0, pad_k)).to(a.dtype)
    w = torch.nn.functional.pad(w.float(), (0, pad_k, 0, pad_n)).to(w.dtype)
    sa, sb = torch.tensor(scale_a, dtype=torch.float32), torch.tensor(scale_b, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = mmaemu.scaled_mm(
            a, w.t(), sa, sb, out_dtype=torch.float32, use_fast_accum=mode == "hopper-fast", splitk=1
        )
    assert torch.equal(bits(scaled_gemm(a, w.t(), sa, sb, mode)), bits(expected))


def rn32(x: Fraction) -> float:
    """x rounded to the nearest float32, ties to even (exact rational arithmetic)."""
    if x == 0:
        return 0.0
    magnitude = abs(x)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    quantum = Fraction(2) ** (max(exponent, -126) - 23)
    steps = magnitude / quantum
    whole = math.floor(steps)
    if steps - whole > Fraction(1, 2) or (steps - whole == Fraction(1, 2) and whole % 2):
        whole += 1
    return math.copysign(float(whole * quantum), x)


def fma_exactly(x: float, y: float, z: float) -> float:
    """x * y + z rounded once to float32; an exact zero takes IEEE's sign (-0 only from -0 + -0),
    which float64 arithmetic gives for it (the product of two float32 values is exact there)."""
    exact = Fraction(x) * Fraction(y) + Fraction(z)
    return rn32(exact) if exact != 0 else x * y + z


@settings(max_examples=40, deadline=None)
@given(
    st.integers(-60, 60),
    st.integers(-60, 60),
    st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=3, max_size=3),
)
def test_the_promotions_multiply_add_rounds_once(e1, e2, free):
    """x * y + z rounded once to float32, as a GPU's FFMA: on products that sit a hair off a
    float32 tie of the sum (where rounding through float64 first would land on the tie and round
    to even), times powers of two, and on any float32 triple."""
    x, y, z = [], [], []
    for i, j, k, sign in itertools.product(range(-4, 5), range(-4, 5), range(4), (1, -1)):
        x.append((1 + i * 2.0**-23 if i >= 0 else 1 + i * 2.0**-24) * 2.0**e1)
        y.append(sign * 2.0**-24 * (1 + j * 2.0**-23 if j >= 0 else 1 + j * 2.0**-24) * 2.0**e2)
        z.append((1 + k * 2.0**-23) * 2.0 ** (e1 + e2))
    x, y, z = x + free[:1], y + free[1:2], z + free[2:]
    ours = accumulation._fma32(*(torch.tensor(v, dtype=torch.float32) for v in (x, y, z)))
    x, y, z = (torch.tensor(v, dtype=torch.float32).tolist() for v in (x, y, z))  # the float32 values
    expected = [fma_exactly(a, b, c) for a, b, c in zip(x, y, z)]
    assert torch.equal(bits(ours), bits(torch.tensor(expected, dtype=torch.float32)))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 700),
    st.sampled_from([32, 64, 128]),
    st.integers(0, 2**31 - 1),
)
def test_block_scales_apply_on_promotion_as_one_fused_multiply_add(m, n, k, chunk, seed):
    """Scales that change along K (here one per chunk of K, per row of a and column of b, over
    a wide range of magnitudes): the result is chunk by chunk RN32(partial * RN32(sa * sb) +
    total), from +0, in exact arithmetic, each partial the chain over the chunk alone."""
    gen = torch.Generator().manual_seed(seed)
    a = fp8_operand("normal", m, k, "e4m3", seed)
    w = fp8_operand("codes", n, k, "e4m3", seed + 1)
    chunks = -(-k // chunk)
    per_chunk_a = torch.exp2(torch.randint(-30, 30, (m, chunks), generator=gen).float()) * (
        1 + torch.rand(m, chunks, generator=gen)
    )
    per_chunk_b = torch.exp2(torch.randint(-30, 30, (chunks, n), generator=gen).float()) * (
        1 + torch.rand(chunks, n, generator=gen)
    )
    scale_a = per_chunk_a.repeat_interleave(chunk, 1)[:, :k]
    scale_b = per_chunk_b.repeat_interleave(chunk, 0)[:k]
    ours = scaled_gemm(a, w.t(), scale_a, scale_b, "hopper-promoted", chunk)
    partials = [
        accumulate(a[:, g * chunk : (g + 1) * chunk], w[:, g * chunk : (g + 1) * chunk].t(), "hopper-fast")
        for g in range(chunks)
    ]
    expected = torch.zeros(m, n)
    for i in range(m):
        for j in range(n):
            total = 0.0
            for g, partial in enumerate(partials):
                scale = rn32(Fraction(per_chunk_a[i, g].item()) * Fraction(per_chunk_b[g, j].item()))
                total = fma_exactly(partial[i, j].item(), scale, total)
            expected[i, j] = total
    assert torch.equal(bits(ours), bits(expected))


def test_scales_must_hold_within_a_chain():
    a, w = fp8_operand("normal", 2, 256, "e4m3", 0), fp8_operand("normal", 3, 256, "e4m3", 1)
    blocks_of_128 = full_scales(torch.tensor([[0.5, 2.0]]), (1, 128), 2, 256)
    with pytest.raises(ValueError, match="hopper-fast accumulates all of K in one tensor-core chain"):
        scaled_gemm(a, w.t(), blocks_of_128, 1.0, "hopper-fast")
    with pytest.raises(ValueError, match="changes within a promotion interval of 256"):
        scaled_gemm(a, w.t(), blocks_of_128, 1.0, "hopper-promoted", 256)
    # one scale per row of a and per column of b: constant along K, fine in both modes
    rows, cols = torch.tensor([[0.5], [2.0]]), torch.tensor([[1.0, 4.0, 0.25]])
    for mode in ("hopper-fast", "hopper-promoted"):
        expected = accumulate(a, w.t(), mode) * (rows * cols)
        assert torch.equal(scaled_gemm(a, w.t(), rows, cols, mode), expected)


def test_bad_operands_are_refused_with_the_fix():
    a, w = fp8_operand("normal", 2, 64, "e4m3", 0), fp8_operand("normal", 3, 64, "e5m2", 1)
    with pytest.raises(ValueError, match="pass elements="):
        accumulate(a.float(), w.t(), "hopper-fast")
    with pytest.raises(ValueError, match="not an e4m3 value"):
        accumulate(a.float() * 1.01, w.float().t(), "hopper-fast", elements=("e4m3", "e5m2"))
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        accumulate(w, w.t(), "hopper-promoted")
    with pytest.raises(ValueError, match="no tensor-core accumulation model"):
        accumulate(a.float(), w.float().t(), "hopper-fast", elements=("e2m1", "e5m2"))
    with pytest.raises(ValueError, match="accumulation mode 'hopper'"):
        accumulate(a, w.t(), "hopper")
    with pytest.raises(ValueError, match="a positive multiple of 32"):
        accumulate(a, w.t(), "hopper-promoted", 100)


def test_accumulation_spec_round_trips():
    for text in ("fp32", "hopper-fast", "hopper-promoted:128", "hopper-promoted:4096"):
        assert parse_accumulation(text).text() == text
    assert parse_accumulation("hopper-promoted") == Accumulation("hopper-promoted", 128)
    for bad, message in (
        ("hopper-fast:128", "only hopper-promoted takes an interval"),
        ("hopper-promoted:x", "a number of elements of K"),
        ("hopper-promoted:48", "multiple of 32"),
        ("fp16", "use one of"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_accumulation(bad)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["e4m3", "e5m2"]),
    st.sampled_from(["tensor", (1, 128), (128, 128), (128, 1), (1, 32)]),
    st.integers(1, 180),
    st.integers(1, 180),
    st.integers(0, 2**31 - 1),
)  # below quantize's compile size
def test_split_dequantized_recovers_the_elements(element, layout, rows, cols, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 7 - 3)
    q = quantize(x, element, layout)
    scales = full_scales(q.scales, layout, rows, cols)
    elements = split_dequantized(q.dequantized, scales, element)
    assert torch.equal(elements.to(FP8[element]).float(), elements)  # on the element's grid
    assert torch.equal(bits(elements * scales), bits(q.dequantized))
    with pytest.raises(ValueError, match="not an .* element times its scale"):
        split_dequantized(q.dequantized, scales * 1.5, element)


# ----------------------------------------------------------------------------- the law in K

SMALL = 2.0**-13  # 2^-FRACTION_BITS


def error_bound(k: int, mode: str, chunk: int = 128) -> float:
    """The largest |C - R| / W the model allows, derived from its rule (below)."""
    groups = -(-k // 32)
    if mode == "hopper-fast":
        return (k + 2 * groups) * SMALL
    chain = min(chunk, -(-k // 32) * 32)
    return (chain + 2 * chain // 32) * SMALL + (-(-k // chunk) - 1) * 2.0**-24


@settings(max_examples=40, deadline=None)
@given(gemms(max_side=4), st.sampled_from(["hopper-fast", "hopper-promoted"]))
def test_error_is_bounded_by_the_modelled_fraction_bits(operands, mode):
    """|C - R| < bound * W for every output, W = sum_k max(|a_k b_k|, 2^(e(a_k) + e(b_k))).

    Derivation, per group j of one chain, q_j = 2^(E_j - 13): each of its n_j products and the
    chain value c_j lose less than q_j when truncated onto the grid, and the result loses less
    than 2^-13 of itself when cut to 13 fraction bits. E_j is a product's nominal exponent
    (2^E_j <= W) or c_j's (2^E_j <= |c_j|); truncation toward zero never grows a magnitude, so
    |c_j| and every result are at most the sum of the |products| so far (<= W). Hence group j
    loses less than (n_j + 2) 2^-13 W, and a chain over L elements less than
    (L + 2 ceil(L / 32)) 2^-13 W. hopper-fast is one chain over K: the bound grows with K.
    hopper-promoted: chains of 128, each bounded by its own share of W, then G - 1 float32
    additions, each off by at most 2^-24 of a sum <= W: the bound does not grow with K (but
    for 2^-24 per chunk). R: the float64 product; its own error (< 2^-40 W) is far below.
    """
    a, w = operands
    a32, b32 = a.float(), w.float().t()
    if not (a32.isfinite().all() and b32.isfinite().all()):
        return  # IEEE specials are exact by their own rule
    c = accumulate(a, w.t(), mode).double()
    r = a32.double() @ b32.double()
    emin = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}  # subnormals keep the smallest normal exponent
    nominal = torch.exp2((torch.frexp(a32.double())[1] - 1).clamp(min=emin[a.dtype]).double())
    nominal_b = torch.exp2((torch.frexp(b32.double())[1] - 1).clamp(min=emin[w.dtype]).double())
    weight = torch.maximum(
        (a32.double().abs()[:, :, None] * b32.double().abs()[None]),
        torch.where((a32 != 0)[:, :, None] & (b32 != 0)[None], nominal[:, :, None] * nominal_b[None], 0.0),
    ).sum(1)
    bound = error_bound(a.shape[1], mode) * weight + 2.0**-40 * weight
    assert bool(((c - r).abs() <= bound).all())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 16), st.integers(14, 22), st.integers(2, 8192), st.sampled_from([32, 128, 512]))
def test_one_large_product_swamps_the_rest_of_a_fast_chain_but_one_chunk_of_a_promoted_one(p, d, k, chunk):
    """Products 2^p, then K - 1 products 2^s, s = p - d, d >= 14: every small product is below
    the grid 2^(p - 13) of a chain that holds 2^p, so truncation drops it. hopper-fast keeps
    2^p: it loses (K - 1) 2^s, growing with K. hopper-promoted loses only the small products of
    the first chunk, (min(chunk, K) - 1) 2^s, whatever K; the other chunks sum their equal
    powers of two exactly, and so do the float32 promotions (d <= 22 and K <= 8192 keep every
    sum within 24 bits)."""
    s = p - d
    if s < -12:  # products below E4M3's normal range
        return
    first_a = min(p, 8)
    small_a = max(min(s, 8), -6)
    a = torch.full((1, k), 2.0**small_a)
    b = torch.full((k, 1), 2.0 ** (s - small_a))
    a[0, 0], b[0, 0] = 2.0**first_a, 2.0 ** (p - first_a)
    exact = 2.0**p + (k - 1) * 2.0**s
    fast = accumulate(a, b, "hopper-fast", elements=("e4m3", "e4m3")).item()
    promoted = accumulate(a, b, "hopper-promoted", chunk, elements=("e4m3", "e4m3")).item()
    assert exact - fast == (k - 1) * 2.0**s
    assert exact - promoted == (min(chunk, k) - 1) * 2.0**s


def test_relative_error_is_the_frobenius_ratio():
    a, w = fp8_operand("normal", 4, 2048, "e4m3", 3), fp8_operand("normal", 5, 2048, "e4m3", 4)
    sums = accumulation_error_sums(a, w.t(), 0.5, 2.0, "hopper-fast")
    c = scaled_gemm(a, w.t(), 0.5, 2.0, "hopper-fast").double()
    r = (a.double() * 0.5) @ (w.double().t() * 2.0)
    assert relative_error(sums) == pytest.approx(((c - r).norm() / r.norm()).item(), rel=1e-12)
    assert sums[2] == 0
    pooled = sums + accumulation_error_sums(a, w.t(), 1.0, 1.0, "hopper-promoted")
    assert relative_error(pooled) > 0
    assert relative_error(torch.zeros(3, dtype=torch.float64)) == 0.0


@pytest.mark.slow  # compiles two kernels (tens of seconds with a cold cache)
@pytest.mark.parametrize("mode", ["hopper-fast", "hopper-promoted"])
def test_compiled_kernels_equal_mmaemu(mode, monkeypatch):
    """GEMMs of COMPILE_MIN_PRODUCTS products run the torch.compile'd steps: still mmaemu's bits."""
    from precision_suite.numerics import quantization

    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "1")
    a, w = fp8_operand("normal", 64, 4096, "e4m3", 5), fp8_operand("codes", 64, 4096, "e4m3", 6)
    assert a.shape[0] * w.shape[0] * a.shape[1] >= tensor_core.COMPILE_MIN_PRODUCTS
    ours = accumulate(a, w.t(), mode)
    assert not quantization._compile_failed, "torch.compile fell back to eager: nothing was compared"
    assert torch.equal(bits(ours), bits(mmaemu_accumulate(a, w, fast=mode == "hopper-fast")))


# ----------------------------------------------------------------------------- the metric's law


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 8192),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["hopper-fast", "hopper-promoted"]),
)
def test_the_metric_on_same_sign_operands_is_bounded_by_the_fraction_bits(m, n, k, seed, mode):
    """On same-sign normal (or zero) elements every product's weight is the product itself, so
    the per-output bound of test_error_is_bounded_by_the_modelled_fraction_bits, |C - R| <=
    bound * W with W = |R|, holds for the Frobenius ratio: relative_error <= error_bound(K, mode).
    hopper-promoted's bound is one chunk's, plus 2^-24 per promotion: flat in K; hopper-fast's
    is K's."""
    a = fp8_operand("normal", m, k, "e4m3", seed).float().abs()
    w = fp8_operand("normal", n, k, "e4m3", seed + 1).float().abs()
    a, w = (torch.where(x == 0, 0.0, x.clamp(min=2.0**-6)).to(torch.float8_e4m3fn) for x in (a, w))
    error = relative_error(accumulation_error_sums(a, w.t(), 1.0, 1.0, mode))
    assert error <= error_bound(k, mode) + 2.0**-40
    if mode == "hopper-promoted":  # the same bound whatever K, but for the float32 promotions
        assert error <= error_bound(128, mode) + math.ceil(k / 128) * 2.0**-24 + 2.0**-40


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 8), st.integers(14, 18), st.sampled_from([256, 512, 1024, 2048, 4096, 8192]))
def test_the_metric_grows_with_k_under_fast_accumulation_and_not_under_promotion(p, d, k):
    """One product 2^p, then K - 1 products 2^(p - d), d >= 14 (below the grid of a chain that
    holds 2^p): a fast chain loses every small product, a promoted one only those of its first
    chunk (test_one_large_product_swamps_...). So the metric is, exactly,
    (K - 1) 2^-d / (1 + (K - 1) 2^-d) under hopper-fast, rising with K toward 1, and
    127 * 2^-d / (1 + (K - 1) 2^-d) under hopper-promoted, never above its value at K = 128."""
    s = p - d
    assume(s >= -12)  # the small product of two normal E4M3 elements
    small_a = max(s, -6)
    a = torch.full((1, k), 2.0**small_a)
    b = torch.full((k, 1), 2.0 ** (s - small_a))
    a[0, 0], b[0, 0] = 2.0**p, 1.0
    a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    exact = 1 + (k - 1) * 2.0**-d
    fast = relative_error(accumulation_error_sums(a, b, 1.0, 1.0, "hopper-fast"))
    promoted = relative_error(accumulation_error_sums(a, b, 1.0, 1.0, "hopper-promoted"))
    assert fast == pytest.approx((k - 1) * 2.0**-d / exact, rel=1e-12)
    assert promoted == pytest.approx(127 * 2.0**-d / exact, rel=1e-12)
    assert fast > (k // 2 - 1) * 2.0**-d / (1 + (k // 2 - 1) * 2.0**-d)  # above its value at K / 2
    assert promoted <= 127 * 2.0**-d / (1 + 127 * 2.0**-d)  # at most its value at K = 128


# ----------------------------------------------------------------------------- sampled outputs (issue 39)


def _fp8_gemm(
    m: int, k: int, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """E4M3 a (M, K) with one scale per row, b (K, N) with one per column, from N(0, 1) data."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    scale_a, scale_b = x.abs().amax(1, keepdim=True) / 448, w.abs().amax(0, keepdim=True) / 448
    return (x / scale_a).to(torch.float8_e4m3fn), (w / scale_b).to(torch.float8_e4m3fn), scale_a, scale_b


def test_the_output_subset_is_a_function_of_the_shape_alone():
    rows, columns = accumulation_error.output_subset(512, 1376)
    again = accumulation_error.output_subset(512, 1376)
    assert torch.equal(rows, again[0]) and torch.equal(columns, again[1])
    assert len(rows) == accumulation_error.SAMPLED_ROWS and len(columns) == accumulation_error.SAMPLED_COLUMNS
    assert len(set(rows.tolist())) == len(rows) and bool((rows[1:] > rows[:-1]).all()) and int(rows[-1]) < 512
    assert accumulation_error.output_subset(accumulation_error.SAMPLED_ROWS, 64) == (
        None,
        None,
    )  # small: measured whole


def test_sampled_sums_are_the_subsets_sums_scaled_to_the_whole_output():
    a, b, scale_a, scale_b = _fp8_gemm(300, 256, 200, seed=3)
    modes = list(accumulation_error.WHAT_IF)
    sampled = accumulation_error.error_sums_by_mode(a, b, scale_a, scale_b, modes, sampled=True)
    rows, columns = accumulation_error.output_subset(300, 200)
    subset = accumulation_error.error_sums_by_mode(
        a[rows], b[:, columns], scale_a[rows], scale_b[:, columns], modes
    )
    weight = 300 * 200 / (len(rows) * len(columns))
    for got, part in zip(sampled, subset):
        assert torch.equal(got[:3], part[:3] * weight) and float(got[3]) == 300 * 200


def test_a_gemm_within_the_subset_or_with_a_nonfinite_operand_is_measured_whole():
    modes = list(accumulation_error.WHAT_IF)
    small = _fp8_gemm(accumulation_error.SAMPLED_ROWS, 256, 64, seed=4)
    for got, whole in zip(
        accumulation_error.error_sums_by_mode(*small, modes, sampled=True),
        accumulation_error.error_sums_by_mode(*small, modes),
    ):
        assert torch.equal(got, whole)
    a, b, scale_a, scale_b = _fp8_gemm(300, 256, 200, seed=5)
    a = a.view(torch.uint8).clone()
    a[7, 9] = 0x7F  # an E4M3 NaN: the outputs it reaches are counted, not estimated
    a = a.view(torch.float8_e4m3fn)
    got = accumulation_error.error_sums_by_mode(a, b, scale_a, scale_b, modes, sampled=True)
    whole = accumulation_error.error_sums_by_mode(a, b, scale_a, scale_b, modes)
    assert all(torch.equal(x, y) for x, y in zip(got, whole)) and float(whole[0][2]) == 200


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_finite_elements_of_a_float8_tensor_read_from_its_codes_agree_with_its_values(dtype):
    """The check by codes (the largest magnitude code) against torch's conversion of the values:
    each of the 256 codes alone, and a tensor of finite codes with one NaN or Inf code planted."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for code in codes:
        x = code.reshape(1).view(dtype)
        assert tensor_core.finite_elements(x) == bool(x.float().isfinite().all()), int(code)
    values = codes.view(dtype).float()
    finite = codes[values.isfinite()]
    x = finite[torch.randint(len(finite), (64, 48), generator=torch.Generator().manual_seed(0))]
    assert tensor_core.finite_elements(x.view(dtype))
    for code in codes[~values.isfinite()]:
        planted = x.clone()
        planted[5, 7] = code
        assert not tensor_core.finite_elements(planted.view(dtype))
    assert tensor_core.finite_elements(torch.empty(0, 3, dtype=dtype))
