"""RunSpec validation, run() datasets (schema 1), determinism, netCDF round trip."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import precision_suite
from precision_suite.files import SCHEMA_VERSION, load_dataset, save_dataset
from precision_suite.training import runs
from precision_suite.training.imports import load_object, project_importable
from precision_suite.training.runs import RunSpec, case_id, run

BASELINES = Path(__file__).resolve().parents[1] / "baselines"
# 8 images x 16 patches = 128 token rows: the smallest batch a (128, 1) block fits
TINY_VIT = dict(model="vit", depth=2, steps=4, batch_size=8, sample_every=2)
TINY_GPT = dict(model="gpt", depth=2, seq_len=32, batch_size=4, steps=3, sample_every=2)


@pytest.fixture(scope="module")
def fp8_gpt() -> xr.Dataset:
    return run(RunSpec(recipe="fp8-block", extra_formats=("mxfp8", "nvfp4"), **TINY_GPT))


def test_dataset_follows_the_schema(fp8_gpt):
    ds = fp8_gpt
    assert ds.step.values.tolist() == [0, 2] and ds.step.dtype == np.int64
    assert ds.tokens.dims == ("step",) and ds.tokens.values.tolist() == [128, 384]
    assert ds.layer.values.tolist() == [0, 1]
    assert ds.tensor.values.tolist() == ["activation", "gradient", "gradient_transpose", "weight"]
    assert ds.layout.values.tolist() == ["1x128", "128x1", "128x128", "mxfp8", "nvfp4"]
    assert ds.train_step.values.tolist() == [0, 1, 2]
    assert ds.attention_norm.dims == ("step", "layer")
    for name in ("underflow", "zeros_after", "overflow", "distortion", "sqnr_db", "mse"):
        assert ds[name].dims == ("step", "layer", "tensor", "layout")
    assert ds.nonfinite.dims == ("step", "layer", "tensor") and int(ds.nonfinite.sum()) == 0
    assert ds.loss.dims == ds.accuracy.dims == ("train_step",)
    assert np.isfinite(ds.loss).all() and ((ds.accuracy >= 0) & (ds.accuracy <= 1)).all()
    # per module: the four block linears of each layer and the output head (no block index)
    assert ds.module.values.tolist() == [
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ] + ["head"]
    assert ds.module_layer.values.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, -1]
    assert ds.module_sums.dims == ("step", "module", "tensor", "layout", "sum_field")
    assert ds.attention_module.values.tolist() == ["blocks.0.attn", "blocks.1.attn"]
    assert ds.attrs["schema_version"] == SCHEMA_VERSION
    # sizes other than the defaults make another case: its id carries a hash of them
    assert ds.attrs["case"].startswith("gpt-softmax-fp8-block-") and ds.attrs["case"] == case_id(
        RunSpec.from_json(ds.attrs["spec"])
    )
    assert RunSpec.from_json(ds.attrs["spec"]) == RunSpec(
        recipe="fp8-block", extra_formats=("mxfp8", "nvfp4"), **TINY_GPT
    )
    assert ds.attrs["package_version"] == precision_suite.__version__
    fingerprint = json.loads(ds.attrs["fingerprint"])
    assert fingerprint["threads"] == 1 and fingerprint["torch"] == torch.__version__
    assert {"device", "cpu_capability", "python", "platform"} <= set(fingerprint)


def test_gradient_transpose_is_recorded_apart_from_the_gradient(fp8_gpt):
    underflow = fp8_gpt.underflow
    gradient = underflow.sel(tensor="gradient", layout="1x128")
    transpose = underflow.sel(tensor="gradient_transpose", layout="128x1")
    assert np.isfinite(gradient).all() and np.isfinite(transpose).all()
    # each tensor is measured only under its own layout; the other pair stays NaN
    assert np.isnan(underflow.sel(tensor="gradient", layout="128x1")).all()
    assert np.isnan(underflow.sel(tensor="gradient_transpose", layout="1x128")).all()
    assert not np.array_equal(gradient.values, transpose.values)
    # fixed-block formats measure all four tensors
    assert np.isfinite(fp8_gpt.distortion.sel(layout=["mxfp8", "nvfp4"])).all()


def test_softmax_attention_norm_stays_within_sqrt_n_in_a_run():
    ds = run(RunSpec(attention="softmax", **TINY_VIT))
    assert bool((ds.attention_norm <= math.sqrt(16)).all())
    assert bool((ds.attention_norm > 0).all())


@pytest.mark.parametrize("power", ["", "^3"])
def test_unscaled_polynomial_norm_exceeds_its_sqrt_n_twin(power):
    unscaled = run(RunSpec(attention=f"x{power}/1", **TINY_VIT)).attention_norm
    scaled = run(RunSpec(attention=f"x{power}/sqrt(N)", **TINY_VIT)).attention_norm
    assert bool((unscaled > scaled).all())


def test_a_diverging_run_counts_nan_and_inf_instead_of_crashing():
    # an absurd learning rate on the unnormalised cubic attention blows the weights up at once
    ds = run(RunSpec(attention="x^3/1", lr=50.0, **TINY_VIT))
    assert np.isnan(ds.loss.values[-1])
    assert int(ds.nonfinite.isel(step=-1).sum()) > 0
    assert int(ds.nonfinite.isel(step=0).sum()) == 0


def test_same_spec_twice_gives_identical_datasets():
    spec = RunSpec(recipe="mxfp8", **TINY_GPT)
    xr.testing.assert_identical(run(spec), run(spec))


def test_a_different_seed_gives_different_numbers():
    first = run(RunSpec(**TINY_GPT)).loss
    second = run(RunSpec(**{**TINY_GPT, "seed": 1})).loss
    assert not np.array_equal(first.values, second.values)


def test_netcdf_round_trip_is_identical(fp8_gpt, tmp_path):
    path = save_dataset(fp8_gpt, tmp_path / "sub" / "run.nc")
    xr.testing.assert_identical(load_dataset(path), fp8_gpt)
    assert [p.name for p in path.parent.iterdir()] == ["run.nc"]  # no temp file left behind


def test_load_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results file .*missing.nc"):
        load_dataset(tmp_path / "missing.nc")


def test_run_restores_threads_and_rng_and_reports_progress():
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    seen = []
    torch.set_num_threads(2)  # the run pins 1 thread and must put 2 back
    try:
        run(RunSpec(threads=1, **TINY_GPT), progress=lambda *args: seen.append(args))
        assert torch.get_num_threads() == 2 and torch.equal(torch.get_rng_state(), rng)
    finally:
        torch.set_num_threads(threads)
    assert [(done, total) for done, total, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert all(isinstance(loss, float) and loss > 0 for *_, loss in seen)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "bert"}, "unknown model 'bert'; choose one of vit, gpt"),
        ({"attention": "tanh"}, "unknown attention 'tanh'; known: .*softmax"),
        (
            {"recipe": "fp6"},
            "unknown recipe 'fp6': use fp32, fp8-block, fp8-hybrid, mxfp8, nvfp4, nvfp4-training",
        ),
        ({"extra_formats": ("int8",)}, "bad quantization scheme 'int8'"),
        ({"extra_formats": ("e4m3:1x128",)}, "'fp8-block' already measures"),
        ({"steps": 0}, "steps must be a positive integer, got 0"),
        ({"sample_every": -1}, "sample_every must be a positive integer"),
        ({"batch_size": 1}, r"gradient_transpose \(32x384\) into 128x1 blocks"),
        ({"width": 64}, r"activation \(128x64\) into 1x128 blocks"),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda"),
        *([] if torch.cuda.is_available() else [({"device": "cuda"}, "torch sees no CUDA device")]),
        ({"lr": float("nan")}, "lr must be a positive finite number"),
        ({"model": "vit", "seq_len": 9}, r"tokens \(seq_len\) must be one of \(4, 16, 64\)"),
        ({"name": "my case"}, "name must be 1 to 80 letters, digits, '.', '_' or '-'.*got 'my case'"),
        ({"name": "x" * 81}, "name must be 1 to 80 letters"),
        ({"name": 7}, "name must be 1 to 80 letters"),
        ({"modules": "blocks.*"}, r"modules must be a list of globs over module names.*got 'blocks.\*'"),
        ({"modules": ("blocks.*", "")}, "modules must be a list of globs"),
        (
            {"modules": ("blocks.9.*",)},
            r"modules pattern 'blocks.9.\*' matches none of the 9 linear-like modules",
        ),
    ],
)
def test_bad_specs_fail_before_training_with_what_is_allowed(change, message, monkeypatch):
    def training_started(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(runs, "Trainer", training_started)
    with pytest.raises(ValueError, match=message):
        run(RunSpec(**{**TINY_GPT, **change}))


def test_spec_json_round_trip_and_unknown_fields():
    spec = RunSpec(model="vit", attention="x^3/sqrt(N)", extra_formats=["nvfp4"], depth=3)
    assert spec.extra_formats == ("nvfp4",)
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match=r"unknown RunSpec field\(s\) \['stepz'\]; allowed: .*steps"):
        RunSpec.from_json('{"stepz": 3}')
    with pytest.raises(ValueError, match="not valid JSON"):
        RunSpec.from_json("{")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (RunSpec(model="vit"), "vit-softmax-fp32"),
        (RunSpec(model="gpt", recipe="fp8-block"), "gpt-softmax-fp8-block"),
        (RunSpec(attention="x^3/sqrt(N)", recipe="e5m2:tensor"), "gpt-x3-sqrtN-e5m2-tensor"),
        (RunSpec(attention="x/1"), "gpt-x-1-fp32"),
        (RunSpec(attention="relu/N"), "gpt-relu-N-fp32"),
    ],
)
def test_case_ids_are_filename_safe(spec, expected):
    assert case_id(spec) == expected


def test_everything_that_defines_a_case_is_in_its_id_and_the_host_is_not():
    base = RunSpec(model="gpt", recipe="fp8-block")
    variants = [
        RunSpec(model="gpt", recipe="fp8-block", **{field: value})
        for field, value in [
            ("depth", 2),
            ("width", 64),
            ("steps", 20),
            ("sample_every", 5),
            ("seq_len", 32),
            ("extra_formats", ("mxfp8",)),
            ("lr", 1e-4),
            ("batch_size", 4),
        ]
    ]
    ids = [case_id(spec) for spec in (base, *variants)]
    assert len(set(ids)) == len(ids)
    assert all(
        i.startswith("gpt-softmax-fp8-block-") and len(i) == len("gpt-softmax-fp8-block-") + 8
        for i in ids[1:]
    )
    # seeds draw members of one case's ensemble; threads and device are the host's
    for host in [{"seed": 7}, {"threads": 2}, {"device": "cpu"}]:
        assert case_id(RunSpec(model="gpt", recipe="fp8-block", **host)) == ids[0]


def test_a_named_case_is_its_name_and_a_hash_of_what_it_trains():
    named = [
        RunSpec(name="tiny", **fields)
        for fields in [{}, {"model": "vit"}, {"attention": "x/1"}, {"recipe": "fp8-block"}, {"steps": 20}]
    ]
    ids = [case_id(spec) for spec in named]
    assert len(set(ids)) == len(ids)  # one name, different things trained: different ids
    assert all(re.fullmatch(r"tiny-[0-9a-f]{8}", i) for i in ids)
    # the hash says what is trained: a renamed case keeps it, the host changes nothing
    assert case_id(RunSpec(name="other.name", model="vit")).removeprefix("other.name") == ids[1].removeprefix(
        "tiny"
    )
    for host in [{"seed": 7}, {"threads": 2}, {"device": "cpu"}]:
        assert case_id(RunSpec(name="tiny", model="vit", **host)) == ids[1]
    # a named case never takes the id of an unnamed one
    assert case_id(RunSpec(name="gpt-softmax-fp32")) != case_id(RunSpec())


def test_the_committed_baselines_and_the_default_matrix_keep_their_case_ids():
    """The fields added for naming and module selection change no existing id: each committed
    baseline's stored spec still reads as the case its file is named after, and the default
    matrix is those cases."""
    from precision_suite.training.matrix import default_matrix

    stored = {path.stem: load_dataset(path).attrs for path in sorted(BASELINES.glob("*.nc"))}
    assert stored, f"no baselines in {BASELINES}"
    for stem, attrs in stored.items():
        spec = RunSpec.from_json(attrs["spec"])
        assert (spec.name, spec.modules) == (None, ())
        assert case_id(spec) == attrs["case"] == stem
    assert sorted(case_id(spec) for spec in default_matrix()) == sorted(stored)
    assert not {"name", "modules"} & {key for spec in default_matrix() for key in json.loads(spec.to_json())}


def test_modules_define_the_case_and_what_its_dataset_holds():
    base = RunSpec(**TINY_GPT)
    first_block = RunSpec(**TINY_GPT, modules=["blocks.0.*", "head"])
    assert first_block.modules == ("blocks.0.*", "head")
    assert RunSpec.from_json(first_block.to_json()) == first_block
    assert case_id(first_block) != case_id(base) and case_id(first_block).startswith("gpt-softmax-fp32-")
    # fields added later enter a spec's JSON only when set: stored specs read as the same case
    assert "modules" not in json.loads(base.to_json()) and "name" not in json.loads(base.to_json())
    short = dataclasses.replace(first_block, steps=1)
    ds = run(short)
    assert ds.attrs["case"] == case_id(short)
    assert ds.module.values.tolist() == [
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.0.mlp.fc1",
        "blocks.0.mlp.fc2",
        "head",
    ]


def test_a_users_model_batches_and_attention_run_from_import_strings():
    spec = RunSpec(
        model="user_code:build", batches="user_code:batches", steps=2, sample_every=1, recipe="fp8-block"
    )
    ds = run(spec)
    assert ds.attrs["case"] == case_id(spec) and case_id(spec).startswith(
        "user_code-build-softmax-fp8-block-"
    )
    assert ds.module.values.tolist()[:2] == ["h.0.attn.c_attn", "h.0.attn.c_proj"]
    assert ds.attention_module.values.tolist() == ["h.0.attn", "h.1.attn"]  # read from SDPA
    assert ds.attrs["N"] == 32 and ds.tokens.values.tolist() == [256, 512]
    assert np.isfinite(ds.attention_norm).all() and (ds.attention_norm <= math.sqrt(32)).all()
    custom = run(RunSpec(**{**TINY_VIT, "attention": "user_code:half_softmax", "steps": 1}))
    assert (custom.attention_norm >= 1).all()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": "user_code:build"}, "batches: model 'user_code:build' is a user's model"),
        (
            {"model": "user_code:nothing", "batches": "user_code:batches"},
            "model: module 'user_code' has no attribute 'nothing'",
        ),
        (
            {"model": "no_such_pkg:build", "batches": "user_code:batches"},
            "model: cannot import 'no_such_pkg'",
        ),
        (
            {"model": "user_code:VOCAB", "batches": "user_code:batches"},
            "model: 'user_code:VOCAB' is a int, not a callable",
        ),
        (
            {"model": "vit", "batches": "user_code:batches"},
            "batches: the built-in 'vit' model trains on its own data",
        ),
        ({"attention": "user_code:missing"}, "attention: module 'user_code' has no attribute 'missing'"),
    ],
)
def test_bad_import_strings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RunSpec(**fields).validate()


def test_an_import_that_fails_says_what_is_missing_and_where_it_was_looked_for(tmp_path):
    (tmp_path / "ergo_dependent.py").write_text("import ergo_not_installed\n")
    (tmp_path / "ergo_pkg").mkdir()
    (tmp_path / "ergo_pkg" / "__init__.py").touch()
    try:
        with project_importable(tmp_path):
            # a name found nowhere: where it was looked for, not "run from the project root"
            with pytest.raises(
                ValueError,
                match=re.escape(
                    f"model: cannot import 'ergo_missing.models': no module 'ergo_missing' under {tmp_path.resolve()} "
                    "(the project root: the current directory, under pytest its rootdir) nor among the installed "
                    "packages; check the name (a ergo_missing.py file or a ergo_missing/ folder with an "
                    "__init__.py)"
                ),
            ):
                load_object("ergo_missing.models:build", "model")
            # the package is there, its module is not: a misspelt name
            with pytest.raises(
                ValueError,
                match=re.escape(
                    f"model: cannot import 'ergo_pkg.modle': package 'ergo_pkg' (in {tmp_path.resolve() / 'ergo_pkg'}) "
                    "has no module 'modle'; check the name"
                ),
            ):
                load_object("ergo_pkg.modle:build", "model")
            # the module is there but its own import is not: not a question of where it is
            with pytest.raises(
                ValueError,
                match=re.escape(
                    "batches: importing 'ergo_dependent' failed: No module "
                    "named 'ergo_not_installed'; install what it imports"
                ),
            ):
                load_object("ergo_dependent:batch", "batches")
    finally:
        sys.modules.pop("ergo_pkg", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_records_its_device():
    ds = run(RunSpec(device="cuda", recipe="fp8-block", **TINY_GPT))
    assert json.loads(ds.attrs["fingerprint"])["device"] != "cpu"
    assert np.isfinite(ds.underflow.sel(tensor="gradient_transpose", layout="128x1")).all()


@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8", "nvfp4", "nvfp4-training"])
def test_a_small_run_stays_eager_and_its_estimate_counts_every_quantized_element(recipe, monkeypatch):
    """The compile decision's estimate is the number of elements the run's quantizers really see
    (counted where every quantizer checks its input), and a run below COMPILE_MIN_RUN_ELEMENTS
    compiles nothing, so it pays no compile tax."""
    from precision_suite.numerics import metrics, quantization

    seen: list[int] = []
    check = quantization.check_tensor

    def counting_check(x, name="x"):
        seen.append(x.numel())
        return check(x, name)

    monkeypatch.setattr(quantization, "check_tensor", counting_check)
    monkeypatch.setattr(metrics, "check_tensor", counting_check)
    # an empty table of compiled functions: every compiled call would have to compile first
    monkeypatch.setattr(quantization, "_compiled", {})
    monkeypatch.setattr(
        quantization, "_compile", lambda *args: pytest.fail("a small run compiled a quantizer")
    )
    spec = RunSpec(model="gpt", depth=1, steps=3, sample_every=2, recipe=recipe).validate()
    torch.manual_seed(0)
    trainer = runs.Trainer(spec, torch.device("cpu"))
    sampled = set(spec.sampled_steps())
    for index in range(spec.steps):
        trainer.step(index, sample=index in sampled)
    assert trainer.compiles is False
    assert sum(seen) == trainer.quantized_elements(spec.tokens_per_step())
    assert not quantization.compile_pays(sum(seen))


def test_every_default_case_compiles_so_its_baseline_numbers_are_those_of_the_kernels():
    from precision_suite.numerics.quantization import compile_pays
    from precision_suite.training.matrix import default_matrix

    for spec in default_matrix():
        torch.manual_seed(0)
        trainer = runs.Trainer(spec.validate(), torch.device("cpu"))
        assert compile_pays(trainer.quantized_elements(spec.tokens_per_step())), case_id(spec)


def test_compile_1_compiles_even_a_small_run(monkeypatch):
    from precision_suite.numerics import quantization

    compiled: list[tuple] = []

    def record(fn, fmt, layout, pow2_scale):
        compiled.append((fn.__name__, fmt.name, layout))
        return lambda blocks: fn(blocks, fmt, pow2_scale)  # eager stand-in: no compile tax here

    monkeypatch.setattr(quantization, "_compiled", {})
    monkeypatch.setattr(quantization, "_compile", record)
    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "1")
    run(RunSpec(model="gpt", depth=1, steps=1, recipe="fp8-block"))
    assert ("_block_sums", "e4m3", (1, 128)) in compiled and (
        "dequantize_blocks",
        "e4m3",
        (1, 128),
    ) in compiled


def test_nothing_compiles_inside_eager_whatever_the_size_or_setting(monkeypatch):
    from precision_suite.numerics import quantization, tensor_core

    monkeypatch.setenv("PRECISION_SUITE_COMPILE", "1")
    big = 1 << 30
    assert quantization.compiling(big)
    assert quantization.compiling(big, tensor_core.COMPILE_MIN_PRODUCTS, run_decides=False)
    with quantization.eager():
        assert not quantization.compiling(big)
        assert not quantization.compiling(big, tensor_core.COMPILE_MIN_PRODUCTS, run_decides=False)
    assert quantization.compiling(big)  # restored on leaving
