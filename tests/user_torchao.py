"""A user's model trained in float8 by torchao (``convert_to_float8_training``), named by import
strings in tests (``user_torchao:build``). Nothing from precision_suite. Which torchao recipe and
whether the head is converted are read from the environment when the model is built
(``USER_TORCHAO_RECIPE``: tensorwise, rowwise, rowwise_with_gw_hp; ``USER_TORCHAO_HEAD=hp`` keeps
the head out of float8), as a team's config would set them; so are two changes of model code
(``USER_TORCHAO_RESIDUAL``: the MLP branch's weight in the residual; ``USER_TORCHAO_ATTENTION_SCALE``:
``1/sqrt(d)``, SDPA's default, or ``1/d``).
"""

from __future__ import annotations

import os

import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from user_code import VOCAB, batches  # noqa: F401  (the same data as user_code's model)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.residual = float(os.environ.get("USER_TORCHAO_RESIDUAL", "1"))

    def forward(self, x):
        return x + self.residual * self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPModel(nn.Module):
    """Embedding, one parameter-free causal attention, MLP blocks, a head (every width a multiple of
    16, as torchao's float8 GEMMs ask)."""

    def __init__(self, depth: int = 2, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)
        # None: SDPA's default 1/sqrt(d)
        self.attention_scale = (
            1 / width if os.environ.get("USER_TORCHAO_ATTENTION_SCALE", "1/sqrt(d)") == "1/d" else None
        )

    def forward(self, idx):
        x = self.embed(idx).unsqueeze(1)  # one head
        x = F.scaled_dot_product_attention(x, x, x, is_causal=True, scale=self.attention_scale).squeeze(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def config(recipe: str | None = None) -> Float8LinearConfig:
    return Float8LinearConfig.from_recipe_name(recipe or os.environ.get("USER_TORCHAO_RECIPE", "tensorwise"))


def build(spec) -> MLPModel:
    model = MLPModel(depth=spec.depth or 2, width=spec.width or 64)
    keep_head = os.environ.get("USER_TORCHAO_HEAD", "fp8") == "hp"
    convert_to_float8_training(
        model, config=config(), module_filter_fn=lambda module, name: not (keep_head and name == "head")
    )
    return model
