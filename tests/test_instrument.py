"""instrument(): any nn.Module's GEMM operands and attention norms, per module and per layer."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_suite.numerics.metrics import quant_stats
from precision_suite.training import linear_modules
from precision_suite.training import recorder as recorder_module
from precision_suite.training.linear_modules import register_linear
from precision_suite.training.models import build_model, model_config
from precision_suite.training.probes import FP8_BLOCK
from precision_suite.training.quant_linear import set_recipe
from precision_suite.training.recorder import instrument
from precision_suite.training.views import layer_index, module_view


@pytest.fixture(autouse=True)
def eager_quantizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check *which* tensors the recorder measures, bit for bit against quant_stats by
    hand; the compiled and eager quantizers agree only up to float64 summation order (documented
    in numerics.quantization.fused, tested in test_compiled.py), and whether a call compiles
    depends on what earlier tests in the worker left in dynamo's caches (a random order once
    failed here by 1e-15 relative). Both sides eager: the same kernels, whatever ran before."""
    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "0")


def seeded(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class SdpaBlock(nn.Module):
    """A user's attention block: plain nn.Linear and F.scaled_dot_product_attention."""

    def __init__(self, width: int = 128, heads: int = 4, kv_heads: int = 4, causal: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width * kv_heads // heads)
        self.out = nn.Linear(width, width)
        self.last_attention: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, w = x.shape
        d = w // self.heads
        q = self.q(x).view(b, n, self.heads, d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, d).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=self.causal and mask is None,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.out(y.transpose(1, 2).reshape(b, n, w))


class UserModel(nn.Module):
    def __init__(self, depth: int = 2, **block):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(SdpaBlock(**block) for _ in range(depth))
        self.head = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, mask)
        return self.head(x)


def by_hand_attention(q, k, scale, mask) -> torch.Tensor:
    """softmax(QK^T*scale) with the mask, written out (independent of instrument._sdpa_attention)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1)


def frobenius_mean(a: torch.Tensor) -> float:
    return float(a.square().sum(dim=(-2, -1)).sqrt().mean())


def test_gemm_operands_are_measured_per_module_as_by_hand():
    model = UserModel()
    captured: dict[str, dict[str, torch.Tensor]] = {}
    for name, module in model.named_modules():  # plain autograd hooks, independent of the recorder
        if isinstance(module, nn.Linear):
            captured[name] = {"w": module.weight}
            module.register_forward_hook(lambda m, a, o, n=name: captured[n].update(x=a[0].detach()))
            module.register_full_backward_hook(lambda m, gi, go, n=name: captured[n].update(dy=go[0]))
    x = seeded(4, 64, 128, seed=1).requires_grad_()  # so full backward hooks see an input gradient
    with instrument(model, schemes=("fp8-block", "nvfp4")) as rec:
        with rec.step(0):
            model(x).square().mean().backward()
        ds = rec.dataset(case="user")
    view = module_view(ds)
    assert list(ds["module"].values) == list(captured)
    for name, c in captured.items():
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        expected = {
            ("activation", "1x128"): quant_stats(flat(c["x"]), "e4m3", (1, 128)),
            ("gradient", "1x128"): quant_stats(flat(c["dy"]), "e4m3", (1, 128)),
            ("gradient_transpose", "128x1"): quant_stats(flat(c["dy"]), "e4m3", (128, 1)),
            ("weight", "128x128"): quant_stats(c["w"].detach(), "e4m3", (128, 128)),
            ("gradient_transpose", "nvfp4"): quant_stats(flat(c["dy"]), "nvfp4", (16, 1)),
        }
        for (role, label), stats in expected.items():
            got = ds["module_sums"].sel(step=0, module=name, tensor=role, layout=label).values
            np.testing.assert_array_equal(got, stats.sums.numpy(), err_msg=f"{name} {role} {label}")
            assert (
                view["underflow"].sel(step=0, module=name, tensor=role, layout=label)
                == stats.metrics()["underflow"]
            )


def test_layer_numbers_are_their_modules_sums_added():
    model = UserModel(depth=3)
    rec = instrument(model)
    with rec.step(0):
        model(seeded(4, 64, 128)).square().mean().backward()
    ds = rec.dataset()
    assert list(ds["layer"].values) == [0, 1, 2]  # the head (no block index) is per module only
    assert list(ds["module_layer"].values) == [0, 0, 0, 1, 1, 1, 2, 2, 2, -1]
    for layer in range(3):
        modules = [m for m in ds["module"].values if layer_index(m) == layer]
        counts = ds["module_sums"].sel(module=modules, sum_field=["numel", "underflow"]).sum("module")
        numel, underflow = counts.sel(sum_field="numel"), counts.sel(sum_field="underflow")
        expected = (underflow / numel).sel(step=0, tensor="gradient", layout="1x128")
        assert float(ds["underflow"].sel(step=0, layer=layer, tensor="gradient", layout="1x128")) == float(
            expected
        )
        weights = sum(m.weight.numel() for m in model.layers[layer].modules() if isinstance(m, nn.Linear))
        assert int(ds["numel"].sel(layer=layer, tensor="weight")) == weights


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding-mask"])
def test_sdpa_attention_norm_is_recomputed_from_query_and_key(kv_heads, masked):
    model = UserModel(depth=1, kv_heads=kv_heads)
    block = model.layers[0]
    x = seeded(3, 32, 128, seed=2)
    n = 32
    if masked:  # each sequence sees a different number of keys
        lengths = torch.tensor([32, 20, 7])
        mask = (torch.arange(n)[None, :] < lengths[:, None])[:, None, None, :].expand(3, 1, n, n)
    else:
        mask = None
    rec = instrument(model)
    with rec.step(0):
        model(x, mask).mean().backward()
    ds = rec.dataset()
    with torch.no_grad():
        b, d = 3, 128 // 4
        q = block.q(x).view(b, n, 4, d).transpose(1, 2)
        k = block.kv(x).view(b, n, 2, kv_heads, d).permute(2, 0, 3, 1, 4)[0]
        visible = torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask
        expected = frobenius_mean(by_hand_attention(q, k, 1 / math.sqrt(d), visible))
    assert list(ds["attention_module"].values) == ["layers.0"]
    assert math.isclose(float(ds["attention_norm"].sel(step=0, layer=0)), expected, rel_tol=1e-5)
    # a causal softmax matrix has row sums 1: its norm is at most sqrt(N), above 1
    assert 1.0 <= expected <= math.sqrt(n)


def test_explicit_softmax_is_read_and_builtin_taps_win():
    model = build_model(model_config("gpt", "softmax", depth=2, width=128, heads=4, tokens=32))
    seen = []
    original = model.blocks[1].attn.phi
    model.blocks[1].attn.phi = lambda s, n, m: seen.append(original(s, n, m)) or seen[-1]
    rec = instrument(model)
    with rec.step(0):
        model(torch.randint(256, (3, 32), generator=torch.Generator().manual_seed(0))).mean().backward()
    ds = rec.dataset()
    # the softmax inside phi is intercepted too, but counted once: the module's own tap wins
    assert list(ds["attention_module"].values) == ["blocks.0.attn", "blocks.1.attn"]
    assert math.isclose(
        float(ds["attention_norm"].sel(step=0, layer=1)),
        frobenius_mean(seen[0].detach().double()),
        rel_tol=1e-6,
    )


def test_nothing_is_measured_or_attached_off_sample(monkeypatch):
    calls = []
    monkeypatch.setattr(
        recorder_module, "quant_stats", lambda *a, **k: calls.append(a) or quant_stats(*a, **k)
    )
    model = UserModel()
    rec = instrument(model, sample_every=2)
    x = seeded(2, 64, 128)
    for step in range(3):
        with rec.step(step) as sampled:
            model(x).mean().backward()
        assert sampled == (step % 2 == 0)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert len(calls) == 2 * 7 * 4  # sampled steps x linears x tensor roles
    assert list(rec.dataset()["step"].values) == [0, 2]


def test_a_recorded_recipe_run_measures_the_operands_before_quantization():
    model = build_model(model_config("gpt", "softmax", depth=1, width=128, heads=4, tokens=32))
    set_recipe(model, FP8_BLOCK)
    captured = {}
    model.blocks[0].mlp.fc1.register_forward_hook(lambda m, a, o: captured.update(x=a[0].detach()))
    rec = instrument(model, modules="blocks.*.mlp.fc1", attention=None)
    with rec.step(0):
        model(torch.randint(256, (4, 32), generator=torch.Generator().manual_seed(1))).mean().backward()
    got = rec.dataset()["module_sums"].sel(
        step=0, module="blocks.0.mlp.fc1", tensor="activation", layout="1x128"
    )
    np.testing.assert_array_equal(
        got.values, quant_stats(captured["x"].reshape(-1, 128), "e4m3", (1, 128)).sums.numpy()
    )


class TransposedLinear(nn.Module):
    """Stores W as (in, out) like Hugging Face's Conv1D: y = x @ W + b."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(seeded(n_in, n_out) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_registered_look_alike_has_its_weight_read_as_out_by_in(monkeypatch):
    monkeypatch.setattr(linear_modules, "_LINEAR_LIKE", dict(linear_modules._LINEAR_LIKE))
    model = nn.Sequential(TransposedLinear(128, 256))
    with pytest.raises(ValueError, match="no linear-like module.*register_linear"):
        instrument(model, attention=None)
    register_linear(TransposedLinear, weight=lambda m: m.weight.t())
    rec = instrument(model, attention=None)
    with rec.step(0):
        model(seeded(128, 128)).sum().backward()
    got = rec.dataset()["module_sums"].sel(step=0, module="0", tensor="weight", layout="128x128")
    np.testing.assert_array_equal(
        got.values, quant_stats(model[0].weight.detach().t(), "e4m3", (128, 128)).sums.numpy()
    )


def test_module_patterns_select_by_glob_or_regex_and_must_match():
    model = UserModel()
    assert list(instrument(model, modules="layers.*.q").gemms) == ["layers.0.q", "layers.1.q"]
    assert list(instrument(model, modules=re.compile(r"layers\.1\..*")).gemms) == [
        "layers.1.q",
        "layers.1.kv",
        "layers.1.out",
    ]
    with pytest.raises(
        ValueError, match=r"'\*\.mlp\.\*' matches none of the 7 linear-like modules \(layers.0.q"
    ):
        instrument(model, modules="*.mlp.*")


def test_attention_auto_that_records_nothing_is_an_error():
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
    rec = instrument(model)
    with rec.step(0):
        model(seeded(128, 128)).sum().backward()
    with pytest.raises(ValueError, match="recorded no attention matrix.*attention=None"):
        rec.dataset()
    rec_gemms = instrument(model, attention=None)
    with rec_gemms.step(0):
        model(seeded(128, 128)).sum().backward()
    assert "attention_norm" not in rec_gemms.dataset() and "layer" in rec_gemms.dataset().dims


def test_bad_arguments_name_what_to_fix():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        instrument("gpt")
    with pytest.raises(ValueError, match="attention must be 'auto' or None"):
        instrument(UserModel(), attention="sdpa")
    with pytest.raises(ValueError, match="sample_every must be a positive integer"):
        instrument(UserModel(), sample_every=0)
    with pytest.raises(ValueError, match="bad quantization scheme 'fp9'"):
        instrument(UserModel(), schemes=("fp9",))
    with pytest.raises(ValueError, match="no sampled step was recorded"):
        instrument(UserModel()).dataset()


def test_nonfinite_inputs_are_counted_not_crashed_on():
    model = nn.Sequential(nn.Linear(128, 128))
    x = seeded(128, 128)
    x[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    rec = instrument(model, attention=None)
    with rec.step(0):
        model(x.requires_grad_()).sum().backward()
    view = module_view(rec.dataset())
    assert int(view["nonfinite"].sel(step=0, module="0", tensor="activation")) == 3
    assert int(view["nonfinite"].sel(step=0, module="0", tensor="weight")) == 0


def test_rules_work_per_module_and_project_rules_skip_what_a_user_model_lacks():
    from precision_suite.verdicts.rule_check import check_rules

    model = UserModel()
    rec = instrument(model)
    with rec.step(0):
        model(seeded(4, 64, 128)).square().mean().backward()
    ds = rec.dataset(case="user")
    (finding,) = check_rules(ds, ["underflow <= -1 @ module=*.q, tensor=weight, layout=128x128"])[:1]
    assert finding.kind == "threshold" and finding.where["module"] == "layers.0.q"
    assert {f.where["module"] for f in check_rules(ds, ["underflow <= -1 @ module=*.q, tensor=weight"])} == {
        "layers.0.q",
        "layers.1.q",
    }
    assert check_rules(ds, ["attention_norm <= sqrt(N) @ attention=softmax"]) == []  # no spec: no such field
    assert check_rules(ds, ["attention_norm <= 64"]) == []  # per layer, holds
    (error,) = check_rules(ds.assign(attention_norm=ds["attention_norm"] * np.nan), ["attention_norm <= 64"])
    assert error.kind == "error" and "every selected cell of attention_norm is NaN" in error.message
