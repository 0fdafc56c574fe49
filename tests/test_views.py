"""The per-module view of a run joins its groups of modules by name: the GEMM modules (probed,
observed, accumulated) and the attention modules, whatever subset each group has (a torchao LM's
attention sits in a submodule of each block, a module of no GEMM)."""

from __future__ import annotations

import numpy as np
import torch

from precision_suite.numerics.accumulation_error import ERROR_FIELDS
from precision_suite.numerics.metrics import SUM_FIELDS, quant_stats
from precision_suite.reports.figures import _gemms_as_run
from precision_suite.training.module_variables import AccumulationSteps, ObservedSteps
from precision_suite.training.observed_operands import GEMMS
from precision_suite.training.probes import TENSOR_ROLES
from precision_suite.training.recipes import GEMM_OPERANDS
from precision_suite.training.views import ACCUMULATIONS, AS_RUN, module_view, run_dataset

GEMM_MODULES = ["blocks.0.attn.qkv", "blocks.0.mlp.up", "head"]
ATTENTION_MODULES = ["blocks.0.attn", "blocks.1.attn"]


def _sums(seed: int) -> np.ndarray:
    return quant_stats(
        torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)), "e4m3", (1, 128)
    ).sums.numpy()


def a_run(attention: bool = True):
    """One sampled step: probes measured blocks.0.mlp.up, the model's own quantization was observed
    in blocks.0.attn.qkv, the head's GEMMs accumulated as an H100 does; attention norms under the
    blocks' attention submodules, which hold none of those GEMMs."""
    n = len(GEMM_MODULES)
    sums = np.zeros((1, n, len(TENSOR_ROLES), 1, len(SUM_FIELDS)))
    sums[0, 1] = _sums(0)
    observed = ObservedSteps(
        sums=np.zeros((1, n, len(GEMM_OPERANDS), len(SUM_FIELDS))),
        formats=np.full((1, n, len(GEMM_OPERANDS)), "", dtype=object),
        blocks=np.full((1, n, len(GEMM_OPERANDS)), "", dtype=object),
        scales=np.full((1, n, len(GEMM_OPERANDS)), "", dtype=object),
        gemms=np.zeros((1, n, len(GEMMS)), dtype=np.int64),
        accumulation=np.full((1, n, len(GEMMS)), "", dtype=object),
        unconsumed=np.zeros((1, n), dtype=np.int64),
        targets=np.full((1, n, len(GEMM_OPERANDS)), np.nan),
        shapes=np.full((1, n, len(GEMM_OPERANDS)), "", dtype=object),
    )
    observed.sums[0, 0, 0] = _sums(1)
    observed.formats[0, 0, 0], observed.blocks[0, 0, 0], observed.scales[0, 0, 0] = (
        "e4m3:tensor",
        "tensor",
        "float32",
    )
    observed.gemms[0, 0] = 1
    errors = np.zeros((1, n, len(GEMMS), len(ACCUMULATIONS), len(ERROR_FIELDS)))
    errors[0, 2, 0, :] = [1e-6, 1.0, 0, 10]  # err2, ref2, nonfinite, outputs: a relative error of 1e-3
    modes = np.full((1, n, len(GEMMS)), "", dtype=object)
    modes[0, 2, 0] = "hopper-promoted:128"
    reductions = np.zeros((1, n, len(GEMMS)), dtype=np.int64)
    reductions[0, 2, 0] = 64
    norms = np.array([[0.5, 0.25]])
    return run_dataset(
        [0],
        GEMM_MODULES,
        ["1x128"],
        sums,
        ATTENTION_MODULES if attention else [],
        norms if attention else np.zeros((1, 0)),
        ["1x128"] * len(TENSOR_ROLES),
        "toy",
        {},
        observed=observed,
        accumulation=AccumulationSteps(errors, modes, reductions),
    )


def test_the_module_view_joins_gemm_and_attention_modules_by_name_filling_what_each_lacks():
    view = module_view(a_run())
    assert list(view["module"].values) == GEMM_MODULES + ATTENTION_MODULES
    np.testing.assert_array_equal(view["attention_norm"].sel(step=0, module=ATTENTION_MODULES), [0.5, 0.25])
    assert np.isnan(view["attention_norm"].sel(step=0, module=GEMM_MODULES)).all()
    attention = view.sel(module=ATTENTION_MODULES)
    # no GEMM there: strings empty, counts zero (and still integers), measurements NaN
    for name in (
        "observed_format",
        "observed_block",
        "observed_scale",
        "observed_accumulation",
        "accumulation_mode",
    ):
        assert (attention[name] == "").all(), name
    for name in (
        "observed_gemms",
        "observed_unconsumed",
        "observed_numel",
        "accumulation_k",
        "numel",
        "nonfinite",
    ):
        assert view[name].dtype.kind == "i" and (attention[name] == 0).all(), name
    for name in ("sqnr_db", "observed_sqnr_db", "accumulation_error"):
        assert np.isnan(attention[name]).all(), name
    # the GEMM modules' numbers are those of the view without attention modules
    alone = module_view(a_run(attention=False))
    for name in alone.data_vars:
        np.testing.assert_array_equal(
            view[name].sel(module=GEMM_MODULES).values, alone[name].values, err_msg=name
        )
    assert (
        str(view["observed_format"].sel(step=0, module="blocks.0.attn.qkv", operand="fprop.a").values)
        == "e4m3:tensor"
    )
    assert np.isfinite(view["sqnr_db"].sel(step=0, module="blocks.0.mlp.up")).all()
    error = float(view["accumulation_error"].sel(step=0, module="head", gemm="fprop", accumulation=AS_RUN))
    np.testing.assert_allclose(error, 1e-3)


def test_the_accumulation_chart_reads_each_gemm_on_its_own_module():
    assert _gemms_as_run(a_run()) == [(64, _gemms_as_run(a_run(attention=False))[0][1], "hopper-promoted")]
    np.testing.assert_allclose(_gemms_as_run(a_run())[0][1], 1e-3)
