"""The model's own quantization, observed (training/observation.py): torchao's float8 training and a
user's own casts and torch._scaled_mm, per module and GEMM operand, forward and backward; the
observed recipe as data and the verdicts on it (verdicts/observed.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torchao.float8 import Float8LinearConfig
from torchao.float8.config import ScalingGranularity, ScalingType

import user_fp8
import user_torchao
from cast_capture import CastRecorder
from precision_suite.numerics.metrics import SUM_FIELDS
from precision_suite.training.observation import Observation
from precision_suite.training.observed_operands import CONTRACTION_AXIS, low_precision_format
from precision_suite.training.recipe_registry import get_recipe
from precision_suite.training.recipes import GEMM_OPERANDS
from precision_suite.training.recorder import instrument
from precision_suite.training.runs import RunSpec, Trainer, case_id, run, seeded
from precision_suite.verdicts import judge, observed

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# which torchao cast config quantizes each operand (torchao/float8/config.py: the input and the
# weight of the output GEMM, the gradient and the weight for grad_input, the gradient and the
# input for grad_weight)
TORCHAO_CASTS = {
    "fprop.a": "cast_config_input",
    "fprop.b": "cast_config_weight",
    "dgrad.a": "cast_config_grad_output",
    "dgrad.b": "cast_config_weight_for_grad_input",
    "wgrad.a": "cast_config_grad_output_for_grad_weight",
    "wgrad.b": "cast_config_input_for_grad_weight",
}


def one_step(model: torch.nn.Module, *, observe: bool = True, steps: int = 1, seed: int = 0):
    """(dataset, losses) of `steps` sampled training steps of `model` on user_code's batches."""
    rec = instrument(model, attention=None, observe=observe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        inputs, targets = user_fp8.batches(RunSpec(), generator)
        with rec.step(step):
            loss = F.cross_entropy(model(inputs).reshape(targets.numel(), -1), targets.reshape(-1))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    ds = rec.dataset()
    rec.remove()
    return ds, losses


def torchao_model(
    monkeypatch: pytest.MonkeyPatch, recipe: str = "tensorwise", head: str = "fp8", seed: int = 0
):
    monkeypatch.setenv("USER_TORCHAO_RECIPE", recipe)
    monkeypatch.setenv("USER_TORCHAO_HEAD", head)
    torch.manual_seed(seed)
    return user_torchao.build(RunSpec())


def expected_torchao_text(config: Float8LinearConfig, operand: str) -> str:
    """What torchao's config says an operand is, in recipe vocabulary: the cast's target format,
    one scale per tensor, or (axiswise) one scale per slice along the GEMM's contraction axis:
    rows of an operand that reduces over its columns, columns of one that reduces over its rows;
    fp32 where the cast is disabled (rowwise_with_gw_hp's wgrad: a float32 GEMM of the module)."""
    cast = getattr(config, TORCHAO_CASTS[operand])
    if cast.scaling_type is ScalingType.DISABLED:
        return "fp32"
    fmt = low_precision_format(cast.target_dtype)
    if cast.scaling_granularity is ScalingGranularity.TENSORWISE:
        return f"{fmt}:tensor"
    return f"{fmt}:{'row' if CONTRACTION_AXIS[operand] == 1 else 'column'}"


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_torchao_float8_recipes_are_observed_as_their_config_declares(monkeypatch, recipe):
    ds, _ = one_step(torchao_model(monkeypatch, recipe))
    config = user_torchao.config(recipe)
    blocks = [m for m in ds["module"].values if str(m).startswith("blocks.")]
    for module in blocks:
        for operand in GEMM_OPERANDS:
            got = str(ds["observed_format"].sel(step=0, module=module, operand=operand).values)
            assert got == expected_torchao_text(config, operand), (module, operand)
        quantized = {
            g for g in ("fprop", "dgrad", "wgrad") if expected_torchao_text(config, f"{g}.a") != "fp32"
        }
        assert {
            g: int(ds["observed_gemms"].sel(step=0, module=module, gemm=g))
            for g in ("fprop", "dgrad", "wgrad")
        } == {g: int(g in quantized) for g in ("fprop", "dgrad", "wgrad")}
        # torchao's GEMM configs: fast accumulation for the output GEMM only
        assert str(ds["observed_accumulation"].sel(step=0, module=module, gemm="fprop").values) == "fast"
    assert "Float8Linear" in ds.attrs["quantized_by"] and "torchao" in ds.attrs["quantized_by"]
    checked = ds["operand_numel"].sel(module=blocks)
    assert int(ds["operand_mismatch"].sum()) == 0 and int((checked > 0).sum()) > 0


def test_observed_counts_equal_a_recomputation_from_the_captured_casts_bit_for_bit(monkeypatch):
    """One torchao Float8Linear (tensorwise): each operand's cast input y and output q, captured by
    the test, give underflow (y != 0, q == 0) and zeros (q == 0) counts equal to the dataset's bit
    for bit, and cosines equal to its distortion (a tensor-wide scale cancels in a cosine) up to
    the rounding of y = x * s in float32: each element within 2**-24 relative of x * s, which
    moves a cosine by at most 2 * 2**-24."""
    monkeypatch.setenv("USER_TORCHAO_RECIPE", "tensorwise")
    torch.manual_seed(0)
    model = user_torchao.MLPModel(depth=1, width=64)
    user_torchao.convert_to_float8_training(
        model, config=user_torchao.config(), module_filter_fn=lambda module, name: name == "blocks.0.fc1"
    )
    capture = CastRecorder()
    rec = instrument(model, attention=None)
    inputs, targets = user_fp8.batches(RunSpec(batch_size=3, seq_len=16), torch.Generator().manual_seed(1))
    with rec.step(0), capture:
        F.cross_entropy(model(inputs).reshape(targets.numel(), -1), targets.reshape(-1)).backward()
    ds = rec.dataset()
    tokens, width = inputs.numel(), 64
    # each operand's (dtype, shape as cast): x (tokens, in), W (out, in), dy (tokens, out)
    shapes = {
        "fprop.a": (torch.float8_e4m3fn, (tokens, width)),
        "fprop.b": (torch.float8_e4m3fn, (2 * width, width)),
        "dgrad.a": (torch.float8_e5m2, (tokens, 2 * width)),
        "dgrad.b": (torch.float8_e4m3fn, (2 * width, width)),
        "wgrad.a": (torch.float8_e5m2, (tokens, 2 * width)),
        "wgrad.b": (torch.float8_e4m3fn, (tokens, width)),
    }
    sums = ds["observed_sums"].sel(step=0, module="blocks.0.fc1")
    for operand, (dtype, shape) in shapes.items():
        # as torchao casts it: x with its leading dims, W transposed (its GEMMs take W^T)
        y, q = next(
            (y, q)
            for y, q in capture.casts
            if q.dtype == dtype and sorted(q.reshape(-1, q.shape[-1]).shape) == sorted(shape)
        )
        q = q.float()
        field = dict(zip(SUM_FIELDS, sums.sel(operand=operand).values))
        assert field["numel"] == q.numel()
        assert field["underflow"] == int(((y != 0) & (q == 0)).sum()), operand
        assert field["zeros_after"] == int((q == 0).sum()), operand
        cosine = float((y.double() * q.double()).sum() / (y.double().norm() * q.double().norm()))
        distortion = float(ds["observed_distortion"].sel(step=0, layer=0, operand=operand))
        assert distortion == pytest.approx(cosine, rel=0, abs=2 * 2.0**-24), operand


def test_a_cast_lets_go_of_its_tensors_once_no_gemm_can_take_it(monkeypatch):
    """A cast keeps its input and source (a full-size float tensor each) only while a GEMM can
    still take it: while its output lives, or while its module runs (changed 8-bit data
    dequantizes as the module's latest cast of its shape). So a sampled step holds what the model
    holds, not a float copy of every tensor it cast."""
    seen: list = []
    finish = Observation.finish

    def keep_casts(self):  # the step's casts as the step ends, before finish lets them go
        seen.append((list(self.casts.all), self.casts.module))
        return finish(self)

    monkeypatch.setattr(Observation, "finish", keep_casts)
    one_step(torchao_model(monkeypatch))
    ((casts, last_module),) = seen
    gone = [cast for cast in casts if cast.output is None and cast.module != last_module]
    assert len(gone) > len(casts) // 2  # torchao casts again in backward: few outputs outlive their GEMM
    assert all(cast.cast_input is None and cast.source is None for cast in gone)
    assert all(cast.elements > 0 for cast in casts)  # what finish counts stays


def test_a_users_own_casts_and_scaled_mm_are_observed_and_checked():
    ds, _ = one_step(user_fp8.build(RunSpec()))
    assert "ScaledLinear (user_fp8)" in ds.attrs["quantized_by"]
    blocks = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    formats = ds["observed_format"].sel(step=0, module=blocks)
    # the model's code: E4M3 forward and weights, E5M2 gradients, one scale per tensor
    wanted = {
        "fprop.a": "e4m3:tensor",
        "fprop.b": "e4m3:tensor",
        "dgrad.a": "e5m2:tensor",
        "dgrad.b": "e4m3:tensor",
        "wgrad.a": "e5m2:tensor",
        "wgrad.b": "e4m3:tensor",
    }
    assert {o: set(formats.sel(operand=o).values) for o in GEMM_OPERANDS} == {
        o: {t} for o, t in wanted.items()
    }
    # use_fast_accum=True in its forward GEMM only
    assert set(ds["observed_accumulation"].sel(step=0, module=blocks, gemm="fprop").values) == {"fast"}
    assert set(ds["observed_accumulation"].sel(step=0, module=blocks, gemm="wgrad").values) == {"precise"}
    assert int(ds["operand_mismatch"].sum()) == 0
    assert (ds["operand_numel"].sel(step=0, module=blocks).values > 0).all()
    assert str(ds["observed_format"].sel(step=0, module="head", operand="fprop.a").values) == ""


def test_a_cast_kernel_that_rounds_toward_zero_is_caught_on_every_element_it_moved(monkeypatch):
    """Each element the planted kernel stepped back toward zero (round-to-nearest had moved it
    away) is one consumed element round-to-nearest of its source cannot give: the mismatch count
    is exactly the number of elements the kernel moved."""
    moved = []
    original = user_fp8.cast

    def counting_cast(x, dtype, rounding):
        q, inverse = original(x, dtype, rounding)
        nearest, _ = original(x, dtype, "nearest")
        # the model's backward casts dy once for its two GEMMs (dgrad and wgrad): counted twice
        uses = 2 if dtype == torch.float8_e5m2 else 1
        moved.append(uses * int((q.view(torch.uint8) != nearest.view(torch.uint8)).sum()))
        return q, inverse

    monkeypatch.setattr(user_fp8, "cast", counting_cast)
    monkeypatch.setenv("USER_FP8_ROUNDING", "toward_zero")
    ds, _ = one_step(user_fp8.build(RunSpec()))
    assert int(ds["operand_mismatch"].sum()) == sum(moved) > 0
    findings = judge.judge_case(ds, None).findings
    mismatch = [f for f in findings if f.metric == "operand_mismatch"]
    assert {f.where["operand"] for f in mismatch} == set(GEMM_OPERANDS)
    assert "round-to-nearest of their high-precision source" in mismatch[0].message


def test_observing_changes_no_number_of_the_training(monkeypatch):
    _, observed_losses = one_step(torchao_model(monkeypatch), steps=3)
    _, plain_losses = one_step(torchao_model(monkeypatch), observe=False, steps=3)
    assert observed_losses == plain_losses


def test_the_suites_own_recipe_is_not_the_models_quantization():
    ds = run(RunSpec(model="gpt", recipe="fp8-block", steps=1, depth=1, width=128, seq_len=32, batch_size=4))
    assert not [name for name in ds.data_vars if str(name).startswith("observed_")]
    assert "quantized_by" not in ds.attrs
    assert int(ds["operand_numel"].sum()) > 0  # the recipe's operands are checked as before


def test_a_recipe_over_a_model_that_quantizes_itself_is_refused_naming_the_module_and_the_ways_out():
    spec = RunSpec(model="user_torchao:build", batches="user_torchao:batches", recipe="fp8-hybrid", steps=1)
    with pytest.raises(ValueError, match=r"blocks\.0\.fc1 is a Float8Linear \(torchao\.float8") as error:
        with seeded(spec) as device:
            Trainer(spec, device)
    assert "drop `recipe`" in str(error.value) and "replace_own_quantization = true" in str(error.value)
    # said explicitly, the suite's recipe replaces torchao's: nothing of torchao's is observed
    ds = run(dataclasses.replace(spec, replace_own_quantization=True))
    assert "observed_format" not in ds and int(ds["operand_numel"].sum()) > 0


def test_a_users_model_without_a_recipe_of_the_suite_is_named_by_its_own_quantization():
    spec = RunSpec(model="user_torchao:build", batches="user_torchao:batches")
    assert case_id(spec).startswith("user_torchao-build-softmax-own-")
    assert case_id(dataclasses.replace(spec, recipe="fp8-hybrid")).startswith(
        "user_torchao-build-softmax-fp8-hybrid-"
    )
    # expectations judge a case, they do not make another one; an unset new field stays out of the JSON
    assert case_id(dataclasses.replace(spec, expect=(("blocks.*", "fp8-hybrid"),))) == case_id(spec)
    assert "expect" not in json.loads(spec.to_json()) and "replace_own_quantization" not in json.loads(
        spec.to_json()
    )
    assert RunSpec.from_json(spec.to_json()) == spec


# --------------------------------------------------------------------------- verdicts


def test_a_change_of_the_observed_recipe_is_a_finding_naming_the_module_and_the_change(monkeypatch):
    base, _ = one_step(torchao_model(monkeypatch))
    no_head, _ = one_step(torchao_model(monkeypatch, head="hp"))
    rowwise, _ = one_step(torchao_model(monkeypatch, "rowwise"))
    assert observed.check_observed_recipe(base, base) == []
    [head] = observed.check_observed_recipe(no_head, base)
    assert "head: scaled GEMMs observed 3 -> 0 at step 0" in head.message and head.kind == "regression"
    messages = [f.message for f in observed.check_observed_recipe(rowwise, base)]
    assert any(
        "blocks.1.fc1 dgrad operand a: e5m2:tensor (tensor, float32, target 1) -> "
        "e4m3:row (1x128, float32 pow2, target 1)" in m
        for m in messages
    )
    assert len(messages) == 6 * 5  # every operand of the five float8 linears: four in blocks, the head


def test_gradients_cast_to_e4m3_instead_of_e5m2_are_named(monkeypatch):
    base, _ = one_step(user_fp8.build(RunSpec()))
    monkeypatch.setenv("USER_FP8_GRADIENTS", "e4m3")
    changed, _ = one_step(user_fp8.build(RunSpec()))
    changes = {(f.where["module"], f.where["operand"]) for f in observed.check_observed_recipe(changed, base)}
    assert changes == {
        (m, o)
        for m in ("blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2")
        for o in ("dgrad.a", "wgrad.a")
    }


def with_expectations(ds, *pairs):
    spec = (
        {**json.loads(ds.attrs["spec"]), "expect": [list(p) for p in pairs]}
        if "spec" in ds.attrs
        else {"expect": [list(p) for p in pairs]}
    )
    return ds.assign_attrs(spec=json.dumps(spec))


def test_a_declared_recipe_fails_where_the_observation_differs_and_where_nothing_is_quantized(monkeypatch):
    tensorwise, _ = one_step(torchao_model(monkeypatch))
    no_head, _ = one_step(torchao_model(monkeypatch, head="hp"))
    declared = (("head", "fp8-hybrid"), ("blocks.*", "fp8-hybrid"))
    # torchao's tensorwise recipe is fp8-hybrid: E4M3 forward, E5M2 gradients, tensor scales
    assert observed.check_expected(with_expectations(tensorwise, *declared)) == []
    [nothing] = observed.check_expected(with_expectations(no_head, *declared))
    assert nothing.message.endswith(
        "head is expected to quantize as fp8-hybrid but quantizes nothing: no cast "
        "to an 8-bit float and no scaled GEMM was observed in it"
    )
    assert judge.judge_case(with_expectations(no_head, *declared), None).status == "fail"
    assert observed.check_expected(with_expectations(no_head, ("head", "fp32"), ("*", "fp8-hybrid"))) == []
    wrong = observed.check_expected(with_expectations(tensorwise, ("*", "e4m3:tensor")))
    assert {f.where["operand"] for f in wrong} == {"dgrad.a", "wgrad.a"}
    assert "expected e4m3:tensor (e4m3:tensor), observed e5m2:tensor" in wrong[0].message
    [unmatched] = observed.check_expected(with_expectations(tensorwise, ("decoder.*", "fp8-hybrid")))
    assert unmatched.kind == "error" and "matches no module" in unmatched.message


def test_rowwise_expectations_read_row_and_column_blocks(monkeypatch):
    rowwise, _ = one_step(torchao_model(monkeypatch, "rowwise"))
    config = user_torchao.config("rowwise")
    blocks = {o: expected_torchao_text(config, o).split(":")[1] for o in GEMM_OPERANDS}
    monkeypatch.setenv(
        "PRECISION_SUITE_RECIPES",
        json.dumps(
            {
                "torchao-rowwise": {
                    g: {"a": f"e4m3:{blocks[g + '.a']}", "b": f"e4m3:{blocks[g + '.b']}", "hadamard": 0}
                    for g in ("fprop", "dgrad", "wgrad")
                }
            }
        ),
    )
    assert get_recipe("torchao-rowwise").fprop.a.layout == (1, 0)
    assert observed.check_expected(with_expectations(rowwise, ("blocks.*", "torchao-rowwise"))) == []


def test_a_users_scaled_mm_is_accumulated_as_its_use_fast_accum_says(monkeypatch):
    """Each scaled GEMM of the model's own code is measured as an H100 accumulates it, the call's
    use_fast_accum choosing the mode: the error equals the one computed from mmaemu's
    torch._scaled_mm (the independent oracle) on the same call's operands, over the outputs a run
    measures."""
    import warnings

    import mmaemu

    from precision_suite.numerics.accumulation_error import output_subset, relative_error
    from precision_suite.training.views import AS_RUN, module_view

    calls = []
    scaled_mm = torch._scaled_mm

    def keeping(a, b, scale_a, scale_b, **kwargs):
        calls.append((a, b, scale_a, scale_b, bool(kwargs.get("use_fast_accum", False))))
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", keeping)
    torch.manual_seed(0)
    ds, _ = one_step(user_fp8.build(RunSpec()))
    modes = ds["accumulation_mode"].sel(step=0, module="blocks.0.fc1")
    assert [str(modes.sel(gemm=g).values) for g in ("fprop", "dgrad", "wgrad")] == [
        "hopper-fast",
        "hopper-promoted:128",
        "hopper-promoted:128",
    ]
    errors = module_view(ds)["accumulation_error"].sel(step=0, module="blocks.0.fc1", accumulation=AS_RUN)
    # blocks.0.fc1's forward GEMM is the model's first call (fast), its weight-gradient GEMM the last
    assert calls[0][4] and not calls[-1][4]
    for gemm, (a, b, scale_a, scale_b, fast) in (("fprop", calls[0]), ("wgrad", calls[-1])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # splitk=1: the unsplit GEMM the model covers
            c = mmaemu.scaled_mm(
                a, b, scale_a, scale_b, out_dtype=torch.float32, use_fast_accum=fast, splitk=1
            )
        r = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
        # measured on the run's fixed subset of outputs (output_subset): the same outputs here
        rows, columns = output_subset(*r.shape)
        rows = torch.arange(r.shape[0]) if rows is None else rows
        columns = torch.arange(r.shape[1]) if columns is None else columns
        c, r = c.double()[rows][:, columns], r[rows][:, columns]
        expected = relative_error(torch.stack([((c - r) ** 2).sum(), (r * r).sum()]))
        assert float(errors.sel(gemm=gemm)) == pytest.approx(expected, rel=1e-9)
        assert expected > 0
