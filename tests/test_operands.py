"""What the GEMMs consumed: on sampled steps every operand a recipe's
QuantLinearFn consumes is compared with a fresh quantization of the live tensor it came from
(`operand_mismatch`), and any nonzero count fails the case. Unchanged code records zero for every
recipe; planted recipe bugs (a stale weight cache, a transposed block axis, a wrong format) are
caught with the module, operand and step named, each plant shown to change what the GEMMs consumed.
What is compared is what the GEMMs' matrix products received, not what the quantizer returned: a
GEMM fed another tensor is caught too."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
import xarray as xr
from torch import nn

from precision_suite.numerics.quantization import quantize
from precision_suite.reports import drift_chart
from precision_suite.training import quant_linear
from precision_suite.training.matrix import KnownViolation
from precision_suite.training.probes import transpose_layout
from precision_suite.training.quant_linear import QuantLinear, add_operand_observer, set_recipe
from precision_suite.training.recipe_registry import NAMED_RECIPES, get_recipe, recipes_environment
from precision_suite.training.recipes import GEMM_OPERANDS, HIGH_PRECISION, Gemm, Operand, Recipe
from precision_suite.training.recorder import instrument
from precision_suite.training.runs import RunSpec, run
from precision_suite.training.views import module_view
from precision_suite.verdicts.judge import judge_case
from precision_suite.verdicts.operand_invariant import check_operands
from precision_suite.verdicts.rule_check import check_rules
from test_teeth import wgrad_of_the_unquantized_activation

BLOCK_MODULES = ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]
# every way an operand is declared: fp32 kept, bf16 cast, stochastic e5m2, a Hadamard-rotated wgrad
MIXED = Recipe(
    "lockstep-mixed",
    fprop=Gemm(Operand("e4m3", (1, 128)), Operand("bf16")),
    dgrad=Gemm(Operand("e5m2", (1, 128), "stochastic"), Operand("e4m3", "tensor")),
    wgrad=Gemm(Operand("e5m2", (128, 1)), Operand(HIGH_PRECISION), hadamard=16),
)
RECIPES = [*NAMED_RECIPES, "bf16", "e4m3:tensor", MIXED.name]


@pytest.fixture(autouse=True)
def mixed_recipe(monkeypatch):
    for name, value in recipes_environment({MIXED.name: MIXED}).items():
        monkeypatch.setenv(name, value)


def small_run(recipe: str) -> xr.Dataset:
    return run(RunSpec(model="gpt", recipe=recipe, depth=1, steps=3, sample_every=1))


@functools.cache
def clean_run(recipe: str) -> xr.Dataset:
    return small_run(recipe)


def counts(ds, **where) -> np.ndarray:
    return ds["operand_mismatch"].sel(module=BLOCK_MODULES, **where).values


# --------------------------------------------------------------------------- the law per operand


def seeded(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "operand",
    [
        Operand(HIGH_PRECISION),
        Operand("e4m3", (1, 128)),
        Operand("mxfp8", (32, 1)),
        Operand("nvfp4", (16, 16)),
        Operand("nvfp4", (1, 16), "stochastic"),
        Operand("e5m2", "tensor", "stochastic"),
    ],
)
def test_an_operand_as_applied_matches_and_one_changed_element_is_counted(operand):
    live = seeded(128, 128)
    live[3, :7] = torch.tensor([0.0, -0.0, float("nan"), 1e-30, -1e-30, 0.5, -2.0])
    consumed = operand.apply(live, torch.Generator().manual_seed(1))
    assert int(operand.mismatches(live, consumed)) == 0
    broken = consumed.clone()
    broken[5, 9] = 4 * live.nan_to_num().abs().max()  # beyond any grid point of its block
    assert int(operand.mismatches(live, broken)) == 1
    broken[3, 2] = 0.0  # a NaN must stay NaN
    assert int(operand.mismatches(live, broken)) == 2


def test_round_to_nearest_is_checked_bit_for_bit_and_stochastic_rounding_by_its_neighbours():
    live = seeded(64, 128, seed=2)
    e4m3 = Operand("e4m3", (1, 128))
    other_format = quantize(live, "e5m2", (1, 128)).dequantized
    assert int(e4m3.mismatches(live, other_format)) > 1000
    assert int(e4m3.mismatches(live, quantize(live, "e4m3", (128, 1)).dequantized)) > 1000  # the other axis
    # a fresh draw differs from the consumed one, yet both obey the law; round-to-nearest does too
    sr = Operand("nvfp4", (1, 16), "stochastic")
    first, second = (sr.apply(live, torch.Generator().manual_seed(s)) for s in (1, 2))
    assert not torch.equal(first, second)
    assert int(sr.mismatches(live, first)) == int(sr.mismatches(live, second)) == 0
    assert int(sr.mismatches(live, quantize(live, "nvfp4", (1, 16)).dequantized)) == 0
    # but not a value two grid points away: the other block axis moves many elements that far
    assert int(sr.mismatches(live, sr.apply(live.t().contiguous(), torch.Generator()).t())) > 100
    assert int(Operand(HIGH_PRECISION).mismatches(live, live.bfloat16().float())) > 1000


def test_quant_linear_fn_hands_every_consumed_operand_to_an_observer_and_observing_changes_nothing():
    recipe = NAMED_RECIPES["nvfp4-training"]  # stochastic rounding and a Hadamard-rotated wgrad

    def train_once(observe: bool) -> tuple[nn.Module, list, torch.Tensor]:
        torch.manual_seed(0)
        layer = QuantLinear(128, 64)
        set_recipe(layer, recipe, seed=3)
        x = seeded(2, 36, 128, seed=1).requires_grad_()  # 72 token rows: the Hadamard pads them to 80
        seen: list = []
        stop = add_operand_observer(lambda *args: seen.append(args)) if observe else None
        layer(x).backward(seeded(2, 36, 64, seed=2) * 1e-3)
        if stop is not None:
            stop()
        return layer, seen, x.grad

    layer, seen, x_grad = train_once(observe=True)
    assert [where for _, where, *_ in seen] == list(GEMM_OPERANDS)
    assert all(observed_layer is layer for observed_layer, *_ in seen)
    for _, where, live, consumed, operand in seen:
        assert operand == recipe.operand(where)
        assert int(operand.mismatches(live, consumed)) == 0, where
    shapes = {where: tuple(live.shape) for _, where, live, *_ in seen}
    assert shapes == {
        "fprop.a": (72, 128),
        "fprop.b": (64, 128),
        "dgrad.a": (72, 64),
        "dgrad.b": (64, 128),
        "wgrad.a": (80, 64),
        "wgrad.b": (80, 128),
    }
    # the observer draws no random numbers and alters nothing: same gradients without it
    plain, unseen, plain_x_grad = train_once(observe=False)
    assert (
        not unseen and torch.equal(plain.weight.grad, layer.weight.grad) and torch.equal(plain_x_grad, x_grad)
    )
    train_once(observe=False)
    assert len(seen) == 6  # removed: no longer called


# --------------------------------------------------------------------------- unchanged code


@pytest.mark.parametrize("recipe", RECIPES)
def test_unchanged_recipes_consume_what_they_declare(recipe):
    ds = clean_run(recipe)
    declared = get_recipe(recipe)
    assert [str(v) for v in ds["operand_declared"].values] == [
        declared.operand(w).text() for w in GEMM_OPERANDS
    ]
    assert (ds["operand_numel"].sel(module=BLOCK_MODULES).values > 0).all()  # every operand compared
    assert (ds["operand_numel"].sel(module="head").values == 0).all()  # measured, not quantized
    assert int(ds["operand_mismatch"].sum()) == 0
    outcome = judge_case(ds, None)
    assert outcome.status == "pass", [f.message for f in outcome.findings]


def test_a_float_run_compares_nothing_and_rules_read_the_counts_per_module():
    ds = clean_run("fp32")
    assert int(ds["operand_numel"].sum()) == 0 and int(ds["operand_mismatch"].sum()) == 0
    assert set(str(v) for v in ds["operand_declared"].values) == {""}
    assert check_operands(ds) == []
    view = module_view(clean_run("fp8-block"))
    assert (view["operand_mismatch"].sel(module=BLOCK_MODULES) == 0).all()
    assert (
        check_rules(clean_run("fp8-block"), ["operand_mismatch <= 0 @ module=blocks.*, operand=fprop.b"])
        == []
    )


def test_a_users_linears_are_checked_under_their_own_names():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    set_recipe(model, get_recipe("mxfp8"))
    recorder = instrument(model, attention=None)
    with recorder.step(0):
        assert quant_linear._observers  # observed while sampling only: other steps pay one list test
        model(seeded(64, 128)).square().sum().backward()
    with recorder.step(1, sample=False):
        assert not quant_linear._observers
    ds = recorder.dataset(case="user")
    assert list(ds["module"].values) == ["0", "2"]
    assert (ds["operand_numel"].values > 0).all() and int(ds["operand_mismatch"].sum()) == 0
    assert recorder.measured_elements(64) > instrument(
        nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)), attention=None
    ).measured_elements(64)  # the checks' fresh quantizations are counted


# --------------------------------------------------------------------------- planted recipe bugs


def plant(monkeypatch, wrong) -> None:
    """Operand.apply computes `wrong(operand, x2d, apply)` instead."""
    apply = Operand.apply
    monkeypatch.setattr(
        Operand, "apply", lambda self, x2d, generator: wrong(self, x2d, lambda op, t: apply(op, t, generator))
    )


def caught(ds, operands: list[str], first_step: int) -> list:
    """Asserts that exactly `operands` of every block module mismatch from `first_step` on, and that
    the judge names each (module, operand) at that step as a regression no known violation excuses."""
    expected = np.isin(list(GEMM_OPERANDS), operands)
    mismatch = ds["operand_mismatch"].sel(module=BLOCK_MODULES).transpose("step", "module", "operand").values
    assert (mismatch[:first_step] == 0).all()
    assert (mismatch[first_step:, :, expected] > 0).all() and (mismatch[:, :, ~expected] == 0).all()
    excused = KnownViolation("planted", metric="operand_mismatch")
    outcome = judge_case(ds, None, known=[excused])
    assert outcome.status == "fail"
    findings = [f for f in outcome.findings if f.metric == "operand_mismatch"]
    assert {(f.where["module"], f.where["operand"]) for f in findings} == {
        (m, o) for m in BLOCK_MODULES for o in operands
    }
    for f in findings:
        assert f.kind == "regression" and not f.known and f.where["step"] == first_step
        numel = int(
            ds["operand_numel"].sel(module=f.where["module"], operand=f.where["operand"], step=first_step)
        )
        assert (
            f"operand {f.where['operand']} of {f.where['module']} consumed {int(f.value):,} of {numel:,} elements"
            in f.message
            and f"at step {first_step}" in f.message
            and ds.attrs["case"] in f.message
        )
    return findings


def changed_training(planted: xr.Dataset, clean: xr.Dataset, from_step: int) -> None:
    """The plant changed what the GEMMs consumed: the loss moves from `from_step` on."""
    losses, clean = planted["loss"].values, clean["loss"].values
    np.testing.assert_array_equal(losses[:from_step], clean[:from_step])
    assert (losses[from_step:] != clean[from_step:]).all()


def test_a_stale_weight_cache_is_caught_at_the_first_sampled_step_after_the_weight_changed(monkeypatch):
    cache: dict = {}

    def stale(operand, x2d, apply):  # keeps the step-0 quantized weight after the optimizer moved it
        if not isinstance(x2d, nn.Parameter):
            return apply(operand, x2d)
        return cache.setdefault((operand, id(x2d)), apply(operand, x2d))

    clean = clean_run("fp8-block")  # before planting: the cache serves the unchanged test too
    plant(monkeypatch, stale)
    ds = small_run("fp8-block")
    changed_training(ds, clean, from_step=1)
    findings = caught(ds, ["fprop.b", "dgrad.b"], first_step=1)  # dgrad reuses fprop's 128x128 weight
    qkv = next(
        f for f in findings if f.where == {"module": "blocks.0.attn.qkv", "operand": "fprop.b", "step": 1}
    )
    assert "differ from a fresh e4m3 128x128 quantization of the live tensor" in qkv.message
    assert "(and at 1 later sampled step)" in qkv.message
    drift_chart.plot_drift(ds, None, findings)  # a failing case's chart draws these panels


def test_a_weight_quantized_along_the_wrong_axis_is_caught(monkeypatch):
    def transposed(operand, x2d, apply):
        if isinstance(x2d, nn.Parameter):
            operand = dataclasses.replace(operand, layout=transpose_layout(operand.layout))
        return apply(operand, x2d)

    clean = clean_run("mxfp8")
    plant(monkeypatch, transposed)
    ds = small_run("mxfp8")  # 1x32 weight blocks in fprop, 32x1 in dgrad
    changed_training(ds, clean, from_step=0)
    caught(ds, ["fprop.b", "dgrad.b"], first_step=0)


def test_a_wrong_format_is_caught_on_exactly_the_operands_it_hits(monkeypatch):
    def e5m2(operand, x2d, apply):
        return apply(dataclasses.replace(operand, fmt="e5m2") if operand.fmt == "e4m3" else operand, x2d)

    clean = clean_run("fp8-hybrid")
    plant(monkeypatch, e5m2)
    ds = small_run("fp8-hybrid")  # e4m3 forward and weights, e5m2 gradients (left alone by the plant)
    changed_training(ds, clean, from_step=0)
    findings = caught(ds, ["fprop.a", "fprop.b", "dgrad.b", "wgrad.b"], first_step=0)
    assert all("differ from a fresh e4m3 tensor quantization" in f.message for f in findings)


def test_a_wgrad_fed_the_unquantized_activation_is_caught_at_step_0(monkeypatch):
    clean = clean_run("fp8-block")
    wgrad_of_the_unquantized_activation(monkeypatch)
    ds = small_run("fp8-block")
    changed_training(ds, clean, from_step=1)  # the weight gradient: the loss after the first update
    findings = caught(ds, ["wgrad.b"], first_step=0)
    assert all(
        "differ from a fresh e4m3 128x1 quantization of the live tensor" in f.message for f in findings
    )


def one_layer_mismatches(recipe: Recipe) -> dict[str, tuple[int, int]]:
    """(mismatched, live elements) per operand reported by one forward and backward of a layer."""
    torch.manual_seed(0)
    layer = QuantLinear(256, 128)
    set_recipe(layer, recipe)
    counts: dict[str, tuple[int, int]] = {}

    def count(_, where, live, consumed, operand):
        mismatched, numel = counts.get(where, (0, 0))
        counts[where] = (mismatched + int(operand.mismatches(live, consumed)), numel + live.numel())

    stop = add_operand_observer(count)
    try:
        layer(seeded(2, 64, 256, seed=1)).backward(seeded(2, 64, 128, seed=2))
    finally:
        stop()
    return counts


def planted_wgrad(monkeypatch, compute) -> None:
    """The wgrad GEMM computes `compute(layer, recipe, a, b, product)` (`product`: the unplanted one)."""
    product = quant_linear._product
    monkeypatch.setattr(
        quant_linear,
        "_product",
        lambda layer, recipe, gemm, a, b, bias=None: (
            compute(layer, recipe, a, b, product)
            if gemm == "wgrad"
            else product(layer, recipe, gemm, a, b, bias)
        ),
    )


def stochastic_x(layer, recipe, a, b, product):
    """x rounded stochastically though round-to-nearest is declared: on the declared grid and scales."""
    x_rows, _ = b
    drawn = dataclasses.replace(recipe.wgrad.b, rounding="stochastic").apply(
        x_rows, torch.Generator().manual_seed(5)
    )
    return product(layer, recipe, "wgrad", a, (x_rows, drawn))


def elementwise(layer, recipe, a, b, product):
    """The product summed elementwise: no matrix product for the check to see."""
    (_, dy_wgrad), (_, x_wgrad) = a, b
    return (dy_wgrad[:, :, None] * x_wgrad[:, None, :]).sum(0)


@pytest.mark.parametrize(
    ("recipe", "compute", "mismatched"),
    [
        ("fp8-block", lambda layer, recipe, a, b, product: a[1].t() @ b[0], ["wgrad.b"]),
        (
            "fp8-block-hopper",
            lambda layer, recipe, a, b, product: a[1].t() @ b[0],
            ["wgrad.b"],
        ),  # bypasses the emulation
        ("fp8-block-hopper", stochastic_x, ["wgrad.b"]),  # what the emulated GEMM received
        ("fp8-block", elementwise, ["wgrad.a", "wgrad.b"]),
    ],
    ids=["torch product", "emulation bypassed", "emulated", "no matrix product"],
)
def test_the_check_compares_what_each_gemm_received_not_what_the_quantizer_returned(
    recipe, compute, mismatched, monkeypatch
):
    declared = get_recipe(recipe)
    clean = one_layer_mismatches(declared)
    assert list(clean) == list(GEMM_OPERANDS) and all(count == 0 for count, _ in clean.values())
    planted_wgrad(monkeypatch, compute)
    planted = one_layer_mismatches(declared)
    assert {where for where, (count, _) in planted.items() if count} == set(mismatched)
    assert all(numel == clean[where][1] for where, (_, numel) in planted.items())
    if compute is elementwise:  # nothing seen: every element counts
        assert all(planted[where][0] == planted[where][1] for where in mismatched)
