"""The model's own quantization gated end to end, as a user's project meets it: per client (a model
whose own code quantizes, a test module copied in) a git repository built once per test run, its baselines made at the
first commit `base` by `precision-suite baseline update`, one branch per change, each checked out in
its own worktree. Every gate runs the command as a user types it, default flags (charts on):
`run`, `diff base BRANCH`, `diff --strict`, and the pytest plugin (a test file of the project
calling `precision_check`, run by `pytest`). A change of the numerics the client's code computes
fails every gate naming the module and operand; a rename passes every gate; `run` and `diff` give
one verdict on every row.

The table (client x change x gate: exit status and the finding's text) is printed by each row's
test (`-s`) and collected by `tests/own_stack_table.py`. The clients are data: a new client is one
`Client` entry. Each client's repository is built once per test run, shared by the xdist workers
through a file lock (the build trains the baselines; every row reuses them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from filelock import FileLock

from precision_suite import cli
from shared_build import built_once

TESTS = Path(__file__).resolve().parent
SUITE_ROOT = TESTS.parent
TABLE_ENV = "OWN_STACK_TABLE"


@dataclass(frozen=True)
class Change:
    """A change a team makes in its own code: `text` -> `replacement` in the client's module.
    `named`: what every failing gate's finding must say (the module and operand, and what
    changed); "" for a change of model code, where no module's quantization changed. `passes`: every gate passes (a rename)."""

    text: str
    replacement: str
    named: str = ""
    passes: bool = False


@dataclass(frozen=True)
class Client:
    """A user project: its module (a file of tests/), its case (RunSpec fields, as cases.toml and the
    plugin test name them) and its changes. `no_baseline_gate`: the changes also judged by `diff` on
    a case without a baseline (within BASE's rounding twins, measured now: the costliest gate, so
    on one change of each kind, not on every change)."""

    module: str
    changes: dict[str, Change]
    case: dict = field(default_factory=dict)
    no_baseline_gate: frozenset[str] = frozenset()

    @property
    def fields(self) -> dict:
        name = self.module.removesuffix(".py")
        return {
            "model": f"{name}:build",
            "batches": f"{name}:batches",
            "steps": 4,
            "sample_every": 2,
            "width": 32,
            **self.case,
        }


RENAME = "rename"
CLIENTS = {
    # torchao Float8Linear (convert_to_float8_training), its SDPA in the top module
    "torchao": Client(
        "user_torchao.py",
        changes={
            RENAME: Change("keep_head", "head_in_high_precision", passes=True),
            "which modules quantize": Change(
                '"USER_TORCHAO_HEAD", "fp8"',
                '"USER_TORCHAO_HEAD", "hp"',
                "head: scaled GEMMs observed 3 -> 0",
            ),
            "block layout": Change(
                '"USER_TORCHAO_RECIPE", "tensorwise"',
                '"USER_TORCHAO_RECIPE", "rowwise"',
                "blocks.0.fc1 fprop operand a: e4m3:tensor (tensor, float32, target 1) -> e4m3:row",
            ),
            # changes of model code: no module's quantization changed, the numbers did
            "model code: residual x0.5": Change(
                '"USER_TORCHAO_RESIDUAL", "1"', '"USER_TORCHAO_RESIDUAL", "0.5"'
            ),
            "model code: attention 1/d": Change(
                '"USER_TORCHAO_ATTENTION_SCALE", "1/sqrt(d)"', '"USER_TORCHAO_ATTENTION_SCALE", "1/d"'
            ),
        },
        no_baseline_gate=frozenset({RENAME, "block layout", "model code: residual x0.5"}),
    ),
    # torchao Float8Linear on a decoder LM whose attention is a submodule of each block (as Hugging
    # Face and nanoGPT models have it): observed, probed and attention modules all differ
    "torchao, attention in submodules": Client(
        "user_torchao_attention.py",
        changes={
            RENAME: Change("DecoderLM", "TinyDecoderLM", passes=True),
            "block layout": Change(
                '"USER_TORCHAO_LM_RECIPE", "tensorwise"',
                '"USER_TORCHAO_LM_RECIPE", "rowwise"',
                "blocks.0.attn.qkv fprop operand a: e4m3:tensor (tensor, float32, target 1) -> e4m3:row",
            ),
            "scale kind": Change(
                '"USER_TORCHAO_LM_POW2_SCALES", "0"',
                '"USER_TORCHAO_LM_POW2_SCALES", "1"',
                "blocks.0.attn.qkv fprop operand a: e4m3:tensor (tensor, float32, target 1) -> "
                "e4m3:tensor (tensor, float32 pow2, target 1)",
            ),
        },
    ),
    # a hand-written torch._scaled_mm model (user_fp8.py)
    "_scaled_mm": Client(
        "user_fp8.py",
        changes={
            RENAME: Change("column_major", "to_column_major", passes=True),
            "element format": Change(
                '"USER_FP8_GRADIENTS", "e5m2"',
                '"USER_FP8_GRADIENTS", "e4m3"',
                "dgrad operand a: e5m2:tensor (tensor, float32, target 1) -> e4m3:tensor (tensor, float32, target 1)",
            ),
            "rounding": Change(
                '"USER_FP8_ROUNDING", "nearest"',
                '"USER_FP8_ROUNDING", "toward_zero"',
                "round-to-nearest of their high-precision source at the GEMM's own scale cannot give",
            ),
        },
    ),
}
# the fake-quantization clients: casts dequantized into plain matrix products
FAKE_QUANTIZATION_CLIENTS = {
    # blockwise QDQ in a custom autograd Function, gradients quantized in its backward; attention in
    # a submodule of each block
    "hand-written QDQ": Client(
        "user_qdq.py",
        case={"width": 128},
        changes={
            RENAME: Change("parse_block", "block_shape", passes=True),
            "block layout": Change(
                '"USER_QDQ_WEIGHT_BLOCK", "128x128"',
                '"USER_QDQ_WEIGHT_BLOCK", "1x128"',
                "blocks.0.attn.proj dgrad operand b: e4m3:tensor (tensor, float32, target 1) -> "
                "e4m3:row (1x128, float32, target 1)",
            ),
            "element format": Change(
                '"USER_QDQ_GRADIENTS", "e5m2"',
                '"USER_QDQ_GRADIENTS", "e4m3"',
                "blocks.0.attn.proj dgrad operand a: e5m2:row (1x128, float32, target 1) -> "
                "e4m3:row (1x128, float32, target 1)",
            ),
            "which modules quantize": Change(
                '"USER_QDQ_FP32_MODULES", ""',
                '"USER_QDQ_FP32_MODULES", "head"',
                "head: scaled GEMMs observed 3 -> 0",
            ),
            "scale target": Change(
                '"USER_QDQ_TARGET", "448"',
                '"USER_QDQ_TARGET", "240"',
                "(1x128, float32, target 1) -> e5m2:row (1x128, float32, target 0.54)",
            ),
            "rounding": Change(
                '"USER_QDQ_ROUNDING", "nearest"',
                '"USER_QDQ_ROUNDING", "toward_zero"',
                "round-to-nearest of their high-precision source at the GEMM's own scale cannot give",
            ),
        },
    ),
    # torchao QAT float8 (FakeQuantizedLinear), straight-through backward
    "torchao QAT": Client(
        "user_qat.py",
        case={"width": 128},
        changes={
            RENAME: Change("GRANULARITIES", "SCALE_GRANULARITIES", passes=True),
            "block layout": Change(
                '"USER_QAT_GRANULARITY", "rowwise"',
                '"USER_QAT_GRANULARITY", "tensorwise"',
                "h.0.attn.c_attn dgrad operand b: e4m3:row",
            ),
            "which modules quantize": Change(
                '"USER_QAT_HEAD", "fp8"', '"USER_QAT_HEAD", "hp"', "lm_head: scaled GEMMs observed 3 -> 0"
            ),
        },
    ),
}
ALL_CLIENTS = {**CLIENTS, **FAKE_QUANTIZATION_CLIENTS}
ROWS = [(client, change) for client, c in ALL_CLIENTS.items() for change in c.changes]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def user_environment(repo: Path) -> dict[str, str]:
    """The user's shell: their project importable; nothing of this pytest session (xdist's worker
    variables would tell the inner pytest it is a worker)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "OWN_STACK"))}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(repo), str(SUITE_ROOT), os.environ.get("PYTHONPATH")) if p
    )
    return env


def suite(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """`precision-suite ARGS` typed in `repo`: a fresh interpreter, the checkout's code imported anew."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from precision_suite.cli import main; sys.exit(main())", *args],
        cwd=repo,
        env=user_environment(repo),
        capture_output=True,
        text=True,
    )


def user_pytest(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *args],
        cwd=repo,
        env=user_environment(repo),
        capture_output=True,
        text=True,
    )


def branch_name(change: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in change)


def build(client: Client, repo: Path) -> None:
    """The repository at its first commit, its baselines made there, a branch and a worktree per change."""
    repo.mkdir()
    git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    for key, value in (("user.name", "Tester"), ("user.email", "t@example.com"), ("commit.gpgsign", "false")):
        git(repo, "config", key, value)
    for name in ("user_code.py", client.module):
        shutil.copy(TESTS / name, repo / name)
    toml = "".join(f"{key} = {json.dumps(value)}\n" for key, value in client.fields.items())
    (repo / "cases.toml").write_text("[[case]]\n" + toml)
    (repo / "pytest.ini").write_text("[pytest]\n")  # the rootdir the plugin imports the project from
    (repo / "test_precision.py").write_text(
        "from precision_suite import RunSpec\n\n\n"
        f"def test_model(precision_check):\n    precision_check(RunSpec(**{client.fields!r}))\n"
    )
    (repo / ".gitignore").write_text("__pycache__/\nbaselines/\nreports/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"a model quantized by its own code ({client.module})")
    git(repo, "tag", "base")
    for change_name, change in client.changes.items():
        branch = branch_name(change_name)
        git(repo, "checkout", "-q", "-b", branch, "base")
        source = (repo / client.module).read_text()
        assert change.text in source, (change_name, change.text)
        (repo / client.module).write_text(source.replace(change.text, change.replacement))
        git(repo, "commit", "-q", "-am", f"change: {change_name}")
        git(repo, "checkout", "-q", "main")
        git(repo, "worktree", "add", "-q", str(repo.parent / "branches" / branch), branch)
    made = suite(repo, "baseline", "update", "--config", "cases.toml", "--baseline-dir", "baselines")
    assert made.returncode == 0, made.stderr[-3000:]


def project(tmp_path_factory: pytest.TempPathFactory, client: str) -> Path:
    """The client's repository, built once per test run (the rows write only their own reports)."""
    folder = built_once(
        tmp_path_factory,
        f"own-stack-{branch_name(client)}",
        lambda folder: build(ALL_CLIENTS[client], folder / "project"),
    )
    return folder / "project"


def messages(summary: object) -> list[str]:
    """Every finding's message in a summary.json, in order."""
    if isinstance(summary, dict):
        return [
            m
            for key, value in summary.items()
            for m in ([value] if key == "message" and isinstance(value, str) else messages(value))
        ]
    if isinstance(summary, list):
        return [m for value in summary for m in messages(value)]
    return []


@dataclass
class Gate:
    name: str
    status: int
    text: str  # what the gate printed and wrote: where the finding must be named
    finding: str  # the finding the table shows
    seconds: float


def finding_of(named: str | None, texts: list[str]) -> str:
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    hit = next((line for line in lines if named and named in line), None)
    return (hit or (lines[0] if lines else ""))[:300]


def last_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines()[::-1] if line.strip()), "")[:300]


def gates(client: Client, repo: Path, branch: str, named: str | None) -> list[Gate]:
    """Every gate on the branch, each once, as the user types it."""
    worktree = repo.parent / "branches" / branch
    baselines = str(repo / "baselines")
    reports = repo.parent / "reports" / branch
    diffs = {
        "diff": ["--baseline-dir", baselines],
        "diff --strict": ["--baseline-dir", baselines, "--strict"],
    }
    if branch in map(branch_name, client.no_baseline_gate):
        diffs["diff, no baseline"] = ["--baseline-dir", "no-baselines"]
    commands = [
        ("run", worktree, ["run", "--config", "cases.toml", "--baseline-dir", baselines]),
        *(
            (name, repo, ["diff", "base", branch, "--config", "cases.toml", *options])
            for name, options in diffs.items()
        ),
    ]
    out = [
        command_gate(name, where, [*argv, "--report-dir", str(reports / branch_name(name))], named)
        for name, where, argv in commands
    ]
    started = time.perf_counter()
    done = user_pytest(
        worktree,
        "-q",
        "test_precision.py",
        "--precision-baseline-dir",
        baselines,
        "--precision-report-dir",
        str(reports / "plugin"),
    )
    failures = [line for line in done.stdout.splitlines() if "] " in line]  # "  [regression] ..."
    out.append(
        Gate(
            "plugin",
            done.returncode,
            done.stdout + done.stderr[-3000:],
            finding_of(named, failures) or last_line(done.stdout),
            time.perf_counter() - started,
        )
    )
    return out


def command_gate(name: str, where: Path, argv: list[str], named: str | None) -> Gate:
    started = time.perf_counter()
    done = suite(where, *argv)
    report = Path(argv[argv.index("--report-dir") + 1])
    summary = json.loads((report / "summary.json").read_text()) if (report / "summary.json").exists() else {}
    found = messages(summary)
    text = "\n".join([done.stdout, done.stderr[-3000:], *found])
    identical = [line for line in done.stdout.splitlines() if "bitwise identical" in line]
    finding = (
        finding_of(named, found)
        or finding_of(None, identical)
        or (f"{summary['overall']}: no finding" if summary else last_line(done.stderr))
    )
    gate = Gate(name, done.returncode, text, finding, time.perf_counter() - started)
    return gate


def table_lines(client: str, change: str, results: list[Gate]) -> list[str]:
    def shown(gate: Gate) -> str:
        return gate.finding.replace("|", "/")

    return [
        f"| {client} | {change} | {g.name} | {g.status} | {g.seconds:.0f} | {shown(g)} |" for g in results
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("client", "change"), ROWS, ids=[f"{c}-{branch_name(ch)}" for c, ch in ROWS])
def test_each_change_of_the_clients_own_numerics_fails_every_gate_naming_the_module(
    tmp_path_factory, client, change
):
    spec = ALL_CLIENTS[client].changes[change]
    results = gates(ALL_CLIENTS[client], project(tmp_path_factory, client), branch_name(change), spec.named)
    lines = table_lines(client, change, results)
    print("\n".join(lines))
    if os.environ.get(TABLE_ENV):
        with FileLock(os.environ[TABLE_ENV] + ".lock"), open(os.environ[TABLE_ENV], "a") as table:
            table.write("\n".join(lines) + "\n")
    shown = "\n".join(lines)
    expected = 0 if spec.passes else 1
    # the plugin reports a failed test as pytest's exit status 1 too
    assert [g.status for g in results] == [expected] * len(results), (
        shown
        + "\n\n"
        + "\n\n".join(f"--- {g.name}\n{g.text[-2500:]}" for g in results if g.status != expected)
    )
    for gate in results:
        assert spec.named in gate.text, (
            f"{gate.name} does not name {spec.named!r}\n{shown}\n{gate.text[-2500:]}"
        )
        assert "Traceback" not in gate.text, f"{gate.name}\n{gate.text[-3000:]}"
    by_name = {g.name: g for g in results}
    if spec.passes:  # the same numbers, bit for bit: diff says so
        assert "bitwise identical" in by_name["diff"].text, by_name["diff"].text[-2000:]
    else:
        assert "judged strict: any change of the numbers fails" in by_name["diff --strict"].text, shown
    if "diff, no baseline" in by_name and not spec.passes:
        assert "against BASE's rounding twins" in by_name["diff, no baseline"].text, shown


def test_a_recipe_over_the_models_own_quantization_is_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "cases.toml").write_text(
        '[[case]]\nmodel = "user_torchao:build"\nbatches = "user_torchao:batches"\n'
        'recipe = "fp8-hybrid"\nsteps = 1\n'
    )
    monkeypatch.chdir(tmp_path)
    status = cli.main(
        ["baseline", "update", "--config", "cases.toml", "--baseline-dir", "b", "--workers", "1"]
    )
    err = capsys.readouterr().err
    assert status == 2 and not (tmp_path / "b").exists()
    assert "would replace the quantization the model's own code does: blocks.0.fc1 is a Float8Linear" in err
    assert len(err.strip().splitlines()[-1]) < 500  # one line, no traceback
