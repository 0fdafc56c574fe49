"""The tests' own record of a model's casts into float8, independent of the observation under test."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


class CastRecorder(TorchDispatchMode):
    """Every cast of a wider float into float8 run inside it: (input, output) pairs, copied."""

    def __init__(self):
        super().__init__()
        self.casts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype in FLOAT8 and args[0].dtype not in FLOAT8:
            self.casts.append((args[0].detach().clone(), out.clone()))
        return out
