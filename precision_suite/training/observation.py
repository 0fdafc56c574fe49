"""What the model's own code quantized: every cast into an 8-bit float and every scaled GEMM,
observed on sampled steps, forward and backward, from any code.

The probes (recorder.py) answer "what would recipe R do to these tensors"; this module answers
"what did this model do". A ``TorchDispatchMode`` sees each ATen op below autograd, so it sees
torchao's ``Float8Linear`` (its casts, and the ``aten.mm`` that its ``Float8TrainingTensor``
operands reach: the ``_scaled_mm`` call inside the subclass's own dispatch is not seen, its
operands are), a user's own ``x.to(torch.float8_e4m3fn)`` and ``torch._scaled_mm``, and any
library that uses either. For each scaled GEMM it records per operand:

- what the operand is: element format (the data's dtype), scale granularity (from the scale's
  shape), scale kind, and the GEMM's accumulation flag (``use_fast_accum``);
- which operand it is: fprop / dgrad / wgrad and a / b (``recipes.GEMM_OPERANDS``), and the module
  that ran it (in forward the innermost module running, in backward the innermost module whose
  forward created the autograd node being run);
- how good the quantization was: the SCIENCE.md sums of the high-precision tensor it came from
  against the GEMM's reconstruction ``q * scale`` (``metrics.reconstruction_stats``);
- whether it is a correct quantization of that tensor: elements that round-to-nearest of the
  source at the GEMM's own scale cannot give (``operand_mismatch``, as for the suite's recipes).

Operands are described as the suite's recipes describe them (recipes.py): x as (tokens, in), W as
(out, in), dy as (tokens, out), whatever orientation the GEMM received them in, so a granularity
reads the same in a declaration and in an observation ("e4m3:row" is one scale per row of x).

The high-precision source of an operand is found two ways: through the cast that produced its data
(matched by value) and the scaling ops before that cast (``x * s``, ``x / d``, a clamp), or, in a
linear-like module, as the module's own input, weight or output gradient (``Observation.live``).
Not seen: kernels compiled by ``torch.compile`` or written in C++/CUDA extensions whose casts do not
go through ATen ops (Transformer Engine), and GEMMs on tensor subclasses other than torchao's
float8 training tensor (``SUBCLASS_OPERANDS`` lists what is known).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)
from torch.utils.weak import WeakIdKeyDictionary

from precision_suite.numerics.formats import ElementType, get_format
from precision_suite.numerics.metrics import QuantStats, reconstruction_stats
from precision_suite.numerics.quantization import round_by_bits

aten = torch.ops.aten

# dtype name -> the suite's element format of the data; scale dtypes are described apart
LOW_PRECISION = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float8_e4m3fnuz": "e4m3fnuz",
                 "float8_e5m2fnuz": "e5m2fnuz"}
GEMMS = ("fprop", "dgrad", "wgrad")
# the axis each operand reduces over in the suite's orientation: x (tokens, in) and W (out, in)
# over `in` in fprop; dy (tokens, out) over `out` and W over `out` in dgrad; dy and x over tokens
CONTRACTION_AXIS = {"fprop.a": 1, "fprop.b": 1, "dgrad.a": 1, "dgrad.b": 0, "wgrad.a": 0, "wgrad.b": 0}
# the module tensor each operand is, for a linear-like module (Observation.live)
OPERAND_TENSORS = {"fprop.a": "x", "fprop.b": "weight", "dgrad.a": "dy", "dgrad.b": "weight",
                   "wgrad.a": "dy", "wgrad.b": "x"}
# consumed elements may be off by rounding of the recomputed scaled source: a product or quotient
# recomputed with the reciprocal scale is within 2 float32 ulps of the one the kernel computed
_SOURCE_SLACK = 2.0**-22

_CASTS = {aten._to_copy.default}
_SCALINGS = {aten.mul.Tensor: "mul", aten.div.Tensor: "div"}
_CLAMPS = {aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default}
# the matrix products torch's matmul, `@`, F.linear and einsum reach below autograd
_MATRIX_PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


@dataclass(frozen=True)
class Scaling:
    """How a quantized tensor relates to its high-precision source: ``op`` "mul" (q = x * factor,
    torchao's convention) or "div" (q = x / factor, the dequantization scale `_scaled_mm` takes)."""

    op: str
    factor: Tensor

    def scaled(self, x: Tensor) -> Tensor:
        """The source in the quantized grid's units."""
        return x * self.factor if self.op == "mul" else x / self.factor

    def dequantized(self, q: Tensor) -> Tensor:
        """The reconstruction a GEMM with this scale computes with."""
        return q / self.factor if self.op == "mul" else q * self.factor

    def transposed(self) -> Scaling:
        return Scaling(self.op, self.factor.t() if self.factor.dim() == 2 else self.factor)


@dataclass
class Cast:
    """One cast into a low-precision dtype: its input, output and what came before it."""

    module: str
    cast_input: Tensor  # float, already scaled
    output: Tensor  # low precision
    source: Tensor | None  # the tensor before the scaling op (None: no scaling op seen)
    scaling: Scaling | None
    consumed: bool = False  # an observed GEMM took its output as an operand


@dataclass
class ObservedOperand:
    """One operand of one observed scaled GEMM, in the suite's orientation (module docstring)."""

    module: str
    gemm: str  # fprop | dgrad | wgrad
    operand: str  # "fprop.a" ... "wgrad.b"
    fmt: str  # element format: "e4m3", "e5m2", ...
    granularity: str  # "tensor", "row", "column" or "RxC" blocks
    block: str  # the block one scale covers, "RxC" ("tensor": one scale), whatever its granularity's name
    scale: str  # scale kind: "float32", "float32 pow2", "float8_e8m0fnu", ...
    fast_accumulation: bool | None  # the GEMM's use_fast_accum, None where the call does not say
    stats: QuantStats | None  # None: the source was not found
    mismatched: int  # consumed elements round-to-nearest of the source cannot give
    checked: int  # elements compared (0: the source was not found or the format is unknown)

    @property
    def text(self) -> str:
        """The recipe vocabulary's "<fmt>:<layout>" (recipes.Operand.text)."""
        return f"{self.fmt}:{self.granularity}"


@dataclass
class _GemmOperand:
    """A GEMM argument as received: data (low precision), its scaling, and which tensor role a
    subclass says it has (torchao's GemmInputRole) when it says so."""

    data: Tensor
    scaling: Scaling
    role: str | None = None


@dataclass(frozen=True)
class GemmCall:
    """An observed scaled GEMM as the hardware executes it: a (M, K) @ b (K, N) low-precision data,
    each with the scale that dequantizes it (data * scale: per tensor, row of a, column of b)."""

    module: str
    gemm: str  # fprop | dgrad | wgrad
    a: Tensor
    scale_a: Tensor
    b: Tensor
    scale_b: Tensor
    fast_accumulation: bool | None  # the call's use_fast_accum, None where it does not say


@dataclass
class StepObservation:
    """What one sampled step observed (no tensor of the step is kept)."""

    operands: list[ObservedOperand] = field(default_factory=list)
    cast_modules: set[str] = field(default_factory=set)  # modules that cast to 8-bit floats
    unconsumed: dict[str, int] = field(default_factory=dict)  # module -> elements cast but fed to no GEMM seen


def _torchao_operand(tensor: Tensor) -> _GemmOperand:
    """torchao.float8's Float8TrainingTensor: `_data` = x * `_scale`, its role and GEMM configs."""
    role = str(getattr(tensor, "_gemm_input_role", "")).rsplit(".", 1)[-1].lower() or None
    return _GemmOperand(tensor._data, Scaling("mul", tensor._scale), role)


# tensor subclasses whose GEMMs are scaled GEMMs, by class (matched by name: torchao need not be
# installed) -> how to read one as a GEMM operand
SUBCLASS_OPERANDS: dict[str, Callable[[Tensor], _GemmOperand]] = {
    "torchao.float8.float8_training_tensor.Float8TrainingTensor": _torchao_operand,
}
# torchao's GemmInputRole of each operand: which GEMM a pair of roles is
_TORCHAO_GEMMS = {frozenset({"input", "weight"}): "fprop", frozenset({"grad_output", "weight"}): "dgrad",
                  frozenset({"grad_output", "input"}): "wgrad"}
_TORCHAO_SIDES = {"fprop": ("input", "weight"), "dgrad": ("grad_output", "weight"),
                  "wgrad": ("grad_output", "input")}
_TORCHAO_GEMM_CONFIG = {"fprop": "output", "dgrad": "grad_input", "wgrad": "grad_weight"}


def _subclass_reader(tensor: object) -> Callable[[Tensor], _GemmOperand] | None:
    for cls in type(tensor).__mro__:
        reader = SUBCLASS_OPERANDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if reader is not None:
            return reader
    return None


def low_precision_format(dtype: torch.dtype) -> str | None:
    """The element format of a low-precision dtype this module observes, None for any other."""
    return LOW_PRECISION.get(str(dtype).removeprefix("torch."))


class Observation(TorchDispatchMode):
    """The dispatch mode of one sampled step (module docstring).

    module_now(): the innermost module running (the recorder's forward stack); in backward the
    autograd node's `MODULE_TAG` metadata names it (`tag_nodes`). live: module -> its linear
    tensors ("x", "weight", "dy") as the recorder saw them this step, the sources of last resort.
    on_gemm: handed each observed scaled GEMM as executed (`GemmCall`), the tensors alive only
    during the call.
    """

    def __init__(self, module_now: Callable[[], str], live: Mapping[str, Mapping[str, Tensor]],
                 modules: Callable[[str], bool], on_gemm: Callable[[GemmCall], None] | None = None) -> None:
        super().__init__()
        self.module_now, self.live, self.wanted, self.on_gemm = module_now, live, modules, on_gemm
        self.operands: list[ObservedOperand] = []
        self.casts: list[Cast] = []
        self._scaled: WeakIdKeyDictionary = WeakIdKeyDictionary()  # output -> (op, source, factor)
        self._clamped: WeakIdKeyDictionary = WeakIdKeyDictionary()  # output -> input
        self._backward_gemms: dict[tuple[str, int], int] = {}  # (module, autograd node) -> GEMMs seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CASTS or func is aten.copy_.default:
            cast_input, output = (args[1], args[0]) if func is aten.copy_.default else (args[0], out)
            if isinstance(output, Tensor) and low_precision_format(output.dtype) and isinstance(cast_input, Tensor) \
                    and cast_input.is_floating_point() and low_precision_format(cast_input.dtype) is None:
                self._cast(cast_input, output)
        elif func in _SCALINGS:
            if isinstance(out, Tensor) and out.is_floating_point() and isinstance(args[0], Tensor):
                self._scaled[out] = (_SCALINGS[func], args[0], args[1])
        elif func in _CLAMPS:
            if isinstance(out, Tensor) and isinstance(args[0], Tensor):
                self._clamped[out] = args[0]
        elif func is aten._scaled_mm.default:
            self._scaled_mm(*args, **kwargs)
        elif func in _MATRIX_PRODUCTS:
            self._subclass_gemm(func, args)
        return out

    # -- what the mode records ---------------------------------------------------------------
    def _where(self) -> tuple[str, bool]:
        """(module, in backward)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return self.module_now(), False
        return str(node.metadata.get(MODULE_TAG, "")), True

    def _cast(self, cast_input: Tensor, output: Tensor) -> None:
        module, _ = self._where()
        if not self.wanted(module):
            return
        source, scaling = self._unscaled(cast_input)
        self.casts.append(Cast(module, cast_input, output, source, scaling))

    def _unscaled(self, tensor: Tensor) -> tuple[Tensor | None, Scaling | None]:
        """The tensor before the scaling op (and clamps) that made `tensor`, and that scaling."""
        while tensor in self._clamped:
            tensor = self._clamped[tensor]
        if tensor not in self._scaled:
            return None, None
        op, a, b = self._scaled[tensor]
        # x * s or s * x: the source has the product's shape, the factor broadcasts into it
        if op == "mul" and isinstance(b, Tensor) and b.shape == tensor.shape and \
                (not isinstance(a, Tensor) or a.shape != tensor.shape):
            a, b = b, a
        factor = b if isinstance(b, Tensor) else torch.tensor(float(b), dtype=torch.float32, device=a.device)
        return a, Scaling(op, factor.float())

    def _scaled_mm(self, a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None = None,
                   scale_result: Tensor | None = None, out_dtype: torch.dtype | None = None,
                   use_fast_accum: bool = False) -> None:
        self._gemm(_GemmOperand(a, Scaling("div", scale_a.float())), _GemmOperand(b, Scaling("div", scale_b.float())),
                   bool(use_fast_accum))

    def _subclass_gemm(self, func: Any, args: Sequence[Any]) -> None:
        pair = [arg for arg in args[-2:]]  # mm(a, b), addmm(bias, a, b), bmm(a, b)
        readers = [_subclass_reader(arg) for arg in pair]
        if any(reader is None for reader in readers) or func is aten.bmm.default:
            return
        a, b = (reader(arg) for reader, arg in zip(readers, pair))
        fast = None
        config = getattr(pair[0], "_linear_mm_config", None)
        gemm = _TORCHAO_GEMMS.get(frozenset({a.role, b.role}))
        if config is not None and gemm is not None:
            fast = bool(getattr(getattr(config, _TORCHAO_GEMM_CONFIG[gemm]), "use_fast_accum", False))
        self._gemm(a, b, fast)

    def _gemm(self, a: _GemmOperand, b: _GemmOperand, fast: bool | None) -> None:
        if a.data.dim() != 2 or b.data.dim() != 2:
            return
        module, backward = self._where()
        if not self.wanted(module):
            return
        gemm, swapped = self._which_gemm(module, backward, a, b)
        if self.on_gemm is not None:
            self.on_gemm(GemmCall(module, gemm, a.data, a.scaling.dequantized(torch.ones_like(a.scaling.factor)),
                                  b.data, b.scaling.dequantized(torch.ones_like(b.scaling.factor)), fast))
        sides = (b, a) if swapped else (a, b)
        for side, operand in zip(("a", "b"), sides):
            executed_axis = 0 if (operand is b) else 1  # A (M, K) reduces over columns, B (K, N) over rows
            self.operands.append(self._describe(module, gemm, f"{gemm}.{side}", operand, executed_axis, fast))

    def _which_gemm(self, module: str, backward: bool, a: _GemmOperand, b: _GemmOperand) -> tuple[str, bool]:
        """(fprop | dgrad | wgrad, whether the executed a and b are the suite's b and a).

        A subclass that names its operands' roles (torchao) says it exactly. Otherwise: forward is
        fprop; in backward, a GEMM with a weight operand (the source of its cast is a parameter)
        is dgrad, one whose output has the shape of the module's weight is wgrad, and otherwise
        the first scaled GEMM a backward node runs for the module is dgrad, the second wgrad."""
        roles = frozenset({a.role, b.role})
        if roles in _TORCHAO_GEMMS:
            gemm = _TORCHAO_GEMMS[roles]
            return gemm, a.role != _TORCHAO_SIDES[gemm][0]
        weight_side = [self._is_weight(module, operand) for operand in (a, b)]
        if not backward:
            return "fprop", weight_side[0] and not weight_side[1]
        if any(weight_side):
            return "dgrad", weight_side[0] and not weight_side[1]
        weight = self.live.get(module, {}).get("weight")
        out_shape = (a.data.shape[0], b.data.shape[1])
        if weight is not None and weight.shape[0] != weight.shape[1] and out_shape in (tuple(weight.shape),
                                                                                        tuple(weight.shape[::-1])):
            return "wgrad", False
        key = (module, id(torch._C._current_autograd_node()))
        seen = self._backward_gemms[key] = self._backward_gemms.get(key, 0) + 1
        return ("dgrad" if seen == 1 else "wgrad"), False

    def _is_weight(self, module: str, operand: _GemmOperand) -> bool:
        cast = self._cast_of(operand.data)
        source = cast[0].source if cast is not None else None
        weight = self.live.get(module, {}).get("weight")
        return isinstance(source, torch.nn.Parameter) or (source is not None and source is weight)

    def _cast_of(self, data: Tensor) -> tuple[Cast, bool] | None:
        """The latest observed cast whose output is `data` (or its transpose), and whether it is
        transposed."""
        bits = data.view(torch.uint8)
        for cast in reversed(self.casts):
            out = cast.output
            if out.numel() != data.numel() or out.dtype != data.dtype or out.dim() < 2:
                continue
            out = out.reshape(-1, out.shape[-1])
            if out.shape == data.shape and torch.equal(out.view(torch.uint8), bits):
                return cast, False
            if out.shape == data.shape[::-1] and torch.equal(out.view(torch.uint8).t(), bits):
                return cast, True
        return None

    def _describe(self, module: str, gemm: str, operand: str, given: _GemmOperand, executed_axis: int,
                  fast: bool | None) -> ObservedOperand:
        fmt = low_precision_format(given.data.dtype) or str(given.data.dtype).removeprefix("torch.")
        turn = executed_axis != CONTRACTION_AXIS[operand]  # executed orientation -> the suite's
        data = given.data.t() if turn else given.data
        scaling = given.scaling.transposed() if turn else given.scaling
        factor = _broadcast_factor(scaling.factor, data.shape)
        granularity = _granularity(scaling.factor, data.shape, factor)
        block = "tensor" if granularity in ("tensor", "unknown") else \
            f"{data.shape[0] // scaling.factor.shape[0]}x{data.shape[1] // scaling.factor.shape[1]}"
        found = self._cast_of(given.data)
        if found is not None:
            found[0].consumed = True
        source, cast_input = self._source(module, operand, data, found, turn)
        q = data.float()
        if factor is None:
            return ObservedOperand(module, gemm, operand, fmt, granularity, block, _scale_kind(scaling.factor),
                                   fast, None, 0, 0)
        dequantized = Scaling(scaling.op, factor).dequantized(q)
        stats, mismatched, checked = None, 0, 0
        if source is not None:
            scaled = Scaling(scaling.op, factor).scaled(source)
            # the cast's own input, where the GEMM's scale agrees with the cast's: exact, no slack
            exact = cast_input is not None and bool(
                ((cast_input - scaled).abs() <= scaled.abs() * _SOURCE_SLACK).all())
            reference = cast_input if exact else scaled
            element = _element(fmt)
            threshold = element.overflow_threshold if element is not None else math.inf
            stats = reconstruction_stats(source, dequantized, reference.abs() > threshold)
            if element is not None:
                slack = 0.0 if exact else _SOURCE_SLACK
                mismatched, checked = int(_unlike_nearest(q, reference, element, slack)), q.numel()
        return ObservedOperand(module, gemm, operand, fmt, granularity, block, _scale_kind(scaling.factor), fast,
                               stats, mismatched, checked)

    def _source(self, module: str, operand: str, data: Tensor, found: tuple[Cast, bool] | None,
                turn: bool) -> tuple[Tensor | None, Tensor | None]:
        """(the high-precision tensor `data` was quantized from, the input of the cast that did it),
        both in the suite's orientation (`data`'s shape), None where not seen. The cast is the one
        whose output `data` is, or else one whose source is the module's own tensor for this
        operand (a kernel that changed the cast's output before the GEMM took it)."""
        live = self.live.get(module, {}).get(OPERAND_TENSORS[operand])
        live = None if live is None else live.detach().float().reshape(-1, live.shape[-1])
        flip = False
        if found is not None:
            cast, transposed = found
            flip = transposed != turn  # cast orientation -> executed (transposed) -> the suite's (turn)
        elif live is not None and (by_source := self._cast_from(live)) is not None:
            cast, flip = by_source
        else:
            return (live if live is not None and live.shape == data.shape else None), None
        as_data = [None if t is None else (lambda t2d: t2d.t() if flip else t2d)(t.float().reshape(-1, t.shape[-1]))
                   for t in (cast.source, cast.cast_input)]
        source = as_data[0] if as_data[0] is not None and as_data[0].shape == data.shape else live
        cast_input = as_data[1] if as_data[1] is not None and as_data[1].shape == data.shape else None
        return (source if source is not None and source.shape == data.shape else None), cast_input

    def _cast_from(self, tensor: Tensor) -> tuple[Cast, bool] | None:
        """The latest cast whose source is `tensor` (same memory, as it or transposed)."""
        for cast in reversed(self.casts):
            source = cast.source
            if source is None or source.numel() != tensor.numel() or source.data_ptr() != tensor.data_ptr():
                continue
            shape = source.reshape(-1, source.shape[-1]).shape if source.dim() >= 2 else None
            if shape == tensor.shape:
                return cast, False
            if shape == tensor.shape[::-1]:
                return cast, True
        return None

    # -- after the step ----------------------------------------------------------------------
    def finish(self) -> StepObservation:
        """The step's observations, its tensors let go; casts no observed GEMM consumed are
        counted per module."""
        step = StepObservation(self.operands, {cast.module for cast in self.casts})
        for cast in self.casts:
            if not cast.consumed:
                step.unconsumed[cast.module] = step.unconsumed.get(cast.module, 0) + cast.output.numel()
        self.operands, self.casts = [], []
        self._scaled, self._clamped = WeakIdKeyDictionary(), WeakIdKeyDictionary()
        return step


def describe_observation(steps: Sequence[StepObservation], model: torch.nn.Module) -> str:
    """What quantized a run, in a line: the classes of the modules whose scaled GEMMs were observed
    and the observed recipe, e.g. "observed: Float8Linear (torchao.float8.float8_linear) in 4
    modules; fprop e4m3:tensor x e4m3:tensor, dgrad e5m2:tensor x e4m3:tensor, ..."."""
    modules = dict(model.named_modules())
    operands = [item for step in steps for item in step.operands]
    if not operands:
        casts = sum(sum(step.unconsumed.values()) for step in steps)
        return f"observed: {casts:,} elements cast to 8-bit floats, no scaled GEMM seen" if casts else ""
    owners = dict.fromkeys(item.module for item in operands)
    classes = dict.fromkeys(f"{type(modules[name]).__name__} ({type(modules[name]).__module__})"
                            for name in owners if name in modules)
    texts: dict[str, dict[str, None]] = {}
    for item in operands:
        texts.setdefault(item.operand, {})[item.text] = None
    recipe = ", ".join(f"{gemm} {' x '.join('|'.join(texts.get(f'{gemm}.{side}', {'-': None})) for side in 'ab')}"
                       for gemm in GEMMS if f"{gemm}.a" in texts or f"{gemm}.b" in texts)
    return f"observed: {', '.join(classes) or 'the model'} in {len(owners)} module(s); {recipe}"


MODULE_TAG = "precision_suite_module"


def tag_nodes(outputs: Any, module: str, first_node: int) -> None:
    """Name `module` in the metadata of every autograd node its forward created (sequence number
    `first_node` or later) that an inner module has not named: in backward, the node being run
    says which module's GEMMs these are (`Observation._where`)."""
    pending = [leaf.grad_fn for leaf in torch.utils._pytree.tree_leaves(outputs)
               if isinstance(leaf, Tensor) and leaf.grad_fn is not None]
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


class GemmArguments(TorchDispatchMode):
    """The operands every matrix product run inside it received, as executed: (a (M, K), b (K, N))
    pairs in `calls` (aten.mm, addmm, and bmm of one matrix: what `@`, torch.matmul, F.linear and
    einsum reach below autograd, whichever tensors the code hands them). A GEMM computed some other
    way (the suite's emulation, under `unobserved`) hands its operands with `gemm_received`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATRIX_PRODUCTS:  # mm(a, b), addmm(bias, a, b), bmm(a, b)
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
        while (stack := _get_current_dispatch_mode_stack()) and isinstance(stack[-1], (Observation, GemmArguments)):
            popped.enter_context(_pop_mode_temporarily())
        yield


def observing() -> bool:
    """Whether an observation mode is active (a sampled step of an instrumented model)."""
    return any(isinstance(mode, Observation) for mode in _get_current_dispatch_mode_stack())


# --------------------------------------------------------------------------- helpers


def _element(fmt: str) -> ElementType | None:
    try:
        return get_format(fmt).element
    except ValueError:
        return None


def _broadcast_factor(factor: Tensor, shape: torch.Size) -> Tensor | None:
    """The scale factor broadcast over a 2-D operand: one per tensor, row, column or block (a
    factor of shape (R/r, C/c) repeated r and c times); None for a layout this cannot read
    (swizzled MX scales)."""
    if factor.numel() == 1:
        return factor.reshape(1, 1)
    if factor.dim() != 2:
        return None
    rows, cols = shape
    fr, fc = factor.shape
    if fr == 0 or fc == 0 or rows % fr or cols % fc:
        return None
    return factor.repeat_interleave(rows // fr, dim=0).repeat_interleave(cols // fc, dim=1)


def _granularity(factor: Tensor, shape: torch.Size, broadcast: Tensor | None) -> str:
    """"tensor", "row" (one scale per row), "column", "RxC" blocks, or "unknown"."""
    if factor.numel() == 1:
        return "tensor"
    if broadcast is None:
        return "unknown"
    rows, cols = shape
    block = (rows // factor.shape[0], cols // factor.shape[1])
    if block == (1, cols):
        return "row"
    if block == (rows, 1):
        return "column"
    return f"{block[0]}x{block[1]}"


def _scale_kind(factor: Tensor) -> str:
    """The scale's dtype, with " pow2" when every finite nonzero scale is a power of two."""
    kind = str(factor.dtype).removeprefix("torch.")
    if factor.is_floating_point() and factor.element_size() >= 2:
        values = factor.detach().float()
        nonzero = values[(values != 0) & torch.isfinite(values)].abs()
        if nonzero.numel() and bool((torch.frexp(nonzero).mantissa == 0.5).all()):
            kind += " pow2"
    return kind


def _unlike_nearest(q: Tensor, scaled: Tensor, element: ElementType, slack: float) -> Tensor:
    """Elements of q (low-precision values as float32) that round-to-nearest-even of the scaled
    source cannot give, saturating at +-max, allowing the source the relative `slack` of its
    recomputation: q must lie between the roundings of the interval's ends (rounding is
    monotone). A non-finite source admits NaN and +-max."""
    finite = torch.isfinite(scaled)
    value = torch.where(finite, scaled, 0.0)
    low = value - value.abs() * slack
    high = value + value.abs() * slack
    low = round_by_bits(low.clamp(-element.max, element.max), element)
    high = round_by_bits(high.clamp(-element.max, element.max), element)
    admitted = torch.where(finite, (q >= low) & (q <= high), q.isnan() | (q.abs() == element.max))
    return (~admitted).sum()
