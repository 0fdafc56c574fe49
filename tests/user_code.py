"""A user's own model, batches and attention variant, named by import strings in tests
(``user_code:build`` and so on): nanoGPT-style, plain nn.Linear and F.scaled_dot_product_attention,
nothing from precision_suite."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.c_attn(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, n, w))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, depth: int = 2, width: int = 128, heads: int = 4, seq_len: int = 32):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(seq_len, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def build(spec) -> TinyGPT:
    return TinyGPT(depth=spec.depth or 2, width=spec.width or 128, seq_len=spec.seq_len or 32)


def batches(spec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token prediction on a repeating pattern: learnable in a few steps."""
    n = spec.seq_len or 32
    start = torch.randint(VOCAB, (spec.batch_size or 8, 1), generator=generator)
    tokens = (start + torch.arange(n + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def half_softmax(scores: torch.Tensor, n_tokens: int, causal_mask: torch.Tensor | None) -> torch.Tensor:
    """An attention variant of the user's: softmax at half temperature."""
    if causal_mask is not None:
        scores = scores.masked_fill(~causal_mask, float("-inf"))
    return torch.softmax(scores / 2, dim=-1)
