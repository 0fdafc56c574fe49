"""Where two runs of one spec first differ: per variable, the first step (or training step) at
which any value differs, the cell that differs most there, and by how much.

`diff` trains the same spec with two commits' code on one host, so the runs are bitwise identical
unless the code changed the numbers; this says where the change starts. Judging its size against
tolerances is `tolerances.compare`'s."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from precision_suite.numerics.metric_table import METRICS
from precision_suite.verdicts.findings import TIME_DIMS, format_where, to_python


@dataclass(frozen=True)
class Difference:
    """The first change of one variable: at `step` (None: the variable has no time dimension, or
    its coordinates differ, said in `note`), largest at `where`, from `base` to `head`;
    `cells`: how many of its values differ at that step."""

    metric: str
    step: int | None
    where: dict[str, Any] = field(default_factory=dict)
    base: float | str = math.nan  # a text for a variable of words (the observed recipe)
    head: float | str = math.nan
    cells: int = 0
    note: str = ""

    def describe(self) -> str:
        """'underflow at layer 0, tensor activation, layout 1x128: 0 -> 0.1606 (+0.1606; 1 value differs)'"""
        if self.note:
            return f"{self.metric}: {self.note}"
        where = f" at {format_where(self.where)}" if self.where else ""
        values = f"{self.cells} value{'s differ' if self.cells != 1 else ' differs'}"
        if isinstance(self.base, str) or isinstance(self.head, str):
            return f"{self.metric}{where}: {self.base or 'none'!s} -> {self.head or 'none'!s} ({values})"
        return f"{self.metric}{where}: {self.base:.4g} -> {self.head:.4g} ({_size(self.base, self.head)}; {values})"

    def when(self) -> str:
        """'from step 2' ('' without a step)."""
        return "" if self.step is None else f"from step {self.step}"


def first_differences(base: xr.Dataset, head: xr.Dataset) -> list[Difference]:
    """Every data variable of `head` that differs from `base`, earliest first (ties: the metric
    table's order, then the raw variables such as module_sums); empty when the data are equal."""
    found = []
    for name in head.data_vars:
        if name not in base.data_vars:
            found.append(Difference(str(name), None, note="only in HEAD"))
        elif (difference := _first_difference(str(name), base[name], head[name])) is not None:
            found.append(difference)
    found += [
        Difference(str(name), None, note="only in BASE")
        for name in base.data_vars
        if name not in head.data_vars
    ]
    if not found and not base.equals(head):
        found.append(Difference("coordinates", None, note="the coordinates differ (e.g. tokens seen)"))
    order = list(METRICS)
    return sorted(
        found,
        key=lambda d: (
            d.step is None,
            d.step or 0,
            order.index(d.metric) if d.metric in order else len(order),
        ),
    )


def _first_difference(name: str, base: xr.DataArray, head: xr.DataArray) -> Difference | None:
    if base.dims != head.dims or any(not base[d].equals(head[d]) for d in head.dims if d in head.coords):
        return None if base.equals(head) else Difference(name, None, note="dimensions or coordinates differ")
    words = base.dtype.kind in "OUS"
    b = np.asarray(base.values, dtype=object if words else np.float64)
    h = np.asarray(head.transpose(*base.dims).values, dtype=object if words else np.float64)
    differs = (b != h) if words else ~((b == h) | (np.isnan(b) & np.isnan(h)))
    if not differs.any():
        return None
    time = next((d for d in base.dims if d in TIME_DIMS), None)
    if time is None:
        return _at(name, base, b, h, differs, None)
    axis = base.dims.index(time)
    first = int(np.flatnonzero(np.moveaxis(differs, axis, 0).reshape(differs.shape[axis], -1).any(axis=1))[0])
    at = {time: first}
    return _at(
        name,
        base.isel(at),
        np.take(b, first, axis),
        np.take(h, first, axis),
        np.take(differs, first, axis),
        int(to_python(base[time].values[first])),
    )


def _at(
    name: str, base: xr.DataArray, b: np.ndarray, h: np.ndarray, differs: np.ndarray, step: int | None
) -> Difference:
    if b.dtype == object:  # words: the first that differs
        size = differs.astype(np.float64)
    else:
        with np.errstate(invalid="ignore"):
            size = np.where(differs, np.nan_to_num(np.abs(h - b), nan=np.inf), -1.0)
    index = np.unravel_index(int(np.argmax(size)), size.shape) if size.ndim else ()
    where = {d: to_python(base[d].values[i]) for d, i in zip(base.dims, index) if d in base.coords}
    value = str if b.dtype == object else float
    return Difference(name, step, where, value(b[index]), value(h[index]), int(differs.sum()))


def _size(base: float, head: float) -> str:
    if not (math.isfinite(base) and math.isfinite(head)):
        return "non-finite"
    ratio = f"x{head / base:.3g}" if base != 0 and head / base > 0 else "x1"
    ratio = "" if ratio == "x1" else f", {ratio}"  # a ratio that rounds to 1 says nothing
    return f"{head - base:+.4g}{ratio}"


def first_of(differences: Sequence[Difference], metric: str | None = None) -> Difference | None:
    """The earliest difference (of `metric` when given); None when there is none."""
    return next((d for d in differences if metric is None or d.metric == metric), None)
