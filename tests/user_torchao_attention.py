"""A user's decoder LM trained in float8 by torchao, its attention in a submodule of each block (as
Hugging Face and nanoGPT models have it), named by import strings in tests
(``user_torchao_attention:build``, ``user_torchao_attention:batches``). Nothing from
precision_suite. Read from the environment when the model is built, as a team's config would set
them: the torchao recipe (``USER_TORCHAO_LM_RECIPE``: tensorwise, rowwise, rowwise_with_gw_hp),
whether the head is converted (``USER_TORCHAO_LM_HEAD=hp`` keeps it out of float8) and whether
scales are rounded to powers of two (``USER_TORCHAO_LM_POW2_SCALES=1``).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from user_code import VOCAB, batches  # noqa: F401  (the same data as user_code's model)


class Attention(nn.Module):
    """Causal self-attention: one qkv projection, F.scaled_dot_product_attention, an output projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, w))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """Token and position embeddings, blocks, a head; every width a multiple of 16, as torchao's
    float8 GEMMs ask."""

    def __init__(self, depth: int = 2, width: int = 64, heads: int = 2, seq_len: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.position(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def config() -> Float8LinearConfig:
    recipe = Float8LinearConfig.from_recipe_name(os.environ.get("USER_TORCHAO_LM_RECIPE", "tensorwise"))
    return dataclasses.replace(
        recipe, round_scales_to_power_of_2=os.environ.get("USER_TORCHAO_LM_POW2_SCALES", "0") == "1"
    )


def build(spec) -> DecoderLM:
    model = DecoderLM(depth=spec.depth or 2, width=spec.width or 64, seq_len=spec.seq_len or 32)
    keep_head = os.environ.get("USER_TORCHAO_LM_HEAD", "fp8") == "hp"
    convert_to_float8_training(
        model, config=config(), module_filter_fn=lambda module, name: not (keep_head and name == "head")
    )
    return model
