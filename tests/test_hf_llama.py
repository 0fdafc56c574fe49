"""Hugging Face Llama (a tiny config, random weights, offline) instrumented, trained a few steps on
the shipped text and checked with the plugin against a baseline (`transformers`: test extra)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason='needs the test extra: pip install -e ".[test]"')

import hf_models  # noqa: E402  (tests/ is on sys.path)
from precision_suite import instrument  # noqa: E402
from precision_suite.training.data import text_batch  # noqa: E402


def test_llama_gemms_and_sdpa_attention_are_recorded_per_module():
    torch.manual_seed(0)
    model = hf_models.build_llama()
    idx, _ = text_batch(3, hf_models.SEQ_LEN, torch.Generator().manual_seed(0))
    rec = instrument(model, schemes=("fp8-block", "mxfp8"))
    with rec.step(0):
        model(idx).logits.logsumexp(-1).mean().backward()
    ds = rec.dataset(case="llama")
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(
        ds["module"].values
    )
    assert list(ds["attention_module"].values) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert list(ds["layer"].values) == [0, 1] and ds.attrs["N"] == hf_models.SEQ_LEN

    # independent: the same weights with eager attention hand back their attention probabilities
    eager = type(model)(hf_models.llama_config("eager"))
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        attentions = eager(idx, output_attentions=True).attentions
    for layer, probabilities in enumerate(attentions):
        expected = float(torch.linalg.matrix_norm(probabilities.double(), ord="fro").mean())
        assert math.isclose(float(ds["attention_norm"].sel(step=0, layer=layer)), expected, rel_tol=1e-5)


CHECK = """
import pytest
from precision_suite.training.runs import RunSpec

@pytest.mark.precision
def test_llama(precision_check):
    precision_check(RunSpec(model="hf_models:build_llama", batches="hf_models:shakespeare_batch",
                            recipe="fp8-hybrid", steps=4, sample_every=2, batch_size=4),
                    rules=["attention_norm <= sqrt(N)", "distortion >= 0.99 @ module=*.mlp.*, tensor=activation, layout=1x128"])
"""


def test_llama_is_checked_by_the_plugin_against_its_baseline(pytester: pytest.Pytester):
    shutil.copy(Path(__file__).with_name("hf_models.py"), pytester.path / "hf_models.py")
    pytester.makepyfile(test_inner=CHECK)
    pytester.syspathinsert()
    pytester.runpytest_subprocess("--precision-regen", "-p", "no:xdist").assert_outcomes(passed=1)
    assert len(list((pytester.path / "baselines").glob("hf_models-build_llama-softmax-fp8-hybrid-*.nc"))) == 1
    pytester.runpytest_subprocess("-p", "no:xdist").assert_outcomes(passed=1)
