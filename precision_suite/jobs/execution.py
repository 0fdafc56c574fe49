"""Where runs execute: one function for every command that trains several runs.

`run_tasks(tasks, workers, scheduler=...)` trains each `Task` (a RunSpec plus environment variables
such as PRECISION_SUITE_COMPILE=0; a variable that a library reads once, when it starts, such as
ATEN_CPU_CAPABILITY, makes its run go to a fresh interpreter) serially in this process
(workers=1), in a pool of spawned
worker processes, or, given the address of a Dask scheduler (`tcp://HOST:PORT`, the optional
`dask` extra), as one Dask task each on that cluster's workers. In a pool or on Dask the runs
estimated longest start first (`longest_first`). Results come back in task order and are
identical to a serial run on the same machine: every run seeds its own RNG and pins its thread
count, wherever it executes.

This module imports neither torch nor Dask at import time, so the command line can check a
scheduler address while it parses its arguments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from precision_suite.files import load_dataset, save_dataset
from precision_suite.jobs.usage import EXIT_USAGE

if TYPE_CHECKING:
    import xarray as xr

    from precision_suite.training.runs import RunSpec

DASK_INSTALL_HINT = 'pip install "precision-suite[dask]"'
CONNECT_TIMEOUT_S = 5.0  # a scheduler answers in milliseconds; an address that is wrong never does
_SCHEDULER_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})")

Done = Callable[[int, "Task", float], None]
FORWARDED_ENV_PREFIX = "PRECISION_SUITE_"
# Read by ATen, MKL, oneDNN or OpenMP once, when they load: a run that sets one needs a process of
# its own, since setting it around a run in a process that has loaded torch changes nothing.
PROCESS_START_ENV = frozenset(
    {"ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS"}
)


@dataclass(frozen=True)
class Task:
    """One run: its spec, environment variables set around it, and what progress lines call it
    (default: its case id). `replay_from`: a stored training state to replay the spec's last steps
    from (training.replays) instead of training the whole run; `keep_state`: the run's dataset
    carries the state its replays start from (baseline regeneration)."""

    spec: RunSpec
    env: Mapping[str, str] = field(default_factory=dict)
    label: str = ""
    replay_from: xr.Dataset | None = field(default=None, repr=False, compare=False)
    keep_state: bool = False
    replay_at: int | None = None  # the step a kept state was kept before (None: a stored baseline's)


class ExecutorError(RuntimeError):
    """The runs could not be executed: Dask missing, no scheduler at the address, workers lost."""


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
    if PROCESS_START_ENV & set(task.env):
        return run_in_fresh_process(task)
    with _environment(task.env):
        return train_here(task)


def train_here(task: Task) -> xr.Dataset:
    """`task`'s run (or replay) in this process, in the environment it finds."""
    from precision_suite.training import replays, runs  # lazy: torch loads with a run, not with --help

    if task.replay_from is not None:
        return replays.replay(task.spec, task.replay_from, task.replay_at)
    if task.keep_state:
        return replays.run_keeping_state(task.spec)
    return runs.run(task.spec)


# `python -m` would put the working directory first on sys.path, ahead of PYTHONPATH: in a
# commit's checkout under `diff`, which may hold a precision_suite of its own (or its own `git`,
# `train`... modules).
_BOOTSTRAP = (
    "import runpy, sys; sys.path.pop(0); sys.argv.pop(0); "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def fresh_interpreter(module: str, *args: str) -> list[str]:
    """The command line of `python -m module args` in a new interpreter of this environment,
    without the working directory on sys.path (PYTHONPATH decides)."""
    return [sys.executable, "-c", _BOOTSTRAP, module, *args]


def run_in_fresh_process(task: Task) -> xr.Dataset:
    """`task` trained by a new interpreter (`python -m precision_suite.jobs.fresh_run`) started
    with the task's environment; its dataset (and a replay's state) go through netCDF files."""
    with tempfile.TemporaryDirectory(prefix="precision-suite-run-") as folder:
        out = Path(folder) / "run.nc"
        command = fresh_interpreter("precision_suite.jobs.fresh_run", str(out))
        if task.replay_from is not None:
            command += [
                "--replay",
                str(save_dataset(task.replay_from, Path(folder) / "state.nc", compress=False)),
            ]
        if task.keep_state:
            command.append("--keep-state")
        if task.replay_at is not None:
            command += ["--replay-at", str(task.replay_at)]
        # the working directory stays importable (the user's model packages), after PYTHONPATH
        path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH", ""), os.getcwd()]))
        done = subprocess.run(
            command,
            input=task.spec.to_json(),
            text=True,
            capture_output=True,
            env={**os.environ, "PYTHONPATH": path, **task.env},
        )
        if done.returncode == EXIT_USAGE:  # a bad spec: the same error as in this process
            raise ValueError(done.stderr.strip())
        if done.returncode != 0:
            settings = " ".join(f"{k}={v}" for k, v in task.env.items())
            raise RuntimeError(
                f"the run of {task.label or task.spec} in a fresh process ({settings}) "
                f"failed: {done.stderr.strip()[-2000:]}"
            )
        return load_dataset(out)


# A run sets process-wide state (torch's thread count, os.environ), so a Dask worker started with
# several threads must still train one run at a time to give the numbers of a serial run.
_ONE_RUN_AT_A_TIME = threading.Lock()


def run_task_exclusively(task: Task) -> xr.Dataset:
    """`run_task`, one at a time per process: what each Dask task calls on its worker."""
    with _ONE_RUN_AT_A_TIME:
        return run_task(task)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def scheduler_address(text: str) -> str:
    """`text` if it is a Dask scheduler address `tcp://HOST:PORT`; ValueError saying how to write one."""
    match = _SCHEDULER_ADDRESS.fullmatch(text)
    if match is None or not 1 <= int(match[2]) <= 65535:
        raise ValueError(
            f"{text!r} is not a Dask scheduler address; write tcp://HOST:PORT as "
            "`dask scheduler` prints it, e.g. tcp://10.0.0.5:8786"
        )
    return text


def run_tasks(
    tasks: Sequence[Task], workers: int = 1, done: Done | None = None, *, scheduler: str | None = None
) -> list[xr.Dataset]:
    """Train every task and return the datasets in task order; `done(index, task, seconds)` after
    each one, in the order they finish (progress).

    `scheduler` (`tcp://HOST:PORT`) sends each task to that Dask cluster and `workers` is unused;
    otherwise `workers` > 1 trains in a pool of that many local processes. ExecutorError when the
    cluster cannot be reached or a worker process dies, ValueError for a bad argument.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    started = time.monotonic()
    if scheduler is not None:
        return _run_on_dask(tasks, scheduler_address(scheduler), done, started)
    if workers == 1 or len(tasks) <= 1:
        results = []
        for index, task in enumerate(tasks):
            results.append(run_task(task))
            if done:
                done(index, task, time.monotonic() - started)
        return results
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context) as pool:
        futures = {pool.submit(run_task, tasks[index]): index for index in longest_first(tasks)}
        return _gather(
            tasks, futures, concurrent.futures.as_completed(futures), done, started, lost=(BrokenProcessPool,)
        )


def longest_first(tasks: Sequence[Task]) -> list[int]:
    """The indexes of `tasks` in the order to start them: estimated longest first
    (`RunSpec.relative_work`), ties in task order. A long run started last would train alone at
    the end while the other workers idle. A spec too broken to estimate goes first, so that its
    run fails at once with the validation's own message."""

    def work(task: Task) -> float:
        try:
            return task.spec.relative_work()
        except (ValueError, TypeError):
            return math.inf

    estimates = [work(task) for task in tasks]
    return sorted(range(len(tasks)), key=lambda index: -estimates[index])


def _gather(
    tasks: Sequence[Task],
    futures: Mapping[Any, int],
    finished: Iterable[Any],
    done: Done | None,
    started: float,
    lost: tuple[type[BaseException], ...],
) -> list[Any]:
    """The results of `futures` (future -> task index) in task order, taken as `finished` yields
    them (a pool's or Dask's as_completed); `lost`: the errors meaning that a worker process or
    the scheduler went away with the run."""
    from precision_suite.training.runs import case_id  # lazy: torch loads with a run, not with --help

    results: list[Any] = [None] * len(tasks)
    for future in finished:
        index = futures[future]
        try:
            results[index] = future.result()
        except lost as exc:
            task = tasks[index]
            detail = " ".join(str(exc).split())  # Dask's messages run over several lines
            raise ExecutorError(
                f"lost the run of {task.label or case_id(task.spec)}"
                + f" ({type(exc).__name__}: {detail}); look for the cause (a worker out "
                "of memory? the scheduler stopped?) in the logs of the workers"
            ) from exc
        if done:
            done(index, tasks[index], time.monotonic() - started)
    return results


def _with_local_settings(task: Task) -> Task:
    """`task` carrying this process's PRECISION_SUITE_* settings (user recipes, COMPILE=0), which a
    remote worker does not see otherwise; the task's own env wins."""
    forwarded = {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV_PREFIX)}
    return dataclasses.replace(task, env={**forwarded, **task.env})


def _run_on_dask(tasks: Sequence[Task], address: str, done: Done | None, started: float) -> list[Any]:
    try:
        import distributed
    except ImportError as exc:
        raise ExecutorError(
            f"running on a Dask cluster needs dask.distributed, which is not "
            f"installed ({exc}); install it with: {DASK_INSTALL_HINT}"
        ) from None
    _check_scheduler(address)
    try:
        client = distributed.Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, asyncio.TimeoutError) as exc:
        raise ExecutorError(_unreachable(address, exc)) from None
    with client:
        try:
            client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            raise ExecutorError(
                f"the Dask scheduler at {address} has no workers; start some with "
                f"`dask worker {address} --nthreads 1`"
            ) from None
        # pure=False: two equal tasks are two runs. The scheduler gives a lost worker's tasks to
        # other workers, up to distributed.scheduler.allowed-failures times, then KilledWorker;
        # a lost scheduler cancels every future.
        # the scheduler runs higher priorities first (and, among equal ones, the earlier submitted)
        order = longest_first(tasks)
        futures = {
            client.submit(
                run_task_exclusively,
                _with_local_settings(tasks[index]),
                pure=False,
                priority=len(order) - rank,
            ): index
            for rank, index in enumerate(order)
        }
        finished = distributed.as_completed(futures, loop=client.loop)  # not the default client's
        return _gather(
            tasks,
            futures,
            finished,
            done,
            started,
            lost=(distributed.KilledWorker, distributed.CancelledError),
        )


def _check_scheduler(address: str) -> None:
    """Ask `address` who it is, within CONNECT_TIMEOUT_S. distributed.Client would wait forever on
    a server that accepts connections and never answers, and fail with odd errors (a MemoryError)
    on one that speaks another protocol."""
    from distributed.core import rpc

    async def identity() -> dict:
        async with rpc(address, timeout=CONNECT_TIMEOUT_S) as server:
            return await server.identity()

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as thread:  # an event loop of its own, whatever
            info = thread.submit(  # loop the caller's thread runs
                asyncio.run, asyncio.wait_for(identity(), CONNECT_TIMEOUT_S)
            ).result()
    except (OSError, asyncio.TimeoutError) as exc:
        raise ExecutorError(_unreachable(address, exc)) from None
    except Exception as exc:  # whatever a server of another protocol makes the Dask comm raise
        raise ExecutorError(
            f"the server at {address} does not answer as a Dask scheduler "
            f"({type(exc).__name__}: {exc}); give the address `dask scheduler` "
            "prints"
        ) from None
    if info.get("type") != "Scheduler":
        raise ExecutorError(
            f"{address} is a Dask {info.get('type', 'server')}, not a scheduler; "
            "give the address `dask scheduler` prints"
        )


def _unreachable(address: str, exc: BaseException) -> str:
    return (
        f"no Dask scheduler answered at {address} within {CONNECT_TIMEOUT_S:g} s "
        f"({str(exc) or type(exc).__name__}); check the address, or start one with `dask scheduler`"
    )
