"""A user's own FP8 training code, named by import strings in tests (``user_fp8:build``): linear
layers that cast to float8 themselves and call ``torch._scaled_mm`` forward and backward, as a team
without torchao writes them. Nothing from precision_suite. ``USER_FP8_ROUNDING=toward_zero`` plants
a cast kernel that rounds toward zero instead of to nearest; ``USER_FP8_GRADIENTS=e4m3`` casts
gradients to E4M3 instead of E5M2 (both read when the model is built).

Tensor-wise current scaling: s = max / amax, q = fp8(clamp(x * s)), the GEMM dequantizes with 1/s.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from user_code import VOCAB, batches  # noqa: F401  (the same data as user_code's model)

MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
GRADIENTS = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}


def cast(x: torch.Tensor, dtype: torch.dtype, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, 1/s): x scaled to the format's max and cast; `rounding` "toward_zero" steps every
    element that round-to-nearest moved away from zero back by one code."""
    scale = MAX[dtype] / x.detach().abs().amax().clamp(min=1e-12)
    scaled = (x.detach() * scale).clamp(-MAX[dtype], MAX[dtype])
    q = scaled.to(dtype)
    if rounding == "toward_zero":
        overshot = q.float().abs() > scaled.abs()
        codes = q.view(torch.uint8)
        q = torch.where(overshot, codes - 1, codes).view(dtype)  # sign-magnitude: one code nearer zero
    return q, scale.reciprocal()


def column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class ScaledLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gradients, rounding):
        x2d = x.reshape(-1, x.shape[-1])
        qx, ix = cast(x2d, torch.float8_e4m3fn, rounding)
        qw, iw = cast(weight, torch.float8_e4m3fn, rounding)
        y = torch._scaled_mm(qx, qw.t(), ix, iw, out_dtype=torch.float32, use_fast_accum=True)
        ctx.save_for_backward(x2d, weight)
        ctx.gradients, ctx.rounding, ctx.shape = gradients, rounding, x.shape
        y = y if bias is None else y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        qdy, idy = cast(dy2d, ctx.gradients, ctx.rounding)
        qw, iw = cast(weight, torch.float8_e4m3fn, ctx.rounding)
        dx = torch._scaled_mm(qdy, column_major(qw), idy, iw, out_dtype=torch.float32)
        qx, ix = cast(x2d, torch.float8_e4m3fn, ctx.rounding)
        dw = torch._scaled_mm(qdy.t().contiguous(), column_major(qx), idy, ix, out_dtype=torch.float32)
        return dx.reshape(ctx.shape), dw, dy2d.sum(0), None, None


class ScaledLinear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 through torch._scaled_mm."""

    def __init__(self, *args, gradients: torch.dtype, rounding: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradients, self.rounding = gradients, rounding

    def forward(self, x):
        return ScaledLinearFn.apply(x, self.weight, self.bias, self.gradients, self.rounding)


class Block(nn.Module):
    def __init__(self, width: int, **fp8):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = ScaledLinear(width, 2 * width, **fp8)
        self.fc2 = ScaledLinear(2 * width, width, **fp8)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Fp8MLP(nn.Module):
    """Embedding, one parameter-free causal attention, blocks of FP8 MLPs, a float32 head."""

    def __init__(self, depth: int = 2, width: int = 64):
        super().__init__()
        fp8 = {
            "gradients": GRADIENTS[os.environ.get("USER_FP8_GRADIENTS", "e5m2")],
            "rounding": os.environ.get("USER_FP8_ROUNDING", "nearest"),
        }
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, **fp8) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx):
        x = self.embed(idx).unsqueeze(1)  # one head
        x = F.scaled_dot_product_attention(x, x, x, is_causal=True).squeeze(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(spec) -> Fp8MLP:
    return Fp8MLP(depth=spec.depth or 2, width=spec.width or 64)
