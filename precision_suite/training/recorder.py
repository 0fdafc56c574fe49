"""Record any ``nn.Module``'s GEMM operands and attention matrices on sampled steps.

``instrument(model)`` attaches to a model without editing or subclassing it::

    rec = precision_suite.recorder(model, schemes=("fp8-block", "mxfp8"))
    for i, batch in enumerate(batches):
        with rec.step(i):            # measures only on sampled steps; free otherwise
            loss = loss_fn(model, batch); loss.backward()
        opt.step(); opt.zero_grad()
    ds = rec.dataset(case="my-model")  # the run schema (docs/architecture.md), with `module`
    rec.remove()                      # also usable as a context manager

On a sampled step, every selected linear-like module gets a forward hook that measures its input
activation x and its weight W (read as (out, in)) and hangs a hook on its output that measures the
output gradient dy in backward (``gradient`` and, in the transposed layout, ``gradient_transpose``:
the wgrad GEMM's operand). Each (module, tensor role, layout) keeps additive sums
(``metrics.QuantStats``); per-layer numbers are those sums added over a block's modules
(``views.py``), so both levels come from one measurement.

Operands consumed: on a sampled step the recorder also observes every operand a recipe's
``QuantLinearFn`` GEMMs receive in a selected module (``quant_linear.add_operand_observer``: the
arguments of their own matrix products, not the quantizer's outputs) and counts the
elements that differ from a fresh quantization of the live tensor under the operand's declared
format and layout (``Operand.mismatches``): ``operand_mismatch(step, module, operand)``, which
must be zero (verdicts.operand_invariant.check_operands). Modules no recipe quantizes count nothing
(``operand_numel`` 0).

Accumulation error: on a sampled step, each GEMM that accumulates as an H100's FP8 tensor cores
do (a recipe's GEMM whose ``accumulate`` is a hopper mode, or a scaled GEMM of the model's own code,
its ``use_fast_accum`` selecting the mode) is measured against the float64 product of the same
quantized operands, as it ran and under each mode of ``accumulation_error.WHAT_IF``, on a fixed
subset of its outputs (training/gemm_errors.py; docs/runs.md). GEMMs that accumulate in float32
record nothing.

Attention (``attention="auto"``): a module with an ``attention_tap`` attribute (the explicit hook,
for custom kernels; the built-in models have one) is handed phi(S) directly. Elsewhere, calls to
``F.scaled_dot_product_attention`` (causal or masked, grouped-query heads) are intercepted on
sampled steps and softmax(Q K^T * scale + mask) is recomputed from the query and key the kernel
receives; explicit softmaxes over square (..., N, N) scores are read as they are computed. Each
value goes to the innermost module running at the time (e.g. ``model.layers.3.self_attn``).
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import xarray as xr
from torch import Tensor, nn

from precision_suite.numerics.accumulation_error import WHAT_IF
from precision_suite.numerics.metrics import SUM_FIELDS, QuantStats, quant_stats
from precision_suite.training.attention_capture import AttentionCapture, attention_norm, outside_capture
from precision_suite.training.gemm_errors import (
    GemmErrors,
    accumulation_steps,
    add_errors,
    observed_gemm_errors,
)
from precision_suite.training.linear_modules import WeightReader, module_filter, select_gemms
from precision_suite.training.model_modes import sequence_number, tag_nodes
from precision_suite.training.module_variables import observed_steps
from precision_suite.training.observation import Observation
from precision_suite.training.observed_operands import (
    StepObservation,
    describe_observation,
)
from precision_suite.training.probes import (
    TENSOR_ROLES,
    Scheme,
    check_measurements,
    get_scheme,
    operand_shapes,
)
from precision_suite.training.quant_linear import (
    Consumed,
    add_gemm_observer,
    add_operand_observer,
    gemm_error_sums,
    layer_recipe,
    reduction_length,
)
from precision_suite.training.recipes import Operand, Recipe
from precision_suite.training.views import operand_counts, run_dataset

ATTENTION_MODES = ("auto", None)


def instrument(
    model: nn.Module,
    *,
    modules: str | re.Pattern | Sequence[str | re.Pattern] | None = None,
    schemes: Sequence[str | Scheme] = ("fp8-block",),
    attention: str | None = "auto",
    sample_every: int = 1,
    observe: bool = True,
) -> Recorder:
    """A recorder of ``model``'s GEMM operands and attention norms (see the module docstring).

    modules: fully qualified module names to measure: globs (``"*.mlp.*"``) or compiled regular
      expressions (``re.compile(r"layers\\.\\d+\\.self_attn")``); default every linear-like module.
    schemes: what each operand is measured under (``probes.get_scheme`` names or Schemes).
    attention: "auto" records attention-matrix norms (explicit taps, SDPA, softmax); None does not.
    sample_every: ``step(i)`` measures when i % sample_every == 0 (or when told ``sample=True``).
    observe: also record the quantization the model's own code does, its casts into 8-bit floats
      and its scaled GEMMs (training/observation.py), in the modules `modules` selects.
    """
    return Recorder(model, modules, schemes, attention, sample_every, observe)


class Recorder:
    """What ``instrument`` returns; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        modules: Any,
        schemes: Sequence[str | Scheme],
        attention: str | None,
        sample_every: int,
        observe: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"instrument: model must be an nn.Module, got {type(model).__name__}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"instrument: attention must be 'auto' or None, got {attention!r}")
        if not isinstance(sample_every, int) or isinstance(sample_every, bool) or sample_every < 1:
            raise ValueError(f"instrument: sample_every must be a positive integer, got {sample_every!r}")
        if isinstance(schemes, (str, Scheme)):
            schemes = (schemes,)
        self.schemes = check_measurements([s if isinstance(s, Scheme) else get_scheme(s) for s in schemes])
        self.model, self.attention, self.sample_every, self.observe = model, attention, sample_every, observe
        self.gemms = select_gemms(model, modules)
        self._observed_module = module_filter(modules)
        self.names = {id(module): name for name, module in model.named_modules()}
        self._gemm_names = {id(module): name for name, (module, _) in self.gemms.items()}
        self.taps = [
            (name, module) for name, module in model.named_modules() if hasattr(module, "attention_tap")
        ]
        # per scheme, role -> (layout label, layout): worked out once, not per tensor
        self._measured = [
            (s.fmt, {role: (s.role_labels()[role], layout) for role, layout in s.role_layouts().items()})
            for s in self.schemes
        ]
        self.labels = list(dict.fromkeys(label for s in self.schemes for label in s.role_labels().values()))
        self.steps: list[int] = []
        self._sums: list[dict[tuple[str, str, str], QuantStats]] = []
        self._attention: list[dict[str, list[float]]] = []
        # per step, (module, operand) -> (mismatched elements, a 0-d tensor; elements compared)
        self._operands: list[dict[tuple[str, str], tuple[Tensor, int]]] = []
        self._declared: dict[str, dict[str, None]] = defaultdict(dict)  # operand -> its Operand.text()s
        # per step, (module, gemm) -> its accumulation error (`GemmErrors`)
        self._accumulation: list[dict[tuple[str, str], GemmErrors]] = []
        self._stack: list[tuple[str, int]] = []  # modules running now, each with its first autograd node
        self._observed: list[StepObservation] = []
        self._live: dict[str, dict[str, Tensor]] = {}  # module -> x, weight, dy of this step (observation)
        self._handles: list[Any] = []
        self._sampling = False  # inside a sampled step
        self._stop_observing: Callable[[], None] | None = None
        self._current_attention: dict[str, list[float]] = defaultdict(list)
        self.tokens = 0  # N: the largest attention matrix seen (bounds such as sqrt(N) need it)

    # -- measuring ---------------------------------------------------------------------------
    @contextmanager
    def step(self, index: int, sample: bool | None = None) -> Iterator[bool]:
        """Measure the forward and backward run inside the block if the step is sampled
        (``index % sample_every == 0``, or ``sample``); yields whether it is."""
        sampled = index % self.sample_every == 0 if sample is None else bool(sample)
        if not sampled:
            yield False
            return
        if self._sampling:
            raise RuntimeError("Recorder.step: steps do not nest; finish the current one first")
        sums: dict[tuple[str, str, str], QuantStats] = {}
        attention: dict[str, list[float]] = defaultdict(list)
        intercepted: dict[str, list[float]] = defaultdict(list)
        operands: dict[tuple[str, str], tuple[Tensor, int]] = {}
        accumulation: dict[tuple[str, str], GemmErrors] = {}
        self._attach(sums, attention, intercepted, operands, accumulation)
        observation = (
            Observation(
                self._module_now,
                self._live,
                self._observed_module,
                functools.partial(observed_gemm_errors, accumulation),
            )
            if self.observe
            else None
        )
        try:
            with (
                AttentionCapture(lambda phi: self._add_attention(intercepted, self._module_now(), phi))
                if self.attention == "auto"
                else nullcontext(),
                observation if observation is not None else nullcontext(),
            ):
                yield True
        finally:
            self._detach()
            self._live = {}
        observed = observation.finish() if observation is not None else StepObservation()
        for item in observed.operands:  # the consumed-operand invariant of observed GEMMs
            if item.checked:
                mismatched, numel = operands.get((item.module, item.operand), (0, 0))
                operands[item.module, item.operand] = (mismatched + item.mismatched, numel + item.checked)
        # an explicit tap is the module's own account of phi(S): it wins over what was intercepted
        for name, values in intercepted.items():
            if name not in attention:
                attention[name] = values
        self.steps.append(int(index))
        self._observed.append(observed)
        self._sums.append(sums)
        self._attention.append(dict(attention))
        self._operands.append(operands)
        self._accumulation.append(accumulation)

    def record_attention(self, attention: Tensor, module: str | nn.Module | None = None) -> None:
        """Record phi(S) (..., N, N) of a custom kernel for ``module`` (default: the innermost
        module running now). Only on sampled steps; a no-op otherwise."""
        if not self._sampling:
            return
        name = self.names.get(id(module)) if isinstance(module, nn.Module) else module
        self._add_attention(
            self._current_attention, name if name is not None else self._module_now(), attention
        )

    def _add_attention(self, into: dict[str, list[float]], name: str, attention: Tensor) -> None:
        into[name].append(attention_norm(attention))
        self.tokens = max(self.tokens, attention.shape[-1])

    def _attach(
        self, sums: dict, attention: dict, intercepted: dict, operands: dict, accumulation: dict
    ) -> None:
        self._current_attention = attention
        stop_operands = add_operand_observer(functools.partial(self._check_operand, operands))
        stop_gemms = add_gemm_observer(functools.partial(self._emulated_gemm, accumulation))

        def stop_observing() -> None:
            stop_operands()
            stop_gemms()

        self._stop_observing = stop_observing
        for name, (module, read_weight) in self.gemms.items():
            self._handles.append(module.register_forward_hook(self._gemm_hook(name, read_weight, sums)))
            if self.observe:  # the sources the observation checks the module's own GEMM operands against
                self._handles.append(
                    module.register_forward_pre_hook(functools.partial(self._keep_live, name, read_weight))
                )
        for name, module in self.taps:
            module.attention_tap = lambda a, name=name: self._add_attention(attention, name, a)
        if self.attention == "auto" or self.observe:
            for name, module in self.model.named_modules():
                self._handles.append(
                    module.register_forward_pre_hook(lambda *_, name=name: self._enter(name))
                )
                self._handles.append(module.register_forward_hook(lambda _, __, output: self._leave(output)))
        self._sampling = True

    # module hooks: a hook that returns a value replaces the module's input or output, so None
    def _enter(self, name: str) -> None:
        self._stack.append((name, sequence_number()))

    def _leave(self, output: Any) -> None:
        name, first_node = self._stack.pop()
        if self.observe:  # in backward, the autograd nodes this forward made name the module
            tag_nodes(output, name, first_node)

    def _module_now(self) -> str:
        """The innermost module running (the model itself: "")."""
        return self._stack[-1][0] if self._stack else ""

    def _detach(self) -> None:
        if self._stop_observing is not None:
            self._stop_observing()
            self._stop_observing = None
        for handle in self._handles:
            handle.remove()
        for _, module in self.taps:
            module.attention_tap = None
        self._handles, self._stack, self._sampling = [], [], False

    def _check_operand(
        self,
        into: dict,
        layer: nn.Module | None,
        where: str,
        live: Tensor,
        consumed: Tensor,
        operand: Operand,
    ) -> None:
        name = self._gemm_names.get(id(layer))
        if name is None:  # not a selected module
            return
        with outside_capture():
            count = operand.mismatches(live, consumed)
        self._declared[where][operand.text()] = None
        mismatched, numel = into.get((name, where), (0, 0))  # a module called twice in a step: counts add
        into[name, where] = (
            mismatched + count,
            numel + max(consumed.numel(), live.numel()),
        )  # as mismatches counts

    def _emulated_gemm(
        self,
        into: dict,
        layer: nn.Module | None,
        recipe: Recipe,
        gemm: str,
        a: Consumed,
        b: Consumed,
        out: Tensor,
    ) -> None:
        """The accumulation error of a recipe's GEMM that ran as the H100 accumulates (`out`, its
        result, is reused), and what the WHAT_IF modes would give on the same operands."""
        name = self._gemm_names.get(id(layer))
        if name is None:  # not a selected module
            return
        declared = getattr(recipe, gemm).accumulation
        with outside_capture():
            errors = gemm_error_sums(
                recipe, gemm, a, b, [declared, *WHAT_IF], computed={declared: out}, sampled=True
            )
        add_errors(into, name, gemm, declared, reduction_length(gemm, a), errors)

    def _gemm_hook(self, name: str, read_weight: WeightReader, sums: dict) -> Callable:
        def add(role: str, tensor: Tensor) -> None:
            with outside_capture():
                tensor = tensor.detach()
                for fmt, roles in self._measured:
                    label, layout = roles[role]
                    key = (name, role, label)
                    stats = quant_stats(tensor, fmt, layout)
                    sums[key] = stats if key not in sums else sums[key] + stats

        def on_gradient(dy: Tensor) -> None:
            dy2d = dy.reshape(-1, dy.shape[-1])
            self._live.setdefault(name, {})["dy"] = dy2d
            add("gradient", dy2d)
            add("gradient_transpose", dy2d)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
                raise TypeError(
                    f"instrument: {name} ({type(module).__name__}) must be called with the input "
                    "tensor as its first argument and return a tensor; exclude it with modules="
                )
            add("activation", args[0].reshape(-1, args[0].shape[-1]))
            add("weight", read_weight(module))
            if output.requires_grad:
                output.register_hook(on_gradient)

        return hook

    def observed_modules(self) -> set[str]:
        """Modules whose own quantization the last sampled step observed (casts or scaled GEMMs)."""
        if not self._observed:
            return set()
        last = self._observed[-1]
        return {item.module for item in last.operands} | last.cast_modules

    def _keep_live(self, name: str, read_weight: WeightReader, module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], Tensor):
            self._live[name] = {"x": args[0].reshape(-1, args[0].shape[-1]), "weight": read_weight(module)}

    def measured_elements(self, tokens: int) -> int:
        """Elements one sampled step measures when every selected GEMM is fed `tokens` rows: the
        probes', and the fresh quantizations that check a recipe's consumed operands."""
        total = checked = 0
        for module, read_weight in self.gemms.values():
            out_features, in_features = read_weight(module).shape
            total += sum(
                math.prod(shape) for shape in operand_shapes(in_features, out_features, tokens).values()
            )
            recipe = layer_recipe(module)
            if recipe is not None:
                checked += recipe.quantized_elements(in_features, out_features, tokens, checked=True)
        return total * len(self.schemes) + checked

    # -- results -----------------------------------------------------------------------------
    def dataset(self, case: str = "run", attrs: Mapping[str, Any] | None = None) -> xr.Dataset:
        """The recorded steps as a run dataset (schema in docs/architecture.md): per-module sums,
        and the per-layer metrics derived from them where module names carry a block index.
        Attribute ``N`` is the attention matrices' size unless ``attrs`` sets it."""
        if not self.steps:
            raise ValueError(
                "Recorder.dataset: no sampled step was recorded; wrap forward and backward "
                "in `with rec.step(i):` with i % sample_every == 0"
            )
        attention_modules = list(dict.fromkeys(name for step in self._attention for name in step))
        if self.attention == "auto" and not attention_modules:
            raise ValueError(
                "instrument(attention='auto') recorded no attention matrix: the model has no "
                "`attention_tap`, calls no F.scaled_dot_product_attention and no softmax over square "
                "(..., N, N) scores on sampled steps. Pass attention=None to record GEMMs only, or call "
                "rec.record_attention(phi_S) from a custom kernel"
            )
        # the measured GEMM modules, then modules whose own quantization was observed elsewhere
        observed_modules = [item.module for step in self._observed for item in step.operands]
        observed_modules += [module for step in self._observed for module in step.unconsumed]
        accumulating = [module for step in self._accumulation for module, _ in step]
        modules = list(dict.fromkeys([*self.gemms, *observed_modules, *accumulating]))
        where = {name: i for i, name in enumerate(modules)}
        roles = {role: i for i, role in enumerate(TENSOR_ROLES)}
        layouts = {label: i for i, label in enumerate(self.labels)}
        sums = np.zeros((len(self.steps), len(modules), len(TENSOR_ROLES), len(self.labels), len(SUM_FIELDS)))
        for i, step_sums in enumerate(self._sums):
            for (module, role, label), stats in step_sums.items():
                sums[i, where[module], roles[role], layouts[label]] = stats.sums.double().cpu().numpy()
        attention_index = {name: i for i, name in enumerate(attention_modules)}
        norms = np.full((len(self.steps), len(attention_modules)), np.nan)
        for i, step_norms in enumerate(self._attention):
            for name, values in step_norms.items():
                norms[i, attention_index[name]] = float(np.mean(values))
        first_labels = [self.schemes[0].role_labels()[role] for role in TENSOR_ROLES]
        attrs = {**({"N": self.tokens} if self.tokens else {}), **(attrs or {})}
        observed = observed_steps(self._observed, len(self.steps), where) if observed_modules else None
        if observed is not None:
            attrs = {"quantized_by": describe_observation(self._observed, self.model), **attrs}
        accumulation = (
            accumulation_steps(self._accumulation, len(self.steps), where)
            if any(self._accumulation)
            else None
        )
        # the suite's recipe each module trained with (the observed-only modules had none)
        recipes = [layer_recipe(self.gemms[name][0]) if name in self.gemms else None for name in modules]
        return run_dataset(
            self.steps,
            modules,
            self.labels,
            sums,
            attention_modules,
            norms,
            first_labels,
            case,
            attrs,
            operands=operand_counts(self._operands, self._declared, len(self.steps), where),
            observed=observed,
            accumulation=accumulation,
            recipes=recipes,
        )

    def remove(self) -> None:
        """Detach everything (a sampled step in progress is abandoned)."""
        self._detach()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
