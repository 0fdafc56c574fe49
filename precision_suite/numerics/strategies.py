"""Hypothesis strategies for tensors, formats and layouts, reusable in users' own tests.

Tensors are drawn as (shape, seed, magnitude range, special values) and built with a seeded torch
generator: hypothesis shrinks the few parameters instead of thousands of elements, and one draw
still covers magnitudes from float32 subnormals to past a format's max.

    from hypothesis import given
    from precision_suite.numerics import strategies as pst

    @given(x=pst.tensors(), fmt=pst.formats(), data=st.data())
    def test_mine(x, fmt, data):
        layout = data.draw(pst.layouts(fmt))
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from precision_suite.numerics.formats import FORMATS, get_format
from precision_suite.numerics.layouts import Layout

# log2 magnitudes from float32's smallest subnormal to well past e5m2's max (2**15.8).
MIN_LOG2 = -149
MAX_LOG2 = 40


def formats(names: tuple[str, ...] | None = None) -> st.SearchStrategy[str]:
    """Format names (all registered formats by default)."""
    return st.sampled_from(sorted(names or FORMATS))


def layouts(fmt: str | None = None, max_block: int = 128) -> st.SearchStrategy[Layout]:
    """Layouts valid for `fmt`: the canonical ones, plus arbitrary block shapes for free formats."""
    if fmt is not None and get_format(fmt).block is not None:
        b = get_format(fmt).block
        return st.sampled_from([(1, b), (b, 1)])
    canonical = st.sampled_from(["tensor", (1, 128), (128, 1), (128, 128)])
    arbitrary = st.tuples(st.integers(1, max_block), st.integers(1, max_block))
    return st.one_of(canonical, arbitrary)


@st.composite
def shapes(draw: st.DrawFn, max_rows: int = 300, max_cols: int = 300, max_rank: int = 3) -> tuple[int, ...]:
    """Tensor shapes whose 2-D view is at most max_rows x max_cols (leading dims split the rows)."""
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    rank = draw(st.integers(2, max_rank))
    if rank == 3 and rows > 1:
        lead = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
        return (lead, rows // lead, cols)
    return (rows, cols)


@st.composite
def tensors(
    draw: st.DrawFn,
    shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]] | None = None,
    min_log2: int = MIN_LOG2,
    max_log2: int = MAX_LOG2,
    zeros: bool = True,
    nonfinite: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float tensors with log-uniform magnitudes in a drawn sub-range of [2**min_log2, 2**max_log2].

    zeros: sprinkle exact zeros; nonfinite: sprinkle NaN and +-Inf.
    """
    if shape is None:
        shape = shapes()
    if isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    lo = draw(st.integers(min_log2, max_log2))
    hi = draw(st.integers(lo, max_log2))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = torch.Generator().manual_seed(seed)
    log2 = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    x = (sign * torch.exp2(log2)).float()
    specials: list[float] = ([0.0] if zeros else []) + (
        [float("nan"), float("inf"), float("-inf")] if nonfinite else []
    )
    if specials:
        fraction = draw(st.sampled_from([0.0, 0.01, 0.3]))
        pick = torch.rand(shape, generator=gen) < fraction
        which = torch.randint(len(specials), shape, generator=gen)
        x = torch.where(pick, torch.tensor(specials)[which], x)
    return x.to(dtype)
