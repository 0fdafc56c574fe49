"""Scaling layouts: how a tensor, seen as 2-D, is cut into blocks that share one scale.

A tensor of any rank is viewed as 2-D with its leading dimensions flattened into rows, so a
`(tokens, hidden)` activation and a `(batch, seq, hidden)` one are cut alike. A layout is
`"tensor"` (one scale for everything) or a `(rows, cols)` block shape:

- `(1, 128)`: row tiles, 128 consecutive elements along the hidden dimension (activations, and
  output gradients for the input-gradient GEMM);
- `(128, 1)`: column tiles, 128 consecutive tokens of one channel (the "gradient transpose" that
  the weight-gradient GEMM reads);
- `(128, 128)`: square blocks (weights);
- `(1, 32)` / `(32, 1)` and `(1, 16)` / `(16, 1)`: MX and NVFP4 blocks along either axis;
  `(16, 16)`: NVFP4 square weight blocks (one scale per 256 elements);
- `"row"` / `"column"`: one scale per row / per column, whatever its length (torchao's rowwise
  float8 recipes: "axiswise" scaling), held as `(1, 0)` / `(0, 1)`, 0 meaning the whole axis.

Shapes that do not divide by the block are zero-padded; a zero never raises a block's amax, so
padding never changes a scale.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from precision_suite.numerics.formats import Format, get_format

Layout = str | tuple[int, int]  # "tensor" or (rows, cols)

_BLOCK_RE = re.compile(r"^\s*(\d+)\s*[x,]\s*(\d+)\s*$")
WHOLE_AXIS = {"row": (1, 0), "column": (0, 1)}  # 0: the block spans the whole axis


def parse_layout(spec: object, fmt: str | Format | None = None) -> Layout:
    """Normalise a layout spec: `"tensor"`, `(r, c)`, `[r, c]` or `"RxC"`; `None` = format default.

    With `fmt`, the layout is also checked against the format: fixed-block formats (MX, NVFP4)
    accept only their block along one axis.
    """
    f = get_format(fmt) if fmt is not None else None
    if spec is None:
        if f is None:
            raise ValueError("layout is None: pass 'tensor' or a (rows, cols) block shape")
        spec = (1, f.block) if f.block else (1, 128) if f.scale_rule == "amax" else "tensor"
    layout: Layout
    if spec == "tensor":
        layout = "tensor"
    elif isinstance(spec, str) and spec in WHOLE_AXIS:
        layout = WHOLE_AXIS[spec]
    elif isinstance(spec, str) and (m := _BLOCK_RE.match(spec)):
        layout = (int(m.group(1)), int(m.group(2)))
    elif (
        isinstance(spec, (tuple, list))
        and len(spec) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in spec)
    ):
        layout = (int(spec[0]), int(spec[1]))
    else:
        raise ValueError(
            f"unknown layout {spec!r}: use 'tensor', 'row', 'column', a (rows, cols) tuple such as "
            "(1, 128) or (128, 1), or a string such as '1x128'"
        )
    if layout != "tensor" and layout not in WHOLE_AXIS.values() and min(layout) < 1:
        raise ValueError(f"layout {layout!r}: block dimensions must be positive")
    # a fixed-block format scales vectors of `block` elements along either axis; square blocks of
    # block x block elements share one scale too (the NVFP4 training recipe's 16x16 weight blocks)
    if (
        f is not None
        and f.block is not None
        and layout not in ((1, f.block), (f.block, 1), (f.block, f.block))
    ):
        raise ValueError(
            f"format {f.name!r} scales blocks of {f.block} elements: layout must be "
            f"(1, {f.block}), ({f.block}, 1) or ({f.block}, {f.block}), got {layout!r}"
        )
    return layout


def layout_label(fmt: str | Format, layout: object = None) -> str:
    """The label used as a dataset coordinate (see docs/architecture.md).

    e4m3 layouts read as in the Ling 2.0 figure (`1x128`, `128x1`, `tensor`); a fixed-block or
    unscaled format is its own name (its orientation follows the tensor role); anything else is
    `fmt:RxC`.
    """
    f = get_format(fmt)
    if f.block is not None or f.scale_rule == "none":
        return f.name
    text = layout_text(parse_layout(layout, f))
    return text if f.name == "e4m3" else f"{f.name}:{text}"


def layout_text(layout: Layout) -> str:
    """A parsed layout as written: "tensor", "row", "column" or "RxC"."""
    if layout == "tensor":
        return "tensor"
    word = next((word for word, block in WHOLE_AXIS.items() if block == layout), None)
    return word or f"{layout[0]}x{layout[1]}"


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """The 2-D view every layout is defined on: leading dims flattened into rows."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def block_shape(layout: Layout, rows: int, cols: int) -> tuple[int, int]:
    """Concrete block shape for a 2-D tensor of `rows x cols` (a 0 spans the whole axis)."""
    if layout == "tensor":
        return rows, cols
    return layout[0] or rows, layout[1] or cols  # type: ignore[index]


def to_blocks(x2d: torch.Tensor, layout: Layout) -> torch.Tensor:
    """View (padding with zeros where needed) a 2-D tensor as `(n_block_rows, r, n_block_cols, c)`."""
    rows, cols = x2d.shape
    r, c = block_shape(layout, rows, cols)
    pad_rows, pad_cols = -rows % r, -cols % c
    if pad_rows or pad_cols:
        x2d = F.pad(x2d, (0, pad_cols, 0, pad_rows))
    return x2d.reshape((rows + pad_rows) // r, r, (cols + pad_cols) // c, c)


def from_blocks(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocks`: back to `rows x cols`, padding cropped."""
    nbr, r, nbc, c = blocks.shape
    return blocks.reshape(nbr * r, nbc * c)[:rows, :cols]
