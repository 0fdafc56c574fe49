"""A recipe is data on both sides: the suite's recipe a run trained with (every GEMM operand's
format and layout, every GEMM's accumulation, per module) is stored in the run dataset, hence in
its baseline, and any change of it is a finding naming the GEMM and operand, judged in the one
engine (verdicts/judge.py) that `run`, `diff` and the plugin call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precision_suite import cli
from precision_suite.training.quant_linear import set_recipe
from precision_suite.training.recipe_registry import recipes_from_toml
from precision_suite.training.recorder import instrument
from precision_suite.verdicts.ensemble.build import make_ensemble
from precision_suite.verdicts.judge import judge_case
from precision_suite.verdicts.observed import check_recipes
from test_diff import MODEL, git
from test_own_quantization import suite  # the user's shell: their project, then this checkout

RECIPE = {
    "fprop": {"a": "e4m3:tensor", "b": "e4m3:tensor", "accumulate": "hopper-fast"},
    "dgrad": {"a": "e5m2:tensor", "b": "e4m3:tensor", "accumulate": "hopper-promoted:128"},
    "wgrad": {"a": "e5m2:tensor", "b": "e4m3:tensor", "accumulate": "hopper-promoted:128"},
}
MODULES = ["0", "2"]  # the two linears of the model below


def trained(gemm: str = "", field: str = "", value: str = "", seed: int = 0):
    """One sampled training step of two linear layers under RECIPE (its `gemm` `field` set to `value`)."""
    table = {g: dict(body) for g, body in RECIPE.items()}
    if gemm:
        table[gemm][field] = value
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    set_recipe(model, recipes_from_toml({"my": table}, "test")["my"])
    rec = instrument(model, attention=None)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))
    with rec.step(0):
        F.mse_loss(model(x), torch.zeros(64, 128)).backward()
    ds = rec.dataset(case="my-case", attrs={"spec": f'{{"seed": {seed}}}'})
    rec.remove()
    return ds


def test_the_recipe_each_module_trained_with_is_in_the_dataset():
    ds = trained()
    for module in MODULES:
        assert [str(v) for v in ds["recipe_operand"].sel(module=module).values] == [
            "e4m3:tensor",
            "e4m3:tensor",
            "e5m2:tensor",
            "e4m3:tensor",
            "e5m2:tensor",
            "e4m3:tensor",
        ]
        assert [str(v) for v in ds["recipe_accumulation"].sel(module=module).values] == [
            "hopper-fast",
            "hopper-promoted:128",
            "hopper-promoted:128",
        ]
    # a model without a recipe of the suite's records none
    model = nn.Sequential(nn.Linear(128, 128))
    rec = instrument(model, attention=None)
    with rec.step(0):
        model(torch.randn(64, 128)).sum().backward()
    assert "recipe_operand" not in rec.dataset() and "recipe_accumulation" not in rec.dataset()


def test_a_change_of_a_gemms_accumulation_or_of_an_operands_format_is_a_finding_naming_them():
    base = trained()
    assert check_recipes(trained(), base) == []  # unchanged
    [accumulation] = check_recipes(trained("dgrad", "accumulate", "hopper-promoted:256"), base)
    assert accumulation.kind == "regression" and accumulation.where == {"module": "0", "gemm": "dgrad"}
    assert (
        "0, 2 dgrad accumulation: hopper-promoted:128 -> hopper-promoted:256 in the suite's recipe the run "
        "trained with" in accumulation.message
    ), accumulation.message
    [operand] = check_recipes(trained("wgrad", "a", "e4m3:tensor"), base, "precision-suite baseline update")
    assert operand.where == {"module": "0", "operand": "wgrad.a"}
    assert (
        "0, 2 wgrad operand a: e5m2:tensor -> e4m3:tensor in the suite's recipe the run trained with; if "
        "intended, regenerate the reference: precision-suite baseline update" in operand.message
    ), operand.message


def test_a_reference_that_does_not_record_the_recipe_is_not_compared():
    """A baseline written before the recipe was stored: not recorded, so nothing to compare."""
    old = trained().drop_vars(["recipe_operand", "recipe_accumulation"])
    assert check_recipes(trained("dgrad", "accumulate", "hopper-promoted:256"), old) == []


def test_the_engine_fails_a_recipe_change_against_a_baseline_and_passes_the_unchanged_recipe():
    members = [trained(seed=seed) for seed in (0, 1)]
    baseline = make_ensemble(members, {}, {})
    changed = judge_case(trained("dgrad", "accumulate", "hopper-promoted:256"), baseline)
    assert changed.status == "fail"
    assert any(
        f.metric == "recipe_accumulation"
        and "dgrad accumulation: hopper-promoted:128 -> hopper-promoted:256" in f.message
        for f in changed.findings
    ), [f.message for f in changed.findings]
    unchanged = judge_case(members[0], baseline)
    assert not [f for f in unchanged.findings if f.metric.startswith("recipe_")], unchanged.findings


# --------------------------------------------------------------------------- end to end: run and diff

CASES = """[recipes.my]
source = "a user's recipe for Hopper"
fprop = { a = "e4m3:tensor", b = "e4m3:tensor", accumulate = "hopper-fast" }
dgrad = { a = "e5m2:tensor", b = "e4m3:tensor", accumulate = "hopper-promoted:128" }
wgrad = { a = "e5m2:tensor", b = "e4m3:tensor", accumulate = "hopper-promoted:128" }

[[case]]
model = "toy.model:build"
batches = "toy.model:batch"
recipe = "my"
steps = 4
sample_every = 2
width = 32
"""
# branch -> (the change of the recipe table, what every gate must say)
CHANGES = {
    "dgrad-promoted-256": (
        ('accumulate = "hopper-promoted:128" }\nwgrad', 'accumulate = "hopper-promoted:256" }\nwgrad'),
        "dgrad accumulation: hopper-promoted:128 -> hopper-promoted:256",
    ),
    "wgrad-a-e4m3": (
        ('wgrad = { a = "e5m2:tensor"', 'wgrad = { a = "e4m3:tensor"'),
        "wgrad operand a: e5m2:tensor -> e4m3:tensor",
    ),
}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's repository: the toy model of test_diff and a case trained with a `[recipes.my]`
    table, baselines made at its first commit (tag base), a branch per change of the table."""
    repo = tmp_path_factory.mktemp("recipe-data") / "project"
    (repo / "toy").mkdir(parents=True)
    git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    for key, value in (("user.name", "Tester"), ("user.email", "t@example.com"), ("commit.gpgsign", "false")):
        git(repo, "config", key, value)
    (repo / "toy" / "__init__.py").write_text("")
    (repo / "toy" / "model.py").write_text(MODEL)
    (repo / "cases.toml").write_text(CASES)
    (repo / ".gitignore").write_text("__pycache__/\nbaselines/\nreports/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a toy model trained with the project's recipe")
    git(repo, "tag", "base")
    for branch, ((text, replacement), _) in CHANGES.items():
        git(repo, "checkout", "-q", "-b", branch, "base")
        assert text in CASES, branch
        (repo / "cases.toml").write_text(CASES.replace(text, replacement))
        git(repo, "commit", "-q", "-am", f"recipe: {branch}")
    git(repo, "checkout", "-q", "main")
    made = suite(repo, "baseline", "update", "--config", "cases.toml", "--workers", "1")
    assert made.returncode == 0, made.stderr[-3000:]
    return repo


def test_an_unchanged_recipe_passes_run_with_its_report(project):
    judged = suite(project, "run", "--config", "cases.toml", "--workers", "1")
    assert judged.returncode == 0, judged.stdout[-2000:] + judged.stderr[-2000:]


@pytest.mark.parametrize("branch", list(CHANGES))
def test_a_change_of_the_recipe_table_fails_run_and_diff_naming_the_gemm_and_operand(
    project, branch, monkeypatch
):
    named = CHANGES[branch][1]
    git(project, "checkout", "-q", branch)
    try:
        judged = suite(
            project,
            "run",
            "--config",
            "cases.toml",
            "--workers",
            "1",
            "--report-dir",
            str(project / "reports" / f"run-{branch}"),
        )
    finally:
        git(project, "checkout", "-q", "main")
    assert judged.returncode == 1 and named in judged.stdout, judged.stdout[-3000:] + judged.stderr[-2000:]
    monkeypatch.chdir(project)
    # diff against the baseline (as run judges) and, without one, against BASE's run (once: its
    # rounding twins and clean replay cost most of this test)
    for options in ((), ("--baseline-dir", "no-baselines"))[: 2 if branch == "dgrad-promoted-256" else 1]:
        report = project / "reports" / f"diff-{branch}-{len(options)}"
        status = cli.main(
            [
                "diff",
                "base",
                branch,
                "--config",
                "cases.toml",
                "--workers",
                "1",
                "--report-dir",
                str(report),
                *options,
            ]
        )
        summary = (report / "summary.json").read_text()
        assert status == 1 and named in summary, summary[:3000]
