"""Where runs execute: one function for every command that trains several runs.

`run_tasks(tasks, workers)` trains each `Task` (a RunSpec plus environment variables such as
PRECISION_SUITE_COMPILE=0) serially in this process (workers=1) or in a pool of spawned worker
processes (each pins its own threads through RunSpec.threads). Results come back in task order
and are identical to a serial run: every run seeds its own RNG and pins its thread count.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import xarray as xr

from precision_suite import runs
from precision_suite.runs import RunSpec


@dataclass(frozen=True)
class Task:
    spec: RunSpec
    env: Mapping[str, str] = field(default_factory=dict)
    label: str = ""


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_task(task: Task) -> xr.Dataset:
    with _environment(task.env):
        return runs.run(task.spec)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def run_tasks(tasks: Sequence[Task], workers: int = 1,
              done: Callable[[int, Task, float], None] | None = None) -> list[xr.Dataset]:
    """Train every task; `done(index, task, seconds)` after each one (progress)."""
    import time

    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    results: list[Any] = [None] * len(tasks)
    started = time.monotonic()
    if workers == 1 or len(tasks) <= 1:
        for index, task in enumerate(tasks):
            results[index] = run_task(task)
            if done:
                done(index, task, time.monotonic() - started)
        return results
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context) as pool:
        futures = {pool.submit(run_task, task): index for index, task in enumerate(tasks)}
        for future in concurrent.futures.as_completed(futures):
            index = futures[future]
            results[index] = future.result()
            if done:
                done(index, tasks[index], time.monotonic() - started)
    return results
