"""`precision-suite diff` and `bisect` on a real git repository built here: 8 commits of a user's
package whose commit 5 plants a numerics change from step 2 on (half the hidden features shrink
a millionfold, so FP8 blocks underflow), the others change no number. The plant switches on when
training has moved the weights far enough, so a replay from a training state (which carries the
weights) switches it on as the run does."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from precision_suite import cli
from precision_suite.jobs import two_commits
from precision_suite.jobs.clean_measurement import Measurement
from precision_suite.verdicts.differences import Difference
from test_browser import chromium, rendered

MODEL = '''"""A user's model: one attention block (F.scaled_dot_product_attention) and an MLP."""
import torch
import torch.nn.functional as F
from torch import nn

WIDTH, TOKENS = 32, 8


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        # fc1's seeded weights, on the model's device: how far training moved them counts the steps
        self.register_buffer("seeded", self.fc1.weight.detach().clone(), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v)
        h = torch.relu(self.fc1(x))
        # PLANT
        return x + self.fc2(h)


class Toy(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def build(spec):
    return Toy(spec.width or WIDTH)


def batch(spec, generator):
    x = torch.randn(spec.batch_size or 8, TOKENS, spec.width or WIDTH, generator=generator)
    return x, x[:, 0, :10].argmax(dim=-1)
'''
# AdamW's first step moves each weight by lr = 1e-3, the next ones by about lr at most: the
# weights have moved further than 1.5e-3 from step 2 on, in a run or in a replay from its state
PLANT = """if (self.fc1.weight.detach() - self.seeded).abs().max() > 1.5e-3:  # from step 2 on
            h = torch.cat([h[..., ::2], 1e-6 * h[..., 1::2]], dim=-1)  # half the hidden features shrink a millionfold"""
CASES = """[[case]]
model = "toy.model:build"
batches = "toy.model:batch"
steps = 4
sample_every = 1
width = 32
"""
CONFIG = ["--config", "cases.toml", "--workers", "1"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def make_toy_repo(repo: Path) -> dict[int, str]:
    """The 8 commits (tagged c1..c8, branch main checked out at c8): commit number -> SHA."""
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    git(repo, "config", "user.name", "Toy Tester")
    git(repo, "config", "user.email", "toy@example.com")
    git(repo, "config", "commit.gpgsign", "false")
    (repo / "toy").mkdir()
    (repo / "toy" / "__init__.py").write_text("")
    (repo / ".gitignore").write_text("__pycache__/\n")
    # a project that holds a precision_suite of its own (precision-suite itself, or an editable
    # install of it): every side and bisect step must measure with the running tool, not this one
    (repo / "precision_suite").mkdir()
    (repo / "precision_suite" / "__init__.py").write_text(
        'raise ImportError("the checked-out precision_suite was imported")\n'
    )
    model, readme = repo / "toy" / "model.py", repo / "README.md"
    changes = {
        1: (
            "toy: a one-block attention model, its batches and a tiny case",
            lambda: (
                model.write_text(MODEL),
                readme.write_text("# toy\n"),
                (repo / "cases.toml").write_text(CASES),
            ),
        ),
        2: (
            "README: how to run the case",
            lambda: readme.write_text("# toy\n\nprecision-suite run --config cases.toml\n"),
        ),
        3: (
            "toy: say what Block counts",
            lambda: model.write_text(
                MODEL.replace("counts the steps", "counts the steps (AdamW moves each by about lr a step)")
            ),
        ),
        4: (
            "README: the config",
            lambda: readme.write_text(readme.read_text() + "\ncases.toml holds one case.\n"),
        ),
        5: (
            "toy: shrink half the hidden features from step 2",
            lambda: model.write_text(model.read_text().replace("# PLANT", PLANT)),
        ),
        6: ("README: changelog", lambda: readme.write_text(readme.read_text() + "\n## changes\n")),
        7: (
            "toy: a comment on the head",
            lambda: model.write_text(
                model.read_text().replace(
                    "self.head = nn.Linear(width, 10)", "self.head = nn.Linear(width, 10)  # ten classes"
                )
            ),
        ),
        8: ("README: the model", lambda: readme.write_text(readme.read_text() + "\nOne attention block.\n")),
    }
    shas = {}
    for number, (subject, change) in changes.items():
        change()
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", subject)
        git(repo, "tag", f"c{number}")
        shas[number] = git(repo, "rev-parse", "HEAD")
    return shas


@pytest.fixture
def toy_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[int, str]]:
    repo = tmp_path / "toy-project"
    shas = make_toy_repo(repo)
    monkeypatch.chdir(repo)
    return repo, shas


def worktrees(repo: Path) -> list[str]:
    return git(repo, "worktree", "list").splitlines()


@pytest.fixture
def interpreters(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """The options of every `train_specs` interpreter diff starts, in order."""
    started: list[tuple[str, ...]] = []
    command = two_commits.Checkout.command

    def counted(self: two_commits.Checkout, *args: str) -> list[str]:
        started.append(args[2:])  # after SPECS.json and OUT
        return command(self, *args)

    monkeypatch.setattr(two_commits.Checkout, "command", counted)
    return started


def test_diff_names_the_first_step_a_planted_change_differs(toy_repo, tmp_path, capsys, interpreters):
    repo, shas = toy_repo
    report = tmp_path / "report"
    assert cli.main(["diff", "c4", "c5", *CONFIG, "--report-dir", str(report)]) == 1
    out = capsys.readouterr().out
    headline = next(line for line in out.splitlines() if line.startswith("numerics changed:"))
    # the plant acts once two steps have moved the weights: step 2 is the first that differs
    assert " from step 2: " in headline, out
    assert "layer 0" in out and "underflow" in out
    assert "FAIL" in out
    # measured cleanly: BASE keeps its state before step 2 and replays, HEAD replays from that state
    # the case has no baseline: BASE's first step under each rounding twin, then its replay's twins
    assert [options[0] for options in interpreters] == [
        "--workers",
        "--workers",
        "--first-step-twins",
        "--keep-state-at",
        "--replay-from",
    ]
    assert interpreters[3] == ("--keep-state-at", "2", "--twins")
    measured = next(line for line in out.splitlines() if line.startswith("    measured from"))
    assert measured.startswith(
        "    measured from BASE's state at step 2 (both codes replay steps 2-3): "
        "underflow at layer 0, tensor activation, layout 1x128: 0 -> 0."
    ), out
    assert "(+0." in measured  # the plant's underflow, not zero
    summary = json.loads((report / "summary.json").read_text())
    assert [case["status"] for case in summary["cases"]] == ["fail"]
    # the change shows in the clean replay: its chart draws HEAD's replay against BASE's
    assert (report / "index.html").is_file() and list((report / "charts").glob("*-drift-replay.png"))
    assert len(worktrees(repo)) == 1  # the temporary worktrees are gone
    # the report's first screen, as Chromium shows it, names both commits and what judged them
    context = [
        line.split(" ", 2)[1:]
        for line in rendered(chromium(), report, tmp_path)
        if line.startswith("context ")
    ]
    assert all(where == "yes" for where, _ in context), context
    named = next(text for _, text in context)
    assert (
        named == f"HEAD {shas[5][:7]} (toy: shrink half the hidden features from step 2) against "
        f"BASE {shas[4][:7]} (README: the config)"
    ), context
    assert any(text.startswith("judged beyond noise: ") for _, text in context), context


def test_diff_without_a_numeric_change_is_bitwise_identical(toy_repo, tmp_path, capsys, interpreters):
    repo, _ = toy_repo
    assert cli.main(["diff", "c2", "c3", *CONFIG, "--report-dir", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "numerics unchanged: toy.model-build-softmax-own-" in out and "bitwise identical" in out
    assert len(interpreters) == 2 and "measured" not in out  # nothing to replay
    assert len(worktrees(repo)) == 1


def test_a_replay_that_cannot_run_is_one_line_and_the_diff_goes_on(toy_repo, tmp_path, capsys):
    repo, _ = toy_repo
    # HEAD: the plant, and a parameter BASE's state lacks (zeros: the seeded weights stay as they were)
    model = repo / "toy" / "model.py"
    model.write_text(
        git(repo, "show", "c5:toy/model.py").replace(
            "self.head = nn.Linear(width, 10)",
            "self.head = nn.Linear(width, 10)\n        self.spare = nn.Parameter(torch.zeros(3))",
        )
    )
    assert cli.main(["diff", "c4", *CONFIG, "--report-dir", str(tmp_path / "report")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("numerics changed:") and " from step 2: " in line for line in out)
    problem = [line for line in out if line.startswith("    no clean measurement")]
    assert len(problem) == 1 and problem[0].startswith(
        "    no clean measurement from BASE's state at step 2: HEAD (working tree) cannot replay: "
    ), out
    assert "parameters of another model" in problem[0] and "spare (3,) only in the model" in problem[0]
    # without a clean measurement the change cannot be judged beyond noise: it fails, saying why
    error = [line for line in out if line.startswith("ERROR ")]
    assert (
        len(error) == 1
        and "numerics changed from step 2 and cannot be judged beyond noise without a "
        "clean measurement (HEAD (working tree) cannot replay: "
        in error[0]
    ), out
    assert len(worktrees(repo)) == 1


def test_bisect_names_commit_5_and_restores_the_branch(toy_repo, capsys):
    repo, shas = toy_repo
    assert cli.main(["bisect", "c1", "c8", *CONFIG]) == 1
    captured = capsys.readouterr()
    assert f"first bad commit: {shas[5]} toy: shrink half the hidden features from step 2" in captured.out
    assert " from step 2: " in captured.out.split("first bad commit:")[1]
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert git(repo, "rev-parse", "HEAD") == shas[8]
    assert git(repo, "status", "--porcelain") == ""
    assert subprocess.run(["git", "bisect", "log"], cwd=repo, capture_output=True).returncode != 0
    assert len(worktrees(repo)) == 1


def test_bisect_refuses_a_dirty_tree(toy_repo, capsys):
    repo, shas = toy_repo
    (repo / "README.md").write_text("local edit\n")
    assert cli.main(["bisect", "c1", "c8", *CONFIG]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "uncommitted changes" in err
    assert (repo / "README.md").read_text() == "local edit\n"
    assert (
        git(repo, "rev-parse", "HEAD") == shas[8] and git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    )
    assert subprocess.run(["git", "bisect", "log"], cwd=repo, capture_output=True).returncode != 0


def test_a_sha_not_in_the_repository_is_one_line(toy_repo, tmp_path, capsys):
    repo, _ = toy_repo
    report = tmp_path / "report"
    assert (
        cli.main(["diff", "0123456789abcdef0123456789abcdef01234567", *CONFIG, "--report-dir", str(report)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err.splitlines() == [err] and "BASE '0123456789abcdef0123456789abcdef01234567' is not a commit" in err
    )
    assert not report.exists() and len(worktrees(repo)) == 1


def test_a_side_that_cannot_run_names_its_commit(toy_repo, tmp_path, capsys):
    repo, shas = toy_repo
    (repo / "toy" / "model.py").write_text("def build(spec)\n")  # uncommitted, broken
    assert cli.main(["diff", "c8", *CONFIG, "--report-dir", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("precision-suite: error: HEAD (working tree) cannot run: "), err[-1]
    assert "SyntaxError: expected ':' (model.py, line 1)" in err[-1]
    assert len(worktrees(repo)) == 1


def test_outside_a_repository_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["diff", "HEAD", *CONFIG]) == 2
    assert "is not inside a git repository" in capsys.readouterr().err


def test_bisect_with_a_metric_that_did_not_move_has_nothing_to_bisect(toy_repo, capsys):
    repo, shas = toy_repo
    # the plant shrinks hidden features: the values stay far from the FP8 range, overflow stays 0
    assert cli.main(["bisect", "c1", "c8", *CONFIG, "--metric", "overflow"]) == 0
    out = capsys.readouterr().out
    assert f"BAD {shas[8][:7]} passes against GOOD {shas[1][:7]}: nothing to bisect" in out
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"


def test_a_clean_measurement_says_what_it_replayed_or_why_not():
    underflow = Difference("underflow", 3, {"layer": 0}, 0.0, 0.5, 1)
    loss = Difference("loss", 4, {}, 2.0, 2.5, 1)
    assert Measurement(3, 2, (underflow, loss)).lines() == [
        "    measured from BASE's state at step 3 (both codes replay steps 3-4): "
        "underflow at layer 0: 0 -> 0.5 (+0.5; 1 value differs)",
        "        from step 4: loss: 2 -> 2.5 (+0.5, x1.25; 1 value differs)",
    ]
    assert (
        Measurement(3, 1, (loss,))
        .lines()[0]
        .endswith("(both codes replay step 3): from step 4: loss: 2 -> 2.5 (+0.5, x1.25; 1 value differs)")
    )
    assert "replay steps 3-4): bitwise identical; " in Measurement(3, 2).lines()[0]
    assert Measurement(3, 2, problem="HEAD cannot replay: why").lines() == [
        "    no clean measurement from BASE's state at step 3: HEAD cannot replay: why"
    ]
    assert "(no replay)" in Measurement(0, 0).lines()[0]


def test_first_differences_finds_the_first_step_and_the_largest_cell():
    import numpy as np
    import xarray as xr

    from precision_suite.verdicts.differences import first_differences

    values = np.zeros((4, 2, 3))
    base = xr.Dataset(
        {"underflow": (("step", "layer", "layout"), values), "loss": (("train_step",), np.ones(4))},
        coords={
            "step": [0, 1, 2, 3],
            "layer": [0, 1],
            "layout": ["1x128", "128x1", "tensor"],
            "train_step": np.arange(4),
        },
    )
    head = base.copy(deep=True)
    head["underflow"][2, 1, 0] = 0.5
    head["underflow"][2, 0, 2] = 0.1
    head["underflow"][3, 0, 0] = np.nan
    head["loss"][3] = 2.0
    first, loss = first_differences(base, head)
    assert (first.metric, first.step, first.where, first.head, first.cells) == (
        "underflow",
        2,
        {"layer": 1, "layout": "1x128"},
        0.5,
        2,
    )
    assert (loss.metric, loss.step, loss.where) == ("loss", 3, {})
    assert first_differences(base, base.copy(deep=True)) == []


OWN_CASES = """[recipes.mine]
source = "the project's own recipe"
fprop = { a = "e4m3:1x128", b = "e4m3:128x128" }
dgrad = { a = "e5m2:1x128", b = "e4m3:128x128" }
wgrad = { a = "e5m2:128x1", b = "e4m3:128x1" }

[[case]]
model = "toy.model:build"
batches = "toy.model:batch"
recipe = "mine"
steps = 2
sample_every = 1
width = 32
"""
# appended to the copied quantization.py, so the plant holds whatever the function's body looks like
# (it is rebound at import, before any module takes the name): every amax rule's scale x4
SCALE_X4 = """

_unplanted_block_scales = block_scales


def block_scales(amax, fmt, pow2_scale=False):
    scale = _unplanted_block_scales(amax, fmt, pow2_scale)
    return scale * 4 if fmt.scale_rule == "amax" else scale
"""


def test_each_side_measures_with_its_own_commits_recipe_tables_and_suite(tmp_path, monkeypatch, capsys):
    """A repository that holds precision_suite itself (as precision-suite's own does): a change of a
    `[recipes.NAME]` table in the config, and a change of the suite's quantizer (every amax scale
    x4, so FP8 blocks underflow), each shows in `diff` across its commit, and the output says
    which code each side ran."""
    repo = tmp_path / "own-suite"
    repo.mkdir()
    git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    for key, value in (("user.name", "Tester"), ("user.email", "t@example.com"), ("commit.gpgsign", "false")):
        git(repo, "config", key, value)
    shutil.copytree(
        Path(two_commits.__file__).resolve().parents[1],
        repo / "precision_suite",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (repo / "toy").mkdir()
    (repo / "toy" / "__init__.py").write_text("")
    (repo / "toy" / "model.py").write_text(MODEL)
    (repo / "cases.toml").write_text(OWN_CASES)
    (repo / ".gitignore").write_text("__pycache__/\n")
    quantization = repo / "precision_suite" / "numerics" / "quantization.py"
    for subject, change in (
        ("the project's recipe, the suite in the repository", lambda: None),
        (
            "recipe: e4m3 weight gradients' activations",
            lambda: (repo / "cases.toml").write_text(
                OWN_CASES.replace('wgrad = { a = "e5m2:128x1"', 'wgrad = { a = "e4m3:128x1"')
            ),
        ),
        (
            "quantization: every amax scale x4",
            lambda: quantization.write_text(quantization.read_text() + SCALE_X4),
        ),
        ("README", lambda: (repo / "README.md").write_text("# the project\n")),
    ):
        change()
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", subject)
    monkeypatch.chdir(repo)
    config = ["--config", "cases.toml", "--workers", "1", "--charts", "none", "--strict"]
    for base, head in (("HEAD~3", "HEAD~2"), ("HEAD~2", "HEAD~1")):  # the recipe table, then the suite
        assert cli.main(["diff", base, head, *config, "--report-dir", str(tmp_path / head)]) == 1
        out = capsys.readouterr().out
        assert "numerics changed: toy.model-build-" in out and "bitwise identical" not in out, out
        assert (
            f"BASE {git(repo, 'rev-parse', '--short=7', base)}: the project's code, its config's recipe "
            "tables and precision-suite from the commit (the repository holds it)" in out
        ), out
    assert cli.main(["diff", "HEAD~1", "HEAD", *config, "--report-dir", str(tmp_path / "readme")]) == 0
    assert "bitwise identical" in capsys.readouterr().out
