"""Runs on a Dask cluster (`--scheduler tcp://HOST:PORT`): a real `dask scheduler` and two
`dask worker` processes on 127.0.0.1 (the kill test kills one), started once for this module
(each pytest-xdist worker starts its own, on ports the OS picks), training real tiny runs.

The cluster's results must be those of a serial run, a worker killed while it trains must cost
a retry and never a half-written baseline, and every way of giving a bad scheduler is one
status-2 line naming --scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import distributed
import pytest
import tomllib
import xarray as xr

import precision_suite
from precision_suite import cli, files
from precision_suite.jobs import execution
from precision_suite.jobs.execution import Task
from precision_suite.training import runs

# Two tiny cases: about half a second per run on two busy cores. The CLI tests train the first
# (its ensemble is 12 runs: 4 seeds and their first steps with 2 threads and with eager kernels).
TINY_CONFIG = """
[[case]]
model = "vit"
depth = 1
batch_size = 8
steps = 12
device = "cpu"

[[case]]
model = "vit"
attention = "x/1"
recipe = "fp8-block"
extra_formats = ["mxfp8"]
depth = 1
batch_size = 8
steps = 12
device = "cpu"
"""
# the first case; its sizes differ from the defaults, so its id carries their hash
CASE = runs.case_id(runs.RunSpec(**tomllib.loads(TINY_CONFIG)["case"][0]))
START_TIMEOUT_S = 60  # two cores shared with other jobs: a worker takes seconds to import torch
# Should this process die without its teardown, the cluster still goes: the scheduler closes
# after 5 idle minutes, a worker a minute after it lost its scheduler.
OUTLIVE_NOTHING = {"scheduler": ["--idle-timeout", "300"], "worker": ["--death-timeout", "60"]}
# The environment of every process that trains here (the workers and the serial reference).
# torch.compile costs each fresh process about 15 s; eager kernels take these tiny runs through
# the same executor in a second (eager and compiled numbers are compared elsewhere). OpenMP
# threads that spin while they wait make a 2-thread run (the ensembles' rounding twins) 30x slower
# on cores that other processes share; waiting passively changes no number.
TRAINING_ENV = {"PRECISION_SUITE_COMPILE": "0", "OMP_WAIT_POLICY": "PASSIVE"}
# The serial reference, in a fresh process of the same environment as the workers: each tiny
# spec's run, and the first case's baseline.
SERIAL_SCRIPT = """
import sys
from pathlib import Path
from precision_suite.jobs import execution, regenerate
from precision_suite import files
from precision_suite.training import runs

folder = Path(sys.argv[1])
specs = [runs.RunSpec(**case) for case in files.read_toml(folder / "tiny.toml")["case"]]
for spec, ds in zip(specs, execution.run_tasks([execution.Task(spec) for spec in specs], workers=1)):
    files.save_dataset(ds, folder / "runs" / f"{runs.case_id(spec)}.nc")
regenerate.regenerate(specs[:1], folder / "baselines", workers=1)
"""


@dataclasses.dataclass
class Cluster:
    address: str
    client: distributed.Client  # the tests' own, to watch and steer the cluster
    env: dict  # of the processes that train
    workers: dict[str, tuple[subprocess.Popen, str]]  # name -> (process, address)


def _start_scheduler(folder: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """A scheduler on a port the OS picks (it writes its address to a file): (process, address)."""
    address_file = folder / "scheduler.json"
    process = _start(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(address_file),
            *OUTLIVE_NOTHING["scheduler"],
        ],
        folder / "scheduler.log",
        env,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while (address := _written_address(address_file)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            pytest.fail(f"no Dask scheduler started:\n{(folder / 'scheduler.log').read_text()}")
        time.sleep(0.1)
    return process, address


def _written_address(address_file: Path) -> str | None:
    """The address in the scheduler's file once it is whole: the scheduler creates the file before
    it writes it, so a reader can find it empty or half written (seen once in CI)."""
    try:
        return json.loads(address_file.read_text())["address"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def _start_workers(
    client: distributed.Client, address: str, folder: Path, env: dict, names: tuple[str, ...]
) -> dict[str, tuple[subprocess.Popen, str]]:
    """Workers of one thread each and no nanny (killing the process kills the worker), ready to
    train: name -> (process, address)."""
    processes = {
        name: _start(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                address,
                "--name",
                name,
                "--nthreads",
                "1",
                "--no-nanny",
                "--host",
                "127.0.0.1",
                "--local-directory",
                str(folder / name),
                *OUTLIVE_NOTHING["worker"],
            ],
            folder / f"{name}.log",
            env,
        )
        for name in names
    }
    try:
        client.wait_for_workers(len(names), timeout=START_TIMEOUT_S)
    except TimeoutError:
        _stop(*processes.values())
        raise
    addresses = {info["name"]: worker for worker, info in client.scheduler_info()["workers"].items()}
    # a process's first run imports sklearn and torch._dynamo (seconds): pay it now, on all at once
    warm_up = Task(runs.RunSpec(model="vit", depth=1, batch_size=8, steps=1, device="cpu"))
    client.run(execution.run_task, warm_up)
    return {name: (processes[name], addresses[name]) for name in names}


def _start(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    # a session of its own: teardown kills the whole process group, nothing outlives the module
    with log.open("wb") as output:
        return subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=log.parent, start_new_session=True
        )


def _stop(*processes: subprocess.Popen) -> None:
    """SIGKILL to each process group: the processes hold nothing worth a graceful close, and a
    worker that closes gracefully waits seconds (or minutes) for a scheduler that closes too."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        process.wait(START_TIMEOUT_S)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dask-cluster")
    package_root = str(Path(precision_suite.__file__).resolve().parents[1])
    # workers import the package from the folder the tests import it from
    env = {
        **os.environ,
        **TRAINING_ENV,
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    scheduler, address = _start_scheduler(folder, env)
    processes = [scheduler]
    try:
        with distributed.Client(address, set_as_default=False, timeout=START_TIMEOUT_S) as client:
            workers = _start_workers(client, address, folder, env, ("survivor", "victim"))
            processes += [process for process, _ in workers.values()]
            yield Cluster(address, client, env, workers)
    finally:
        _stop(*processes)


@pytest.fixture(scope="module")
def serial(tmp_path_factory, cluster):
    """The serial reference: folder with runs/<case>.nc and baselines/<first case>.nc."""
    folder = tmp_path_factory.mktemp("serial")
    (folder / "tiny.toml").write_text(TINY_CONFIG)
    subprocess.run(
        [sys.executable, "-c", SERIAL_SCRIPT, str(folder)],
        env=cluster.env,
        check=True,
        timeout=5 * START_TIMEOUT_S,
    )
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A project folder holding the tiny config, as the current directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY_CONFIG)
    return tmp_path


def _executed(cluster: Cluster) -> int:
    """How many tasks the cluster's workers have run."""
    return sum(cluster.client.run(lambda dask_worker: dask_worker.state.executed_count).values())


def test_cluster_results_are_those_of_a_serial_run_in_task_order(cluster, serial, workdir):
    specs = [runs.RunSpec(**case) for case in files.read_toml(workdir / "tiny.toml")["case"]]
    tasks = [Task(spec, label=f"task {i}") for i, spec in enumerate(specs)]
    tasks.append(
        Task(
            dataclasses.replace(specs[0], threads=2),
            env={"PRECISION_SUITE_COMPILE": "0"},
            label="two threads",
        )
    )
    # submitted out of task order (the second case measures one format more), so the check of
    # the results' order below means something
    assert execution.longest_first(tasks) == [1, 0, 2]
    finished = []
    before = _executed(cluster)
    results = execution.run_tasks(
        tasks, scheduler=cluster.address, done=lambda index, task, seconds: finished.append((index, task))
    )
    assert _executed(cluster) - before == len(tasks)  # trained by the cluster, not in this process
    assert sorted(index for index, _ in finished) == list(range(len(tasks)))
    assert all(task is tasks[index] for index, task in finished)
    for spec, ds in zip(specs, results):  # numbers and attributes (one host, same thread counts)
        xr.testing.assert_identical(ds, files.load_dataset(serial / "runs" / f"{runs.case_id(spec)}.nc"))
    assert results[-1].attrs["spec"] == tasks[-1].spec.to_json()
    assert json.loads(results[-1].attrs["fingerprint"])["threads"] == 2  # RunSpec.threads pinned there


def test_cli_run_on_the_cluster_passes_against_serial_baselines(cluster, serial, workdir, capsys):
    assert (
        cli.main(
            [
                "run",
                "--config",
                "tiny.toml",
                "--case",
                CASE,
                "--scheduler",
                cluster.address,
                "--baseline-dir",
                str(serial / "baselines"),
                "--save-results",
                "results",
                "--report-dir",
                "out",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert f"training 1 case(s) and 1 replay(s) on the Dask cluster at {cluster.address}" in captured.err
    assert (
        f"/2] {CASE} (" in captured.err and f"/2] {CASE} replay (" in captured.err
    )  # a line per finished run
    assert f"PASS  {CASE}" in captured.out
    xr.testing.assert_identical(
        files.load_dataset(workdir / "results" / f"{CASE}.nc"),
        files.load_dataset(serial / "runs" / f"{CASE}.nc"),
    )


def test_a_worker_killed_mid_run_is_retried_and_the_baselines_are_whole(cluster, serial, workdir, capsys):
    victim, victim_address = cluster.workers["victim"]
    status: list[int] = []
    update = threading.Thread(
        target=lambda: status.append(
            cli.main(
                [
                    "baseline",
                    "update",
                    "--config",
                    "tiny.toml",
                    "--case",
                    CASE,
                    "--scheduler",
                    cluster.address,
                ]
            )
        ),
        daemon=True,
    )
    update.start()

    def held() -> set:
        return set(cluster.client.processing(workers=[victim_address]).get(victim_address, ()))

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:  # kill the victim once one run has been on it for 20 ms (a run takes 0.1-1 s)
        assert update.is_alive() and time.monotonic() < deadline, "the victim never trained a run"
        first = held()
        time.sleep(0.02)
        lost = first & held()
        if lost:
            break
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(10)
    update.join(START_TIMEOUT_S)
    assert not update.is_alive() and status == [0], capsys.readouterr().err
    assert victim_address not in cluster.client.scheduler_info()["workers"]
    # the scheduler's transition log: every run the victim held was given to a worker again
    started = cluster.client.run_on_scheduler(
        lambda dask_scheduler: [t[0] for t in dask_scheduler.story(*lost) if t[2] == "processing"]
    )
    assert all(started.count(key) >= 2 for key in lost), started
    # the lost runs were retried on the other workers and give the serial numbers; the folder holds
    # the baseline, its stored replay and nothing else (no temp file of an interrupted write)
    assert _files(workdir / "baselines") == [f"replays/{CASE}.nc", f"{CASE}.nc"]
    for name in _files(workdir / "baselines"):
        xr.testing.assert_identical(
            files.load_dataset(workdir / "baselines" / name), files.load_dataset(serial / "baselines" / name)
        )


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- bad usage


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def quick_timeout(monkeypatch):
    monkeypatch.setattr(execution, "CONNECT_TIMEOUT_S", 1.0)


@pytest.mark.parametrize(
    "address",
    [
        "localhost:8786",
        "http://localhost:8786",
        "tcp://localhost",
        "tcp://localhost:99999",
        "tcp://:8786",
        "tcp://host name:1",
    ],
)
def test_a_malformed_scheduler_address_is_a_usage_error(workdir, capsys, address):
    assert cli.main(["run", "--config", "tiny.toml", "--scheduler", address]) == 2
    err = capsys.readouterr().err
    assert "--scheduler" in err and repr(address) in err and "tcp://HOST:PORT" in err


def test_no_scheduler_at_the_address_is_a_usage_error_within_the_timeout(workdir, capfd, quick_timeout):
    address = f"tcp://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    assert cli.main(["baseline", "update", "--config", "tiny.toml", "--scheduler", address]) == 2
    assert time.monotonic() - started < 10
    err = capfd.readouterr().err
    assert f"precision-suite: error: --scheduler: no Dask scheduler answered at {address} within 1 s" in err
    assert "Traceback" not in err and not (workdir / "baselines").exists()


@pytest.mark.parametrize("server", ["silent", "other protocol"])
def test_a_server_that_is_not_a_dask_scheduler_is_a_usage_error(workdir, capfd, quick_timeout, server):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []

    def serve() -> None:  # accepts; then never answers, or answers in another protocol
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted.append(connection)
            if server == "other protocol":
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 8)

    threading.Thread(target=serve, daemon=True).start()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        assert (
            cli.main(["baseline", "update", "--config", "tiny.toml", "--case", CASE, "--scheduler", address])
            == 2
        )
    finally:
        listener.close()
        for connection in accepted:
            connection.close()
    err = capfd.readouterr().err
    said = {
        "silent": f"no Dask scheduler answered at {address} within 1 s",
        "other protocol": f"the server at {address} does not answer as a Dask scheduler",
    }[server]
    assert f"precision-suite: error: --scheduler: {said}" in err
    assert "Traceback" not in err and not (workdir / "baselines").exists()


def test_a_scheduler_without_workers_is_a_usage_error(workdir, capsys, quick_timeout):
    scheduler, address = _start_scheduler(workdir, dict(os.environ))
    try:
        assert cli.main(["baseline", "update", "--config", "tiny.toml", "--scheduler", address]) == 2
    finally:
        _stop(scheduler)
    err = capsys.readouterr().err
    assert (
        f"--scheduler: the Dask scheduler at {address} has no workers; start some with "
        f"`dask worker {address} --nthreads 1`" in err
    )


@pytest.mark.parametrize("command", [["run"], ["baseline", "update"], ["calibrate"]])
def test_without_dask_installed_the_scheduler_flag_says_what_to_install(
    serial, workdir, capsys, monkeypatch, command
):
    shutil.copytree(serial / "baselines", workdir / "baselines")  # run and calibrate load it first
    before = (workdir / "baselines" / f"{CASE}.nc").read_bytes()
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` fails
    assert (
        cli.main([*command, "--config", "tiny.toml", "--case", CASE, "--scheduler", "tcp://127.0.0.1:8786"])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "precision-suite: error: --scheduler: running on a Dask cluster needs dask.distributed, "
        "which is not installed" in err
    )
    assert 'install it with: pip install "precision-suite[dask]"' in err and "Traceback" not in err
    assert _files(workdir / "baselines") == [f"replays/{CASE}.nc", f"{CASE}.nc"]
    assert (workdir / "baselines" / f"{CASE}.nc").read_bytes() == before


def test_the_address_of_a_worker_is_not_a_scheduler(cluster, workdir, capsys):
    _, worker = cluster.workers["survivor"]
    assert (
        cli.main(["baseline", "update", "--config", "tiny.toml", "--case", CASE, "--scheduler", worker]) == 2
    )
    assert f"--scheduler: {worker} is a Dask Worker, not a scheduler" in capsys.readouterr().err


def test_workers_and_scheduler_together_are_a_usage_error(workdir, capsys):
    assert (
        cli.main(["run", "--config", "tiny.toml", "--workers", "2", "--scheduler", "tcp://127.0.0.1:8786"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--workers 2 trains in local processes, --scheduler tcp://127.0.0.1:8786" in err


@pytest.mark.parametrize(
    "error",
    [
        distributed.KilledWorker("run-1", SimpleNamespace(address="tcp://127.0.0.1:1"), 3),
        distributed.CancelledError("run-1 cancelled for reason: scheduler-connection-lost.\nClient lost"),
    ],
)
def test_a_run_lost_with_its_worker_or_scheduler_is_one_clear_error(error):
    class Lost:  # a finished future whose worker or scheduler went away
        def result(self):
            raise error

    future = Lost()
    with pytest.raises(execution.ExecutorError) as raised:
        execution._gather(
            [Task(runs.RunSpec(model="vit"), label="vit-softmax-fp32 seed 3")],
            {future: 0},
            [future],
            None,
            0.0,
            lost=(distributed.KilledWorker, distributed.CancelledError),
        )
    message = str(raised.value)
    assert message.startswith(f"lost the run of vit-softmax-fp32 seed 3 ({type(error).__name__}: ")
    assert "\n" not in message  # one line for the command line's status-2 message
