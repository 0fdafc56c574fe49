"""The attention matrices of a model on a sampled step, from any code: calls to
F.scaled_dot_product_attention (phi(S) recomputed from the query and key the kernel receives) and
explicit softmaxes over square scores (read as computed), and the Frobenius norm that figure A
plots (SCIENCE.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from precision_suite.training.model_modes import unobserved


def attention_norm(attention: Tensor) -> float:
    """Frobenius norm of each head's N x N matrix, mean over heads and batch (SCIENCE.md figure A)."""
    with outside_capture(), torch.no_grad():
        return float(torch.linalg.matrix_norm(attention.detach().float(), ord="fro").mean())


def sdpa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """softmax(Q K^T * scale + mask): the matrix F.scaled_dot_product_attention applies (same
    signature); grouped-query keys are repeated to the query heads as the kernel does."""
    q, k = query.detach().float(), key.detach().float()
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    n_query, n_key = scores.shape[-2:]
    if is_causal:
        visible = torch.ones(n_query, n_key, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask.float()
        )
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row attends to nothing


_SOFTMAXES = {torch.softmax, F.softmax, Tensor.softmax, torch.special.softmax}


class AttentionCapture(TorchFunctionMode):
    """On a sampled step: reads attention matrices from SDPA calls and square softmaxes."""

    def __init__(self, record: Callable[[Tensor], None]) -> None:
        super().__init__()
        self.record = record  # hands each attention matrix phi(S) to the recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self.record(sdpa_attention(*args, **kwargs))
        elif (
            func in _SOFTMAXES
            and isinstance(out, Tensor)
            and out.ndim >= 3
            and out.shape[-1] == out.shape[-2]
            and _softmax_dim(args, kwargs) in (-1, out.ndim - 1)
        ):
            self.record(out)
        return out


def _softmax_dim(args: tuple, kwargs: Mapping[str, Any]) -> Any:
    return kwargs.get("dim", args[1] if len(args) > 1 else None)


@contextmanager
def outside_capture() -> Iterator[None]:
    """Measure with the capture modes popped: the measuring code's own ops are neither attention
    nor the model's quantization, and torch.compile'd quantizers then see the same (empty) mode
    stacks as on any other call, so they are not compiled a second time."""
    with unobserved():
        if not any(isinstance(mode, AttentionCapture) for mode in _mode_stack()):
            yield
            return
        with torch.overrides._pop_mode_temporarily():  # private, but the one way to step out of a mode
            yield


def _mode_stack() -> list[Any]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
