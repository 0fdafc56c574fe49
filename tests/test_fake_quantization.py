"""Fake quantization observed (training/observation.py): GEMMs whose operands are dequantized casts,
in a hand-written blockwise QDQ autograd Function (tests/user_qdq.py) and in torchao's QAT
(tests/user_qat.py); the scale's target; declarations that hold on such models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import user_code
import user_qat
import user_qdq
from cast_capture import CastRecorder
from precision_suite.numerics.metrics import SUM_FIELDS
from precision_suite.training.observed_operands import low_precision_format, scale_target
from precision_suite.training.recipes import GEMM_OPERANDS
from precision_suite.training.recorder import instrument
from precision_suite.training.runs import RunSpec
from precision_suite.verdicts import observed

QDQ_LINEARS = [
    f"blocks.{i}.{name}" for i in range(2) for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
]
QDQ_LINEARS.append("head")
TOKENS = 8 * 32  # user_code.batches: 8 sequences of 32


def one_step(model: nn.Module, seed: int = 0):
    """The dataset of one sampled training step of `model` on user_code's batches."""
    rec = instrument(model, attention=None)
    inputs, targets = user_code.batches(RunSpec(), torch.Generator().manual_seed(seed))
    with rec.step(0):
        F.cross_entropy(model(inputs).reshape(targets.numel(), -1), targets.reshape(-1)).backward()
    ds = rec.dataset()
    rec.remove()
    return ds


def qdq_model(monkeypatch, seed: int = 0, **switches: str) -> nn.Module:
    for name, value in switches.items():
        monkeypatch.setenv(f"USER_QDQ_{name.upper()}", value)
    torch.manual_seed(seed)
    return user_qdq.build(RunSpec())


def layout_word(block: tuple[int, int], shape: tuple[int, int]) -> str:
    """A block over an operand in recipe vocabulary: clipped to the operand, then tensor / row /
    column where it spans it, else RxC."""
    block = (min(block[0], shape[0]), min(block[1], shape[1]))
    if block == shape:
        return "tensor"
    if block == (1, shape[1]):
        return "row"
    if block == (shape[0], 1):
        return "column"
    return f"{block[0]}x{block[1]}"


def qdq_expected(linear: nn.Linear, recipe: user_qdq.Recipe) -> dict[str, tuple[str, str]]:
    """What user_qdq's code quantizes each operand of `linear` with: (format text, block), the
    operands as the recipes orient them (x tokens x in, W out x in, dy tokens x out)."""
    out_features, in_features = linear.weight.shape
    gradients = low_precision_format(recipe.gradients)
    x, w, dy = (TOKENS, in_features), (out_features, in_features), (TOKENS, out_features)
    blocks = {
        "fprop.a": ("e4m3", (1, 128), x),
        "fprop.b": ("e4m3", recipe.weight_block, w),
        "dgrad.a": (gradients, (1, 128), dy),
        "dgrad.b": ("e4m3", recipe.weight_block, w),
        "wgrad.a": (gradients, (128, 1), dy),
        "wgrad.b": ("e4m3", (128, 1), x),
    }
    expected = {}
    for operand, (fmt, block, shape) in blocks.items():
        clipped = (min(block[0], shape[0]), min(block[1], shape[1]))
        word = layout_word(block, shape)
        expected[operand] = (f"{fmt}:{word}", "tensor" if word == "tensor" else f"{clipped[0]}x{clipped[1]}")
    return expected


def cell(ds, name: str, module: str, operand: str):
    value = ds[name].sel(step=0, module=module, operand=operand).values
    return float(value) if name == "observed_target" else str(value)


@pytest.mark.parametrize("weight_block", ["128x128", "1x128"])
def test_a_blockwise_qdq_function_is_observed_as_its_code_quantizes_forward_and_backward(
    monkeypatch, weight_block
):
    model = qdq_model(monkeypatch, weight_block=weight_block)
    ds = one_step(model)
    modules = dict(model.named_modules())
    for name in QDQ_LINEARS:
        expected = qdq_expected(modules[name], modules[name].recipe)
        for operand in GEMM_OPERANDS:
            got = (cell(ds, "observed_format", name, operand), cell(ds, "observed_block", name, operand))
            assert got == expected[operand], (name, operand)
            assert cell(ds, "observed_scale", name, operand) == "float32"  # 448 / amax: no power of two
            assert cell(ds, "observed_target", name, operand) == 1.0  # every block's amax -> the format's max
        assert ds["observed_gemms"].sel(step=0, module=name).values.tolist() == [1, 1, 1]
    # correct round-to-nearest of the sources the observation found, every operand checked
    assert int(ds["operand_mismatch"].sum()) == 0
    assert (ds["operand_numel"].sel(step=0, module=QDQ_LINEARS).values > 0).all()
    assert int(ds["observed_unconsumed"].sum()) == 0  # every cast fed a GEMM
    # attention's plain q @ k^T and p @ v in the attention modules are not a recipe
    assert not {str(m) for m in ds["module"].values} - set(QDQ_LINEARS)
    assert ds.attrs["quantized_by"].startswith("observed: QDQLinear (user_qdq) in 9 module(s); fprop ")


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_torchao_qat_is_observed_with_its_straight_through_backward_in_fp32(monkeypatch, granularity):
    """torchao's QAT fake-quantizes x and W before an ordinary linear: the forward GEMM takes both
    quantized, the backward GEMMs take the saved dequantized W (dgrad) and x (wgrad) against the
    float32 output gradient."""
    monkeypatch.setenv("USER_QAT_GRANULARITY", granularity)
    torch.manual_seed(0)
    ds = one_step(user_qat.build(RunSpec()))
    word = "row" if granularity == "rowwise" else "tensor"  # one scale per token row of x, per out row of W
    expected = {
        "fprop.a": f"e4m3:{word}",
        "fprop.b": f"e4m3:{word}",
        "dgrad.a": "fp32",
        "dgrad.b": f"e4m3:{word}",
        "wgrad.a": "fp32",
        "wgrad.b": f"e4m3:{word}",
    }
    linears = [f"h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.0", "mlp.2")]
    for name in [*linears, "lm_head"]:
        assert {o: cell(ds, "observed_format", name, o) for o in GEMM_OPERANDS} == expected, name
        for operand, text in expected.items():
            wanted = math.nan if text == "fp32" else 1.0  # torchao: scale = amax / 448
            assert cell(ds, "observed_target", name, operand) == pytest.approx(wanted, nan_ok=True), (
                name,
                operand,
            )
            assert cell(ds, "observed_scale", name, operand) == ("" if text == "fp32" else "float32")
        assert ds["observed_gemms"].sel(step=0, module=name).values.tolist() == [1, 1, 1]
    assert int(ds["operand_mismatch"].sum()) == 0
    assert "FakeQuantizedLinear (torchao.quantization.qat.linear)" in ds.attrs["quantized_by"]


class STEQDQFn(torch.autograd.Function):
    """Forward on fake-quantized x and W (one scale per tensor), backward straight through: the
    gradients' GEMMs on the float32 tensors."""

    @staticmethod
    def forward(ctx, x, weight):
        recipe = user_qdq.Recipe()
        ctx.save_for_backward(x, weight)
        return (
            user_qdq.fake_quantize(x, (x.shape[0], x.shape[1]), torch.float8_e4m3fn, recipe)
            @ user_qdq.fake_quantize(weight, tuple(weight.shape), torch.float8_e4m3fn, recipe).t()
        )

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return dy @ weight, dy.t() @ x


class STELinear(nn.Linear):
    def forward(self, x):
        return STEQDQFn.apply(x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class TinySTE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(user_code.VOCAB, 32)
        self.fc = STELinear(32, 48, bias=False)
        self.plain = nn.Linear(48, user_code.VOCAB)  # never quantized: not observed at all

    def forward(self, idx):
        return self.plain(F.gelu(self.fc(self.embed(idx))))


def test_a_straight_through_backward_reads_fp32_and_is_no_quantized_gemm():
    torch.manual_seed(0)
    ds = one_step(TinySTE())
    formats = {o: cell(ds, "observed_format", "fc", o) for o in GEMM_OPERANDS}
    assert formats == {
        "fprop.a": "e4m3:tensor",
        "fprop.b": "e4m3:tensor",
        "dgrad.a": "fp32",
        "dgrad.b": "fp32",
        "wgrad.a": "fp32",
        "wgrad.b": "fp32",
    }
    assert ds["observed_gemms"].sel(step=0, module="fc").values.tolist() == [1, 0, 0]
    assert "plain" not in ds["module"].values or not any(
        cell(ds, "observed_format", "plain", o) for o in GEMM_OPERANDS
    )


def test_observed_counts_of_fake_quantized_operands_equal_a_recomputation_from_the_captured_casts(
    monkeypatch,
):
    """One QDQ linear: the forward casts x (1x128 tiles) and then W (128x128 blocks); each cast's
    input y and output q, captured by the test, give the dataset's underflow (y != 0, q == 0) and
    zeros (q == 0) counts bit for bit, and its elements."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(user_code.VOCAB, 128), user_qdq.QDQLinear(128, 256, recipe=user_qdq.Recipe())
    )
    capture = CastRecorder()
    rec = instrument(model, attention=None)
    inputs, _ = user_code.batches(RunSpec(), torch.Generator().manual_seed(1))
    with rec.step(0), capture:
        model(inputs).square().mean().backward()
    ds = rec.dataset()
    sums = ds["observed_sums"].sel(step=0, module="1")
    for operand, (y, q) in zip(("fprop.a", "fprop.b"), capture.casts[:2]):
        q = q.float()
        field = dict(zip(SUM_FIELDS, sums.sel(operand=operand).values))
        assert field["numel"] == q.numel() > 0
        assert field["underflow"] == int(((y != 0) & (q == 0)).sum()), operand
        assert field["zeros_after"] == int((q == 0).sum()), operand


def test_the_scale_target_is_where_amax_maps_as_a_fraction_of_the_formats_largest_value(monkeypatch):
    base = one_step(qdq_model(monkeypatch))
    other_seed = one_step(qdq_model(monkeypatch, seed=1), seed=1)
    narrow = one_step(qdq_model(monkeypatch, target="240"))
    wanted = float(f"{240 / 448:.2g}")
    assert wanted == 0.54
    targets = narrow["observed_target"].sel(step=0, module=QDQ_LINEARS).values
    assert (targets == wanted).all()  # E5M2 gradients map to the same fraction of 57344
    changes = observed.check_observed_recipe(narrow, base)
    assert {(f.where["module"], f.where["operand"]) for f in changes} == {
        (m, o) for m in QDQ_LINEARS for o in GEMM_OPERANDS
    }
    assert (
        "blocks.0.attn.qkv fprop operand a: e4m3:row (1x128, float32, target 1) -> e4m3:row (1x128, float32, "
        "target 0.54) at step 0" in "\n".join(f.message for f in changes)
    )
    # another seed's data: the same recipe, the same targets, no finding
    assert observed.check_observed_recipe(other_seed, base) == []


@pytest.mark.parametrize(("target", "bracket"), [(448.0, 1.0), (240.0, 0.5)])
def test_power_of_two_scales_report_the_upper_end_of_their_bracket(target, bracket):
    """A power-of-two scale floored under target / amax leaves each block's amax in (T/2, T]: the
    target reads as the power of two of that bracket's upper end, for every seed."""
    for seed in range(3):
        blocks = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)) * 3
        amax = blocks.abs().amax(dim=1, keepdim=True)
        scale = torch.exp2(torch.floor(torch.log2(target / amax)))
        assert scale_target(blocks * scale, (64, 1), "e4m3", "float32 pow2") == bracket
        assert scale_target(blocks * (target / amax), (64, 1), "e4m3", "float32") == float(
            f"{target / 448:.2g}"
        )


def declare(ds, recipe: dict, *pairs):
    return ds.assign_attrs(spec=json.dumps({"expect": [list(p) for p in pairs]})), recipe


QDQ_RECIPE = {
    "qdq-blocks": {
        "fprop": {"a": "e4m3:1x128", "b": "e4m3:128x128"},
        "dgrad": {"a": "e5m2:1x128", "b": "e4m3:128x128"},
        "wgrad": {"a": "e5m2:128x1", "b": "e4m3:128x1", "hadamard": 0},
    }
}


def test_a_true_declaration_holds_on_the_qdq_model_and_a_changed_block_fails_it(monkeypatch):
    monkeypatch.setenv("PRECISION_SUITE_RECIPES", json.dumps(QDQ_RECIPE))
    declared = (("blocks.*", "qdq-blocks"), ("head", "qdq-blocks"))
    base = one_step(qdq_model(monkeypatch))
    assert observed.check_expected(declare(base, QDQ_RECIPE, *declared)[0]) == []
    rows = one_step(qdq_model(monkeypatch, weight_block="1x128"))
    wrong = observed.check_expected(declare(rows, QDQ_RECIPE, *declared)[0])
    assert {(f.where["module"], f.where["operand"]) for f in wrong} == {
        (m, o) for m in QDQ_LINEARS for o in ("fprop.b", "dgrad.b")
    }
    messages = "\n".join(f.message for f in wrong)
    assert (
        "blocks.0.mlp.fc2 fprop operand b: expected e4m3:128x128 (qdq-blocks), observed e4m3:1x128"
        in messages
    )
    assert (
        "blocks.0.mlp.fc1 dgrad operand b: expected e4m3:128x128 (qdq-blocks), observed e4m3:row" in messages
    )


class CastsAndDrops(nn.Linear):
    """Casts its input to E4M3 and back, then uses the plain input: the cast feeds no GEMM."""

    def forward(self, x):
        self.kept = x.to(torch.float8_e4m3fn).float().sum()
        return super().forward(x)


def test_a_module_that_casts_without_a_gemm_consuming_it_says_so_with_the_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(user_code.VOCAB, 32), CastsAndDrops(32, user_code.VOCAB))
    ds = one_step(model)
    cast = TOKENS * 32
    assert int(ds["observed_unconsumed"].sel(step=0, module="1")) == cast
    [finding] = observed.check_expected(ds.assign_attrs(spec=json.dumps({"expect": [["1", "fp8-hybrid"]]})))
    assert finding.message.endswith(
        f"1 is expected to quantize as fp8-hybrid but quantizes nothing: {cast:,} "
        "elements were cast to 8-bit floats in it, but no GEMM observed consumed them"
    )
