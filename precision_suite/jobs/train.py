"""Training a selection with progress on stderr: serially with a live per-step line, or in a pool
of worker processes or on a Dask cluster with a line per finished run (identical numbers either
way). Errors of execution become one-line UsageErrors."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import xarray as xr

from precision_suite.jobs import execution
from precision_suite.jobs.execution import Done, ExecutorError, Task
from precision_suite.jobs.usage import UsageError
from precision_suite.training import replays, runs
from precision_suite.training.runs import RunSpec


@dataclass(frozen=True)
class Placement:
    """Where runs train: `workers` local processes, or the Dask cluster at `scheduler`."""

    workers: int
    scheduler: str | None = None


def placement(workers: int | None, scheduler: str | None) -> Placement:
    """The placement the --workers/--scheduler flags ask for (default: a worker per core)."""
    if scheduler is not None and workers is not None:
        raise UsageError(
            f"--workers {workers} trains in local processes, --scheduler "
            f"{scheduler} on the Dask cluster's workers; give one of them (size "
            "a cluster with `dask worker ADDRESS --nworkers N --nthreads 1`)"
        )
    return Placement(workers or execution.default_workers(), scheduler)


def train_all(specs: Sequence[RunSpec], where: Placement) -> list[xr.Dataset]:
    """Every spec's run: serially with live per-step progress, or in a pool of worker processes
    or on a Dask cluster with a line per finished case (identical numbers either way)."""
    return train_and_replay(specs, {}, where)[0]


def train_and_replay(
    specs: Sequence[RunSpec], stored_replays: Mapping[str, xr.Dataset], where: Placement
) -> tuple[list[xr.Dataset], dict[str, xr.Dataset]]:
    """`train_all`, and each case's replay from its stored state (`stored_replays`, by case id;
    the replay keeps the stored run's seed, the spec's threads and device): (runs, replays by case)."""
    replay_tasks = {
        case: Task(
            replays.replay_spec(spec, stored_replays[case]),
            label=f"{case} replay",
            replay_from=stored_replays[case],
        )
        for spec in specs
        if (case := runs.case_id(spec)) in stored_replays
    }
    if where.scheduler is None and (where.workers == 1 or len(specs) == 1):
        trained = [
            _train(spec, f"[{i}/{len(specs)}] {runs.case_id(spec)}") for i, spec in enumerate(specs, 1)
        ]
        replayed = {case: _replay(task) for case, task in replay_tasks.items()}
        return trained, replayed
    print(
        f"training {len(specs)} case(s) and {len(replay_tasks)} replay(s) {describe(where, len(specs))}",
        file=sys.stderr,
        flush=True,
    )
    results = run_tasks([Task(spec) for spec in specs] + list(replay_tasks.values()), where)
    return results[: len(specs)], dict(zip(replay_tasks, results[len(specs) :]))


def _replay(task: Task) -> xr.Dataset:
    started = time.monotonic()
    try:
        with execution_errors(Placement(1)):
            ds = execution.run_task(task)
    except UsageError as exc:
        raise UsageError(f"{task.label}: {exc}") from None
    print(f"{task.label}: done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return ds


def run_tasks(tasks: Sequence[Task], where: Placement) -> list[xr.Dataset]:
    """`execution.run_tasks` at `where`, a progress line per finished task, errors as UsageErrors."""
    with execution_errors(where):
        return execution.run_tasks(tasks, where.workers, task_progress(len(tasks)), scheduler=where.scheduler)


def describe(where: Placement, n_tasks: int) -> str:
    if where.scheduler is not None:
        return f"on the Dask cluster at {where.scheduler}"
    if where.workers == 1 or n_tasks <= 1:
        return "in this process"
    return f"on {min(where.workers, n_tasks)} worker processes"


@contextmanager
def execution_errors(where: Placement) -> Iterator[None]:
    """Errors of execution.run_tasks as one-line usage errors (status 2)."""
    try:
        yield
    except ExecutorError as exc:  # Dask missing, scheduler unreachable, a worker process died
        raise UsageError(f"--scheduler: {exc}" if where.scheduler else str(exc)) from None
    except ValueError as exc:  # e.g. --device cuda on a machine without CUDA
        raise UsageError(str(exc)) from None


def task_progress(total: int) -> Done:
    """execution.run_tasks' `done` callback: one stderr line per finished task (its label, or its
    case id), counted in the order they finish (a pool finishes them out of order)."""
    finished = [0]

    def done(_index: int, task: Task, seconds: float) -> None:
        finished[0] += 1
        print(
            f"[{finished[0]}/{total}] {task.label or runs.case_id(task.spec)} ({seconds:.0f} s so far)",
            file=sys.stderr,
            flush=True,
        )

    return done


def _train(spec: RunSpec, label: str) -> xr.Dataset:
    """`runs.run(spec)` with progress on stderr (a live line on a terminal, a few lines in CI)."""
    started = time.monotonic()
    print(f"{label}: training", file=sys.stderr, flush=True)
    try:
        ds = runs.run(spec, progress=_progress_printer(label))
    except ValueError as exc:  # e.g. --device cuda on a machine without CUDA
        raise UsageError(f"{label}: {exc}") from None
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"{label}: done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return ds


def _progress_printer(label: str) -> Callable[[int, int, float], None]:
    live = sys.stderr.isatty()
    last_decile = [-1]

    def progress(steps_done: int, total: int, loss: float) -> None:
        line = f"{label}: step {steps_done}/{total}, loss {loss:.4g}"
        if live:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
            return
        decile = (10 * steps_done) // max(total, 1)
        if decile > last_decile[0]:  # about ten lines per case in a CI log
            last_decile[0] = decile
            print(line, file=sys.stderr, flush=True)

    return progress
