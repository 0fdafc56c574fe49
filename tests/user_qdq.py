"""A user's own blockwise FP8 fake quantization, named by import strings in tests (``user_qdq:build``,
``user_qdq:batches``): research code that emulates DeepSeek-style FP8 training on any hardware. Its
linear layers run a hand-written ``torch.autograd.Function``: the forward casts activations in 1x128
tiles and weights in 128x128 blocks to ``float8_e4m3fn`` and back, divides by the block scale and
calls an ordinary matmul; the backward quantizes the output gradient the same way, in 1x128 tiles
for the input gradient and 128x1 tiles (along tokens) for the weight gradient, with the saved input
in 128x1 tiles and the weight in its blocks. Blocks are at most the tensor (the 64-row head's
weight blocks are 64x128). Nothing from precision_suite.

Each recipe choice is one string read from the environment when the model is built, as a team's
config would set it: ``USER_QDQ_WEIGHT_BLOCK`` (the weights' block, ``128x128`` or ``1x128``),
``USER_QDQ_GRADIENTS`` (the gradients' element format, ``e5m2`` or ``e4m3``),
``USER_QDQ_FP32_MODULES`` (comma-separated modules left in float32), ``USER_QDQ_TARGET`` (the value a
block's amax maps to on the E4M3 scale, 448 = the format's largest finite value; other formats map
to the same fraction of theirs) and ``USER_QDQ_ROUNDING`` (``nearest``, or ``toward_zero``: every
element round-to-nearest moved away from zero is stepped back one code).

Tokens per step (batch x sequence) must be a multiple of 128: the weight gradient's tiles run along
tokens.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from user_code import VOCAB, batches  # noqa: F401  (the same data as user_code's model)

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
LARGEST = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
TILE = 128


def parse_block(text: str) -> tuple[int, int]:
    rows, _, cols = text.partition("x")
    return int(rows), int(cols)


class Recipe:
    """The model's quantization choices, from the environment (module docstring)."""

    def __init__(self):
        self.weight_block = parse_block(os.environ.get("USER_QDQ_WEIGHT_BLOCK", "128x128"))
        self.gradients = FORMATS[os.environ.get("USER_QDQ_GRADIENTS", "e5m2")]
        self.fraction = float(os.environ.get("USER_QDQ_TARGET", "448")) / LARGEST[torch.float8_e4m3fn]
        self.rounding = os.environ.get("USER_QDQ_ROUNDING", "nearest")


def fake_quantize(
    x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, recipe: Recipe
) -> torch.Tensor:
    """x (2-D) cast to `dtype` per block (at most the tensor) and back: each block's amax maps to
    the recipe's fraction of the format's largest value; the result is q / scale."""
    rows, cols = x.shape
    r, c = min(block[0], rows), min(block[1], cols)
    tiles = x.detach().reshape(rows // r, r, cols // c, c)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    largest = LARGEST[dtype]
    scale = recipe.fraction * largest / amax
    scaled = (tiles * scale).clamp(-largest, largest)  # torch versions differ on casting 448.x
    q = scaled.to(dtype)
    if recipe.rounding == "toward_zero":
        overshot = q.float().abs() > scaled.abs()
        codes = q.view(torch.uint8)
        q = torch.where(overshot, codes - 1, codes).view(dtype)  # sign-magnitude: one code nearer zero
    return (q.to(torch.float32) / scale).reshape(rows, cols)


class QDQLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        x2d = x.reshape(-1, x.shape[-1])
        y = (
            fake_quantize(x2d, (1, TILE), torch.float8_e4m3fn, recipe)
            @ fake_quantize(weight, recipe.weight_block, torch.float8_e4m3fn, recipe).t()
        )
        ctx.save_for_backward(x2d, weight)
        ctx.recipe, ctx.shape, ctx.has_bias = recipe, x.shape, bias is not None
        y = y if bias is None else y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        recipe = ctx.recipe
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = fake_quantize(dy2d, (1, TILE), recipe.gradients, recipe) @ fake_quantize(
            weight, recipe.weight_block, torch.float8_e4m3fn, recipe
        )
        dw = fake_quantize(dy2d, (TILE, 1), recipe.gradients, recipe).t() @ fake_quantize(
            x2d, (TILE, 1), torch.float8_e4m3fn, recipe
        )
        return dx.reshape(ctx.shape), dw, dy2d.sum(0) if ctx.has_bias else None, None


class QDQLinear(nn.Linear):
    """nn.Linear whose three GEMMs run on fake-quantized FP8 operands (``quantize`` False: float32)."""

    def __init__(self, *args, recipe: Recipe, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe, self.quantize = recipe, True

    def forward(self, x):
        if not self.quantize:
            return super().forward(x)
        return QDQLinearFn.apply(x, self.weight, self.bias, self.recipe)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, recipe: Recipe):
        super().__init__()
        self.heads = heads
        self.qkv = QDQLinear(width, 3 * width, recipe=recipe)
        self.proj = QDQLinear(width, width, recipe=recipe)

    def forward(self, x):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, w))


class MLP(nn.Module):
    def __init__(self, width: int, recipe: Recipe):
        super().__init__()
        self.fc1 = QDQLinear(width, 4 * width, recipe=recipe)
        self.fc2 = QDQLinear(4 * width, width, recipe=recipe)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, recipe: Recipe):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, recipe)
        self.mlp = MLP(width, recipe)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class QDQGPT(nn.Module):
    """A tiny decoder LM: embeddings, blocks with an attention submodule and an MLP, a head."""

    def __init__(self, depth: int = 2, width: int = 128, heads: int = 4, seq_len: int = 32):
        super().__init__()
        recipe = Recipe()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads, recipe) for _ in range(depth))
        self.head = QDQLinear(width, VOCAB, bias=False, recipe=recipe)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(spec) -> QDQGPT:
    model = QDQGPT(depth=spec.depth or 2, width=spec.width or 128, seq_len=spec.seq_len or 32)
    float32_modules = [name for name in os.environ.get("USER_QDQ_FP32_MODULES", "").split(",") if name]
    modules = dict(model.named_modules())
    for name in float32_modules:
        modules[name].quantize = False
    return model
