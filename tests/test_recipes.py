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
from precision_suite.numerics.accumulation import full_scales
from precision_suite.numerics.formats import FORMATS, get_format
from precision_suite.numerics.quantization import quantize, stochastic_round
from precision_suite.training import recipes
from precision_suite.training.probes import get_scheme
from precision_suite.training.quant_linear import QuantLinear, set_recipe
from precision_suite.training.recipe_registry import (
    NAMED_RECIPES,
    RECIPES_ENV,
    get_recipe,
    recipes_environment,
    recipes_from_toml,
)
from precision_suite.training.recipes import HIGH_PRECISION, Gemm, Operand, Recipe
from precision_suite.training.runs import RunSpec, Trainer, run

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
    above = elements[
        np.minimum(np.searchsorted(elements, y.double().numpy(), side="left"), len(elements) - 1)
    ]
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
    assert torch.equal(r, again) and not torch.equal(
        r, stochastic_round(y, element, torch.Generator().manual_seed(1))
    )


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
    expected_y = torch.nn.functional.linear(
        quantize(x.detach(), "nvfp4", (1, 16)).dequantized, w16, layer.bias.detach()
    )
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
    assert (recipe.fprop.a.fmt, recipe.fprop.b.fmt, recipe.dgrad.a.fmt, recipe.wgrad.a.fmt) == (
        "e4m3",
        "e4m3",
        "e5m2",
        "e5m2",
    )
    assert all(op.layout == "tensor" for g in (recipe.fprop, recipe.dgrad, recipe.wgrad) for op in (g.a, g.b))
    assert all(r.source for r in NAMED_RECIPES.values())  # each named recipe says where it comes from


def test_scheme_recipes_keep_the_transposed_backward_layouts():
    recipe = get_recipe("fp8-block")
    assert (recipe.fprop.a.layout, recipe.fprop.b.layout) == ((1, 128), (128, 128))
    assert (recipe.dgrad.a.layout, recipe.dgrad.b.layout) == ((1, 128), (128, 128))
    assert (recipe.wgrad.a.layout, recipe.wgrad.b.layout) == ((128, 1), (128, 1))
    assert get_recipe("bf16").fprop.a.fmt == "bf16"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: Recipe(
                "r",
                Gemm(Operand("e4m3"), Operand("e4m3"), hadamard=16),
                Gemm(Operand("e4m3"), Operand("e4m3")),
                Gemm(Operand("e4m3"), Operand("e4m3")),
            ),
            "a Hadamard transform on fprop",
        ),
        (
            lambda: Recipe(
                "r",
                *[Gemm(Operand("e4m3"), Operand("e4m3"))] * 2,
                Gemm(Operand("e4m3"), Operand("e4m3"), hadamard=12),
            ),
            "power of two",
        ),
        (lambda: Operand("e4m3", "tensor", "dither"), "rounding must be one of nearest, stochastic"),
        (lambda: Operand("mxfp8", (1, 16)), "must be (1, 32), (32, 1) or (32, 32)"),
        (lambda: Operand("bf16", "tensor", "stochastic"), "stochastic rounding needs a block-scaled format"),
        (lambda: get_recipe("fp6"), "unknown recipe 'fp6'"),
    ],
)
def test_inconsistent_recipes_are_refused_when_built(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


MY_RECIPE = {
    "source": "a test",
    "fprop": {"a": "e4m3:1x128", "b": "e4m3:128x128"},
    "dgrad": {"a": "e5m2:1x128:stochastic", "b": "e4m3:128x128"},
    "wgrad": {"a": "e5m2:128x1", "b": "fp32", "hadamard": 0},
}


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


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({**MY_RECIPE, "wgrad": {"a": "e5m2"}}, "wgrad must be a table"),
        ({**MY_RECIPE, "fprop": {"a": "e4m3:1x128:fast", "b": "fp32"}}, "operand 'e4m3:1x128:fast'"),
        ({**MY_RECIPE, "extra": 1}, "unknown key(s) extra"),
    ],
)
def test_bad_user_recipes_name_the_table_and_field(body, message):
    with pytest.raises(
        ValueError, match=r"cases.toml: \[recipes.mine\].*" + message.replace("(", r"\(").replace(")", r"\)")
    ):
        recipes_from_toml({"mine": body}, "cases.toml")


def test_a_config_file_declares_its_recipes(tmp_path, monkeypatch):
    monkeypatch.delenv(RECIPES_ENV, raising=False)
    config = tmp_path / "mine.toml"
    config.write_text(
        '[recipes.mine]\nfprop = { a = "e4m3:tensor", b = "e4m3:tensor" }\n'
        'dgrad = { a = "e5m2:tensor", b = "e4m3:tensor" }\nwgrad = { a = "fp32", b = "fp32" }\n'
        '[[case]]\nmodel = "gpt"\nrecipe = "mine"\n'
    )
    (spec,) = config_specs(config)
    assert spec.training_recipe().wgrad.a.fmt == "fp32"
    config.write_text('[recipe.mine]\n[[case]]\nmodel = "gpt"\n')
    with pytest.raises(cli.UsageError, match="unknown top-level key.*recipe"):
        config_specs(config)


# --------------------------------------------------------------------------- the contraction law

# Each GEMM of y = x W^T over its operands as stored (x, dy: tokens by features; W: out by in):
# the letter summed over is K
GEMM_SUMS = {"fprop": "ik,jk->ij", "dgrad": "ik,kj->ij", "wgrad": "ki,kj->ij"}
SCHEME_RECIPES = [
    "fp8-block",
    *FORMATS,
    *(
        f"{fmt}:{layout}"
        for fmt, f in FORMATS.items()
        if f.scale_rule == "amax"
        for layout in ("tensor", "row", "128x128")
    ),
]


def contraction_axis(where: str) -> int:
    gemm, side = where.split(".")
    return GEMM_SUMS[gemm].split("->")[0].split(",")["ab".index(side)].index("k")


def shortest_scale_run(operand: Operand, shape: tuple[int, int], axis: int) -> int:
    """The fewest consecutive elements along `axis` that share one scale of `operand`'s quantization
    of a random tensor (random blocks have distinct amaxes, so a scale changes where a block ends)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=generator) * torch.rand(*shape, generator=generator).exp2()
    quantized = quantize(x, operand.fmt, operand.layout)
    lines = full_scales(quantized.scales, operand.layout, *shape).expand(*shape).movedim(axis, 1)
    run_of = torch.cat(
        [torch.zeros(len(lines), 1, dtype=torch.long), (lines[:, 1:] != lines[:, :-1]).long()], 1
    )
    run_of = run_of.cumsum(1) + torch.arange(len(lines))[:, None] * lines.shape[1]  # one id per run
    return int(torch.unique(run_of, return_counts=True)[1].min())


@pytest.mark.parametrize(
    "recipe",
    [*NAMED_RECIPES.values(), *(Recipe.from_scheme(get_scheme(n)) for n in SCHEME_RECIPES)],
    ids=[*NAMED_RECIPES, *(f"scheme {n}" for n in SCHEME_RECIPES)],
)
def test_every_scale_is_shared_by_consecutive_products_of_its_gemms_dot_products(recipe):
    """A block scale can be factored out of a partial sum of a dot product only where the block
    lies along K: every scale must cover at least two consecutive elements of K."""
    for where, operand, shape in recipe.operands(in_features=128, out_features=192, tokens=128):
        if operand.fmt == HIGH_PRECISION or get_format(operand.fmt).scale_rule == "none":
            continue
        assert shortest_scale_run(operand, shape, contraction_axis(where)) >= 2, (where, operand.text())


def test_a_recipe_whose_wgrad_blocks_lie_across_the_tokens_is_refused_naming_wgrad(monkeypatch):
    """The planted bug: the backward GEMMs keep the forward layouts (1x128 tiles of dy and x), so
    wgrad, which sums over tokens, would change both operands' scales at every token."""
    monkeypatch.setattr(recipes, "transpose_layout", lambda layout: layout)
    assert (
        shortest_scale_run(Operand("e4m3", (1, 128)), (128, 192), contraction_axis("wgrad.b")) == 1
    )  # breaks the law
    with pytest.raises(
        ValueError,
        match=r"recipe 'fp8-block' wgrad: operand a e4m3:1x128 of dy \(tokens, out\) has "
        r"scaling blocks one element long along axis 0, the GEMM's contraction axis "
        r"\(wgrad sums over tokens\).*such as e4m3:128x1",
    ):
        Recipe.from_scheme(get_scheme("fp8-block"))


def test_a_users_table_that_breaks_the_law_is_a_one_line_usage_error_before_any_training(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(RECIPES_ENV, raising=False)
    monkeypatch.setattr(Trainer, "__init__", lambda *args, **kwargs: pytest.fail("trained a refused recipe"))
    config = tmp_path / "cases.toml"
    config.write_text(
        '[recipes.tiles]\nfprop = { a = "e4m3:1x128", b = "e4m3:128x128" }\n'
        'dgrad = { a = "e5m2:1x128", b = "e4m3:128x128" }\nwgrad = { a = "e5m2:1x128", b = "e4m3:128x1" }\n'
        '[[case]]\nmodel = "gpt"\nrecipe = "tiles"\n'
    )
    assert cli.main(["run", "--config", str(config), "--report-dir", str(tmp_path / "report")]) == 2
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1
        and f"{config}: [recipes.tiles]: recipe 'tiles' wgrad: operand a e5m2:1x128" in error
    )
    assert "such as e5m2:128x1" in error


# --------------------------------------------------------------------------- accumulation per GEMM


def test_built_in_recipes_accumulate_in_float32_and_the_hopper_presets_as_their_sources_say():
    hopper = {"fp8-hybrid-hopper", "fp8-block-hopper"}
    for name, recipe in NAMED_RECIPES.items():
        modes = tuple(g.accumulation.text() for g in (recipe.fprop, recipe.dgrad, recipe.wgrad))
        if name not in hopper:  # the default matrix's numbers and baselines stay as they were
            assert modes == ("fp32",) * 3, name
    assert tuple(
        g.accumulation.text()
        for g in (
            get_recipe("fp8-hybrid-hopper").fprop,
            get_recipe("fp8-hybrid-hopper").dgrad,
            get_recipe("fp8-hybrid-hopper").wgrad,
        )
    ) == (
        "hopper-fast",
        "hopper-promoted:128",
        "hopper-promoted:128",
    )  # TE current scaling, torchao tensorwise
    block = get_recipe("fp8-block-hopper")
    assert {g.accumulation.text() for g in (block.fprop, block.dgrad, block.wgrad)} == {"hopper-promoted:128"}
    for name in hopper:  # the operands of the recipe they accumulate differently
        base = get_recipe(name.removesuffix("-hopper"))
        assert all(
            getattr(get_recipe(name), g).a == getattr(base, g).a
            and getattr(get_recipe(name), g).b == getattr(base, g).b
            for g in ("fprop", "dgrad", "wgrad")
        )


def test_toml_declares_the_accumulation_and_it_reaches_workers(monkeypatch):
    body = {
        **MY_RECIPE,
        "fprop": {"a": "e4m3:tensor", "b": "e4m3:tensor", "accumulate": "hopper-fast"},
        "dgrad": {"a": "e5m2:1x128", "b": "e4m3:128x128", "accumulate": "hopper-promoted:64"},
        "wgrad": {"a": "e5m2:128x1", "b": "fp32"},
    }
    (recipe,) = recipes_from_toml({"mine": body}, "cases.toml").values()
    assert recipe.describe()["fprop"]["accumulate"] == "hopper-fast"
    assert recipe.describe()["dgrad"]["accumulate"] == "hopper-promoted:64"
    assert recipe.describe()["wgrad"]["accumulate"] == "fp32"
    monkeypatch.setenv(RECIPES_ENV, recipes_environment({"mine": recipe})[RECIPES_ENV])
    assert get_recipe("mine") == recipe


@pytest.mark.parametrize(
    ("gemm", "message"),
    [
        (
            {"a": "e4m3:tensor", "b": "e4m3:tensor", "accumulate": "hopper"},
            r"fprop accumulate: accumulation mode 'hopper'",
        ),
        (
            {"a": "mxfp8:1x32", "b": "mxfp8:1x32", "accumulate": "hopper-promoted"},
            r"recipe 'mine' fprop accumulates hopper-promoted:128, but operand a is mxfp8:1x32: the Hopper tensor-core "
            r"model takes FP8 operands",
        ),
        (
            {"a": "nvfp4:1x16", "b": "nvfp4:1x16", "accumulate": "hopper-fast"},
            r"recipe 'mine' fprop .* operand a is nvfp4",
        ),
        ({"a": "e4m3:tensor", "b": "fp32", "accumulate": "hopper-fast"}, r"operand b is fp32"),
        ({"a": "e5m2:tensor", "b": "e5m2:tensor", "accumulate": "hopper-fast"}, r"E5M2 x E5M2"),
        ({"a": "e4m3:1x128", "b": "e4m3:tensor", "accumulate": "hopper-fast"}, r"scales that change along K"),
        (
            {"a": "e4m3:1x128", "b": "e4m3:128x128", "accumulate": "hopper-promoted:256"},
            r"promotes every 256 elements of K, but operand a e4m3:1x128 changes its scale every 128",
        ),
        (
            {"a": "e4m3:1x64", "b": "e4m3:tensor", "accumulate": "hopper-promoted"},
            r"changes its scale every 64\b",
        ),
    ],
)
def test_accumulations_the_operands_cannot_take_are_refused_naming_recipe_and_gemm(gemm, message):
    with pytest.raises(ValueError, match=r"cases.toml: \[recipes.mine\].*" + message):
        recipes_from_toml({"mine": {**MY_RECIPE, "fprop": gemm}}, "cases.toml")


def fp8_tensor(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))


def test_a_hopper_recipe_trains_with_the_gemms_an_h100_computes(monkeypatch):
    """fp8-hybrid-hopper's three GEMMs, each against mmaemu's torch._scaled_mm of the same FP8
    elements and tensor scales (fprop fast, dgrad and wgrad slow accumulation), bit for bit."""
    import mmaemu

    recipe = get_recipe("fp8-hybrid-hopper")
    torch.manual_seed(0)
    layer = QuantLinear(64, 32)
    set_recipe(layer, recipe)
    x = fp8_tensor((48, 64), 1).requires_grad_()
    dy = fp8_tensor((48, 32), 2) * 1e-3
    y = layer(x)
    y.backward(dy)

    def fp8(t, fmt):
        q = quantize(t.detach(), fmt, "tensor")
        return (q.dequantized / q.scales).to(
            torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        ), q.scales

    def h100(a, a_scale, b, b_scale, fast):  # b: (K, N), column-major as cuBLAS reads it
        with __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            return mmaemu.scaled_mm(
                a.contiguous(),
                b.t().contiguous().t(),
                a_scale.reshape(()),
                b_scale.reshape(()),
                out_dtype=torch.float32,
                use_fast_accum=fast,
                splitk=1,
            )

    (xq, sx), (wq, sw), (dyq, sdy) = fp8(x, "e4m3"), fp8(layer.weight, "e4m3"), fp8(dy, "e5m2")
    assert torch.equal(y.detach(), h100(xq, sx, wq.t(), sw, fast=True) + layer.bias.detach())
    assert torch.equal(x.grad, h100(dyq, sdy, wq, sw, fast=False))
    assert torch.equal(layer.weight.grad, h100(dyq.t(), sdy, xq, sx, fast=False))


def test_block_scaled_hopper_gemms_apply_each_chunks_scales_on_promotion():
    """fp8-block-hopper: every GEMM is scaled_gemm of the consumed elements and their block scales
    (the block path itself is tested against exact arithmetic in tests/test_accumulation.py), and
    differs from the float32 GEMM of the same operands (fp8-block) by the accumulation alone."""
    from precision_suite.numerics.accumulation import full_scales, scaled_gemm, split_dequantized

    torch.manual_seed(0)
    layer = QuantLinear(256, 128)
    x = fp8_tensor((256, 256), 3)
    set_recipe(layer, get_recipe("fp8-block-hopper"))
    y = layer(x)
    set_recipe(layer, get_recipe("fp8-block"))
    y_fp32 = layer(x)

    def factors(t, layout):
        q = quantize(t.detach(), "e4m3", layout)
        scales = full_scales(q.scales, layout, *t.shape)
        return split_dequantized(q.dequantized, scales, "e4m3"), scales

    (xe, xs), (we, ws) = factors(x, (1, 128)), factors(layer.weight, (128, 128))
    expected = (
        scaled_gemm(xe, we.t(), xs, ws.t(), "hopper-promoted", elements=("e4m3", "e4m3"))
        + layer.bias.detach()
    )
    assert torch.equal(y.detach(), expected)
    assert not torch.equal(y, y_fp32)
    # within the bound the model's 13 fraction bits allow a promoted chain of 128 (and float32's
    # own rounding, K 2^-24), relative to sum_k |x_k w_k| (tests/test_accumulation.py derives it)
    magnitude = (xe * xs).abs().double() @ (we * ws).abs().double().t()
    bound = ((128 + 2 * 128 // 32) * 2.0**-13 + 256 * 2.0**-24) * magnitude
    assert bool(((y - y_fp32).detach().double().abs() <= bound).all())


def test_gemm_error_sums_measure_each_mode_on_what_the_gemm_consumed():
    from precision_suite.numerics.accumulation import Accumulation
    from precision_suite.numerics.accumulation_error import relative_error
    from precision_suite.training.quant_linear import gemm_error_sums

    recipe = get_recipe("fp8-hybrid-hopper")
    x, w = fp8_tensor((64, 2048), 4).abs(), fp8_tensor((16, 2048), 5).abs()  # same sign: a long sum
    a, b = (x, recipe.fprop.a.apply(x, None)), (w, recipe.fprop.b.apply(w, None))
    modes = ("fp32", "hopper-fast", "hopper-promoted")
    sums = gemm_error_sums(recipe, "fprop", a, b, [Accumulation(mode) for mode in modes])
    errors = {mode: relative_error(s) for mode, s in zip(modes, sums)}
    assert 0 < errors["fp32"] < 2.0**-20 < errors["hopper-promoted"] < errors["hopper-fast"] < 2.0**-4
    for mode, together in zip(modes, sums):  # measured together as each alone
        [alone] = gemm_error_sums(recipe, "fprop", a, b, [Accumulation(mode)])
        assert torch.equal(together, alone)
    nvfp4 = get_recipe("nvfp4")  # no FP8 elements: only float32 accumulation is defined
    [fp32] = gemm_error_sums(
        nvfp4, "fprop", (x, nvfp4.fprop.a.apply(x, None)), (w, nvfp4.fprop.b.apply(w, None)), [Accumulation()]
    )
    assert relative_error(fp32) < 2.0**-20


def test_gemm_error_sums_leave_out_what_the_hardware_cannot_run():
    from precision_suite.numerics.accumulation import Accumulation
    from precision_suite.training.quant_linear import gemm_error_sums, reduction_length

    recipe = get_recipe("fp8-block-hopper")  # 1x128 and 128x128 scales change along K
    x, w = fp8_tensor((64, 256), 6), fp8_tensor((128, 256), 7)
    a, b = (x, recipe.fprop.a.apply(x, None)), (w, recipe.fprop.b.apply(w, None))
    fast, promoted, every_256 = gemm_error_sums(
        recipe,
        "fprop",
        a,
        b,
        [
            Accumulation("hopper-fast"),
            Accumulation("hopper-promoted", 128),
            Accumulation("hopper-promoted", 256),
        ],
    )
    assert fast is None and every_256 is None and promoted is not None
    assert promoted[3] == 64 * 128  # every output of x W^T
    assert reduction_length("fprop", a) == 256 and reduction_length("wgrad", a) == 64
