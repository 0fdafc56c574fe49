"""Recipes per GEMM operand: declarations checked when built, stochastic rounding and the random
Hadamard transform tested against their definitions, user recipes from TOML."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from precision_suite import cli
from precision_suite.jobs.selection import config_specs
from precision_suite.numerics.formats import get_format
from precision_suite.numerics.quantization import quantize, stochastic_round
from precision_suite.training.recipes import (
    NAMED_RECIPES,
    RECIPES_ENV,
    Gemm,
    Operand,
    QuantLinear,
    Recipe,
    get_recipe,
    recipes_environment,
    recipes_from_toml,
    set_recipe,
)
from precision_suite.training.runs import RunSpec, run

ORACLE = {"e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn, "nvfp4": ml_dtypes.float4_e2m1fn}


def grid(fmt: str) -> np.ndarray:
    """Every finite element of the format, from ml_dtypes (an independent oracle)."""
    dtype = ORACLE[fmt]
    bits = np.arange(16 if fmt == "nvfp4" else 256, dtype=np.uint8)
    values = bits.view(dtype).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3", "nvfp4"])
def test_stochastic_rounding_lands_on_a_neighbouring_element(fmt):
    element = get_format(fmt).element
    elements = grid(fmt)
    y = torch.empty(20_000).uniform_(-element.max, element.max, generator=torch.Generator().manual_seed(1))
    y[:8] = torch.tensor([0.0, element.max, -element.max, 1.0, -1.0, 1.5, 0.5, 3.0])  # on the grid: exact
    r = stochastic_round(y, element, torch.Generator().manual_seed(2)).double().numpy()
    below = elements[np.searchsorted(elements, y.double().numpy(), side="right") - 1]
    above = elements[np.minimum(np.searchsorted(elements, y.double().numpy(), side="left"), len(elements) - 1)]
    assert np.isin(r, elements).all()
    assert ((r == below) | (r == above)).all()
    np.testing.assert_array_equal(r[:8], y[:8].double().numpy())


def test_stochastic_rounding_is_unbiased_and_seeded():
    element = get_format("nvfp4").element
    y = torch.full((200_000,), 2.3)  # between the E2M1 elements 2 and 3: up with probability 0.3
    r = stochastic_round(y, element, torch.Generator().manual_seed(0))
    assert set(r.unique().tolist()) == {2.0, 3.0}
    sigma = math.sqrt(0.3 * 0.7 / y.numel())  # binomial: the mean's standard error
    assert abs(float((r == 3.0).double().mean()) - 0.3) < 5 * sigma
    again = stochastic_round(y, element, torch.Generator().manual_seed(0))
    assert torch.equal(r, again) and not torch.equal(r, stochastic_round(y, element, torch.Generator().manual_seed(1)))


def test_the_random_hadamard_transform_is_orthogonal_and_keeps_the_weight_gradient():
    recipe = NAMED_RECIPES["nvfp4-training"]
    h = recipe.hadamard_matrix(torch.device("cpu")).double()
    torch.testing.assert_close(h @ h.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-12)
    assert set(h.abs().unique().tolist()) == {0.25}  # +-1/sqrt(16): a Hadamard matrix, signs seeded
    dy, x = torch.randn(40, 24, dtype=torch.float64), torch.randn(40, 8, dtype=torch.float64)  # 40: padded
    rotated = recipe.rotate_tokens(dy, h).T @ recipe.rotate_tokens(x, h)
    torch.testing.assert_close(rotated, dy.T @ x, rtol=1e-12, atol=1e-12)


def test_the_nvfp4_training_recipe_quantizes_each_operand_as_declared():
    recipe = NAMED_RECIPES["nvfp4-training"]
    torch.manual_seed(0)
    layer = QuantLinear(128, 64)
    set_recipe(layer, recipe, seed=3)
    x = torch.randn(64, 128, requires_grad=True)
    dy = torch.randn(64, 64) * 1e-3
    layer(x).backward(dy)
    w16 = quantize(layer.weight.detach(), "nvfp4", (16, 16)).dequantized
    expected_y = torch.nn.functional.linear(quantize(x.detach(), "nvfp4", (1, 16)).dequantized, w16, layer.bias.detach())
    torch.testing.assert_close(layer(x).detach(), expected_y, rtol=0, atol=0)
    # the 16x16 weight blocks: one scale per 256 elements, so one weight serves fprop and dgrad
    assert quantize(layer.weight.detach(), "nvfp4", (16, 16)).scales.shape == (4, 8)
    # dgrad's dy is rounded stochastically: x.grad = SR(dy) @ W16 with the layer's own generator
    generator = torch.Generator().manual_seed(3 * 1_000_003)
    sr_dy = recipe.dgrad.a.apply(dy, generator)
    torch.testing.assert_close(x.grad, sr_dy @ w16, rtol=0, atol=0)
    assert not torch.equal(sr_dy, quantize(dy, "nvfp4", (1, 16)).dequantized)


def test_the_hybrid_recipe_is_e4m3_forward_and_e5m2_gradients():
    recipe = get_recipe("fp8-hybrid")
    assert (recipe.fprop.a.fmt, recipe.fprop.b.fmt, recipe.dgrad.a.fmt, recipe.wgrad.a.fmt) == ("e4m3", "e4m3", "e5m2", "e5m2")
    assert all(op.layout == "tensor" for g in (recipe.fprop, recipe.dgrad, recipe.wgrad) for op in (g.a, g.b))
    assert all(r.source for r in NAMED_RECIPES.values())  # each named recipe says where it comes from


def test_scheme_recipes_keep_the_transposed_backward_layouts():
    recipe = get_recipe("fp8-block")
    assert (recipe.fprop.a.layout, recipe.fprop.b.layout) == ((1, 128), (128, 128))
    assert (recipe.dgrad.a.layout, recipe.dgrad.b.layout) == ((1, 128), (128, 128))
    assert (recipe.wgrad.a.layout, recipe.wgrad.b.layout) == ((128, 1), (128, 1))
    assert get_recipe("bf16").fprop.a.fmt == "bf16"


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Recipe("r", Gemm(Operand("e4m3"), Operand("e4m3"), hadamard=16), Gemm(Operand("e4m3"), Operand("e4m3")),
                    Gemm(Operand("e4m3"), Operand("e4m3"))), "a Hadamard transform on fprop"),
    (lambda: Recipe("r", *[Gemm(Operand("e4m3"), Operand("e4m3"))] * 2, Gemm(Operand("e4m3"), Operand("e4m3"), hadamard=12)),
     "power of two"),
    (lambda: Operand("e4m3", "tensor", "dither"), "rounding must be one of nearest, stochastic"),
    (lambda: Operand("mxfp8", (1, 16)), "must be (1, 32), (32, 1) or (32, 32)"),
    (lambda: Operand("bf16", "tensor", "stochastic"), "stochastic rounding needs a block-scaled format"),
    (lambda: get_recipe("fp6"), "unknown recipe 'fp6'"),
])
def test_inconsistent_recipes_are_refused_when_built(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


MY_RECIPE = {"source": "a test", "fprop": {"a": "e4m3:1x128", "b": "e4m3:128x128"},
             "dgrad": {"a": "e5m2:1x128:stochastic", "b": "e4m3:128x128"},
             "wgrad": {"a": "e5m2:128x1", "b": "fp32", "hadamard": 0}}


def test_user_recipes_from_toml_reach_workers_through_the_environment(monkeypatch):
    (recipe,) = recipes_from_toml({"mine": MY_RECIPE}, "cases.toml").values()
    assert recipe.wgrad.b.fmt == "fp32" and recipe.dgrad.a.rounding == "stochastic"
    with pytest.raises(ValueError, match="unknown recipe 'mine'"):
        get_recipe("mine")
    monkeypatch.setenv(RECIPES_ENV, recipes_environment({"mine": recipe})[RECIPES_ENV])
    assert get_recipe("mine") == recipe
    spec = RunSpec(model="gpt", recipe="mine", depth=1, seq_len=32, batch_size=4, steps=2, sample_every=1)
    first, second = run(spec), run(spec)
    assert np.isfinite(first.loss).all() and first.loss.equals(second.loss)  # seeded stochastic rounding


@pytest.mark.parametrize(("body", "message"), [
    ({**MY_RECIPE, "wgrad": {"a": "e5m2"}}, "wgrad must be a table"),
    ({**MY_RECIPE, "fprop": {"a": "e4m3:1x128:fast", "b": "fp32"}}, "operand 'e4m3:1x128:fast'"),
    ({**MY_RECIPE, "extra": 1}, "unknown key(s) extra"),
])
def test_bad_user_recipes_name_the_table_and_field(body, message):
    with pytest.raises(ValueError, match=r"cases.toml: \[recipes.mine\].*" + message.replace("(", r"\(").replace(")", r"\)")):
        recipes_from_toml({"mine": body}, "cases.toml")


def test_a_config_file_declares_its_recipes(tmp_path, monkeypatch):
    monkeypatch.delenv(RECIPES_ENV, raising=False)
    config = tmp_path / "mine.toml"
    config.write_text('[recipes.mine]\nfprop = { a = "e4m3:tensor", b = "e4m3:tensor" }\n'
                      'dgrad = { a = "e5m2:tensor", b = "e4m3:tensor" }\nwgrad = { a = "fp32", b = "fp32" }\n'
                      '[[case]]\nmodel = "gpt"\nrecipe = "mine"\n')
    (spec,) = config_specs(config)
    assert spec.training_recipe().wgrad.a.fmt == "fp32"
    config.write_text('[recipe.mine]\n[[case]]\nmodel = "gpt"\n')
    with pytest.raises(cli.UsageError, match="unknown top-level key.*recipe"):
        config_specs(config)
