"""What the model's own code quantized: every cast into an 8-bit float, every scaled GEMM and every
GEMM on dequantized casts (fake quantization), observed on sampled steps, forward and backward,
from any code. This module captures them (dequantization.py: how a dequantized tensor links to its
cast; model_modes.py: what runs around the mode); observed_operands.py describes each operand.

The probes (recorder.py) answer "what would recipe R do to these tensors"; this module answers
"what did this model do". A ``TorchDispatchMode`` sees each ATen op below autograd, so it sees
torchao's ``Float8Linear`` (its casts, and the ``aten.mm`` that its ``Float8TrainingTensor``
operands reach: the ``_scaled_mm`` call inside the subclass's own dispatch is not seen, its
operands are), a user's own ``x.to(torch.float8_e4m3fn)`` and ``torch._scaled_mm``, fake
quantization (torchao's QAT, a hand-written QDQ autograd Function), and any library that uses
either. GEMMs, per operand:

- scaled GEMMs: ``_scaled_mm`` and matrix products of torchao's float8 tensors;
- fake-quantized GEMMs: a matrix product (``mm``, ``addmm``, ``bmm`` of one matrix: what matmul,
  ``@``, ``F.linear`` and einsum reach) whose operand is a dequantized cast: the 8-bit output
  cast back to a wider float, multiplied or divided by its scale, through views, reshapes,
  transposes, expands and copies (``Dequantization``: the chain is replayed on the cast's output,
  source and input, and on the scale's index, so blocks are read from the scale's shape, not its
  values). The other operand, if plain, is described as unquantized (``fp32``); the accumulation
  of such a GEMM is not modelled (it runs in float32). 8-bit data the model's code made from its
  latest cast of that shape (a rounding kernel stepping codes) dequantizes as that cast, made
  before another module casts or multiplies (a cast keeps its float tensors no longer: `Cast`);
- in the backward of a linear-like module whose GEMMs took a quantized operand this step, a
  GEMM of plain tensors (a straight-through backward): both operands ``fp32``, no quantized GEMM.

For each, what the operand is, which operand (fprop / dgrad / wgrad and a / b, and the module: in
forward the innermost module running, in backward the innermost module whose forward created the
autograd node being run), how good and whether correct (observed_operands.py).

The high-precision source of an operand is found through the cast that produced its data (linked,
or matched by value) and the scaling ops before that cast (``x * s``, ``x / d``, a clamp), or, in a
linear-like module, as the module's own input, weight or output gradient (``Observation.live``).
Not seen: kernels compiled by ``torch.compile`` or written in C++/CUDA extensions whose casts do not
go through ATen ops (Transformer Engine), GEMMs on tensor subclasses other than torchao's
float8 training tensor (``subclass_operands.SUBCLASS_OPERANDS`` lists what is known), and dequantizations through
ops the chain does not follow (indexing, concatenation, a scale applied twice): such a GEMM is not
described and its casts count as unconsumed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from precision_suite.training.dequantization import (
    RELINKS,
    Cast,
    Dequantization,
    GemmOperand,
    StepCasts,
    first_matrix,
    same_op,
)
from precision_suite.training.model_modes import MATRIX_PRODUCTS, MODULE_TAG, ModelMode
from precision_suite.training.observed_operands import (
    CONTRACTION_AXIS,
    ObservedOperand,
    Scaling,
    StepObservation,
    describe_operand,
    low_precision_format,
)
from precision_suite.training.subclass_operands import (
    TORCHAO_GEMM_CONFIG,
    TORCHAO_GEMMS,
    TORCHAO_SIDES,
    subclass_reader,
)

aten = torch.ops.aten

# the module tensor each operand is, for a linear-like module (Observation.live)
OPERAND_TENSORS = {
    "fprop.a": "x",
    "fprop.b": "weight",
    "dgrad.a": "dy",
    "dgrad.b": "weight",
    "wgrad.a": "dy",
    "wgrad.b": "x",
}
_CASTS = {aten._to_copy.default}
_SCALINGS = {aten.mul.Tensor: "mul", aten.div.Tensor: "div"}
_CLAMPS = {aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default}


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


class Observation(ModelMode):
    """The dispatch mode of one sampled step (module docstring).

    module_now(): the innermost module running (the recorder's forward stack); in backward the
    autograd node's `MODULE_TAG` metadata names it (`tag_nodes`). live: module -> its linear
    tensors ("x", "weight", "dy") as the recorder saw them this step, the sources of last resort.
    on_gemm: handed each observed scaled GEMM as executed (`GemmCall`), the tensors alive only
    during the call.
    """

    def __init__(
        self,
        module_now: Callable[[], str],
        live: Mapping[str, Mapping[str, Tensor]],
        modules: Callable[[str], bool],
        on_gemm: Callable[[GemmCall], None] | None = None,
    ) -> None:
        super().__init__()
        self.module_now, self.live, self.wanted, self.on_gemm = module_now, live, modules, on_gemm
        self.operands: list[ObservedOperand] = []
        self.casts = StepCasts()
        self._scaled: WeakIdKeyDictionary = WeakIdKeyDictionary()  # output -> (op, source, factor)
        self._clamped: WeakIdKeyDictionary = WeakIdKeyDictionary()  # output -> input
        self._links: WeakIdKeyDictionary = (
            WeakIdKeyDictionary()
        )  # tensor -> Dequantization of a cast's output
        self._quantized: set[str] = set()  # modules whose GEMMs took a quantized operand this step
        self._backward_gemms: dict[tuple[str, int], int] = {}  # (module, autograd node) -> GEMMs seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CASTS or func is aten.copy_.default:
            cast_input, output = (args[1], args[0]) if func is aten.copy_.default else (args[0], out)
            if (
                isinstance(output, Tensor)
                and isinstance(cast_input, Tensor)
                and cast_input.is_floating_point()
            ):
                if low_precision_format(output.dtype) and low_precision_format(cast_input.dtype) is None:
                    self._cast(cast_input, output)
                elif low_precision_format(output.dtype) is None and output.is_floating_point():
                    link = self._links.get(cast_input) or self._changed_cast(cast_input)
                    if link is not None and not link.wide:  # 8 bits back to a wider float
                        self._links[output] = link.derived(wide=True)
        elif func in _SCALINGS:
            if isinstance(out, Tensor) and out.is_floating_point() and isinstance(args[0], Tensor):
                self._scaled[out] = (_SCALINGS[func], args[0], args[1])
                self._dequantizing(func, args, out)
        elif func in _CLAMPS:
            if isinstance(out, Tensor) and isinstance(args[0], Tensor):
                self._clamped[out] = args[0]
        elif func in RELINKS:
            link = self._links.get(args[0]) if isinstance(args[0], Tensor) else None
            if link is not None and isinstance(out, Tensor):
                self._links[out] = link.then(same_op(RELINKS[func] or func, args[1:], kwargs))
        elif func is aten._scaled_mm.default:
            self._scaled_mm(*args, **kwargs)
        elif func in MATRIX_PRODUCTS:
            readers = [subclass_reader(arg) for arg in args[-2:]]
            if all(reader is not None for reader in readers):
                self._subclass_gemm(func, args)
            elif not any(readers):
                self._product(func, args[-2:])
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
        self._links[output] = Dequantization(self.casts.add(module, cast_input, output, source, scaling))

    def _changed_cast(self, data: Tensor) -> Dequantization | None:
        """8-bit data no observed cast produced, taken as the module's latest cast of that shape
        and dtype changed by the model's own code (a rounding kernel that steps codes through
        integer views): its input and source are that cast's, its values its own."""
        if low_precision_format(data.dtype) is None:
            return None
        cast = self.casts.latest(self._where()[0], data)
        return None if cast is None else Dequantization(cast.changed(data))

    def _dequantizing(self, func: Any, args: Sequence[Any], out: Tensor) -> None:
        """A dequantized 8-bit tensor multiplied (q * s: the reconstruction divides by s's
        reciprocal, Scaling "div") or divided (q / d: Scaling "mul") by its scale."""
        a, b = args[0], args[1]
        link = self._links.get(a) if isinstance(a, Tensor) else None
        if link is None and func is aten.mul.Tensor and isinstance(b, Tensor):
            link, a, b = self._links.get(b), b, a
        if link is None or not link.wide or link.scaling is not None or out.shape != a.shape:
            return
        factor = (
            b.detach()
            if isinstance(b, Tensor)
            else torch.tensor(float(b), dtype=torch.float32, device=out.device)
        )
        scaling = Scaling("div" if func is aten.mul.Tensor else "mul", factor)
        self._links[out] = link.derived(scaling=scaling, at=len(link.chain), shape_at=tuple(out.shape))

    def _product(self, func: Any, pair: Sequence[Any]) -> None:
        """A matrix product of plain tensors: a fake-quantized GEMM where an operand is a
        dequantized cast (the other described as unquantized, fp32), an unquantized GEMM where
        none is but it runs in the backward of a linear-like module whose GEMMs took quantized
        operands this step (a straight-through backward), else not the model's quantization."""
        links = [self._links.get(t) for t in pair]
        if func is aten.bmm.default:  # one matrix of a batch: the links go by the 3-D tensors
            if any(t.dim() != 3 or t.shape[0] != 1 for t in pair):
                return
            links = [None if link is None else link.then(first_matrix) for link in links]
            pair = [t[0] for t in pair]
        dequantized = [link if link is not None and link.wide else None for link in links]
        if not any(dequantized):
            module, backward = self._where()
            if not (backward and module in self._quantized and module in self.live):
                return
        operands = []
        for tensor, link in zip(pair, dequantized):
            operand = link.operand(tensor) if link is not None else GemmOperand(tensor.detach(), None)
            if operand is None:
                return  # a chain this cannot replay: not described rather than misdescribed
            operands.append(operand)
        self._gemm(*operands, None)

    def _unscaled(self, tensor: Tensor) -> tuple[Tensor | None, Scaling | None]:
        """The tensor before the scaling op (and clamps) that made `tensor`, and that scaling."""
        while tensor in self._clamped:
            tensor = self._clamped[tensor]
        if tensor not in self._scaled:
            return None, None
        op, a, b = self._scaled[tensor]
        # x * s or s * x: the source has the product's shape, the factor broadcasts into it
        if (
            op == "mul"
            and isinstance(b, Tensor)
            and b.shape == tensor.shape
            and (not isinstance(a, Tensor) or a.shape != tensor.shape)
        ):
            a, b = b, a
        factor = b if isinstance(b, Tensor) else torch.tensor(float(b), dtype=torch.float32, device=a.device)
        return a, Scaling(op, factor.float())

    def _scaled_mm(
        self,
        a: Tensor,
        b: Tensor,
        scale_a: Tensor,
        scale_b: Tensor,
        bias: Tensor | None = None,
        scale_result: Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        use_fast_accum: bool = False,
    ) -> None:
        self._gemm(
            GemmOperand(a, Scaling("div", scale_a.float())),
            GemmOperand(b, Scaling("div", scale_b.float())),
            bool(use_fast_accum),
        )

    def _subclass_gemm(self, func: Any, args: Sequence[Any]) -> None:
        pair = [arg for arg in args[-2:]]  # mm(a, b), addmm(bias, a, b), bmm(a, b)
        readers = [subclass_reader(arg) for arg in pair]
        if any(reader is None for reader in readers) or func is aten.bmm.default:
            return
        a, b = (reader(arg) for reader, arg in zip(readers, pair))
        fast = None
        config = getattr(pair[0], "_linear_mm_config", None)
        gemm = TORCHAO_GEMMS.get(frozenset({a.role, b.role}))
        if config is not None and gemm is not None:
            fast = bool(getattr(getattr(config, TORCHAO_GEMM_CONFIG[gemm]), "use_fast_accum", False))
        self._gemm(a, b, fast)

    def _gemm(self, a: GemmOperand, b: GemmOperand, fast: bool | None) -> None:
        if a.data.dim() != 2 or b.data.dim() != 2:
            return
        module, backward = self._where()
        if not self.wanted(module):
            return
        self.casts.running(module)
        gemm, swapped = self._which_gemm(module, backward, a, b)
        quantized = a.scaling is not None or b.scaling is not None
        if quantized:
            self._quantized.add(module)
        # a scaled GEMM as the hardware runs it; a fake-quantized one runs in float32
        if (
            self.on_gemm is not None
            and a.scaling is not None
            and b.scaling is not None
            and a.cast is b.cast is None
        ):
            self.on_gemm(
                GemmCall(
                    module,
                    gemm,
                    a.data,
                    a.scaling.dequantized(torch.ones_like(a.scaling.factor)),
                    b.data,
                    b.scaling.dequantized(torch.ones_like(b.scaling.factor)),
                    fast,
                )
            )
        sides = (b, a) if swapped else (a, b)
        for side, operand in zip(("a", "b"), sides):
            executed_axis = 0 if (operand is b) else 1  # A (M, K) reduces over columns, B (K, N) over rows
            described = self._describe(module, gemm, f"{gemm}.{side}", operand, executed_axis, fast)
            self.operands.append(replace(described, quantized_gemm=quantized))

    def _which_gemm(self, module: str, backward: bool, a: GemmOperand, b: GemmOperand) -> tuple[str, bool]:
        """(fprop | dgrad | wgrad, whether the executed a and b are the suite's b and a).

        A subclass that names its operands' roles (torchao) says it exactly. Otherwise: forward is
        fprop; in backward, a GEMM with a weight operand (it, or the source of its cast, is the
        module's weight or a parameter) is dgrad; else it is wgrad, its a the module's input
        (dW^T = x^T dy) where a is, or where its output has the shape of the module's (non-square)
        weight transposed; else the first GEMM a backward node runs for the module is dgrad, the
        second wgrad."""
        roles = frozenset({a.role, b.role})
        if roles in TORCHAO_GEMMS:
            gemm = TORCHAO_GEMMS[roles]
            return gemm, a.role != TORCHAO_SIDES[gemm][0]
        weight_side = [self._is_tensor(module, operand, "weight") for operand in (a, b)]
        if not backward:
            return "fprop", weight_side[0] and not weight_side[1]
        key = (module, id(torch._C._current_autograd_node()))
        seen = self._backward_gemms[key] = self._backward_gemms.get(key, 0) + 1
        if any(weight_side):
            return "dgrad", weight_side[0] and not weight_side[1]
        if self._is_tensor(module, a, "x"):
            return "wgrad", True
        weight = self.live.get(module, {}).get("weight")
        out_shape = (a.data.shape[0], b.data.shape[1])
        if (
            weight is not None
            and weight.shape[0] != weight.shape[1]
            and out_shape in (tuple(weight.shape), tuple(weight.shape[::-1]))
        ):
            return "wgrad", out_shape == tuple(weight.shape[::-1])
        return ("dgrad" if seen == 1 else "wgrad"), False

    def _is_tensor(self, module: str, operand: GemmOperand, name: str) -> bool:
        """Whether the operand is (quantized from) the module's own tensor `name` ("x", "weight";
        a weight: or any parameter): the same memory."""
        if operand.scaling is None:
            tensor: Tensor | None = operand.data
        elif operand.cast is not None:
            tensor = operand.cast.source
        else:
            found = self.casts.of(operand.data)
            tensor = found[0].source if found is not None else None
        if tensor is None:
            return False
        if name == "weight" and isinstance(tensor, torch.nn.Parameter):
            return True
        own = self.live.get(module, {}).get(name)
        return own is not None and tensor.data_ptr() == own.data_ptr() and tensor.numel() == own.numel()

    def _describe(
        self, module: str, gemm: str, operand: str, given: GemmOperand, executed_axis: int, fast: bool | None
    ) -> ObservedOperand:
        """The operand in the suite's orientation, with the high-precision tensor it came from and
        its cast's input where found (its cast marked consumed)."""
        turn = executed_axis != CONTRACTION_AXIS[operand]  # executed orientation -> the suite's
        data = given.data.t() if turn else given.data
        if given.scaling is None:
            return describe_operand(module, gemm, operand, data, None, None, None, fast)
        scaling = given.scaling.transposed() if turn else given.scaling
        consumed = None
        if given.cast is not None:  # a dequantized cast: its tensors came with it, as executed
            given.cast.consume()
            source, cast_input, consumed = (
                (None if t is None else (t.t() if turn else t).float())
                for t in (given.source, given.cast_input, given.consumed)
            )
            source = source if source is not None else self._live_source(module, operand, data)
        else:
            found = self.casts.of(given.data)
            if found is not None:
                found[0].consumed = True
            source, cast_input = self._source(module, operand, data, found, turn)
        return describe_operand(module, gemm, operand, data, scaling, source, cast_input, fast, consumed)

    def _live_source(self, module: str, operand: str, data: Tensor) -> Tensor | None:
        live = self.live.get(module, {}).get(OPERAND_TENSORS[operand])
        live = None if live is None else live.detach().float().reshape(-1, live.shape[-1])
        return live if live is not None and live.shape == data.shape else None

    def _source(
        self, module: str, operand: str, data: Tensor, found: tuple[Cast, bool] | None, turn: bool
    ) -> tuple[Tensor | None, Tensor | None]:
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
        elif live is not None and (by_source := self.casts.from_source(live)) is not None:
            cast, flip = by_source
        else:
            return (live if live is not None and live.shape == data.shape else None), None
        as_data = [
            None if t is None else (lambda t2d: t2d.t() if flip else t2d)(t.float().reshape(-1, t.shape[-1]))
            for t in (cast.source, cast.cast_input)
        ]
        source = as_data[0] if as_data[0] is not None and as_data[0].shape == data.shape else live
        cast_input = as_data[1] if as_data[1] is not None and as_data[1].shape == data.shape else None
        return (source if source is not None and source.shape == data.shape else None), cast_input

    # -- after the step ----------------------------------------------------------------------
    def finish(self) -> StepObservation:
        """The step's observations, its tensors let go; casts no observed GEMM consumed are
        counted per module."""
        step = StepObservation(self.operands, self.casts.modules(), self.casts.unconsumed())
        self.operands, self.casts, self._quantized = [], StepCasts(), set()
        self._scaled, self._clamped, self._links = (
            WeakIdKeyDictionary(),
            WeakIdKeyDictionary(),
            WeakIdKeyDictionary(),
        )
        return step
