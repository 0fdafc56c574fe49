"""Probes read the very tensors the GEMMs use; recipes quantize the GEMM operands; no cost off-sample."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from precision_suite import probes
from precision_suite.metrics import quant_stats
from precision_suite.models import build_model, model_config
from precision_suite.probes import (
    FP8_BLOCK,
    LinearTap,
    Probes,
    QuantLinear,
    QuantLinearFn,
    check_scheme_fits,
    get_scheme,
    set_recipe,
)
from precision_suite.quantization import quantize


def seeded(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def linear_with_inputs(recipe=None) -> tuple[QuantLinear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = QuantLinear(256, 128)
    layer.recipe = recipe
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


@pytest.mark.parametrize("recipe", [None, FP8_BLOCK], ids=["fp32", "fp8-block"])
def test_tap_reads_the_tensors_the_gemms_use(recipe):
    layer, x, dy = linear_with_inputs(recipe)
    sums = {}
    layer.tap = LinearTap([FP8_BLOCK, get_scheme("nvfp4")], sums)
    layer(x).backward(dy)
    x2d, dy2d = x.detach().reshape(-1, 256), dy.reshape(-1, 128)
    by_hand = {
        ("activation", "1x128"): quant_stats(x2d, "e4m3", (1, 128)),
        ("gradient", "1x128"): quant_stats(dy2d, "e4m3", (1, 128)),
        ("gradient_transpose", "128x1"): quant_stats(dy2d, "e4m3", (128, 1)),
        ("weight", "128x128"): quant_stats(layer.weight.detach(), "e4m3", (128, 128)),
        ("activation", "nvfp4"): quant_stats(x2d, "nvfp4", (1, 16)),
        ("gradient", "nvfp4"): quant_stats(dy2d, "nvfp4", (1, 16)),
        ("gradient_transpose", "nvfp4"): quant_stats(dy2d, "nvfp4", (16, 1)),
        ("weight", "nvfp4"): quant_stats(layer.weight.detach(), "nvfp4", (1, 16)),
    }
    assert set(sums) == set(by_hand)
    for key, stats in by_hand.items():
        assert torch.equal(sums[key].sums, stats.sums), key


def tiny_gpt(recipe=None):
    torch.manual_seed(0)
    model = build_model(model_config("gpt", "softmax", depth=3, width=128, heads=4, tokens=32))
    set_recipe(model, recipe)
    return model


@pytest.mark.parametrize("recipe", [None, FP8_BLOCK], ids=["fp32", "fp8-block"])
def test_probes_pool_one_blocks_linears_as_measured_by_hand(recipe):
    """Hooks (independent of the taps) capture block 1's linear inputs and output gradients."""
    model = tiny_gpt(recipe)
    captured: dict[str, dict[str, torch.Tensor]] = {}
    block = model.blocks[1]
    for name, module in block.named_modules():
        if isinstance(module, QuantLinear):
            captured[name] = {"weight": module.weight}
            module.register_forward_hook(lambda m, args, out, n=name: captured[n].update(x=args[0].detach()))
            module.register_full_backward_hook(lambda m, gin, gout, n=name: captured[n].update(dy=gout[0]))
    sampler = Probes(model, [FP8_BLOCK])
    idx = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(3))
    with sampler.sample():
        model(idx).logsumexp(-1).mean().backward()
    record = sampler.records()[1]

    def pooled(tensor: str, layout: tuple[int, int]) -> dict[str, float]:
        # sums are added in the order the tap sees the layers: forward order, backward reversed
        layers = list(captured.values())
        layers = layers[::-1] if tensor == "dy" else layers
        parts = [quant_stats(c[tensor].detach().reshape(-1, c[tensor].shape[-1]), "e4m3", layout) for c in layers]
        return sum(parts[1:], parts[0]).metrics()

    assert len(captured) == 4
    assert record.metrics[("activation", "1x128")] == pooled("x", (1, 128))
    assert record.metrics[("gradient", "1x128")] == pooled("dy", (1, 128))
    assert record.metrics[("gradient_transpose", "128x1")] == pooled("dy", (128, 1))
    assert record.metrics[("weight", "128x128")] == pooled("weight", (128, 128))
    assert record.nonfinite == {"activation": 0, "gradient": 0, "gradient_transpose": 0, "weight": 0}


def test_attention_norm_is_the_mean_frobenius_norm_over_heads_and_batch():
    model = tiny_gpt()
    seen = []
    original = model.blocks[0].attn.phi
    model.blocks[0].attn.phi = lambda s, n, m: seen.append(original(s, n, m)) or seen[-1]
    sampler = Probes(model, [FP8_BLOCK])
    with sampler.sample():
        model(torch.randint(256, (3, 32), generator=torch.Generator().manual_seed(0)))
    by_hand = seen[0].detach().double().square().sum(dim=(-2, -1)).sqrt().mean()
    assert seen[0].shape == (3, 4, 32, 32)
    assert math.isclose(sampler.records()[0].attention_norm, float(by_hand), rel_tol=1e-6)


def test_probes_do_nothing_outside_sampled_steps(monkeypatch):
    calls = []
    monkeypatch.setattr(probes, "quant_stats", lambda *a, **k: calls.append(a) or quant_stats(*a, **k))
    model = tiny_gpt()
    sampler = Probes(model, [FP8_BLOCK])
    idx = torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(0))
    with sampler.sample():
        model(idx).mean().backward()
    assert len(calls) == 3 * 4 * 4  # blocks x linears x tensor roles
    calls.clear()
    model(idx).mean().backward()
    assert calls == []
    assert all(m.tap is None for m in model.modules() if isinstance(m, QuantLinear))
    assert all(b.attn.attention_tap is None for b in model.blocks)


def test_nonfinite_inputs_are_counted_not_crashed_on():
    layer, x, dy = linear_with_inputs()
    x = x.detach().clone()
    x[0, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    sums = {}
    layer.tap = LinearTap([FP8_BLOCK], sums)
    layer(x.requires_grad_()).backward(dy)
    assert sums[("activation", "1x128")].metrics()["nonfinite_in"] == 3
    assert sums[("gradient", "1x128")].metrics()["nonfinite_in"] == 0


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        ("fp8-block", {"activation": "1x128", "gradient": "1x128", "gradient_transpose": "128x1", "weight": "128x128"}),
        ("mxfp8", dict.fromkeys(probes.TENSOR_ROLES, "mxfp8")),
        ("e4m3:tensor", dict.fromkeys(probes.TENSOR_ROLES, "tensor")),
        ("e5m2:1x64", {"activation": "e5m2:1x64", "gradient": "e5m2:1x64", "gradient_transpose": "e5m2:64x1", "weight": "e5m2:1x64"}),
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
    expected = F.linear(x.detach().bfloat16().float(), layer.weight.detach().bfloat16().float(), layer.bias.detach())
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
