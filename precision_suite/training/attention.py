"""Attention activations phi(S) applied to the scores S = Q K^T / sqrt(d_head) (SCIENCE.md figure A).

Every activation has the signature ``fn(scores, n_tokens, causal_mask) -> A``:

- ``scores``: tensor (..., N, N), the scaled dot products of one or more heads.
- ``n_tokens``: N, the number of tokens the formulas use (``sqrt(N)``, ``log N``, ``1/N``). For the
  causal GPT this is the sequence length (choice: the same N for every query row, as in the papers'
  formulas, rather than the number of keys a row actually sees).
- ``causal_mask``: bool tensor (N, N), True where query i may see key j (j <= i), or None. Masked
  entries are exactly zero in A: softmax variants put -inf there before normalising, element-wise
  variants zero them after phi.

Built in: ``softmax``; polynomials ``x^p/c`` with an integer p >= 1 and c a positive number or
``sqrt(N)`` (``x/1``, ``x^3/14``, ``x^3/sqrt(N)``, ``x^2/2.5``: parsed from the name on the fly,
never registered); ``sigmoid`` (``sigmoid(S - log N)``); ``relu/N``; ``ssmax`` (scalable softmax
``softmax(s log(N) S)`` with the constant s = 1: the learned-free variant).

Register your own with ``@register_attention("name")`` or ``register_attention("name", fn)``, or
name it by an import string (``"mypkg.attention:phi"``) where a name is asked for.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import Tensor

from precision_suite.training.imports import is_import_string, load_object

AttentionFn = Callable[[Tensor, int, Tensor | None], Tensor]

ATTENTIONS: dict[str, AttentionFn] = {}

# x^p/c: "x" or "x^<p>", a slash, then a positive number or sqrt(N)
_POLYNOMIAL = re.compile(r"^x(?:\^(?P<power>\d+))?/(?P<divisor>sqrt\(N\)|\d+(?:\.\d*)?|\.\d+)$")
POLYNOMIAL_PATTERN = "x^p/c (p an integer >= 1, c a positive number or sqrt(N); e.g. x/1, x^3/sqrt(N))"


def register_attention(name: str, fn: AttentionFn | None = None):
    """Register an activation under ``name``; use as ``@register_attention(name)`` or call directly.

    Returns ``fn`` (the decorator form returns a decorator that returns its argument).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_attention: name must be a non-empty string, got {name!r}")
    if _POLYNOMIAL.match(name):
        raise ValueError(
            f"register_attention: {name!r} is a polynomial name, which get_attention parses itself; "
            "pick another name"
        )

    def decorate(func: AttentionFn) -> AttentionFn:
        if not callable(func):
            raise TypeError(f"register_attention({name!r}): expected a callable, got {func!r}")
        ATTENTIONS[name] = func
        return func

    return decorate if fn is None else decorate(fn)


def known_attentions() -> list[str]:
    """Registered names plus the polynomial pattern, for error messages and the CLI."""
    return [*sorted(ATTENTIONS), POLYNOMIAL_PATTERN]


def get_attention(name: str) -> AttentionFn:
    """The activation called ``name``: a registered one, a polynomial parsed from the name, or a
    user's function named by an import string (``"mypkg.attention:phi"``, same signature)."""
    if isinstance(name, str) and name in ATTENTIONS:
        return ATTENTIONS[name]
    polynomial = _parse_polynomial(name)
    if polynomial is not None:
        return polynomial
    if is_import_string(name):
        return load_object(name, "attention")
    raise ValueError(
        f"unknown attention {name!r}; known: {', '.join(known_attentions())}, "
        "or a function of yours as package.module:function"
    )


def _parse_polynomial(name: str) -> AttentionFn | None:
    match = _POLYNOMIAL.match(name) if isinstance(name, str) else None
    if match is None:
        return None
    power = int(match["power"] or 1)
    scaled_by_sqrt_n = match["divisor"] == "sqrt(N)"
    constant = 1.0 if scaled_by_sqrt_n else float(match["divisor"])
    if power < 1 or constant <= 0:
        return None

    def polynomial(scores: Tensor, n_tokens: int, causal_mask: Tensor | None) -> Tensor:
        divisor = math.sqrt(n_tokens) if scaled_by_sqrt_n else constant
        return _zero_masked(scores.pow(power) / divisor, causal_mask)

    polynomial.__name__ = polynomial.__qualname__ = f"polynomial[{name}]"
    return polynomial


def _zero_masked(activations: Tensor, causal_mask: Tensor | None) -> Tensor:
    return activations if causal_mask is None else activations.masked_fill(~causal_mask, 0.0)


def _masked_softmax(logits: Tensor, causal_mask: Tensor | None) -> Tensor:
    if causal_mask is not None:
        logits = logits.masked_fill(~causal_mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


@register_attention("softmax")
def softmax(scores: Tensor, n_tokens: int, causal_mask: Tensor | None) -> Tensor:
    return _masked_softmax(scores, causal_mask)


@register_attention("sigmoid")
def sigmoid(scores: Tensor, n_tokens: int, causal_mask: Tensor | None) -> Tensor:
    """Sigmoid attention with the bias -log N (arXiv 2409.04431)."""
    return _zero_masked(torch.sigmoid(scores - math.log(n_tokens)), causal_mask)


@register_attention("relu/N")
def relu_over_n(scores: Tensor, n_tokens: int, causal_mask: Tensor | None) -> Tensor:
    """ReLU attention divided by the sequence length (arXiv 2309.08586)."""
    return _zero_masked(torch.relu(scores) / n_tokens, causal_mask)


@register_attention("ssmax")
def scalable_softmax(scores: Tensor, n_tokens: int, causal_mask: Tensor | None, s: float = 1.0) -> Tensor:
    """Scalable softmax softmax(s log(N) S) (arXiv 2501.19399); s is a constant here, not learned."""
    return _masked_softmax(scores * (s * math.log(n_tokens)), causal_mask)
