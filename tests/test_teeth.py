"""The suite has teeth: plant a numerics regression into the code and the suite must fail on it,
with a chart of the case, while the unplanted code passes against the same baselines.

Each plant is a bug that has shipped in real low-precision stacks: a block scale computed with the
wrong format maximum (flushes small values to zero), truncation instead of round-to-nearest, and
attention scores missing their 1/sqrt(d_head); and a weight-gradient GEMM fed the activation it
saved rather than the operand the recipe quantized (only the consumed-operand check, which looks
at the GEMM's own arguments, sees it at step 0). The late plants start after step 0, where only the
replays from stored states (training.replays) compare deterministically: a scale error switched
on at a trained step, and a quantized weight reused after the optimizer changed the weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from precision_suite import cli
from precision_suite.jobs.selection import config_specs
from precision_suite.jobs.twins import rounding_twins
from precision_suite.numerics import quantization
from precision_suite.training import models, quant_linear, recipes, runs
from precision_suite.training.replays import replay_start
from precision_suite.verdicts.ensemble.build import ENSEMBLE_SEEDS
from shared_build import built_once

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"  # the project's own rules apply
CONFIG = """
[[case]]
model = "vit"
attention = "x/1"
depth = 2
steps = 6
sample_every = 5

[[case]]
model = "gpt"
recipe = "fp8-block"
depth = 2
steps = 6
sample_every = 5
"""


def wrong_scale(monkeypatch):
    """Block scales 256x too large: amax / 1.75 (E4M3's largest mantissa) instead of amax / 448."""
    original = quantization.block_scales
    monkeypatch.setattr(
        quantization,
        "block_scales",
        lambda amax, fmt, pow2_scale=False: original(amax, fmt, pow2_scale) * 256,
    )


def scale_four_times_too_large(monkeypatch):
    """Block scales 4x too large: two binades lost at the bottom of every block (a few elements)."""
    original = quantization.block_scales
    monkeypatch.setattr(
        quantization, "block_scales", lambda amax, fmt, pow2_scale=False: original(amax, fmt, pow2_scale) * 4
    )


def truncating_rounding(monkeypatch):
    """Round toward zero instead of to nearest (ties to even)."""

    def truncate(y, element):
        exp_bits = (y.view(torch.int32) & 0x7F800000).clamp(min=(element.emin + 127) << 23)
        quantum = (exp_bits - (element.man_bits << 23)).view(torch.float32)
        return torch.trunc(y / quantum) * quantum

    monkeypatch.setattr(quantization, "round_to_element", truncate)


def missing_score_scaling(monkeypatch):
    monkeypatch.setattr(models, "attention_scores", lambda q, k: q @ k.transpose(-2, -1))


LATE_ONSET = 3  # a trained step before the small cases' replays (steps 4 and 5 of 6)


def switched_on_late(monkeypatch, plant, onset: int = LATE_ONSET):
    """`plant` in force from training step `onset` on (in runs and replays alike)."""
    original_step = runs.Trainer.step
    original_scales = quantization.block_scales
    with monkeypatch.context() as planted:
        plant(planted)
        broken_scales = quantization.block_scales
    state = {"step": 0}

    def step(self, index, sample):
        state["step"] = index
        return original_step(self, index, sample)

    monkeypatch.setattr(runs.Trainer, "step", step)
    monkeypatch.setattr(
        quantization,
        "block_scales",
        lambda *args, **kwargs: (broken_scales if state["step"] >= onset else original_scales)(
            *args, **kwargs
        ),
    )


def wrong_scale_from_a_trained_step(monkeypatch):
    switched_on_late(monkeypatch, wrong_scale)


def scale_four_times_too_large_from_a_trained_step(monkeypatch):
    switched_on_late(monkeypatch, scale_four_times_too_large)


def stale_quantized_weight(monkeypatch):
    """The forward keeps each weight's first quantization and reuses it after the optimizer has
    changed the weight (a quantized-weight cache that is never invalidated)."""
    original = recipes.Operand.apply
    cache = {}

    def apply(self, x2d, generator):
        if not isinstance(x2d, torch.nn.Parameter):  # activations and gradients: as they were
            return original(self, x2d, generator)
        if id(x2d) not in cache:
            cache[id(x2d)] = (x2d, original(self, x2d, generator))  # the weight kept alive: ids stay unique
        return cache[id(x2d)][1]

    monkeypatch.setattr(recipes.Operand, "apply", apply)


def wgrad_of_the_unquantized_activation(monkeypatch):
    """The weight-gradient GEMM multiplies x as it came (dy_wgrad^T x_rows), while the quantizer
    quantized x and returned it: a GEMM fed another tensor than the operand it reports."""
    original = quant_linear._product

    def product(layer, recipe, gemm, a, b, bias=None):
        if gemm != "wgrad":
            return original(layer, recipe, gemm, a, b, bias)
        (_, dy_wgrad), (x_rows, _) = a, b
        return dy_wgrad.t() @ x_rows

    monkeypatch.setattr(quant_linear, "_product", product)


LATE_PLANTS = {
    # plant: (case it breaks); each must fail there through its replay
    wrong_scale_from_a_trained_step: "gpt-softmax-fp8-block",
    scale_four_times_too_large_from_a_trained_step: "vit-x-1-fp32",
    stale_quantized_weight: "gpt-softmax-fp8-block",
}

PLANTS = {
    # plant: (case it breaks, metrics that must be reported as regressions)
    wrong_scale: ("gpt-softmax-fp8-block", {"underflow", "zeros_after"}),
    scale_four_times_too_large: ("gpt-softmax-fp8-block", {"underflow", "zeros_after"}),
    truncating_rounding: ("gpt-softmax-fp8-block", {"distortion", "sqnr_db"}),
    missing_score_scaling: ("vit-x-1-fp32", {"attention_norm"}),
    wgrad_of_the_unquantized_activation: ("gpt-softmax-fp8-block", {"operand_mismatch"}),
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder with the two small cases and their baselines from the unplanted code, built
    once per test run (the tests write only reports of their own names there)."""

    def build(root: Path) -> None:
        (root / "cases.toml").write_text(CONFIG)
        assert (
            cli.main(
                [
                    "baseline",
                    "update",
                    "--workers",
                    "1",
                    "--config",
                    str(root / "cases.toml"),
                    "--baseline-dir",
                    str(root / "baselines"),
                ]
            )
            == 0
        )

    return built_once(tmp_path_factory, "teeth", build)


def _run(project, report: str) -> tuple[int, dict]:
    # one worker: the plants patch this process
    status = cli.main(
        [
            "run",
            "--workers",
            "1",
            "--config",
            str(project / "cases.toml"),
            "--baseline-dir",
            str(project / "baselines"),
            "--report-dir",
            str(project / report),
            "--rules",
            str(PYPROJECT),
        ]
    )
    return status, json.loads((project / report / "summary.json").read_text())


@pytest.mark.slow
def test_unplanted_code_passes(project):
    status, summary = _run(project, "clean")
    assert status == 0, summary
    assert {c["status"] for c in summary["cases"]} <= {"pass", "drift"}


@pytest.mark.slow
@pytest.mark.parametrize("plant", list(PLANTS), ids=lambda p: p.__name__)
def test_planted_regression_fails_with_a_chart(project, plant, monkeypatch):
    broken_case, expected_metrics = PLANTS[plant]
    case = _failing_case(project, plant, monkeypatch, broken_case, f"planted-{plant.__name__}")
    regressed = {f["metric"] for f in case["findings"] if f["kind"] == "regression"}
    assert expected_metrics <= regressed, regressed
    assert case["charts"], "a failing case must come with a chart"
    for chart in case["charts"]:
        png = project / f"planted-{plant.__name__}" / chart
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _failing_case(project, plant, monkeypatch, broken_case: str, report: str) -> dict:
    """Plant, run the main job and return the broken case's summary: it must fail, and the
    baselines stay as they were."""
    baselines_before = _files(project / "baselines")
    plant(monkeypatch)
    status, summary = _run(project, report)
    assert status == 1
    assert _files(project / "baselines") == baselines_before
    # the small config's cases carry a hash of their sizes after model-attention-recipe
    case = next(c for c in summary["cases"] if c["case"].startswith(f"{broken_case}-"))
    assert case["status"] == "fail"
    return case


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_late_onset_comes_before_the_small_cases_replays(tmp_path):
    (tmp_path / "cases.toml").write_text(CONFIG)
    for spec in config_specs(tmp_path / "cases.toml"):
        assert 0 < LATE_ONSET < replay_start(spec)


@pytest.mark.slow
@pytest.mark.parametrize("plant", list(LATE_PLANTS), ids=lambda p: p.__name__)
def test_a_bug_that_starts_late_fails_its_replay(project, plant, monkeypatch):
    """Bugs that start after step 0 leave the first point alone; the replay of the stored state
    after their onset is where the comparison is exact again, and it must fail there."""
    case = _failing_case(project, plant, monkeypatch, LATE_PLANTS[plant], f"late-{plant.__name__}")
    replayed = [f for f in case["findings"] if f["kind"] == "regression" and "replayed_from" in f["where"]]
    assert replayed, [f["message"] for f in case["findings"]]
    first_points = [
        f
        for f in case["findings"]
        if "replayed_from" not in f["where"] and 0 in (f["where"].get("step"), f["where"].get("train_step"))
    ]
    assert first_points == []  # the bug starts late: step 0 is as it was
    assert any(chart.endswith("-replay.png") for chart in case["charts"])


@pytest.mark.parametrize("numel", [64 * 256, 512 * 256], ids=["eager", "fused"])
def test_quantizer_plants_reach_both_paths(numel, monkeypatch):
    """A plant must change the numbers on the eager path and on the compiled one (whose kernels
    were traced from the unplanted functions), or the teeth tests above prove nothing."""
    x = torch.randn(numel // 256, 256, generator=torch.Generator().manual_seed(0))
    clean = quantization.quantize(x, "e4m3", (1, 128)).dequantized
    for plant in (wrong_scale, scale_four_times_too_large, truncating_rounding):
        with monkeypatch.context() as m:
            plant(m)
            assert not torch.equal(quantization.quantize(x, "e4m3", (1, 128)).dequantized, clean), (
                plant.__name__
            )
    assert torch.equal(quantization.quantize(x, "e4m3", (1, 128)).dequantized, clean)


def test_score_plant_reaches_the_model(monkeypatch):
    attention = models.Attention(width=64, heads=2, activation="x/1", tokens=8, causal=False)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    clean = attention(x)
    monkeypatch.setattr(models, "attention_scores", lambda q, k: q @ k.transpose(-2, -1))
    assert not torch.allclose(attention(x), clean)


@pytest.mark.slow
def test_calibrate_counts_no_false_alarm_on_unchanged_code(project):
    """The calibration a team runs on its CI runners: rounding perturbations, held-out seeds and
    every baseline seed left out of its ensemble; unchanged code raises no alarm."""
    report = project / "calibration"
    status = cli.main(
        [
            "calibrate",
            "--workers",
            "1",
            "--config",
            str(project / "cases.toml"),
            "--baseline-dir",
            str(project / "baselines"),
            "--report-dir",
            str(report),
            "--rules",
            str(PYPROJECT),
            "--held-out-seeds",
            "100",
        ]
    )
    table = json.loads((report / "calibration.json").read_text())
    assert status == 0, [row for row in table["runs"] if row["status"] != "pass"]
    labels = {(row["case"], row["perturbation"]) for row in table["runs"]}
    for case in ("vit-x-1-fp32", "gpt-softmax-fp8-block"):
        case = next(c for c, _ in labels if c.startswith(case))
        assert {p for c, p in labels if c == case} == {
            *(twin.name for twin in rounding_twins()),
            "seed 100",
            *(f"seed {s} left out" for s in ENSEMBLE_SEEDS),
            *(f"replay, {twin.name} left out of the tolerance" for twin in rounding_twins()),
        }
    assert all(sum(row["false_alarms"].values()) == 0 for row in table["runs"])
    assert set(table["detectable_change"]) == {c for c, _ in labels}
