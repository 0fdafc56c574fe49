"""Which modules of a model are linear-like (their GEMMs are measured) and how to read each one's
weight as (out, in); the modules a recorder's `modules=` selects."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

WeightReader = Callable[[nn.Module], Tensor]

# class -> how to read its weight as (out, in). Hugging Face's Conv1D (GPT-2 and relatives) computes
# x @ W + b with W stored as (in, out); it is matched by name so transformers need not be imported.
_LINEAR_LIKE: dict[type, WeightReader] = {nn.Linear: lambda module: module.weight}
_LINEAR_LIKE_BY_NAME: dict[str, WeightReader] = {
    "transformers.pytorch_utils.Conv1D": lambda module: module.weight.t(),
}


def register_linear(cls: type, weight: WeightReader = lambda module: module.weight) -> None:
    """Treat ``cls`` (and its subclasses) as a GEMM layer y = x W^T (+ b) whose input is the
    forward's first argument; ``weight(module)`` returns W as (out, in)."""
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_linear: expected an nn.Module subclass, got {cls!r}")
    if not callable(weight):
        raise TypeError(f"register_linear({cls.__name__}): weight must be callable, got {weight!r}")
    _LINEAR_LIKE[cls] = weight


def weight_reader(module: nn.Module) -> WeightReader | None:
    """How to read ``module``'s weight as (out, in), or None when it is not linear-like."""
    for cls in type(module).__mro__:
        if cls in _LINEAR_LIKE:
            return _LINEAR_LIKE[cls]
        reader = _LINEAR_LIKE_BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
        if reader is not None:
            return reader
    return None


def module_filter(patterns: Any) -> Callable[[str], bool]:
    """Whether a module name is selected by `modules=` (globs or compiled regexes; None: all)."""
    if patterns is None:
        return lambda name: True
    listed = [patterns] if isinstance(patterns, (str, re.Pattern)) else list(patterns)
    return lambda name: any(
        p.fullmatch(name) if isinstance(p, re.Pattern) else fnmatch.fnmatchcase(name, p) for p in listed
    )


def select_gemms(model: nn.Module, patterns: Any) -> dict[str, tuple[nn.Module, WeightReader]]:
    linear_like = {
        name: (module, reader)
        for name, module in model.named_modules()
        if (reader := weight_reader(module)) is not None
    }
    if not linear_like:
        kinds = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"instrument: {type(model).__name__} has no linear-like module (searched "
            f"{len(kinds)} module types: {', '.join(kinds[:12])}); register yours with "
            "precision_suite.register_linear(cls, weight=...)"
        )
    if patterns is None:
        return linear_like
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    selected: dict[str, tuple[nn.Module, WeightReader]] = {}
    for pattern in patterns:
        if isinstance(pattern, re.Pattern):
            hits = [name for name in linear_like if pattern.fullmatch(name)]
        elif isinstance(pattern, str):
            hits = fnmatch.filter(linear_like, pattern)
        else:
            raise TypeError(f"instrument: modules= takes globs or compiled regexes, got {pattern!r}")
        if not hits:
            shown = ", ".join(list(linear_like)[:8]) + (", ..." if len(linear_like) > 8 else "")
            raise ValueError(
                f"instrument: modules pattern {getattr(pattern, 'pattern', pattern)!r} matches "
                f"none of the {len(linear_like)} linear-like modules ({shown})"
            )
        selected.update({name: linear_like[name] for name in hits})
    return {name: selected[name] for name in linear_like if name in selected}  # model order
