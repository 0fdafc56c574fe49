"""`precision-suite diff BASE [HEAD]`: the pull-request gate. The selection is trained with the
code of commit BASE (a temporary git worktree) and with HEAD's (default: the working tree) on this
host, same specs and seeds, so the two runs are bitwise identical unless the code changed the
numbers. Per case: where each metric first differs, and HEAD judged against BASE as a single-run
reference (the tolerance table, the project's overrides, --fail). `bisect` reuses every step.

Each side trains in a fresh interpreter (jobs/train_specs.py) whose PYTHONPATH starts with a copy
of the running precision_suite, then the side's tree: the user's code comes from the commit, the
measuring tool is the same for both sides (even when the user's project is precision-suite).

A case whose runs first differ at a step t > 0 is then measured cleanly (`measure_cleanly`): BASE's
code keeps its training state before step t (training.replays.keep_state), and BASE's and HEAD's
code each replay the next steps from that one state, in fresh interpreters as above. Their
differences are the change's own, free of what the two runs' earlier steps had already made
different (at t = 0 both runs start from the same state: the free runs' sizes are clean)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite import files
from precision_suite.jobs import git, results
from precision_suite.jobs.checking import finish, judge_case, report_folder
from precision_suite.jobs.reference import Reference, load_project
from precision_suite.jobs.selection import Selection, selected_specs
from precision_suite.jobs.train_specs import PROBLEMS
from precision_suite.jobs.usage import DEFAULT_RULES_FILE, UsageError
from precision_suite.numerics.metric_table import METRICS
from precision_suite.training.replays import replay_steps
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.baseline_files import same_numbers
from precision_suite.verdicts.differences import Difference, first_differences, first_of
from precision_suite.verdicts.findings import CaseVerdict, verdict
from precision_suite.verdicts.tolerances import DEFAULT_TOLERANCES, Tolerance, resolve_tolerances

# `python -m` would put the working directory first on sys.path, ahead of PYTHONPATH: in the
# user's tree, which may hold a precision_suite of its own (or its own `git`, `train`... modules).
_BOOTSTRAP = ("import runpy, sys; sys.path.pop(0); sys.argv.pop(0); "
              "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")

Tolerances = Mapping[str, Tolerance | None]


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
class CaseDiff:
    """One case compared: its differences, earliest first (empty: bitwise identical), and the
    verdict of HEAD judged against BASE."""

    case: str
    differences: tuple[Difference, ...]
    verdict: CaseVerdict

    def lines(self, metric: str | None = None) -> list[str]:
        """What `diff` prints for the case: a headline (about `metric` when given and changed),
        then every other changed metric, indented."""
        first = first_of(self.differences, metric) or first_of(self.differences)
        if first is None:
            return [f"numerics unchanged: {self.case} bitwise identical"]
        when = f" {first.when()}" if first.when() else ""
        return [f"numerics changed: {self.case}{when}: {first.describe()}", *_others(self.differences, first, "    ")]


@dataclass(frozen=True)
class Measurement:
    """A changed case measured cleanly: BASE's and HEAD's code each replayed `steps` steps from
    BASE's state before step `start`; the replays' differences (empty: bitwise identical), or
    `problem`, why they could not run. At `start` 0 nothing is replayed: the runs are clean there."""

    start: int
    steps: int
    differences: tuple[Difference, ...] = ()
    problem: str = ""

    def lines(self, metric: str | None = None) -> list[str]:
        """What `diff` prints under the case's lines: the replays' headline (about `metric` when
        given and changed), then every other metric they changed, indented further."""
        if self.start == 0:
            return ["    measured cleanly from step 0: both runs start from the same state, so their "
                    "differences there are the change's own (no replay)"]
        if self.problem:
            return [f"    no clean measurement from BASE's state at step {self.start}: {self.problem}"]
        replayed = f"step {self.start}" if self.steps == 1 else f"steps {self.start}-{self.start + self.steps - 1}"
        headline = f"    measured from BASE's state at step {self.start} (both codes replay {replayed})"
        first = first_of(self.differences, metric) or first_of(self.differences)
        if first is None:
            return [f"{headline}: bitwise identical; the runs' difference comes from what a replay does not "
                    "carry (an earlier change at a step the probes did not sample, optimizer moments, "
                    "buffers, the process's own state)"]
        when = f"{first.when()}: " if first.step not in (None, self.start) else ""
        return [f"{headline}: {when}{first.describe()}", *_others(self.differences, first, " " * 8)]


def _others(differences: Sequence[Difference], first: Difference, indent: str) -> list[str]:
    """A line per changed metric but `first`, then the raw variables (module sums...) in one."""
    lines = [f"{indent}{d.when() + ': ' if d.when() else ''}{d.describe()}"
             for d in differences if d.metric in METRICS and d is not first]
    raw = [d.metric for d in differences if d.metric not in METRICS and d is not first]
    if raw:
        lines.append(f"{indent}also changed: {', '.join(raw)}")
    return lines


def fresh_interpreter(module: str, *args: str) -> list[str]:
    """The command line of `python -m module args` in a new interpreter of this environment,
    without the working directory on sys.path (PYTHONPATH decides)."""
    return [sys.executable, "-c", _BOOTSTRAP, module, *args]


@contextmanager
def tool_snapshot() -> Iterator[Path]:
    """A folder holding a copy of the running precision_suite package, to put first on
    PYTHONPATH: every side (and every bisect step, while git checks other commits out in the
    tree an editable install may point to) measures with the code this command started with."""
    with tempfile.TemporaryDirectory(prefix="precision-suite-tool-") as folder:
        shutil.copytree(Path(files.__file__).resolve().parent, Path(folder) / "precision_suite")
        yield Path(folder)


def side_environment(tool: Path, root: Path, tree: Path) -> dict[str, str]:
    """os.environ for an interpreter that runs `tree`'s code (a checkout of the repository at
    `root`): PYTHONPATH the tool's copy, the working directory's place in `tree`, then the
    existing entries (those inside the repository moved into `tree`); no bytecode written into
    the user's tree (git bisect checks files out faster than .pyc timestamps can tell)."""
    entries = [str(tool), str(_moved(Path.cwd(), root, tree))]
    entries += [str(_moved(Path(entry), root, tree)) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if entry]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(entries)), "PYTHONDONTWRITEBYTECODE": "1"}


def _moved(path: Path, root: Path, tree: Path) -> Path:
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


def train_at(side: Side, root: Path, specs: Sequence[RunSpec], tool: Path, out: Path,
             workers: int | None) -> dict[str, xr.Dataset]:
    """case -> run of every spec trained with `side`'s code (a temporary worktree of its commit,
    or the working tree), saved in `out` too; UsageError "<side> cannot run: <reason>"."""
    with side_tree(side, root) as tree:
        return _train_tree(side, root, tree, specs, tool, out, workers)


def _train_tree(side: Side, root: Path, tree: Path, specs: Sequence[RunSpec], tool: Path, out: Path,
                workers: int | None) -> dict[str, xr.Dataset]:
    _run_side(side, root, tree, specs, tool, out, f"training {len(specs)} case(s)",
              *(["--workers", str(workers)] if workers else []))
    return {case_id(spec): files.load_dataset(results.result_path(str(out), case_id(spec))) for spec in specs}


def _run_side(side: Side, root: Path, tree: Path, specs: Sequence[RunSpec], tool: Path, out: Path, doing: str,
              *options: str) -> None:
    """`train_specs` of `specs` into `out` with `options`, by `side`'s code (checked out in `tree`),
    its progress on stderr; UsageError "<side> cannot run: <reason>"."""
    out.mkdir(parents=True, exist_ok=True)
    specs_file = out / "specs.json"
    specs_file.write_text(json.dumps([json.loads(spec.to_json()) for spec in specs]))
    command = fresh_interpreter("precision_suite.jobs.train_specs", str(specs_file), str(out), *options)
    cwd = _moved(Path.cwd(), root, tree)
    print(f"{side.name}: {doing}", file=sys.stderr, flush=True)
    last = ""
    with subprocess.Popen(command, cwd=cwd if cwd.is_dir() else tree, env=side_environment(tool, root, tree),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        try:
            for line in process.stdout:  # progress, then (on failure) the reason as the last line
                print(f"  {side.label} | {line.rstrip()}", file=sys.stderr, flush=True)
                last = line.strip() or last
            status = process.wait()
        except BaseException:  # Ctrl-C: stop the side before its worktree goes
            process.kill()
            raise
    if status != 0:
        raise UsageError(f"{side.name} cannot run: {last or f'exit status {status}'}")


def measure_cleanly(base: Side, head: Side, root: Path, trees: tuple[Path, Path], specs: Sequence[RunSpec],
                    compared: Sequence[CaseDiff], tool: Path, folder: Path) -> dict[str, Measurement]:
    """case -> its clean measurement, for every case of `compared` whose runs first differ at a
    step (`trees`: BASE's and HEAD's code). After step 0, BASE's code keeps its state before that
    step and replays from it, then HEAD's code replays from the same state (two interpreters for
    all the cases); a replay that cannot run is the case's `problem`, never an error of the
    command. At step 0 nothing runs: both runs started from the same state."""
    starts = {case.case: first.step for case in compared
              if (first := first_of(case.differences)) is not None and first.step is not None}
    measured = {case: Measurement(0, 0) for case, start in starts.items() if start == 0}
    todo = [spec for spec in specs if starts.get(case_id(spec), 0) > 0]
    if not todo:
        return measured
    base_replays, problems = _replay(base, root, trees[0], todo, tool, folder / "base-replays",
                                     f"keeping the state and replaying {len(todo)} case(s)",
                                     "--keep-state-at", ",".join(str(starts[case_id(spec)]) for spec in todo))
    kept = [spec for spec in todo if case_id(spec) in base_replays]
    head_replays, head_problems = _replay(head, root, trees[1], kept, tool, folder / "head-replays",
                                          f"replaying {len(kept)} case(s) from BASE's state",
                                          "--replay-from", str(folder / "base-replays")) if kept else ({}, {})
    problems.update(head_problems)
    for spec in todo:
        case, start = case_id(spec), starts[case_id(spec)]
        differences = () if case in problems else tuple(first_differences(base_replays[case], head_replays[case]))
        measured[case] = Measurement(start, replay_steps(spec, start), differences, problems.get(case, ""))
    return measured


def _replay(side: Side, root: Path, tree: Path, specs: Sequence[RunSpec], tool: Path, out: Path, doing: str,
            *options: str) -> tuple[dict[str, xr.Dataset], dict[str, str]]:
    """(case -> replay, case -> why it could not run) of `specs` replayed by `side`'s code."""
    try:
        _run_side(side, root, tree, specs, tool, out, doing, *options)
    except UsageError as exc:  # the whole side: every case says why
        return {}, dict.fromkeys(map(case_id, specs), str(exc))
    problems = json.loads((out / PROBLEMS).read_text())
    replays = {case_id(spec): files.load_dataset(results.result_path(str(out), case_id(spec)))
               for spec in specs if case_id(spec) not in problems}
    return replays, {case: f"{side.name} cannot replay: {reason}" for case, reason in problems.items()}


def diff_tolerances(rules_file: str, fail: Sequence[str], metric: str | None = None) -> dict[str, Tolerance | None]:
    """The tolerances HEAD is judged with: the defaults, the project's [tool.precision_suite]
    overrides, then --fail; as a full override table (None: a metric not compared). UsageError
    for a --metric that is not compared."""
    project = load_project(rules_file)
    try:
        table = resolve_tolerances(project.tolerances, results.parse_fail_rules(fail))
    except ValueError as exc:
        raise UsageError(f"tolerances: {exc}") from None
    if metric is not None and metric not in table:
        raise UsageError(f"--metric {metric}: not a compared metric; choose one of {', '.join(table)}")
    return {**dict.fromkeys(DEFAULT_TOLERANCES), **table}


def tolerances_to_json(tolerances: Tolerances) -> dict[str, Any]:
    return {m: None if t is None else dataclasses.asdict(t) for m, t in tolerances.items()}


def tolerances_from_json(table: Mapping[str, Any]) -> dict[str, Tolerance | None]:
    return {m: None if t is None else Tolerance(**t) for m, t in table.items()}


def compare_sides(base: Mapping[str, xr.Dataset], head: Mapping[str, xr.Dataset], specs: Sequence[RunSpec],
                  tolerances: Tolerances, report_dir: Path, charts: str, metric: str | None = None) -> list[CaseDiff]:
    """Every case of `specs`: its differences and HEAD's verdict against BASE (only the findings
    of `metric` when given: `bisect --metric`)."""
    compared = []
    for spec in specs:
        case = case_id(spec)
        differences = () if same_numbers(base[case], head[case]) else tuple(first_differences(base[case], head[case]))
        # HEAD against BASE's run: the change is judged, not the project's thresholds
        against_base = Reference(case, tolerances=(tolerances,), baseline=base[case])
        outcome = judge_case(head[case], against_base, report_dir, charts)
        if metric is not None:
            outcome = verdict(case, [f for f in outcome.findings if f.metric == metric], outcome.charts)
        compared.append(CaseDiff(case, differences, outcome))
    return compared


def diff_commits(base_ref: str, head_ref: str | None, selection: Selection, *, fail: Sequence[str] = (),
                 metric: str | None = None, rules_file: str = DEFAULT_RULES_FILE, report_dir: str | None = None,
                 charts: str = "failing", workers: int | None = None) -> int:
    """Train the selection with BASE's and HEAD's code, print where each case changed, judge HEAD
    against BASE and write the report; the exit status (0 unchanged or within tolerance)."""
    root = git.repo_root()
    base = Side("BASE", git.resolve_commit(root, base_ref, "BASE"))
    head = Side("HEAD", None if head_ref is None else git.resolve_commit(root, head_ref, "HEAD"))
    specs = selected_specs(selection, validate=False)  # each side validates them with its own code
    tolerances = diff_tolerances(rules_file, fail, metric)
    with tempfile.TemporaryDirectory(prefix="precision-suite-diff-") as name, tool_snapshot() as tool, \
            side_tree(base, root) as base_tree, side_tree(head, root) as head_tree:
        folder = Path(name)
        base_runs = _train_tree(base, root, base_tree, specs, tool, folder / "base", workers)
        head_runs = _train_tree(head, root, head_tree, specs, tool, folder / "head", workers)
        out = report_folder(report_dir)
        compared = compare_sides(base_runs, head_runs, specs, tolerances, out, charts, metric)
        measured = measure_cleanly(base, head, root, (base_tree, head_tree), specs, compared, tool, folder)
    print(f"{head.name} against {base.name} ({git.subject(root, base.sha)}):")
    for case in compared:
        print("\n".join(case.lines(metric) + (measured[case.case].lines(metric) if case.case in measured else [])))
    return finish([case.verdict for case in compared], head_runs, out, charts)
