"""How a tensor the observation saw derives from a cast into an 8-bit float: the cast (`Cast`), the
chain of views, reshapes, transposes, expands and copies since (`Dequantization`: replayed on the
cast's output, source and input at the GEMM, and on the scale's index, so blocks are read from the
scale's shape, not its values), the GEMM operand it gives (`GemmOperand`), and a step's casts
(`StepCasts`: found by output or source, each let go of once no GEMM can take it). observation.py
records them as the model runs; observed_operands.py describes each operand.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from precision_suite.training.observed_operands import Scaling, block_factor

aten = torch.ops.aten


def _as_reshape(tensor: Tensor, size: Sequence[int]) -> Tensor:
    return tensor.reshape(size)  # a replayed view may not be viewable (an expanded id tensor)


def _same(tensor: Tensor, *_: Any, **__: Any) -> Tensor:
    return tensor


def first_matrix(tensor: Tensor) -> Tensor:
    return tensor[0]


first_matrix.key = "first matrix"  # type: ignore[attr-defined]


def same_op(
    op: Callable[..., Tensor], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Callable[[Tensor], Tensor]:
    """The op applied to another tensor with the same arguments. Its `key` names the op and its
    arguments (observed_operands.block_factor caches the blocks of a chain by the keys of its
    steps), None where an argument is not a plain value."""

    def replay(tensor: Tensor) -> Tensor:
        return op(tensor, *args, **kwargs)

    replay.key = _plain((op, tuple(args), tuple(sorted(kwargs.items()))))  # type: ignore[attr-defined]
    return replay


def _plain(value: Any) -> Any:
    """`value` with lists as tuples where it holds only ints, floats, strings, dtypes and ops
    (hashable, and equal exactly when the replay does the same), else None."""
    if isinstance(value, (list, tuple)):
        items = tuple(_plain(item) for item in value)
        return None if any(item is None and orig is not None for item, orig in zip(items, value)) else items
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.memory_format)):
        return value
    return value if callable(value) and not isinstance(value, Tensor) else None


# ops that keep a dequantized tensor's link to its cast, and how each is replayed on the cast's
# tensors at the GEMM (None: the op itself)
RELINKS: dict[Any, Callable[..., Tensor] | None] = {
    aten.view.default: _as_reshape,
    aten._unsafe_view.default: _as_reshape,
    aten.reshape.default: _as_reshape,
    aten.t.default: None,
    aten.transpose.int: None,
    aten.permute.default: None,
    aten.expand.default: None,
    aten.unsqueeze.default: None,
    aten.squeeze.dim: None,
    aten.squeeze.default: None,
    aten.clone.default: _same,
    aten.alias.default: _same,
    aten.detach.default: _same,
}


class Cast:
    """One cast into a low-precision dtype: its input, output and what came before it.

    The output is held weakly, so the step keeps a cast's input and source (a full-size float
    tensor each) only while a GEMM can still take the cast: while its output lives (in the model,
    a view, or a link derived from it: `Dequantization.keep`), or while it is its module's latest
    cast of that shape, which 8-bit data the model's code changed still dequantizes as
    (`Observation._changed_cast`); then `release`. Held to the step's end, the casts of a sampled
    step of a 17M-parameter Llama took 435 MB (issue 39)."""

    def __init__(
        self,
        module: str,
        cast_input: Tensor,
        output: Tensor,
        source: Tensor | None,
        scaling: Scaling | None,
        origin: Cast | None = None,
        on_gone: Callable[[Cast], None] | None = None,
    ) -> None:
        self.module = module
        self.cast_input: Tensor | None = cast_input  # float, already scaled
        self.source = source  # the tensor before the scaling op (None: no scaling op seen)
        self.scaling = scaling
        self.consumed = False  # an observed GEMM took its output as an operand
        self.origin = origin  # the cast whose output the model's code changed into this one's
        self.shape, self.dtype, self.elements = tuple(output.shape), output.dtype, output.numel()
        self._on_gone = on_gone
        self._output = weakref.ref(output, self._gone if on_gone is not None else None)

    @property
    def output(self) -> Tensor | None:
        """The low-precision output, None once nothing holds it."""
        return self._output()

    def changed(self, data: Tensor) -> Cast:
        """This cast with `data` as its output: 8-bit data the model's code made from it."""
        return Cast(self.module, self.cast_input, data, self.source, self.scaling, origin=self)

    def consume(self) -> None:
        self.consumed = True
        if self.origin is not None:
            self.origin.consumed = True

    def release(self) -> None:
        """Let go of the cast's tensors: no GEMM can take it any more."""
        self.cast_input = self.source = None

    def _gone(self, _: weakref.ref) -> None:
        if self._on_gone is not None:
            self._on_gone(self)


class StepCasts:
    """The casts of one sampled step, in order: found by output, by source or as the latest of a
    module's shape, and let go of (`Cast.release`) once no GEMM can take them."""

    def __init__(self) -> None:
        self.all: list[Cast] = []
        self.module: str | None = None  # the module of the latest cast or GEMM
        self._latest: dict[tuple, Cast] = {}  # (module, shape, dtype) -> the latest such cast

    def add(
        self, module: str, cast_input: Tensor, output: Tensor, source: Tensor | None, scaling: Scaling | None
    ) -> Cast:
        self.running(module)
        cast = Cast(module, cast_input, output, source, scaling, on_gone=self._output_gone)
        key = (module, cast.shape, cast.dtype)
        previous, self._latest[key] = self._latest.get(key), cast
        if previous is not None and previous.output is None:
            previous.release()
        self.all.append(cast)
        return cast

    def running(self, module: str) -> None:
        """A cast or GEMM of `module`: other modules' latest casts are no longer what changed
        8-bit data dequantizes as (that is made by the code that cast, before it moves on)."""
        if module == self.module:
            return
        self.module = module
        for key in [key for key in self._latest if key[0] != module]:
            cast = self._latest.pop(key)
            if cast.output is None:
                cast.release()

    def _output_gone(self, cast: Cast) -> None:
        """A cast's output is gone: its tensors go too, unless its module's next changed 8-bit
        data of that shape may still be made from it (`latest`)."""
        if self._latest.get((cast.module, cast.shape, cast.dtype)) is not cast:
            cast.release()

    def latest(self, module: str, data: Tensor) -> Cast | None:
        """The module's latest cast of `data`'s shape and dtype."""
        key = (module, tuple(data.shape), data.dtype)
        return next((c for c in reversed(self.all) if (c.module, c.shape, c.dtype) == key), None)

    def of(self, data: Tensor) -> tuple[Cast, bool] | None:
        """The latest cast whose output is `data` (or its transpose), and whether it is
        transposed."""
        bits = data.view(torch.uint8)
        for cast in reversed(self.all):
            out = cast.output
            if out is None or out.numel() != data.numel() or out.dtype != data.dtype or out.dim() < 2:
                continue
            out = out.reshape(-1, out.shape[-1])
            if out.shape == data.shape and torch.equal(out.view(torch.uint8), bits):
                return cast, False
            if out.shape == data.shape[::-1] and torch.equal(out.view(torch.uint8).t(), bits):
                return cast, True
        return None

    def from_source(self, tensor: Tensor) -> tuple[Cast, bool] | None:
        """The latest cast whose source is `tensor` (same memory, as it or transposed)."""
        for cast in reversed(self.all):
            source = cast.source
            if source is None or source.numel() != tensor.numel() or source.data_ptr() != tensor.data_ptr():
                continue
            shape = source.reshape(-1, source.shape[-1]).shape if source.dim() >= 2 else None
            if shape == tensor.shape:
                return cast, False
            if shape == tensor.shape[::-1]:
                return cast, True
        return None

    def modules(self) -> set[str]:
        return {cast.module for cast in self.all}

    def unconsumed(self) -> dict[str, int]:
        """Per module, the elements of its casts no observed GEMM consumed."""
        counts: dict[str, int] = {}
        for cast in self.all:
            if not cast.consumed:
                counts[cast.module] = counts.get(cast.module, 0) + cast.elements
        return counts


@dataclass
class GemmOperand:
    """A GEMM argument as received: data (low precision; a high-precision tensor where `scaling` is
    None: an unquantized operand), its scaling, and which tensor role a subclass says it has
    (torchao's GemmInputRole) when it says so. A dequantized operand also names its cast and that
    cast's source and input in the executed orientation (`Dequantization.operand`), and, where it
    was dequantized with its scale before the GEMM, the reconstruction the GEMM took (`consumed`)."""

    data: Tensor
    scaling: Scaling | None
    role: str | None = None
    cast: Cast | None = None
    source: Tensor | None = None
    cast_input: Tensor | None = None
    consumed: Tensor | None = None


@dataclass(frozen=True)
class Dequantization:
    """How a tensor the mode saw derives from an observed cast's output: through `chain` (the
    views, reshapes and transposes since the cast, replayed on the cast's tensors at the GEMM),
    cast back to a wider float (`wide`), and multiplied or divided by a scale (`scaling`, after the
    first `at` ops of the chain, on a tensor of shape `shape_at`). Fake quantization: a GEMM that
    takes such a tensor computes with the dequantized 8-bit values."""

    cast: Cast
    chain: tuple[Callable[[Tensor], Tensor], ...] = ()
    wide: bool = False
    scaling: Scaling | None = None
    at: int = 0
    shape_at: tuple[int, ...] = ()
    # the cast's output, held by every link derived from it (a copy outlives what it was made of)
    keep: Tensor | None = field(default=None, compare=False, repr=False)

    def derived(self, **changes: Any) -> Dequantization:
        """The link of a tensor made from this one's (`changes`: what the op did)."""
        return replace(self, keep=self.keep if self.keep is not None else self.cast.output, **changes)

    def then(self, replay: Callable[[Tensor], Tensor]) -> Dequantization:
        return self.derived(chain=(*self.chain, replay))

    def operand(self, tensor: Tensor) -> GemmOperand | None:
        """The GEMM operand `tensor` (2-D, as the GEMM received it) is: the cast's output, source
        and input through the same chain, and the scale as one factor per block of `tensor`
        (``_block_factor``); the cast's own scale where nothing scaled after the cast (a GEMM whose
        result is scaled instead). None where the chain does not give `tensor`'s shape."""
        cast = self.cast

        def replayed(t: Tensor | None) -> Tensor | None:
            if t is None or tuple(t.shape) != cast.shape:
                return None
            t = t.detach()
            for step in self.chain:
                t = step(t)
            return t

        data = replayed(self.keep if self.keep is not None else cast.output)
        if data is None or data.shape != tensor.shape or data.dim() != 2:
            return None
        consumed = None  # the GEMM's product is scaled afterwards: it took the unscaled values
        if self.scaling is None:
            scaling = cast.scaling or Scaling("mul", torch.ones((), dtype=torch.float32, device=data.device))
        else:
            consumed = tensor.detach()
            factor = block_factor(self.scaling.factor, self.shape_at, self.chain[self.at :])
            if factor is None:
                return None
            scaling = Scaling(self.scaling.op, factor)
        return GemmOperand(
            data,
            scaling,
            cast=cast,
            source=replayed(cast.source),
            cast_input=replayed(cast.cast_input),
            consumed=consumed,
        )
