"""The git commands `diff`, `bisect` and `history` need, on the user's project (the repository holding the
working directory), with every failure a one-line UsageError."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from precision_suite.jobs.usage import UsageError


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`git args` in `root`, output captured; the caller reads the return code."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:
        raise UsageError("git is not installed (or not on PATH); diff, bisect and history need it") from None


def repo_root(cwd: Path | None = None) -> Path:
    """The top folder of the git repository holding `cwd` (default: the working directory)."""
    where = Path.cwd() if cwd is None else cwd
    done = git(where, "rev-parse", "--show-toplevel")
    if done.returncode != 0:
        raise UsageError(f"{where} is not inside a git repository; run this from your project's checkout")
    return Path(done.stdout.strip()).resolve()


def resolve_commit(root: Path, ref: str, what: str) -> str:
    """The full SHA of the commit `ref` names (a branch, tag, SHA...); UsageError if none."""
    done = git(root, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
    if done.returncode != 0 or not done.stdout.strip():
        raise UsageError(
            f"{what} {ref!r} is not a commit of the repository {root}; give a branch, "
            "tag or SHA that `git log` shows"
        )
    return done.stdout.strip()


def subject(root: Path, sha: str) -> str:
    """The subject line of commit `sha`."""
    return git(root, "log", "-1", "--format=%s", sha).stdout.strip()


def is_dirty(root: Path) -> bool:
    """Whether tracked files have uncommitted changes (untracked files do not count)."""
    return bool(git(root, "status", "--porcelain", "--untracked-files=no").stdout.strip())


def is_shallow(root: Path) -> bool:
    """Whether the clone lacks history (CI checkouts often fetch one commit)."""
    return git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"


def is_bisecting(root: Path) -> bool:
    return git(root, "bisect", "log").returncode == 0


@contextmanager
def worktree(root: Path, sha: str) -> Iterator[Path]:
    """Commit `sha` checked out (detached) in a temporary worktree of `root`, removed afterwards,
    also on errors and Ctrl-C."""
    folder = Path(tempfile.mkdtemp(prefix="precision-suite-worktree-"))
    tree = folder / "tree"
    try:
        done = git(root, "worktree", "add", "--detach", str(tree), sha)
        if done.returncode != 0:
            raise UsageError(
                f"cannot check out {sha[:12]} in a temporary worktree: {_last_line(done.stderr)}"
            )
        yield tree
    finally:
        if git(root, "worktree", "remove", "--force", str(tree)).returncode != 0 and tree.exists():
            shutil.rmtree(folder, ignore_errors=True)
            git(root, "worktree", "prune")  # forget the worktree whose folder just went
        shutil.rmtree(folder, ignore_errors=True)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def commit_info(root: Path, sha: str) -> dict[str, str | int]:
    """What a history record says of commit `sha`: full SHA, committer time (ISO 8601), subject,
    and its depth: the commits of its first-parent history, itself included (the order of a
    branch's history, where commits made in one second tie on time)."""
    done = git(root, "log", "-1", "--format=%H%x00%cI%x00%s", sha)
    full, time, subject_line = done.stdout.rstrip("\n").split("\x00", 2)
    depth = int(git(root, "rev-list", "--count", "--first-parent", sha).stdout.strip())
    return {"commit": full, "commit_time": time, "subject": subject_line, "commit_depth": depth}


def branch(root: Path) -> str:
    """The checked-out branch ('' on a detached HEAD, as CI jobs often have)."""
    name = git(root, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip()
    return "" if name == "HEAD" else name
