"""One side of `diff` and `bisect`: a commit's code checked out (`Checkout`), trained or replayed in
a fresh interpreter running this command's driver (jobs/train_specs.py) with the side's code first
on PYTHONPATH: the user's code and the config's recipe tables come from the commit, and so does
precision_suite itself when the repository holds it; otherwise every side measures with a copy of
the running tool (`tool_snapshot`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import xarray as xr

from precision_suite import files
from precision_suite.jobs import git, results
from precision_suite.jobs.selection import config_recipes
from precision_suite.jobs.train_specs import PROBLEMS, load_twins
from precision_suite.jobs.usage import UsageError
from precision_suite.training.recipe_registry import RECIPES_ENV
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.stored_replays import twin_tolerance
from precision_suite.version import __version__


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a label (BASE, HEAD, GOOD, BAD) and its commit (None: the
    working tree as it is)."""

    label: str
    sha: str | None = None

    @property
    def name(self) -> str:
        return f"{self.label} {self.sha[:7]}" if self.sha else f"{self.label} (working tree)"


@dataclass(frozen=True)
class SideRuns:
    """What one side trained: case -> run, and case -> replay from the state stored beside the
    case's baseline (where it has one)."""

    runs: Mapping[str, xr.Dataset]
    replays: Mapping[str, xr.Dataset] = field(default_factory=dict)


@contextmanager
def tool_snapshot() -> Iterator[Path]:
    """A folder holding a copy of the running precision_suite package, to put first on
    PYTHONPATH: every side (and every bisect step, while git checks other commits out in the
    tree an editable install may point to) measures with the code this command started with,
    unless the side's tree holds a precision_suite of its own (`Checkout`)."""
    with tempfile.TemporaryDirectory(prefix="precision-suite-tool-") as folder:
        shutil.copytree(Path(files.__file__).resolve().parent, Path(folder) / "precision_suite")
        yield Path(folder)


@dataclass(frozen=True)
class Checkout:
    """One side's code: `side` checked out in `tree` (the repository at `root`), the running
    tool's copy in `tool`, and the config file (if any) whose [recipes.NAME] tables the side reads
    from its own commit: everything that defines the numerics comes from the side's commit (the
    user's code, the config's recipe tables, and precision_suite itself when the repository holds
    it), the selection of cases from the command."""

    side: Side
    root: Path
    tree: Path
    tool: Path
    config: Path | None = None

    @property
    def own_suite(self) -> bool:
        """Whether the tree holds a precision_suite package (precision-suite's own repository, or
        a project that vendors it): then its numerics are the commit's, not the tool's."""
        package = self.tree / "precision_suite"
        return all(
            (package / part).is_file()
            for part in (
                "__init__.py",
                "numerics/quantization.py",
                "training/recipes.py",
                "jobs/train_specs.py",
            )
        )

    def describes(self) -> str:
        """Which code the side ran, for the output."""
        tool = (
            "precision-suite from the commit (the repository holds it)"
            if self.own_suite
            else f"this command's precision-suite {__version__}"
        )
        recipes = ", its config's recipe tables" if self.config is not None else ""
        return f"{self.side.name}: the project's code{recipes} and {tool}"

    def environment(self) -> dict[str, str]:
        """os.environ for an interpreter that runs this side: PYTHONPATH the tool's copy (or the
        tree, when it holds precision_suite), the working directory's place in the tree, then the
        existing entries (those inside the repository moved into the tree); the side's recipe
        tables; no bytecode written into the user's tree (git bisect checks files out faster than
        .pyc timestamps can tell)."""
        env = side_environment(self.tool, self.root, self.tree, own_suite=self.own_suite)
        env.pop(RECIPES_ENV, None)
        if self.config is not None:
            config = moved(self.config, self.root, self.tree)
            if config.is_file():
                env.update(config_recipes(config))
        return env

    def command(self, *args: str) -> list[str]:
        """The driver (jobs/train_specs.py) of the running tool, run by its path: its options are
        the ones this command passes, its imports resolve to the side's precision_suite."""
        return [
            sys.executable,
            "-c",
            _RUN_PATH,
            str(self.tool / "precision_suite" / "jobs" / "train_specs.py"),
            *args,
        ]


# runpy.run_path, not -m: the driver is the tool's, the package it imports the side's PYTHONPATH gives
_RUN_PATH = (
    "import runpy, sys; sys.path.pop(0); sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
)


def side_environment(tool: Path, root: Path, tree: Path, own_suite: bool = False) -> dict[str, str]:
    """os.environ for an interpreter that runs `tree`'s code (a checkout of the repository at
    `root`): PYTHONPATH the tool's copy (after the tree, when `own_suite`), the working
    directory's place in `tree`, then the existing entries (those inside the repository moved
    into `tree`); no bytecode written into the user's tree."""
    entries = [str(tree), str(tool)] if own_suite else [str(tool)]
    entries += [str(moved(Path.cwd(), root, tree))]
    entries += [
        str(moved(Path(entry), root, tree))
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry
    ]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(entries)),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def moved(path: Path, root: Path, tree: Path) -> Path:
    try:
        return tree / path.resolve().relative_to(root)
    except ValueError:  # outside the repository: the same path for every side
        return path


@contextmanager
def side_tree(side: Side, root: Path) -> Iterator[Path]:
    """The tree holding `side`'s code: the working tree `root`, or a temporary worktree of its
    commit (removed afterwards)."""
    if side.sha is None:
        yield root
    else:
        with git.worktree(root, side.sha) as tree:
            yield tree


def train_side(
    code: Checkout, specs: Sequence[RunSpec], out: Path, workers: int | None, baseline_dir: str | None = None
) -> SideRuns:
    """Every spec trained with `code` (and replayed from the state stored beside its baseline in
    `baseline_dir`, where it has one), saved in `out` too; UsageError "<side> cannot run: <reason>"."""
    options = [
        *(["--workers", str(workers)] if workers else []),
        *(["--stored-replays", str(Path(baseline_dir).resolve())] if baseline_dir else []),
    ]
    run_side(code, specs, out, f"training {len(specs)} case(s)", *options)
    runs = {case_id(spec): files.load_dataset(results.result_path(str(out), case_id(spec))) for spec in specs}
    replays = {
        case_id(spec): files.load_dataset(path)
        for spec in specs
        if (path := results.replay_result_path(str(out), case_id(spec))).is_file()
    }
    return SideRuns(runs, replays)


def run_side(code: Checkout, specs: Sequence[RunSpec], out: Path, doing: str, *options: str) -> None:
    """The driver on `specs` into `out` with `options`, by `code`, its progress on stderr;
    UsageError "<side> cannot run: <reason>"."""
    out.mkdir(parents=True, exist_ok=True)
    specs_file = out / "specs.json"
    specs_file.write_text(json.dumps([json.loads(spec.to_json()) for spec in specs]))
    cwd = moved(Path.cwd(), code.root, code.tree)
    print(f"{code.side.name}: {doing}", file=sys.stderr, flush=True)
    last = ""
    with subprocess.Popen(
        code.command(str(specs_file), str(out), *options),
        cwd=cwd if cwd.is_dir() else code.tree,
        env=code.environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        try:
            for line in process.stdout:  # progress, then (on failure) the reason as the last line
                print(f"  {code.side.label} | {line.rstrip()}", file=sys.stderr, flush=True)
                last = line.strip() or last
            status = process.wait()
        except BaseException:  # Ctrl-C: stop the side before its worktree goes
            process.kill()
            raise
    if status != 0:
        raise UsageError(f"{code.side.name} cannot run: {last or f'exit status {status}'}")


def first_step_noise(
    code: Checkout, specs: Sequence[RunSpec], runs: Mapping[str, xr.Dataset], out: Path
) -> dict[str, dict[str, float]]:
    """case -> the rounding noise of its first point (verdicts.stored_replays.twin_tolerance),
    from the first step of each spec trained by `code` under every rounding twin."""
    if not specs:
        return {}
    run_side(
        code,
        specs,
        out,
        f"the first step of {len(specs)} case(s) under each rounding twin",
        "--first-step-twins",
    )
    return {
        case_id(spec): twin_tolerance([runs[case_id(spec)]], load_twins(out, case_id(spec))) for spec in specs
    }


def replay_side(
    code: Checkout, specs: Sequence[RunSpec], out: Path, doing: str, *options: str
) -> tuple[dict[str, xr.Dataset], dict[str, str]]:
    """(case -> replay, case -> why it could not run) of `specs` replayed by `code`."""
    try:
        run_side(code, specs, out, doing, *options)
    except UsageError as exc:  # the whole side: every case says why
        return {}, dict.fromkeys(map(case_id, specs), str(exc))
    problems = json.loads((out / PROBLEMS).read_text())
    replays = {
        case_id(spec): files.load_dataset(results.result_path(str(out), case_id(spec)))
        for spec in specs
        if case_id(spec) not in problems
    }
    return replays, {case: f"{code.side.name} cannot replay: {reason}" for case, reason in problems.items()}
