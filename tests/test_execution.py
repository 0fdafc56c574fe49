"""The local executor: runs start longest first and come back in task order, as a serial run's.
(The Dask path: tests/test_dask.py.)"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys

import pytest
import xarray as xr

from precision_suite.jobs import execution
from precision_suite.jobs.execution import Task
from precision_suite.jobs.twins import rounding_twins
from precision_suite.training import matrix, runs
from precision_suite.training.imports import load_object, project_importable
from precision_suite.training.runs import RunSpec


def test_the_default_matrix_starts_its_quantized_gpt_cases_first_and_keeps_ties_in_order():
    specs = matrix.default_matrix()
    order = [runs.case_id(specs[index]) for index in execution.longest_first([Task(s) for s in specs])]
    # the GPT cases (18 blocks, quantized training) train 2.5-4x as long as the ViT ones (12 blocks,
    # float32): README, suite times; the ViT cases have equal work and keep their task order
    gpt = {runs.case_id(s) for s in specs if s.model == "gpt"}
    assert set(order[: len(gpt)]) == gpt
    assert order[len(gpt) :] == [runs.case_id(s) for s in specs if s.model == "vit"]


def test_more_steps_tokens_or_formats_mean_more_work_and_unknown_work_starts_first():
    base = RunSpec(model="vit", depth=2, steps=4, batch_size=8)
    more = [
        dataclasses.replace(base, steps=8),
        dataclasses.replace(base, batch_size=16),
        dataclasses.replace(base, depth=3),
        dataclasses.replace(base, width=256, heads=4),
        dataclasses.replace(base, recipe="fp8-block"),
        dataclasses.replace(base, extra_formats=("mxfp8",)),
    ]
    assert all(spec.relative_work() > base.relative_work() for spec in more)
    users = RunSpec(model="user_code:build", batches="user_code:batches")  # its size: unknown
    assert execution.longest_first([Task(base), Task(users)]) == [1, 0]
    # too broken to estimate: first, so that its run fails at once with the validation's message
    broken = dataclasses.replace(base, steps="5")
    assert execution.longest_first([Task(base), Task(broken)]) == [1, 0]


@pytest.mark.slow
def test_a_pool_returns_a_serial_runs_datasets_in_task_order_whatever_order_they_ran_in():
    # the second task has more work, so it starts first; its result still comes back second
    light = RunSpec(model="vit", depth=1, steps=3, batch_size=8, device="cpu")
    heavy = dataclasses.replace(light, depth=2, recipe="fp8-block")
    tasks = [Task(light), Task(heavy)]
    assert execution.longest_first(tasks) == [1, 0]
    finished = []
    pooled = execution.run_tasks(tasks, workers=2, done=lambda index, task, seconds: finished.append(index))
    assert sorted(finished) == [0, 1]
    for task, ds in zip(tasks, pooled):
        xr.testing.assert_identical(ds, runs.run(task.spec))


def test_a_setting_read_when_torch_loads_gets_a_fresh_process_and_takes_effect():
    tiny = RunSpec(model="vit", steps=1, depth=1)
    (ds,) = execution.run_tasks([Task(tiny, env={"ATEN_CPU_CAPABILITY": "default"})])
    assert json.loads(ds.attrs["fingerprint"])["cpu_capability"] == "DEFAULT"
    assert "ATEN_CPU_CAPABILITY" not in os.environ  # set in the child only


def test_a_bad_spec_in_a_fresh_process_is_the_same_error_as_in_this_one():
    with pytest.raises(ValueError, match=r"^unknown attention 'nope'; known: "):
        execution.run_tasks(
            [Task(RunSpec(model="vit", attention="nope", steps=1), env={"ATEN_CPU_CAPABILITY": "default"})]
        )


def test_the_project_root_is_importable_here_in_spawned_workers_and_in_fresh_interpreters(
    tmp_path, monkeypatch
):
    root = tmp_path / "project"
    (root / "ergo_user_pkg").mkdir(parents=True)
    (root / "ergo_user_pkg" / "__init__.py").write_text("def build(spec):\n    return 'built'\n")
    monkeypatch.chdir(tmp_path)  # the root is not the current directory: only project_importable adds it
    with pytest.raises(ValueError, match="cannot import 'ergo_user_pkg'"):
        load_object("ergo_user_pkg:build", "model")
    before = (list(sys.path), os.environ.get("PYTHONPATH"))
    try:
        with project_importable(root):
            assert load_object("ergo_user_pkg:build", "model")(None) == "built"
            with concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn")
            ) as pool:
                assert pool.submit(load_object, "ergo_user_pkg:build", "model").result()(None) == "built"
            fresh = subprocess.run(
                [sys.executable, "-c", "import ergo_user_pkg; print(ergo_user_pkg.build(None))"],
                capture_output=True,
                text=True,
            )
            assert fresh.stdout.strip() == "built", fresh.stderr
    finally:
        sys.modules.pop("ergo_user_pkg", None)
    assert (sys.path, os.environ.get("PYTHONPATH")) == before


@pytest.mark.parametrize(
    "capability, isa_twins",
    [
        (
            "AVX512",
            [
                {"ATEN_CPU_CAPABILITY": "default"},
                {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                {"MKL_CBWR": "COMPATIBLE"},
            ],
        ),
        ("AVX2", [{"ATEN_CPU_CAPABILITY": "default"}, {"MKL_CBWR": "COMPATIBLE"}]),
        ("SVE256", [{"ATEN_CPU_CAPABILITY": "default"}]),  # not x86: no MKL, no x86 widths
    ],
)
def test_rounding_twins_are_every_narrower_kernel_level_of_the_host(capability, isa_twins):
    twins = rounding_twins(capability)
    assert [dict(t.env) for t in twins if execution.PROCESS_START_ENV & set(t.env)] == isa_twins
    assert {"threads": 2} in [dict(t.spec_changes) for t in twins]
    assert {"PRECISION_SUITE_COMPILE": "0"} in [dict(t.env) for t in twins]
