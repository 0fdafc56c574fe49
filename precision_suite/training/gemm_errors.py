"""The accumulation error of the GEMMs a sampled step ran as an H100 accumulates, per module and GEMM:
a recipe's emulated GEMMs (recorder.py hands their sums) and the model's own scaled GEMMs (measured
here, as their use_fast_accum says the H100 runs them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from precision_suite.numerics.accumulation import Accumulation
from precision_suite.numerics.accumulation_error import ERROR_FIELDS, WHAT_IF, error_sums_by_mode
from precision_suite.numerics.tensor_core import HOPPER_ELEMENTS
from precision_suite.training.attention_capture import outside_capture
from precision_suite.training.module_variables import AccumulationSteps
from precision_suite.training.observation import GemmCall
from precision_suite.training.observed_operands import GEMMS, low_precision_format
from precision_suite.training.views import ACCUMULATIONS


class GemmErrors:
    """The accumulation error of one module's GEMM on one step, its calls added: the modes it ran
    with, its K (the largest) and per column of views.ACCUMULATIONS the ERROR_FIELDS sums."""

    def __init__(self) -> None:
        self.modes: dict[str, None] = {}
        self.k = 0
        self.sums = np.zeros((len(ACCUMULATIONS), len(ERROR_FIELDS)))


def add_errors(
    into: dict[tuple[str, str], GemmErrors],
    module: str,
    gemm: str,
    as_run: Accumulation | None,
    k: int,
    errors: Sequence[Tensor | None],
) -> None:
    """Add one GEMM call's sums (as it ran, then each WHAT_IF mode; None: not measured)."""
    cell = into.setdefault((module, gemm), GemmErrors())
    if as_run is not None:
        cell.modes[as_run.text()] = None
    cell.k = max(cell.k, int(k))
    for column, sums in enumerate(errors):
        if sums is not None:
            cell.sums[column] += sums.double().cpu().numpy()


def gemm_scales(call: GemmCall) -> tuple[Tensor, Tensor] | None:
    """The call's scales as `scaled_gemm` takes them, or None where they are not one per tensor,
    row of a or column of b, or not positive and finite (nothing the model covers)."""
    (m, k), n = call.a.shape, call.b.shape[1]
    scales = []
    for scale, shape in ((call.scale_a, (m, k)), (call.scale_b, (k, n))):
        scale = scale.detach().float()
        scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
        if (
            scale.dim() != 2
            or any(d not in (1, full) for d, full in zip(scale.shape, shape))
            or not bool(((scale > 0) & scale.isfinite()).all())
        ):
            return None
        scales.append(scale)
    return scales[0], scales[1]


def observed_gemm_errors(into: dict[tuple[str, str], GemmErrors], call: GemmCall) -> None:
    """The accumulation error of a scaled GEMM of the model's own code, as its use_fast_accum
    says the H100 runs it: fast in one chain, else promoted every 128 (cuBLAS's split accumulator)."""
    elements = (low_precision_format(call.a.dtype), low_precision_format(call.b.dtype))
    scales = gemm_scales(call)
    if scales is None or not set(elements) <= set(HOPPER_ELEMENTS) or elements == ("e5m2", "e5m2"):
        return  # no tensor-core model for it (fnuz elements, MX scales, E5M2 x E5M2)
    as_run = (
        None
        if call.fast_accumulation is None
        else Accumulation("hopper-fast" if call.fast_accumulation else "hopper-promoted")
    )
    with outside_capture():
        errors = error_sums_by_mode(
            call.a.detach(),
            call.b.detach(),
            *scales,
            [as_run, *WHAT_IF] if as_run is not None else WHAT_IF,
            sampled=True,
        )
    errors = errors if as_run is not None else [None, *errors]
    add_errors(into, call.module, call.gemm, as_run, call.a.shape[1], errors)


def accumulation_steps(
    steps: Sequence[Mapping[tuple[str, str], GemmErrors]], n_steps: int, where: Mapping[str, int]
) -> AccumulationSteps:
    """Each sampled step's (module, gemm) -> GemmErrors as arrays over (step, module, gemm), the
    modules placed by `where` (name -> index)."""
    shape = (n_steps, len(where), len(GEMMS))
    sums = np.zeros((*shape, len(ACCUMULATIONS), len(ERROR_FIELDS)))
    modes = np.full(shape, "", dtype=object)
    reductions = np.zeros(shape, dtype=np.int64)
    gemm_index = {name: i for i, name in enumerate(GEMMS)}
    for i, step in enumerate(steps):
        for (module, gemm), errors in step.items():
            cell = (i, where[module], gemm_index[gemm])
            sums[cell], modes[cell], reductions[cell] = errors.sums, "|".join(errors.modes), errors.k
    return AccumulationSteps(sums, modes, reductions)
