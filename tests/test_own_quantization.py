"""The model's own quantization gated end to end, as a user's project meets it: a git repository
holding a torchao float8 model and a hand-written FP8 model (the test modules user_torchao and
user_fp8, copied in), their baselines made at the first commit, and one branch per change. Each
change of the numerics the models' own code computes fails `precision-suite run` against the
baselines and `diff` against the first commit, naming the module; a rename passes both. The two
gates give one verdict on every change: `diff` with the baselines, and `diff` on a case without
one (judged within BASE's rounding twins), as `run` does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from precision_suite import cli

TESTS = Path(__file__).resolve().parent
CASES = '''[[case]]
model = "user_torchao:build"
batches = "user_torchao:batches"
steps = 4
sample_every = 2
width = 32

[[case]]
model = "user_fp8:build"
batches = "user_fp8:batches"
steps = 4
sample_every = 2
width = 32
'''
# branch -> (file, text, replacement): each a change a team makes in its own code
CHANGES = {
    "rename": ("user_torchao.py", "keep_head", "head_in_high_precision"),
    "head-out-of-float8": ("user_torchao.py", '"USER_TORCHAO_HEAD", "fp8"', '"USER_TORCHAO_HEAD", "hp"'),
    "rowwise": ("user_torchao.py", '"USER_TORCHAO_RECIPE", "tensorwise"', '"USER_TORCHAO_RECIPE", "rowwise"'),
    "e4m3-gradients": ("user_fp8.py", '"USER_FP8_GRADIENTS", "e5m2"', '"USER_FP8_GRADIENTS", "e4m3"'),
    "round-toward-zero": ("user_fp8.py", '"USER_FP8_ROUNDING", "nearest"', '"USER_FP8_ROUNDING", "toward_zero"'),
    "residual-half": ("user_torchao.py", '"USER_TORCHAO_RESIDUAL", "1"', '"USER_TORCHAO_RESIDUAL", "0.5"'),
    "attention-1/d": ("user_torchao.py", '"USER_TORCHAO_ATTENTION_SCALE", "1/sqrt(d)"',
                      '"USER_TORCHAO_ATTENTION_SCALE", "1/d"'),
}
MODELS = {branch: "user_fp8:build" if name == "user_fp8.py" else "user_torchao:build"
          for branch, (name, _, _) in CHANGES.items()}
# what the verdict must name: the module and what changed
NAMED = {
    "head-out-of-float8": "head: scaled GEMMs observed 3 -> 0",
    "rowwise": "blocks.0.fc1 fprop operand a: e4m3:tensor (tensor, float32) -> e4m3:row",
    "e4m3-gradients": "dgrad operand a: e5m2:tensor (tensor, float32) -> e4m3:tensor (tensor, float32)",
    "round-toward-zero": "round-to-nearest of their high-precision source at the GEMM's own scale cannot give",
    "residual-half": "",  # a change of model code: no module's quantization changed, the numbers did
    "attention-1/d": "",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def suite(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """`precision-suite ARGS` in a fresh interpreter in `repo` (each checkout's code imported anew)."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return subprocess.run([sys.executable, "-c", "import sys; from precision_suite.cli import main; sys.exit(main())",
                           *args], cwd=repo, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository at its first commit, baselines made there, a branch per change."""
    repo = tmp_path_factory.mktemp("own-quantization") / "project"
    repo.mkdir()
    git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    for key, value in (("user.name", "Tester"), ("user.email", "t@example.com"), ("commit.gpgsign", "false")):
        git(repo, "config", key, value)
    for name in ("user_code.py", "user_torchao.py", "user_fp8.py"):
        shutil.copy(TESTS / name, repo / name)
    (repo / "cases.toml").write_text(CASES)
    (repo / ".gitignore").write_text("__pycache__/\nbaselines/\nreports/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a torchao model and a hand-written FP8 model")
    git(repo, "tag", "base")
    for branch, (name, text, replacement) in CHANGES.items():
        git(repo, "checkout", "-q", "-b", branch, "base")
        source = (repo / name).read_text()
        assert text in source, (branch, text)
        (repo / name).write_text(source.replace(text, replacement))
        git(repo, "commit", "-q", "-am", f"change: {branch}")
    git(repo, "checkout", "-q", "main")
    made = suite(repo, "baseline", "update", "--config", "cases.toml", "--baseline-dir", "baselines")
    assert made.returncode == 0, made.stderr[-3000:]
    return repo


def diff(project: Path, branch: str, *options: str) -> tuple[int, str]:
    """`diff base BRANCH` of the branch's model in this process: (status, summary.json)."""
    report = project / "reports" / f"diff-{branch.replace('/', '-')}{''.join(options).replace('-', '_')}"
    status = cli.main(["diff", "base", branch, "--config", "cases.toml", "--model", MODELS[branch],
                       "--charts", "none", "--report-dir", str(report), "--workers", "1", *options])
    return status, (report / "summary.json").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("branch", list(CHANGES))
def test_each_change_of_the_models_own_numerics_fails_run_and_diff_naming_the_module(project, branch, monkeypatch):
    git(project, "checkout", "-q", branch)
    try:
        judged = suite(project, "run", "--config", "cases.toml", "--baseline-dir", "baselines", "--model",
                       MODELS[branch], "--charts", "none", "--report-dir", str(project / "reports" / branch))
    finally:
        git(project, "checkout", "-q", "main")
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    expected = 0 if branch == "rename" else 1
    assert judged.returncode == expected, judged.stdout + judged.stderr[-2000:]
    status, summary = diff(project, branch)
    assert status == expected, summary[:3000]  # one verdict: the baseline's noise judges both gates
    assert NAMED.get(branch, "") in summary, summary[:3000]
    assert NAMED.get(branch, "") in (project / "reports" / branch / "summary.json").read_text()
    if MODELS[branch] == "user_torchao:build":
        # a case without a baseline: judged within BASE's rounding twins, measured now; same verdict
        status, summary = diff(project, branch, "--baseline-dir", "no-baselines")
        assert status == expected, summary[:3000]
        assert "against BASE's rounding twins" in summary or branch == "rename", summary[:3000]
    if branch == "residual-half":  # and the strict gate fails it, saying so
        status, summary = diff(project, branch, "--strict")
        assert status == 1 and "judged strict: any change of the numbers fails" in summary, summary[:3000]


@pytest.mark.slow
def test_a_rename_leaves_diff_bitwise_identical(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    status = cli.main(["diff", "base", "rename", "--config", "cases.toml", "--charts", "none", "--report-dir",
                       str(project / "reports" / "diff-rename-all"), "--workers", "1"])
    out = capsys.readouterr().out
    assert status == 0 and out.count("bitwise identical") == 2, out


def test_a_recipe_over_the_models_own_quantization_is_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "cases.toml").write_text('[[case]]\nmodel = "user_torchao:build"\nbatches = "user_torchao:batches"\n'
                                         'recipe = "fp8-hybrid"\nsteps = 1\n')
    monkeypatch.chdir(tmp_path)
    status = cli.main(["baseline", "update", "--config", "cases.toml", "--baseline-dir", "b", "--workers", "1"])
    err = capsys.readouterr().err
    assert status == 2 and not (tmp_path / "b").exists()
    assert "would replace the quantization the model's own code does: blocks.0.fc1 is a Float8Linear" in err
    assert len(err.strip().splitlines()[-1]) < 500  # one line, no traceback
