"""One chain of an NVIDIA H100's FP8 tensor cores, bit for bit, in torch: the dot products that
`numerics.accumulation` builds its GEMMs from (one chain over K, or one per promotion interval).

What is modelled, exactly: the rule mmaemu 0.1.0 (PyPI; preset ``hopper``, validated bit for bit
against cuBLASLt 12.8.3.14 FP8 GEMMs on an H100 PCIe; after the tensor-core model of Khattak and
Mikaitis, arXiv 2512.07004) gives for an unsplit GEMM. A chain starts from +0 and takes the
products of K in groups of GROUP = 32 consecutive elements (a ragged last group is zero padded,
which changes nothing). For each group, with c the chain's float32 value so far:

1. Each product a_k b_k has the nominal exponent e(a_k) + e(b_k), where e(x) = floor(log2 |x|)
   clamped below at the element format's smallest normal exponent (E4M3 -6, E5M2 -14: subnormal
   inputs keep a denormal significand). Zero products take no part.
2. E = the largest of those exponents and floor(log2 |c|) (c != 0).
3. Each product and c are truncated toward zero onto the grid 2^(E - FRACTION_BITS), with
   FRACTION_BITS = 13, and summed exactly.
4. The sum is truncated toward zero to 13 fraction bits of its own exponent: the new c. A zero
   result is +0.

Non-finite inputs give what IEEE arithmetic gives for the whole dot product (NaN for a NaN
operand, Inf * 0 or opposite infinities, else the infinity), NaN as the bits 0x7FFFFFFF.

Every step is exact or one IEEE rounding: the result does not depend on the device, the thread
count or whether the torch.compile'd kernels ran (`COMPILE_MIN_PRODUCTS`). Tested bit for bit
against mmaemu (tests/test_accumulation.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from precision_suite.numerics import quantization
from precision_suite.numerics.formats import get_format

HOPPER_ELEMENTS = ("e4m3", "e5m2")
GROUP = 32  # products aligned together by the tensor core
FRACTION_BITS = 13  # kept below the group's largest exponent, and in the group's result
# From this many products per GEMM (M * N * K) the chain's two steps run as torch.compile'd
# kernels, whatever a run decided for its quantizers (PRECISION_SUITE_COMPILE=0 still keeps them
# eager): eagerly a product costs about 2 ns, compiled about 0.2 ns (one thread of a 2-core
# host), so such a GEMM saves some 15 ms a call, and a run that emulates one does so for three
# GEMMs per layer, two modes each, per sampled step: the compile tax (seconds, once per process
# with a warm kernel cache) is paid back within its first step. 1 << 23 is a run's sampled
# output (`output_subset`, 128 x 128) over K = 512: a 17M-parameter model's GEMMs compile, the
# suite's tiny test models' (K <= 256) stay eager.
COMPILE_MIN_PRODUCTS = 1 << 23

_ZERO = -1000  # exponent code of a zero element: any sum with it stays below _FLOOR
# Floor of the alignment exponent E: below the exponent of any nonzero product (>= -28) or chain
# value (>= -41, a multiple of 2^(-28 - 13)), so it only bounds E when the group is all zeros.
_FLOOR = -64
_KEEP_FRACTION = ~((1 << (23 - FRACTION_BITS)) - 1)  # float32 bits kept by the result's truncation
_CANONICAL_NAN = 0x7FFFFFFF
_STEP_BUDGET = 1 << 22  # products per eager step: a tile's temporaries stay near 16 MB
_CHAIN_BUDGET = 1 << 18  # chain values per compiled step: its buffers (1 MB each) stay in cache


class FP8Operand(NamedTuple):
    """A checked GEMM operand: its values as float32, its FP8 codes (as int32, to index tables of
    the 256 codes) and its element's name."""

    values: torch.Tensor
    codes: torch.Tensor | None  # None for an fp32 GEMM's operand
    element: str


_code_tables: dict[tuple[str, str, torch.dtype, torch.device], torch.Tensor] = {}


def _look_up(
    codes: torch.Tensor, element: str, what: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Each code's entry in a table over the element's 256 codes, as `dtype`: "values" (NaN, Inf
    where the element has them) or "weights" (see `_WEIGHT_BITS`). index_select: several times faster than
    a float8 cast."""
    key = (element, what, dtype, codes.device)
    if key not in _code_tables:
        grid = get_format(element).element
        values = (
            torch.arange(256, dtype=torch.int32)
            .to(torch.uint8)
            .view(getattr(torch, grid.torch_dtype))
            .double()
        )
        if what == "weights":
            exponents = torch.frexp(values)[1].double().sub(1).clamp(min=grid.emin)
            values = torch.where(
                (values != 0) & values.isfinite(), torch.exp2(exponents * 2**_WEIGHT_BITS - 4), 0.0
            )
        _code_tables[key] = values.to(dtype).to(codes.device)
    return _code_tables[key].index_select(0, codes.flatten()).view(codes.shape)


@functools.cache
def _first_nonfinite_magnitude(dtype: torch.dtype) -> int:
    """The smallest magnitude code (the code without its sign bit) of a float8 dtype that is NaN or
    Inf: magnitude codes grow with the value, and those of NaN and Inf come last."""
    magnitudes = torch.arange(128, dtype=torch.uint8).view(dtype).float()
    return int((~magnitudes.isfinite()).nonzero()[0])


def finite_elements(x: torch.Tensor) -> bool:
    """Whether every element of x is finite: a float8 tensor by the largest of its magnitude codes
    (a byte sweep, some 100 times faster than converting it to test its values)."""
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.numel() == 0 or int((x.view(torch.uint8) & 0x7F).max()) < _first_nonfinite_magnitude(x.dtype)
    return bool(torch.isfinite(x).all())


def _operand(x: torch.Tensor, element: str | None, name: str) -> FP8Operand:
    """A GEMM operand: a float8 tensor, or float32 values of the named element (checked: each
    value must be one of the element's)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {type(x).__name__} {getattr(x, 'shape', '')}")
    by_dtype = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    if x.dtype in by_dtype:
        if element not in (None, by_dtype[x.dtype]):
            raise ValueError(f"{name} is {x.dtype} but its element is given as {element!r}")
        codes = x.view(torch.uint8).int()
        return FP8Operand(_look_up(codes, by_dtype[x.dtype], "values"), codes, by_dtype[x.dtype])
    if element is None:
        raise ValueError(
            f'{name} is {x.dtype}: pass elements=("e4m3" or "e5m2", ...) to say which FP8 '
            "element its values are, or a float8 tensor"
        )
    if element not in HOPPER_ELEMENTS:
        raise ValueError(
            f"{name}: element {element!r} has no tensor-core accumulation model; use e4m3 or e5m2"
        )
    x = x.float()
    codes = x.to(getattr(torch, get_format(element).element.torch_dtype)).view(torch.uint8).int()
    on_grid = (_look_up(codes, element, "values") == x) | x.isnan()
    if not bool(on_grid.all()):
        value = x[~on_grid].flatten()[0].item()
        raise ValueError(
            f"{name} holds {value!r}, not an {element} value: pass the FP8 elements (dequantized "
            "values over their scales, `split_dequantized`), not the dequantized tensor"
        )
    return FP8Operand(x, codes, element)


def gemm_operands(
    a: torch.Tensor, b: torch.Tensor, elements: tuple[str, str] | None, mode: str
) -> tuple[FP8Operand, FP8Operand]:
    """a (M, K) and b (K, N) checked. ``fp32`` takes any floating-point operands (a float32 GEMM
    of whatever they hold: no codes, no element)."""
    if mode == "fp32":
        for x, name in ((a, "a"), (b, "b")):
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
                raise ValueError(
                    f"{name} must be a 2-D floating-point tensor, got {type(x).__name__} "
                    f"{getattr(x, 'shape', '')}"
                )
        if a.shape[1] != b.shape[0]:
            raise ValueError(
                f"a is {tuple(a.shape)} and b is {tuple(b.shape)}: a GEMM needs a (M, K) and b (K, N)"
            )
        return FP8Operand(a.float(), None, ""), FP8Operand(b.float(), None, "")
    element_a, element_b = elements if elements is not None else (None, None)
    a, b = _operand(a, element_a, "a"), _operand(b, element_b, "b")
    if a.values.shape[1] != b.values.shape[0]:
        raise ValueError(
            f"a is {tuple(a.values.shape)} and b is {tuple(b.values.shape)}: a GEMM needs a (M, K) and "
            "b (K, N)"
        )
    if a.element == b.element == "e5m2":
        raise ValueError(
            "E5M2 x E5M2 has no accumulation model: cuBLAS and torch._scaled_mm refuse it; make one "
            "operand e4m3"
        )
    if a.values.device != b.values.device:
        raise ValueError(f"a is on {a.values.device} and b on {b.values.device}")
    return a, b


# ----------------------------------------------------------------------------- the chain

# The largest product exponent of a group, max over k of e(a_k) + e(b_k), comes from a matrix
# product: with w(x) = 2^(8 e(x) - 4) (0 for a zero), sum_k w(a_k) w(b_k) lies in
# [2^(8 E - 8), 32 * 2^(8 E - 8)], exactly where its terms are, so its exponent shifted right by 3
# is E - 1: both ends are powers of two, so no rounding of the sum (in any order, at any
# precision) leaves that range. bfloat16 holds the weights of E4M3 pairs (8 E - 8 within
# [-104, 120]) and its matrix products are the fastest; E5M2's wider exponents take float64.
_WEIGHT_BITS = 3


def _alignment(weight_sums: torch.Tensor, chain_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bits of (2^(13 - E), 2^(E - 13)) for one group of every chain (steps 1-2): E the larger
    of the group's largest product exponent (from its weight sums, see `_WEIGHT_BITS`) and the chain's.

    weight_sums: (C, M, N) bfloat16 or float64; chain_bits: the bit patterns of the
    chains' float32 values. The results are bit patterns too, read as floats by a view outside:
    compiled, the kernel makes no bit casts but the weight sums' (a bfloat16 one is exact in
    float32)."""
    if weight_sums.dtype == torch.float64:
        field = ((weight_sums.view(torch.int64) >> 52) - 1023).int()
    else:
        field = (weight_sums.float().view(torch.int32) >> 23) - 127
    largest = torch.where(weight_sums == 0, _ZERO, (field + 8) >> _WEIGHT_BITS)
    chain_exp = torch.where((chain_bits & 0x7FFFFFFF) == 0, _ZERO, ((chain_bits >> 23) & 0xFF) - 127)
    e = torch.maximum(largest, chain_exp).clamp_min(_FLOOR)
    return (FRACTION_BITS - e + 127) << 23, (e - FRACTION_BITS + 127) << 23


def _add_group(
    a: torch.Tensor,
    b: torch.Tensor,
    inverse_quantum: torch.Tensor,
    quantum: torch.Tensor,
    chain: torch.Tensor,
) -> torch.Tensor:
    """The chains after one group (steps 3-4): a (C, M, 32), b (C, 32, N) float32 values.

    Exact: a product of two FP8 values has at most 8 significant bits, times a power of two it is
    exact in float32 (or below 1, where truncation gives 0 however it rounded); the conversion to
    an integer truncates each term (below 2^15; their sum, below 2^21, in integer additions, which
    a CPU chains faster than float ones); times the quantum the sum is exact again."""
    terms = (
        (a[:, :, :, None] * b[:, None, :, :] * inverse_quantum[:, :, None]).int().sum(2, dtype=torch.int32)
    )
    total = (terms.float() + torch.trunc(chain * inverse_quantum)) * quantum
    # a zero result is +0, as the hardware's: the chain starts from +0, the group's largest
    # product never truncates to zero, and a sum that cancels is +0 under round to nearest
    return (total.view(torch.int32) & _KEEP_FRACTION).view(torch.float32)


_compiled_steps: list[Callable] = []


def _steps(products: int) -> tuple[Callable, Callable] | None:
    """The two chain steps compiled, for GEMMs of COMPILE_MIN_PRODUCTS products or more (None:
    stay eager)."""
    if not quantization.compiling(products, COMPILE_MIN_PRODUCTS, run_decides=False):
        return None
    if not _compiled_steps:
        for fn in (_alignment, _add_group):
            tag = f"precision_suite accumulation {fn.__qualname__}"
            # inductor's defaults: the quantizer's options would recompute the alignment's bit
            # arithmetic inside the group's reduction loop instead of reading it once
            _compiled_steps.append(_with_dynamic_sizes(quantization.compiled(fn, tag, options={}), fn))
    return _compiled_steps[0], _compiled_steps[1]


def _with_dynamic_sizes(compiled: Callable, eager: Callable) -> Callable:
    """`compiled` with every dimension but a group's 32 elements dynamic: one graph serves every
    GEMM shape (the number of chains, rows and columns)."""

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        for tensor in tensors:
            for dim, size in enumerate(tensor.shape):
                if size != GROUP:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        try:
            return compiled(*tensors)
        except Exception as err:  # e.g. no C++ compiler for inductor: eager gives the same bits
            quantization.give_up_compiling(err)
            return eager(*tensors)

    return call


def _chains(a: FP8Operand, b: FP8Operand, length: int) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """The chain results over consecutive runs of `length` elements of K (the last run zero
    padded): one run for hopper-fast, one per chunk for hopper-promoted. Yields (run, rows, the
    chains of those rows (len(rows), N)), the runs of any row in K order. Non-finite values must
    have been replaced by zeros (their codes read as zeros)."""
    (m, k), n = a.values.shape, b.values.shape[1]
    length = -(-min(length, k) // GROUP) * GROUP  # no longer than K, in whole groups
    runs, groups = -(-k // length), length // GROUP
    pad = runs * length - k

    def padded(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        return torch.nn.functional.pad(x, dims) if pad else x

    # (row, run, group, element of the group) and (run, group, element, column): views, no copies
    a_groups = padded(a.values, (0, pad)).reshape(m, runs, groups, GROUP)
    b_groups = padded(b.values, (0, 0, 0, pad)).reshape(runs, groups, GROUP, n)
    dtype = torch.bfloat16 if a.element == b.element == "e4m3" else torch.float64
    # w(x) = 2^(8 e(x) - 4), 0 for zeros and the non-finite codes (which read as zeros)
    weights_a = _look_up(padded(a.codes, (0, pad)), a.element, "weights", dtype).reshape(
        m, runs, groups, GROUP
    )
    weights_b = _look_up(padded(b.codes, (0, 0, 0, pad)), b.element, "weights", dtype).reshape(
        runs, groups, GROUP, n
    )
    steps = _steps(m * n * k)
    alignment, add_group = steps if steps is not None else (_alignment, _add_group)
    # Eagerly a step's temporaries hold GROUP products per output: tiles of runs and rows bound
    # them. Compiled kernels hold none, so their tiles only bound the chains held at once.
    budget = _STEP_BUDGET // GROUP if steps is None else _CHAIN_BUDGET
    tile_runs = max(1, min(runs, budget // (n * m)))
    tile_rows = max(1, min(m, budget // (n * tile_runs)))
    for r0 in range(0, runs, tile_runs):
        rs = slice(r0, r0 + tile_runs)
        for m0 in range(0, m, tile_rows):
            ms = slice(m0, m0 + tile_rows)
            chain = torch.zeros(min(tile_runs, runs - r0), min(tile_rows, m - m0), n, device=a.values.device)
            for g in range(groups):
                weight_sums = torch.bmm(weights_a[ms, rs, g].transpose(0, 1), weights_b[rs, g])
                bits = alignment(weight_sums, chain.view(torch.int32))
                inverse_quantum, quantum = (x.view(torch.float32) for x in bits)
                chain = add_group(
                    a_groups[ms, rs, g].transpose(0, 1), b_groups[rs, g], inverse_quantum, quantum, chain
                )
            for index, run in enumerate(range(r0, min(r0 + tile_runs, runs))):
                yield run, ms, chain[index]


def nonfinite_outputs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(where, value): the outputs whose IEEE dot product is not finite and that value (NaN as
    0x7FFFFFFF), or None when a and b are finite. Counted with 0/1 matrix products (exact), never
    by a BLAS computing Inf * 0."""
    # FP8 values sum far below float32's overflow: a sum is finite exactly when every term is
    if bool(torch.isfinite(a.sum() + b.sum())):
        return None
    inf = float("inf")

    def count(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.double() @ y.double()

    finite_a = a.isfinite()
    positive = (
        count(a == inf, b > 0)
        + count(a == -inf, b < 0)
        + count(finite_a & (a > 0), b == inf)
        + count(finite_a & (a < 0), b == -inf)
    )
    negative = (
        count(a == inf, b < 0)
        + count(a == -inf, b > 0)
        + count(finite_a & (a > 0), b == -inf)
        + count(finite_a & (a < 0), b == inf)
    )
    nan = (
        a.isnan().any(1)[:, None]
        | b.isnan().any(0)[None, :]
        | (count(a.isinf(), b == 0) + count(a == 0, b.isinf()) > 0)
        | ((positive > 0) & (negative > 0))
    )
    where = nan | (positive > 0) | (negative > 0)
    canonical = torch.tensor(_CANONICAL_NAN, dtype=torch.int32, device=a.device).view(torch.float32)
    value = torch.where(nan, canonical, torch.where(positive > 0, inf, -inf))
    return where, value


def with_nonfinite(out: torch.Tensor, special: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    return out if special is None else torch.where(special[0], special[1], out)


def chain_runs(
    a: FP8Operand, b: FP8Operand, mode: str, chunk: int, special: tuple[torch.Tensor, torch.Tensor] | None
) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """`_chains` of a hopper mode (K > 0), non-finite elements read as zeros (`special` says
    where the outputs are not finite)."""
    if special is not None:
        a = a._replace(values=torch.where(a.values.isfinite(), a.values, 0.0))
        b = b._replace(values=torch.where(b.values.isfinite(), b.values, 0.0))
    return _chains(a, b, a.values.shape[1] if mode == "hopper-fast" else chunk)


def accumulate_operands(a: FP8Operand, b: FP8Operand, mode: str, chunk: int) -> torch.Tensor:
    if mode == "fp32":
        return a.values @ b.values
    total = torch.zeros(a.values.shape[0], b.values.shape[1], device=a.values.device)
    if a.values.numel() == 0 or b.values.numel() == 0:
        return total
    special = nonfinite_outputs(a.values, b.values)
    for _, rows, chain in chain_runs(a, b, mode, chunk, special):
        total[rows] = total[rows] + chain  # promotion: float32 additions from +0, in K order
    return with_nonfinite(total, special)
