"""`precision-suite bisect GOOD BAD`: the first commit whose numbers `diff GOOD <commit>` fails,
found by `git bisect run`. GOOD is trained once; each step (`python -m precision_suite.jobs.first_bad_commit
STATE.json`, run by git in the checked-out tree) trains that commit's code and judges it against
GOOD's runs: exit 0 good, 1 bad, 125 skip (the commit cannot run). The steps run a copy of the
precision_suite this command started with (diff.tool_snapshot), never the checked-out tree's.
The starting branch is restored (`git bisect reset`) however the bisect ends."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from precision_suite.files import load_dataset
from precision_suite.jobs import git, results
from precision_suite.jobs.checkouts import (
    Checkout,
    Side,
    SideRuns,
    side_environment,
    side_tree,
    tool_snapshot,
    train_side,
)
from precision_suite.jobs.execution import fresh_interpreter
from precision_suite.jobs.reference import load_project
from precision_suite.jobs.selection import Selection, selected_specs
from precision_suite.jobs.train_specs import cannot_run
from precision_suite.jobs.two_commits import CaseDiff, judge_commits, load_diff_references
from precision_suite.jobs.usage import (
    DEFAULT_BASELINE_DIR,
    DEFAULT_RULES_FILE,
    EXIT_OK,
    EXIT_REGRESSION,
    UsageError,
)
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.judge import blocks

SKIP = 125  # git bisect run: this commit cannot be tested


def bisect_commits(
    good_ref: str,
    bad_ref: str,
    selection: Selection,
    *,
    strict: bool | None = None,
    metric: str | None = None,
    rules_file: str = DEFAULT_RULES_FILE,
    baseline_dir: str = DEFAULT_BASELINE_DIR,
    workers: int | None = None,
) -> int:
    """Find and print the first commit after GOOD whose `diff GOOD` fails (of `metric` only, when
    given; judged as `diff` judges: beyond noise, or any change with `strict`): 1 when found (a
    regression), 0 when BAD itself passes against GOOD."""
    root = git.repo_root()
    good = Side("GOOD", git.resolve_commit(root, good_ref, "GOOD"))
    bad = Side("BAD", git.resolve_commit(root, bad_ref, "BAD"))
    if good.sha == bad.sha:
        raise UsageError(f"GOOD and BAD are the same commit {good.sha[:7]}; give an older GOOD")
    if git.is_dirty(root):
        raise UsageError(
            "the working tree has uncommitted changes and bisect checks other commits out "
            "in it; commit or stash them first (`git status`)"
        )
    if git.is_bisecting(root):
        raise UsageError("a git bisect is already in progress here; end it with `git bisect reset`")
    specs = selected_specs(selection, validate=False)  # read once: every step trains the same specs
    project = load_project(rules_file)
    strict = project.diff_strict if strict is None else strict
    config = Path(selection.config).resolve() if selection.config else None
    with tempfile.TemporaryDirectory(prefix="precision-suite-bisect-") as name, tool_snapshot() as tool:
        folder = Path(name)
        state = {
            "folder": str(folder),
            "specs": [spec.to_json() for spec in specs],
            "metric": metric,
            "workers": workers,
            "strict": strict,
            "rules": rules_file,
            "baseline_dir": baseline_dir,
            "good": good.sha,
            "tool": str(tool),
            "config": str(config) if config else None,
        }
        with side_tree(good, root) as good_tree, side_tree(bad, root) as bad_tree:
            good_code = Checkout(good, root, good_tree, tool, config)
            good_runs = train_side(good_code, specs, folder / "good", workers, baseline_dir)
            compared = _judge(
                state, good_code, Checkout(bad, root, bad_tree, tool, config), good_runs, folder / "bad"
            )
        if not any(blocks(case.verdict) for case in compared):
            print(f"{bad.name} passes against {good.name}: nothing to bisect")
            print("\n".join(line for case in compared for line in case.lines(metric)))
            return EXIT_OK
        _save_step(folder, bad.sha, compared, metric)
        (folder / "state.json").write_text(json.dumps(state))
        first_bad, output = _run_bisect(root, good, bad, tool, folder / "state.json")
        if first_bad is None:
            undecided = [line for line in output.splitlines() if line.strip()][-12:]
            print("could not single out the first bad commit (commits that cannot run were skipped):")
            print("\n".join(undecided))
            return EXIT_REGRESSION
        print(f"first bad commit: {first_bad} {git.subject(root, first_bad)}")
        print((folder / "steps" / f"{first_bad}.txt").read_text().rstrip())
    return EXIT_REGRESSION


def _judge(
    state: dict, good_code: Checkout, code: Checkout, good_runs: SideRuns, out: Path
) -> list[CaseDiff]:
    """`code`'s runs trained into `out` and judged against GOOD's as `diff` judges them."""
    specs = [RunSpec.from_json(text) for text in state["specs"]]
    runs = train_side(code, specs, out, state["workers"], state["baseline_dir"])
    references = load_diff_references(specs, load_project(state["rules"]), state["baseline_dir"])
    compared, _ = judge_commits(
        good_code,
        code,
        specs,
        good_runs,
        runs,
        references,
        out / "judging",
        out / "report",
        "none",
        strict=state["strict"],
        metric=state["metric"],
    )
    return compared


def _run_bisect(root: Path, good: Side, bad: Side, tool: Path, state: Path) -> tuple[str | None, str]:
    """`git bisect run` of the step from BAD back to GOOD: (the first bad commit or None, git's
    output); the starting branch restored afterwards, also on errors and Ctrl-C."""
    started = git.git(root, "bisect", "start", bad.sha, good.sha)
    if started.returncode != 0:
        git.git(root, "bisect", "reset")
        raise UsageError(f"git bisect start {bad.sha[:7]} {good.sha[:7]} failed: {started.stderr.strip()}")
    print(
        f"bisecting from {good.name} to {bad.name}: "
        f"{started.stdout.strip().splitlines()[0] if started.stdout.strip() else ''}",
        file=sys.stderr,
        flush=True,
    )
    try:
        command = [
            "git",
            "bisect",
            "run",
            *fresh_interpreter("precision_suite.jobs.first_bad_commit", str(state)),
        ]
        done = subprocess.run(
            command, cwd=Path.cwd(), env=side_environment(tool, root, root), stdout=subprocess.PIPE, text=True
        )
        if "is the first bad commit" in done.stdout:
            return git.resolve_commit(root, "refs/bisect/bad", "the first bad commit"), done.stdout
        if "only 'skip'ped commits left" in done.stdout:
            return None, done.stdout
        last = (done.stdout.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise UsageError(f"git bisect run stopped without a first bad commit: {last}")
    finally:
        reset = git.git(root, "bisect", "reset")
        if reset.returncode != 0:
            print(
                f"precision-suite: warning: `git bisect reset` failed ({reset.stderr.strip()}); run it "
                "yourself to return to your branch",
                file=sys.stderr,
            )


def _save_step(folder: Path, sha: str, compared: Sequence[CaseDiff], metric: str | None) -> list[str]:
    """The lines `diff` prints for a bad commit, kept for the final message."""
    failing = [case for case in compared if blocks(case.verdict)]
    lines = [line for case in failing for line in case.lines(metric)]
    lines += [
        f"{case.verdict.status.upper():5} {case.case}: {case.verdict.findings[0].message.removeprefix(case.case + ': ')}"
        for case in failing
        if case.verdict.findings
    ]
    (folder / "steps").mkdir(exist_ok=True)
    (folder / "steps" / f"{sha}.txt").write_text("\n".join(lines) + "\n")
    return lines


def step(state_file: str) -> int:
    """One `git bisect run` step on the checked-out commit: 0 good, 1 bad, 125 cannot run."""
    state = json.loads(Path(state_file).read_text())
    folder, metric = Path(state["folder"]), state["metric"]
    root = git.repo_root()
    sha = git.resolve_commit(root, "HEAD", "HEAD")
    label = f"  {sha[:7]} {git.subject(root, sha)}"
    specs = [RunSpec.from_json(text) for text in state["specs"]]
    tool, config = Path(state["tool"]), Path(state["config"]) if state["config"] else None
    good = Side("GOOD", state["good"])
    try:
        with contextlib.redirect_stderr(io.StringIO()), side_tree(good, root) as good_tree:
            # one line per commit, not its training progress
            good_runs = SideRuns(
                {
                    case_id(spec): load_dataset(results.result_path(str(folder / "good"), case_id(spec)))
                    for spec in specs
                },
                {
                    case_id(spec): load_dataset(path)
                    for spec in specs
                    if (path := results.replay_result_path(str(folder / "good"), case_id(spec))).is_file()
                },
            )
            compared = _judge(
                state,
                Checkout(good, root, good_tree, tool, config),
                Checkout(Side("BAD", sha), root, root, tool, config),
                good_runs,
                folder / "steps" / sha,
            )
    except Exception as exc:  # this commit cannot be judged (its code does not run): neither good nor bad
        print(f"{label}: skip, cannot run: {cannot_run(exc)}", file=sys.stderr, flush=True)
        return SKIP
    bad = any(blocks(case.verdict) for case in compared)
    lines = _save_step(folder, sha, compared, metric) if bad else []
    print(
        f"{label}: {'bad' if bad else 'good'}{': ' + lines[0] if lines else ''}", file=sys.stderr, flush=True
    )
    return EXIT_REGRESSION if bad else EXIT_OK


if __name__ == "__main__":
    sys.exit(step(sys.argv[1]))
