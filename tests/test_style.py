"""The tree passes the linter and the formatter as pyproject.toml configures them ([tool.ruff.lint],
[tool.ruff.format]), and the linter's configuration catches what it is there for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ruff(command: str, *paths: str | Path, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`ruff COMMAND` of the venv's ruff (a test dependency) with the project's configuration."""
    config = ("--no-cache", "--config", str(ROOT / "pyproject.toml"))
    return subprocess.run(
        [sys.executable, "-m", "ruff", command, *config, *options, *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def ruff_check(*paths: str | Path) -> subprocess.CompletedProcess:
    return ruff("check", *paths)


def test_the_whole_tree_passes_ruff_check():
    done = ruff_check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_whole_tree_is_formatted_as_ruff_format_writes_it():
    done = ruff("format", ROOT, options=("--check",))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_configuration_catches_planted_problems(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\nimport sys\n\n\ndef f(items=[]):\n    return [lambda: i for i in items]\n")
    done = ruff_check(planted)
    assert done.returncode == 1
    for code in (
        "F401",
        "B006",
        "B023",
    ):  # an unused import, a mutable default, a closure over a loop variable
        assert code in done.stdout
