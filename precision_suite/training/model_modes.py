"""The dispatch modes that watch the model's own ops (observation.Observation, `GemmArguments`), and
what runs around them: the autograd nodes tagged with the module whose forward made them (in
backward they say whose GEMMs run), and `unobserved`, under which the suite's own tensor code runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)

aten = torch.ops.aten

# the matrix products torch's matmul, `@`, F.linear and einsum reach below autograd
MATRIX_PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class ModelMode(TorchDispatchMode):
    """A dispatch mode that watches the model's own ops; the suite's own code runs outside every
    one (`unobserved`)."""


MODULE_TAG = "precision_suite_module"


def tag_nodes(outputs: Any, module: str, first_node: int) -> None:
    """Name `module` in the metadata of every autograd node its forward created (sequence number
    `first_node` or later) that an inner module has not named: in backward, the node being run
    says which module's GEMMs these are (`Observation._where`)."""
    pending = [
        leaf.grad_fn
        for leaf in torch.utils._pytree.tree_leaves(outputs)
        if isinstance(leaf, Tensor) and leaf.grad_fn is not None
    ]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen or node._sequence_nr() < first_node:
            continue
        seen.add(id(node))
        node.metadata.setdefault(MODULE_TAG, module)
        pending.extend(next_node for next_node, _ in node.next_functions)


def sequence_number() -> int:
    """The sequence number the next autograd node created on this thread gets."""
    return torch._C._autograd._get_sequence_nr()


class GemmArguments(ModelMode):
    """The operands every matrix product run inside it received, as executed: (a (M, K), b (K, N))
    pairs in `calls` (aten.mm, addmm, and bmm of one matrix: what `@`, torch.matmul, F.linear and
    einsum reach below autograd, whichever tensors the code hands them). A GEMM computed some other
    way (the suite's emulation, under `unobserved`) hands its operands with `gemm_received`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATRIX_PRODUCTS:  # mm(a, b), addmm(bias, a, b), bmm(a, b)
            a, b = (t[0] if t.dim() == 3 and t.shape[0] == 1 else t for t in args[-2:])
            self.calls.append((a, b))
        return func(*args, **(kwargs or {}))


def gemm_received(a: Tensor, b: Tensor) -> None:
    """Count a (M, K) @ b (K, N) as a call of the innermost active `GemmArguments` (none: nothing)."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, GemmArguments):
            mode.calls.append((a, b))
            return


@contextmanager
def unobserved() -> Iterator[None]:
    """Run the suite's own tensor code (its quantizers, probes, checks and GEMM emulation) without
    being observed: the observation mode and argument captures are popped while it runs, so its
    casts and products are not the model's and compiled code sees the same empty mode stack as on
    any other call."""
    with ExitStack() as popped:
        while (stack := _get_current_dispatch_mode_stack()) and isinstance(stack[-1], ModelMode):
            popped.enter_context(_pop_mode_temporarily())
        yield
