"""Recipes quantize each GEMM operand with its layout; scheme names and labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from precision_suite.numerics.quantization import quantize
from precision_suite.training import probes
from precision_suite.training.probes import FP8_BLOCK, check_measurements, check_scheme_fits, get_scheme
from precision_suite.training.quant_linear import QuantLinear, QuantLinearFn
from precision_suite.training.recipes import Recipe


def seeded(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def linear_with_inputs(recipe=None) -> tuple[QuantLinear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = QuantLinear(256, 128)
    layer.recipe = None if recipe is None else Recipe.from_scheme(recipe)
    x = seeded(2, 128, 256, seed=1).requires_grad_()
    dy = seeded(2, 128, 128, seed=2, scale=1e-3)
    return layer, x, dy


def test_plain_quant_linear_fn_matches_autograd_of_f_linear():
    x = seeded(3, 5, 7, seed=1).double().requires_grad_()
    weight = seeded(4, 7, seed=2).double().requires_grad_()
    bias = seeded(4, seed=3).double().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: QuantLinearFn.apply(*a, None, None), (x, weight, bias))


def test_fp8_block_recipe_quantizes_each_gemm_operand_with_its_layout():
    layer, x, dy = linear_with_inputs(recipe=FP8_BLOCK)
    y = layer(x)
    y.backward(dy)
    x2d, dy2d, w = x.detach().reshape(-1, 256), dy.reshape(-1, 128), layer.weight.detach()
    q = lambda t, layout: quantize(t, "e4m3", layout).dequantized  # noqa: E731
    # the same operation as the layer (F.linear): `@` then `+` rounds differently on some CPUs
    expected_y = F.linear(q(x2d, (1, 128)), q(w, (128, 128)), layer.bias.detach())
    expected_dx = q(dy2d, (1, 128)) @ q(w, (128, 128))
    expected_dw = q(dy2d, (128, 1)).t() @ q(x2d, (128, 1))
    torch.testing.assert_close(y.detach().reshape(-1, 128), expected_y, rtol=0, atol=0)
    torch.testing.assert_close(x.grad.reshape(-1, 256), expected_dx, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, expected_dw, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, dy2d.sum(0))
    # the recipe really changes the numbers (otherwise the test above could not fail)
    assert not torch.equal(expected_dw, dy2d.t() @ x2d)


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        (
            "fp8-block",
            {"activation": "1x128", "gradient": "1x128", "gradient_transpose": "128x1", "weight": "128x128"},
        ),
        ("mxfp8", dict.fromkeys(probes.TENSOR_ROLES, "mxfp8")),
        ("e4m3:tensor", dict.fromkeys(probes.TENSOR_ROLES, "tensor")),
        (
            "e5m2:1x64",
            {
                "activation": "e5m2:1x64",
                "gradient": "e5m2:1x64",
                "gradient_transpose": "e5m2:64x1",
                "weight": "e5m2:1x64",
            },
        ),
    ],
)
def test_scheme_labels(name, labels):
    assert get_scheme(name).role_labels() == labels


def test_fixed_block_schemes_turn_the_gradient_transpose_block():
    layouts = get_scheme("nvfp4").role_layouts()
    assert layouts["gradient"] == (1, 16) and layouts["gradient_transpose"] == (16, 1)


@pytest.mark.parametrize("bad", ["fp9", "mxfp8:1x64", "e4m3:sideways", "e4m3:0x4"])
def test_bad_scheme_names_say_what_is_allowed(bad):
    with pytest.raises(ValueError, match="fp8-block, mxfp8, nvfp4"):
        get_scheme(bad)


def test_blocks_bigger_than_a_tensor_are_rejected():
    check_scheme_fits(FP8_BLOCK, 128, 384, tokens=128, what="qkv")
    with pytest.raises(ValueError, match=r"gradient_transpose \(64x384\) into 128x1 blocks"):
        check_scheme_fits(FP8_BLOCK, 128, 384, tokens=64, what="qkv")
    with pytest.raises(ValueError, match=r"activation \(128x64\) into 1x128"):
        check_scheme_fits(FP8_BLOCK, 64, 384, tokens=128, what="qkv")


def test_bf16_recipe_rounds_operands_to_bfloat16():
    layer, x, _ = linear_with_inputs(recipe=get_scheme("bf16:tensor"))
    y = layer(x).detach()
    expected = F.linear(
        x.detach().bfloat16().float(), layer.weight.detach().bfloat16().float(), layer.bias.detach()
    )
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_two_schemes_measuring_one_role_and_layout_are_refused():
    check_measurements([FP8_BLOCK, get_scheme("mxfp8")])
    with pytest.raises(ValueError, match="'e4m3:1x128' measures the activation under layout '1x128'"):
        check_measurements([FP8_BLOCK, get_scheme("e4m3:1x128")])
