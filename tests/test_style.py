"""The tree passes the linter as pyproject.toml configures it ([tool.ruff.lint]), and that
configuration catches what it is there for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ruff_check(*paths: str | Path) -> subprocess.CompletedProcess:
    """`ruff check` of the venv's ruff (a test dependency) with the project's configuration."""
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                           *map(str, paths)], cwd=ROOT, capture_output=True, text=True)


def test_the_whole_tree_passes_ruff_check():
    done = ruff_check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_configuration_catches_planted_problems(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\nimport sys\n\n\ndef f(items=[]):\n    return [lambda: i for i in items]\n")
    done = ruff_check(planted)
    assert done.returncode == 1
    for code in ("F401", "B006", "B023"):  # an unused import, a mutable default, a closure over a loop variable
        assert code in done.stdout
