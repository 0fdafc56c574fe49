"""Tiny pre-LN transformers, nanoGPT style: a ViT on 8x8 digits and a byte-level causal GPT.

Both share one ``Block`` (pre-LN attention + MLP). Inside a block every linear layer is a
``QuantLinear`` (``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``), so emulated low-precision
recipes and probes reach all of them. Attention is computed explicitly,
``S = Q K^T / sqrt(d_head)``, ``A = phi(S)``, ``A V``, so that probes can read A through
``Attention.attention_tap``. Embeddings and the output head stay plain float32 ``nn.Linear`` /
``nn.Embedding`` (the measurements are per block).

Token counts N (the N in ``x^p/sqrt(N)``): the ViT cuts each 8x8 image into N patches (16 by
default: 2x2 patches) and has no class token: it classifies from the mean over tokens, so N is
exactly the number of patches. The GPT's N is its sequence length (see attention.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from precision_suite.training.attention import get_attention
from precision_suite.training.data import BYTE_VOCAB, DIGITS_CLASSES, DIGITS_SIDE
from precision_suite.training.quant_linear import QuantLinear

ModelKind = Literal["vit", "gpt"]

VIT_TOKEN_COUNTS = (4, 16, 64)  # 4x4, 2x2 or 1x1 pixel patches of an 8x8 image


@dataclass(frozen=True)
class ModelConfig:
    kind: ModelKind
    attention: str
    depth: int
    width: int
    heads: int
    tokens: int  # ViT: patches per image; GPT: sequence length


# Hidden size 128 for both so that (1, 128) scaling tiles are real tiles; GPT depth 18 so the
# figure-B layers 0, 4, 8, 12, 16 exist.
MODEL_DEFAULTS: dict[str, ModelConfig] = {
    "vit": ModelConfig("vit", "softmax", depth=12, width=128, heads=4, tokens=16),
    "gpt": ModelConfig("gpt", "softmax", depth=18, width=128, heads=4, tokens=64),
}


def model_config(
    kind: str,
    attention: str,
    depth: int | None = None,
    width: int | None = None,
    heads: int | None = None,
    tokens: int | None = None,
) -> ModelConfig:
    """The default config of ``kind`` with the given overrides (None keeps the default)."""
    if kind not in MODEL_DEFAULTS:
        raise ValueError(f"unknown model {kind!r}; choose one of {', '.join(MODEL_DEFAULTS)}")
    overrides = {"depth": depth, "width": width, "heads": heads, "tokens": tokens}
    config = replace(
        MODEL_DEFAULTS[kind],
        attention=attention,
        **{field: value for field, value in overrides.items() if value is not None},
    )
    check_model_config(config)
    return config


def check_model_config(config: ModelConfig) -> None:
    """Raise ValueError naming the field and what is allowed."""
    get_attention(config.attention)  # raises with the list of known names
    for field in ("depth", "width", "heads", "tokens"):
        value = getattr(config, field)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
    if config.width % config.heads:
        raise ValueError(f"width ({config.width}) must be divisible by heads ({config.heads})")
    if config.kind == "vit" and config.tokens not in VIT_TOKEN_COUNTS:
        raise ValueError(
            f"the ViT cuts 8x8 images into square patches: tokens (seq_len) must be one of "
            f"{VIT_TOKEN_COUNTS}, got {config.tokens}"
        )


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """S = Q K^T / sqrt(d_head): the scaling keeps scores O(1) whatever the head width."""
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, activation: str, tokens: int, causal: bool):
        super().__init__()
        self.heads = heads
        self.qkv = QuantLinear(width, 3 * width)
        self.proj = QuantLinear(width, width)
        self.phi = get_attention(activation)
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril() if causal else None
        self.register_buffer("causal_mask", mask, persistent=False)
        # called with A (B, heads, N, N) on sampled steps only; None otherwise
        self.attention_tap: Callable[[Tensor], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        batch, n, width = x.shape
        q, k, v = self.qkv(x).view(batch, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = attention_scores(q, k)
        mask = None if self.causal_mask is None else self.causal_mask[:n, :n]
        attention = self.phi(scores, n, mask)
        if self.attention_tap is not None:
            self.attention_tap(attention)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, n, width)
        return self.proj(mixed)


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = QuantLinear(width, 4 * width)
        self.fc2 = QuantLinear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, causal: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = Attention(config.width, config.heads, config.attention, config.tokens, causal)
        self.ln2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config.width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Transformer(nn.Module):
    """What ViT and GPT share: position embedding, blocks, final LN, nanoGPT init."""

    def __init__(self, config: ModelConfig, causal: bool):
        super().__init__()
        self.config = config
        self.position = nn.Parameter(torch.zeros(config.tokens, config.width))
        self.blocks = nn.ModuleList(Block(config, causal) for _ in range(config.depth))
        self.ln_f = nn.LayerNorm(config.width)

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.position, std=0.02)
        # nanoGPT: residual projections scaled by 1/sqrt(2 depth)
        for block in self.blocks:
            for residual in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * self.config.depth))

    def _blocks(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


class ViT(_Transformer):
    """Images (B, 8, 8) -> class logits (B, 10)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, causal=False)
        self.patch = DIGITS_SIDE // math.isqrt(config.tokens)
        self.embed = nn.Linear(self.patch * self.patch, config.width)
        self.head = nn.Linear(config.width, DIGITS_CLASSES)
        self._init_weights()

    def forward(self, images: Tensor) -> Tensor:
        batch, p = images.shape[0], self.patch
        # (B, 8, 8) -> (B, N, p*p): row-major grid of p x p patches
        patches = images.unfold(1, p, p).unfold(2, p, p).reshape(batch, -1, p * p)
        x = self.embed(patches) + self.position
        return self.head(self._blocks(x).mean(dim=1))


class GPT(_Transformer):
    """Bytes (B, T) -> next-byte logits (B, T, 256); T <= tokens."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, causal=True)
        self.embed = nn.Embedding(BYTE_VOCAB, config.width)
        self.head = nn.Linear(config.width, BYTE_VOCAB, bias=False)
        self._init_weights()

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx) + self.position[: idx.shape[1]]
        return self.head(self._blocks(x))


def build_model(config: ModelConfig) -> ViT | GPT:
    """A freshly initialised model (uses the global torch RNG: seed it first)."""
    check_model_config(config)
    return ViT(config) if config.kind == "vit" else GPT(config)


def block_linears(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of the ``QuantLinear`` layers in one block of ``config``.

    Built on the meta device: no memory, no RNG draws.
    """
    # no causal mask: it shapes no linear, and tril on the meta device costs a fresh process seconds
    with torch.device("meta"):
        block = Block(config, causal=False)
    return [
        (name, module.in_features, module.out_features)
        for name, module in block.named_modules()
        if isinstance(module, QuantLinear)
    ]
