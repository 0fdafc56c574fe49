"""GEMM accumulation as an NVIDIA H100's FP8 tensor cores perform it, bit for bit, in torch.

Every other GEMM of the suite sums its products in float32 (``fp32``). An H100 does not
(DeepSeek-V3 report, arXiv 2412.19437, sections 3.3.2 and 3.5.2; SCIENCE.md, "GEMM accumulation
on FP8 tensor cores"). The modes (``ACCUMULATION_MODES``):

- ``fp32``: today's float32 GEMM (torch's own matmul of the dequantized operands).
- ``hopper-fast``: one tensor-core chain over all of K (cuBLAS ``use_fast_accum=True``).
- ``hopper-promoted``: a fresh chain over each chunk of ``chunk`` consecutive elements of K
  (default 128), the chunk results added into a float32 accumulator, in K order, with
  round-to-nearest additions (cuBLAS ``use_fast_accum=False``, Transformer Engine's split
  accumulator, DeepGEMM's promotion every N_C = 128).

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

Split-K, which cuBLAS applies to some shapes (mmaemu's splitk tables), is not modelled: these
are the results of shapes cuBLAS does not split. Only E4M3 and E5M2 elements have the model, and
E5M2 x E5M2 is refused, as torch._scaled_mm and cuBLAS refuse it.

Scales (`scaled_gemm`): scales constant along K (per tensor, per row of A, per column of B)
multiply the accumulator once, in float32, by the float32 product of the two scales (cuBLAS's
epilogue; mmaemu validates it for tensor-wise scales). Scales that change along K (1x128 and
128x128 blocks) can only be applied where a chain ends: under ``hopper-promoted`` each chunk's
result is multiplied by its scales on promotion, as DeepGEMM does
(``final_accum += scale_a * scale_b * accum``, which nvcc compiles to one fused multiply-add),
so each chunk must lie within one scale block along K; ``hopper-fast`` refuses them (one chain
cannot apply a scale that changes inside it).

Every step is exact or one IEEE rounding: the result does not depend on the device, the thread
count or whether the torch.compile'd kernels ran (`COMPILE_MIN_PRODUCTS`). Tested bit for bit
against mmaemu (tests/test_accumulation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from precision_suite.numerics import quantization
from precision_suite.numerics.formats import get_format
from precision_suite.numerics.layouts import Layout, block_shape, from_blocks

ACCUMULATION_MODES = ("fp32", "hopper-fast", "hopper-promoted")
HOPPER_ELEMENTS = ("e4m3", "e5m2")
GROUP = 32  # products aligned together by the tensor core
FRACTION_BITS = 13  # kept below the group's largest exponent, and in the group's result
PROMOTION_INTERVAL = 128  # N_C of DeepSeek-V3 and DeepGEMM; cuBLAS's slow-accumulation chunk
LAW_KS = tuple(2**i for i in range(7, 14))  # K = 128 ... 8192: the reductions `error_law` measures
LAW_DATA = ("same-sign", "mixed-sign")
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


@dataclass(frozen=True)
class Accumulation:
    """How a GEMM accumulates: a mode of ACCUMULATION_MODES and, for ``hopper-promoted``, the
    promotion interval (elements of K per chain, a positive multiple of GROUP)."""

    mode: str = "fp32"
    interval: int = PROMOTION_INTERVAL

    def __post_init__(self) -> None:
        if self.mode not in ACCUMULATION_MODES:
            raise ValueError(f"accumulation mode {self.mode!r}: use one of {', '.join(ACCUMULATION_MODES)}")
        _check_interval(self.interval)

    @property
    def hopper(self) -> bool:
        return self.mode != "fp32"

    def text(self) -> str:
        """ "fp32", "hopper-fast" or "hopper-promoted:128": what `parse_accumulation` reads."""
        return f"{self.mode}:{self.interval}" if self.mode == "hopper-promoted" else self.mode


def parse_accumulation(text: object) -> Accumulation:
    """ "fp32", "hopper-fast", "hopper-promoted" (every 128) or "hopper-promoted:N"."""
    if not isinstance(text, str):
        raise TypeError(
            f'accumulation is written "fp32", "hopper-fast" or "hopper-promoted[:N]", got {text!r}'
        )
    mode, _, interval = text.partition(":")
    if interval and mode != "hopper-promoted":
        raise ValueError(
            f'accumulation {text!r}: only hopper-promoted takes an interval ("hopper-promoted:128")'
        )
    if interval and not interval.isdigit():
        raise ValueError(
            f"accumulation {text!r}: the promotion interval is a number of elements of K, e.g. 128"
        )
    return Accumulation(mode, int(interval) if interval else PROMOTION_INTERVAL)


def _check_interval(interval: object) -> None:
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < GROUP or interval % GROUP:
        raise ValueError(
            f"promotion interval {interval!r}: a positive multiple of {GROUP} (the tensor core's "
            "group of products), such as 128"
        )


# ----------------------------------------------------------------------------- operands


class _FP8(NamedTuple):
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


def _operand(x: torch.Tensor, element: str | None, name: str) -> _FP8:
    """A GEMM operand: a float8 tensor, or float32 values of the named element (checked: each
    value must be one of the element's)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {type(x).__name__} {getattr(x, 'shape', '')}")
    by_dtype = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    if x.dtype in by_dtype:
        if element not in (None, by_dtype[x.dtype]):
            raise ValueError(f"{name} is {x.dtype} but its element is given as {element!r}")
        codes = x.view(torch.uint8).int()
        return _FP8(_look_up(codes, by_dtype[x.dtype], "values"), codes, by_dtype[x.dtype])
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
    return _FP8(x, codes, element)


def _operands(
    a: torch.Tensor, b: torch.Tensor, elements: tuple[str, str] | None, mode: str
) -> tuple[_FP8, _FP8]:
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
        return _FP8(a.float(), None, ""), _FP8(b.float(), None, "")
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


def _check_mode(mode: str, chunk: int) -> None:
    if mode not in ACCUMULATION_MODES:
        raise ValueError(f"accumulation mode {mode!r}: use one of {', '.join(ACCUMULATION_MODES)}")
    _check_interval(chunk)


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
            compiled = torch.compile(
                fn, dynamic=False, backend=quantization.inductor_backend(tag, options={})
            )
            _compiled_steps.append(_with_dynamic_sizes(compiled, fn))
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


def _chains(a: _FP8, b: _FP8, length: int) -> Iterator[tuple[int, slice, torch.Tensor]]:
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


def _nonfinite(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
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


def _patched(out: torch.Tensor, special: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    return out if special is None else torch.where(special[0], special[1], out)


def _runs(
    a: _FP8, b: _FP8, mode: str, chunk: int, special: tuple[torch.Tensor, torch.Tensor] | None
) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """`_chains` of a hopper mode (K > 0), non-finite elements read as zeros (`special` says
    where the outputs are not finite)."""
    if special is not None:
        a = a._replace(values=torch.where(a.values.isfinite(), a.values, 0.0))
        b = b._replace(values=torch.where(b.values.isfinite(), b.values, 0.0))
    return _chains(a, b, a.values.shape[1] if mode == "hopper-fast" else chunk)


def _accumulate(a: _FP8, b: _FP8, mode: str, chunk: int) -> torch.Tensor:
    if mode == "fp32":
        return a.values @ b.values
    total = torch.zeros(a.values.shape[0], b.values.shape[1], device=a.values.device)
    if a.values.numel() == 0 or b.values.numel() == 0:
        return total
    special = _nonfinite(a.values, b.values)
    for _, rows, chain in _runs(a, b, mode, chunk, special):
        total[rows] = total[rows] + chain  # promotion: float32 additions from +0, in K order
    return _patched(total, special)


def accumulate(
    a: torch.Tensor,
    b: torch.Tensor,
    mode: str,
    chunk: int = PROMOTION_INTERVAL,
    *,
    elements: tuple[str, str] | None = None,
) -> torch.Tensor:
    """The float32 accumulator of a (M, K) @ b (K, N) before any scale, as `mode` computes it
    (the module docstring; what mmaemu.accumulate returns for an unsplit GEMM).

    a, b: float8 tensors (E4M3, E5M2), or float32 tensors of FP8 values with
    ``elements=(element_a, element_b)`` naming their elements ("e4m3", "e5m2"); a value off its
    element's grid is a ValueError. chunk: hopper-promoted's interval, a multiple of 32.
    ``fp32`` is torch's float32 matmul (of any floating-point operands)."""
    _check_mode(mode, chunk)
    return _accumulate(*_operands(a, b, elements, mode), mode, chunk)


# ----------------------------------------------------------------------------- scales


def _scale(
    scale: torch.Tensor | float, shape: tuple[int, int], name: str, device: torch.device
) -> torch.Tensor:
    """A float32 scale broadcastable to `shape` (a scalar, per row, per column or per element),
    positive and finite."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=device)
    s = s.reshape(1, 1) if s.dim() == 0 else s
    if s.dim() != 2 or any(d not in (1, full) for d, full in zip(s.shape, shape)):
        raise ValueError(
            f"{name} has shape {tuple(s.shape)}: it must broadcast to its operand's {shape} "
            "(a scalar, one per row, one per column, or one per element)"
        )
    if not bool(((s > 0) & s.isfinite()).all()):
        raise ValueError(f"{name} must be positive and finite")
    return s


def _constant_along(s: torch.Tensor, dim: int) -> bool:
    return s.shape[dim] == 1 or bool((s == s.narrow(dim, 0, 1)).all())


def _first_of_chunks(s: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    """The scale at the start of each chunk of K (along `dim`)."""
    k = s.shape[dim]
    return s.narrow(dim, 0, 1) if k == 1 else s.index_select(dim, torch.arange(0, k, chunk, device=s.device))


def _constant_within_chunks(s: torch.Tensor, dim: int, chunk: int) -> bool:
    k = s.shape[dim]
    return k == 1 or bool(
        (s == _first_of_chunks(s, dim, chunk).repeat_interleave(chunk, dim).narrow(dim, 0, k)).all()
    )


def _chunk_scales(s: torch.Tensor, dim: int, chunk: int, name: str) -> torch.Tensor:
    """One scale per chunk of K (along `dim`), checked constant within each chunk."""
    if not _constant_within_chunks(s, dim, chunk):
        raise ValueError(
            f"{name} changes within a promotion interval of {chunk} elements of K: a scale can only "
            "be applied where a chain ends, so each interval must lie within one scale block along K "
            "(e.g. 1x128 and 128x128 blocks with an interval of 128)"
        )
    return _first_of_chunks(s, dim, chunk)


def runs_on(scale_a: torch.Tensor | float, scale_b: torch.Tensor | float, accumulation: Accumulation) -> bool:
    """Whether the hardware can accumulate a GEMM with these scales (broadcastable to its a (M, K)
    and b (K, N), as `scaled_gemm` takes them) as `accumulation` says: fp32 and scales constant
    along K always; scales that change along K only under hopper-promoted, each interval inside
    one scale block (what `scaled_gemm` refuses otherwise)."""
    s_a, s_b = torch.as_tensor(scale_a), torch.as_tensor(scale_b)
    s_a, s_b = (s.reshape(1, 1) if s.dim() == 0 else s for s in (s_a, s_b))
    if not accumulation.hopper or (_constant_along(s_a, 1) and _constant_along(s_b, 0)):
        return True
    return (
        accumulation.mode == "hopper-promoted"
        and _constant_within_chunks(s_a, 1, accumulation.interval)
        and _constant_within_chunks(s_b, 0, accumulation.interval)
    )


def _fma32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x * y + z of float32 tensors with one rounding to float32, as a GPU's FFMA.

    The float64 product is exact (24 + 24 bits); the float64 sum is rounded to odd (TwoSum gives
    its exact error) and then to float32, which rounds the exact value correctly since float64
    has more than 2 * 24 + 1 bits."""
    product, addend = x.double() * y.double(), z.double()
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    bits = total.view(torch.int64)
    to_odd = (error != 0) & (bits & 1 == 0) & total.isfinite()
    step = torch.where((error > 0) == (total > 0), 1, -1)
    return torch.where(to_odd, bits + step, bits).view(torch.float64).float()


def scaled_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    mode: str,
    chunk: int = PROMOTION_INTERVAL,
    *,
    elements: tuple[str, str] | None = None,
) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in float32 with `mode`'s accumulation (module docstring).

    a (M, K), b (K, N): FP8 elements as for `accumulate`. scale_a broadcasts to (M, K) and
    scale_b to (K, N): per tensor, per row of a / column of b, or per element (block scales
    expanded, `full_scales`). ``fp32``: torch's float32 matmul of the dequantized operands.
    Scales constant along K multiply the accumulator once (by the float32 product of the two);
    scales that change along K need ``hopper-promoted`` with each interval inside one scale block,
    and are applied to each interval's result on promotion by a fused multiply-add."""
    _check_mode(mode, chunk)
    a, b = _operands(a, b, elements, mode)
    (m, k), n, device = a.values.shape, b.values.shape[1], a.values.device
    scale_a, scale_b = _scale(scale_a, (m, k), "scale_a", device), _scale(scale_b, (k, n), "scale_b", device)
    if mode == "fp32":
        return (a.values * scale_a) @ (b.values * scale_b)
    if _constant_along(scale_a, 1) and _constant_along(scale_b, 0):
        return _accumulate(a, b, mode, chunk) * (scale_a[:, :1] * scale_b[:1])
    if mode == "hopper-fast":
        raise ValueError(
            "hopper-fast accumulates all of K in one tensor-core chain, which cannot apply a scale "
            "that changes along K: use scales per tensor, row or column, or hopper-promoted"
        )
    if k == 0 or m == 0 or n == 0:
        return torch.zeros(m, n, device=device)
    per_chunk_a = _chunk_scales(scale_a, 1, chunk, "scale_a")
    per_chunk_b = _chunk_scales(scale_b, 0, chunk, "scale_b")
    special = _nonfinite(a.values, b.values)
    total = torch.zeros(m, n, device=device)
    for run, rows, chain in _runs(a, b, mode, chunk, special):
        # a scale constant along K has one column (row) for every run
        scale_of_a = per_chunk_a[rows, min(run, per_chunk_a.shape[1] - 1), None]
        total[rows] = _fma32(chain, scale_of_a * per_chunk_b[min(run, per_chunk_b.shape[0] - 1)], total[rows])
    return _patched(total, special)


# ----------------------------------------------------------------------------- the error metric

# The additive sums of the error metric, in this order: sum (C - R)^2, sum R^2 over the outputs
# kept, the outputs left out (C or R not finite), and every output (kept or not).
ERROR_FIELDS = ("err2", "ref2", "nonfinite", "outputs")
# The modes every FP8 GEMM's error is also measured under, whatever it ran with: one chain over K
# (cuBLAS's fast accumulation) and promotion every 128 (cuBLAS's split accumulator, DeepGEMM)
WHAT_IF = (Accumulation("hopper-fast"), Accumulation("hopper-promoted", PROMOTION_INTERVAL))


def accumulation_error_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    mode: str,
    chunk: int = PROMOTION_INTERVAL,
    *,
    elements: tuple[str, str] | None = None,
) -> torch.Tensor:
    """How far `mode`'s GEMM lands from the exact product of the same quantized operands, as
    additive sums: float64, one per ERROR_FIELDS [sum (C - R)^2, sum R^2, outputs left out,
    outputs].

    C = scaled_gemm(a, b, scale_a, scale_b, mode, chunk); R = (a * scale_a) @ (b * scale_b) with
    every element times its scale, every product and every sum in float64 (the products are
    exact, the sums off by about 2^-53: R is the quantized GEMM without accumulation error).
    Outputs where C or R is not finite are left out of both sums and counted. Sums of several
    GEMMs (modules, steps) add; `relative_error` turns them into the metric.
    """
    _check_mode(mode, chunk)
    [sums] = error_sums_by_mode(a, b, scale_a, scale_b, [Accumulation(mode, chunk)], elements=elements)
    if sums is None:  # what scaled_gemm says about these scales
        scaled_gemm(a, b, scale_a, scale_b, mode, chunk, elements=elements)
    return sums


# The outputs a training run measures the accumulation error on, per GEMM: at most this many rows
# of C (rows of a) times this many columns (columns of b), drawn once per shape (`output_subset`).
# The emulation costs products, M * N * K: a 512 x 1376 output of a 17M-parameter Llama costs 43x
# less, a 128 x 128 one is measured whole. Measured on that Llama's 87 GEMMs of a step
# (docs/performance.md): the estimate of the relative error is off the whole output's by 3% rms
# (12% at most), and log(hopper-fast / hopper-promoted), a change of accumulation as a verdict
# sees it (1.04 there), by 0.04 rms: the plants move it 25 times that. The subset is the same in
# a baseline's seeds and the run, so what it adds is part of the seed ensemble's spread.
SAMPLED_ROWS = SAMPLED_COLUMNS = 128
_SUBSET_SEED = 39


def output_subset(
    m: int, n: int, rows: int = SAMPLED_ROWS, columns: int = SAMPLED_COLUMNS
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows (of M) and columns (of N) of C a run measures, sorted; None: all of them.

    A function of the shape alone (a seeded permutation): the same GEMM of a baseline and of a
    run, on any host and thread count, measures the same outputs."""

    def pick(size: int, count: int, axis: int) -> torch.Tensor | None:
        if size <= count:
            return None
        generator = torch.Generator().manual_seed(_SUBSET_SEED * 1_000_003 + 2 * size + axis)
        return torch.randperm(size, generator=generator)[:count].sort().values

    return pick(m, rows, 0), pick(n, columns, 1)


def _subset_of(
    x: torch.Tensor | float, index: torch.Tensor | None, dim: int, size: int
) -> torch.Tensor | float:
    """x's entries at `index` along `dim` where x has `size` there (a scale constant along it has 1)."""
    if index is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[dim] != size:
        return x
    return x.index_select(dim, index.to(x.device))


def error_sums_by_mode(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    accumulations: Sequence[Accumulation],
    *,
    elements: tuple[str, str] | None = None,
    computed: Mapping[Accumulation, torch.Tensor] | None = None,
    sampled: bool = False,
) -> list[torch.Tensor | None]:
    """`accumulation_error_sums` of one GEMM under each of `accumulations`, each GEMM and the
    float64 product R computed once; None for a mode the hardware cannot run with these scales
    (`runs_on`). `computed`: `scaled_gemm` results already at hand (the GEMM as a run computed it),
    used instead of computing them again.

    sampled: measure only `output_subset`'s outputs (finite operands; with a NaN or Inf every
    output is measured, so that what is not finite is counted exactly), their sums scaled by
    M * N over the outputs measured: estimates of the whole output's sums, which add across GEMMs
    as the exact ones do; ``outputs`` stays M * N."""
    shaped = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 2
    m, n = (a.shape[0], b.shape[1]) if shaped else (0, 0)
    rows, columns = output_subset(m, n) if sampled and shaped else (None, None)
    if (rows is not None or columns is not None) and _finite_operands(a, b):
        a, scale_a = _subset_of(a, rows, 0, m), _subset_of(scale_a, rows, 0, m)
        b, scale_b = _subset_of(b, columns, 1, n), _subset_of(scale_b, columns, 1, n)
        computed = {
            mode: _subset_of(_subset_of(c, rows, 0, m), columns, 1, n) for mode, c in (computed or {}).items()
        }
        sums = error_sums_by_mode(a, b, scale_a, scale_b, accumulations, elements=elements, computed=computed)
        weight = m * n / (a.shape[0] * b.shape[1])
        return [
            None if s is None else torch.cat([s[:3] * weight, s.new_tensor([float(m * n)])]) for s in sums
        ]
    reference = None
    results = dict(computed or {})
    out: list[torch.Tensor | None] = []
    for accumulation in accumulations:
        if not runs_on(scale_a, scale_b, accumulation):
            out.append(None)
            continue
        if accumulation not in results:
            results[accumulation] = scaled_gemm(
                a, b, scale_a, scale_b, accumulation.mode, accumulation.interval, elements=elements
            )
        c = results[accumulation]
        if reference is None:
            reference = _float64_product(a, b, scale_a, scale_b, elements, accumulation.mode)
        kept = c.isfinite() & reference.isfinite()
        error = torch.where(kept, c.double() - reference, 0.0)
        exact = torch.where(kept, reference, 0.0)
        out.append(
            torch.stack(
                [
                    (error * error).sum(),
                    (exact * exact).sum(),
                    (~kept).sum().double(),
                    torch.tensor(float(c.numel()), dtype=torch.float64, device=c.device),
                ]
            )
        )
    return out


def _finite_operands(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every element of a and b is finite (float8 codes read through the value table)."""

    def finite(x: torch.Tensor) -> bool:
        if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = x.float()
        return bool(torch.isfinite(x).all())

    return finite(a) and finite(b)


def _float64_product(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | float,
    scale_b: torch.Tensor | float,
    elements: tuple[str, str] | None,
    mode: str,
) -> torch.Tensor:
    """R: every element times its scale, products and sums in float64."""
    a, b = (operand.values for operand in _operands(a, b, elements, mode))
    (m, k), n = a.shape, b.shape[1]
    scale_a = _scale(scale_a, (m, k), "scale_a", a.device).double()
    scale_b = _scale(scale_b, (k, n), "scale_b", a.device).double()
    return (a.double() * scale_a) @ (b.double() * scale_b)


def relative_errors(sums: np.ndarray) -> np.ndarray:
    """||C - R||_F / ||R||_F of sums laid out along the last axis as ERROR_FIELDS (pooled by
    addition first): 0 where both sums are zero (an exact zero GEMM), inf where only R's is."""
    sums = np.asarray(sums, dtype=np.float64)
    err2, ref2 = sums[..., 0], sums[..., 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref2 == 0, np.where(err2 == 0, 0.0, np.inf), np.sqrt(err2 / ref2))


def relative_error(sums: torch.Tensor) -> float:
    """||C - R||_F / ||R||_F from `accumulation_error_sums` (pooled by addition).

    The Frobenius ratio, not the largest elementwise relative error: an output near zero (a sum
    that cancels) has an unbounded relative error that says nothing about the accumulator, while
    the ratio of norms weighs every output by its size and is defined whenever R is not all zero
    (0 for an exact zero GEMM, inf when only R is zero)."""
    return float(relative_errors(torch.as_tensor(sums, dtype=torch.float64).cpu().numpy()))


def error_law(
    rows: int = 32, seed: int = 0, ks: Sequence[int] = LAW_KS, modes: Sequence[str] = ACCUMULATION_MODES
) -> list[dict[str, object]]:
    """The error's law in K, measured: for each K and each kind of random E4M3 operands (per-tensor
    amax scales), same-sign (|N(0, 1)| entries: every product adds, the sum grows like K) and
    mixed-sign (N(0, 1): the sum grows like sqrt(K)), the `relative_error` of a (rows x K) @
    (K x rows) GEMM under each mode (hopper-promoted every 128). Rows
    {"K": k, "data": kind, mode: error, ...}. Expected (SCIENCE.md): hopper-fast grows with K,
    hopper-promoted stays flat, fp32 stays near 2^-24."""
    table = []
    with quantization.eager():  # a few small GEMMs: the compile tax would cost ten times the work
        for k in ks:
            gen = torch.Generator().manual_seed(seed + k)
            x, w = torch.randn(rows, k, generator=gen), torch.randn(k, rows, generator=gen)
            for kind in LAW_DATA:
                a, scale_a = _e4m3_tensorwise(x.abs() if kind == "same-sign" else x)
                b, scale_b = _e4m3_tensorwise(w.abs() if kind == "same-sign" else w)
                row: dict[str, object] = {"K": k, "data": kind}
                for mode in modes:
                    row[mode] = relative_error(accumulation_error_sums(a, b, scale_a, scale_b, mode))
                table.append(row)
    return table


def _e4m3_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 elements, their per-tensor scale) of x, quantized as the suite does."""
    q = quantization.quantize(x, "e4m3", "tensor")
    scale = q.scales.reshape(1, 1).float()
    return split_dequantized(q.dequantized, scale, "e4m3").to(torch.float8_e4m3fn), scale


# ----------------------------------------------------------------------------- quantized operands


def full_scales(scales: torch.Tensor, layout: Layout, rows: int, cols: int) -> torch.Tensor:
    """A quantization's block scales (n_block_rows, n_block_cols) as one scale per element of
    the rows x cols operand, or (1, 1) for a per-tensor scale."""
    if layout == "tensor":
        return scales.reshape(1, 1).float()
    r, c = block_shape(layout, rows, cols)
    nbr, nbc = scales.shape
    return from_blocks(scales.float()[:, None, :, None].expand(nbr, r, nbc, c), rows, cols)


def split_dequantized(dequantized: torch.Tensor, scales: torch.Tensor, element: str) -> torch.Tensor:
    """The FP8 elements q of a quantize-dequantize result, as float32: dequantized == q * scales
    (float32 products) for every element, NaN for NaN. `scales` broadcasts to `dequantized`
    (`full_scales`). The division is off by at most 2 float32 ulps, far below half a step of the
    element's grid, so rounding recovers q; a ValueError says when the product is not the input
    (scales that are not this quantization's)."""
    if element not in HOPPER_ELEMENTS:
        raise ValueError(f"element {element!r} has no tensor-core accumulation model; use e4m3 or e5m2")
    grid = get_format(element).element
    q = quantization.round_to_element((dequantized.float() / scales).clamp(-grid.max, grid.max), grid)
    product = q * scales
    unlike = (product.view(torch.int32) != dequantized.float().view(torch.int32)) & ~dequantized.isnan()
    if bool(unlike.any()):
        raise ValueError(
            f"{int(unlike.sum())} of {dequantized.numel()} values are not an {element} element times "
            "its scale: pass the scales of the quantization that produced them"
        )
    return q
