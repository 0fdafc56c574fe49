"""One build of an expensive test project per test run, shared by the pytest-xdist workers.

A session- or module-scoped fixture is built once per worker (`make test` runs two or more):
`built_once` builds it in a folder every worker of the run sees, under a file lock, and the other
workers wait and reuse it. What is built must be read only by the tests that share it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

DONE = ".built"


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run that every xdist worker sees (the workers' base temps' parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` of this run, `build(folder)` called by whichever worker asks first."""
    folder = run_folder(tmp_path_factory) / name
    with FileLock(str(folder) + ".lock"):
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed half done
            folder.mkdir(parents=True)
            build(folder)
            (folder / DONE).touch()
    return folder
