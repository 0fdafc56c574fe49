"""The 256 codes of an 8-bit float dtype as tables indexed by code: each code's value and the
float32 interval that round-to-nearest-even maps onto it. Reading a tensor's codes through them
costs a CPU a fraction of torch's conversion of 8-bit floats (training/observed_operands.py checks
a model's own casts with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Codes:
    """The 256 codes of an 8-bit float dtype as tables indexed by code: `value`, torch's own
    conversion of each; `low` and `high`, the float32 interval that round-to-nearest-even (ties to
    the even code, saturating at +-max) maps onto it, empty (low > high) for NaN and infinities.
    Gathering from the tables costs a CPU a fraction of torch's conversion of 8-bit floats."""

    value: Tensor
    low: Tensor
    high: Tensor

    def index(self, data: Tensor) -> Tensor:
        """The codes of 8-bit `data`, flat, as the tables' index."""
        return data.reshape(-1).view(torch.uint8).long()  # index_select gathers faster by int64


def codes(dtype: torch.dtype, device: torch.device) -> Codes:
    """The tables of an 8-bit float dtype (cached)."""
    key = (dtype, device)
    if key not in _CODES:
        value = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        finite = torch.isfinite(value)
        grid = torch.unique(value[finite].double())  # sorted; +0 and -0 are one value
        v = torch.where(finite, value, 0.0).double()
        at = torch.searchsorted(grid, v)  # each code's place on the grid
        below = torch.cat([grid[:1] - math.inf, grid])[at]  # below -max: nothing
        above = torch.cat([grid, grid[-1:] + math.inf])[at + 1]  # above +max: saturates to it
        low, high = ((below + v) / 2).float(), ((v + above) / 2).float()
        # a tie goes to the even code: an odd code's interval leaves out its midpoints
        odd = (torch.arange(256) % 2 == 1) & finite
        low = torch.where(odd, torch.nextafter(low, torch.full_like(low, math.inf)), low)
        high = torch.where(odd, torch.nextafter(high, torch.full_like(high, -math.inf)), high)
        low, high = torch.where(finite, low, math.inf), torch.where(finite, high, -math.inf)
        _CODES[key] = Codes(value.to(device), low.to(device), high.to(device))
    return _CODES[key]


_CODES: dict[tuple[torch.dtype, torch.device], Codes] = {}
