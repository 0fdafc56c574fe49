"""The local executor: runs start longest first and come back in task order, as a serial run's.
(The Dask path: tests/test_dask.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import xarray as xr

from precision_suite.jobs import execution
from precision_suite.training import matrix, runs
from precision_suite.jobs.execution import Task
from precision_suite.training.runs import RunSpec


def test_the_default_matrix_starts_its_quantized_gpt_cases_first_and_keeps_ties_in_order():
    specs = matrix.default_matrix()
    order = [runs.case_id(specs[index]) for index in execution.longest_first([Task(s) for s in specs])]
    # the GPT cases (18 blocks, quantized training) train 2.5-4x as long as the ViT ones (12 blocks,
    # float32): README, suite times; the ViT cases have equal work and keep their task order
    gpt = {runs.case_id(s) for s in specs if s.model == "gpt"}
    assert set(order[:len(gpt)]) == gpt
    assert order[len(gpt):] == [runs.case_id(s) for s in specs if s.model == "vit"]


def test_more_steps_tokens_or_formats_mean_more_work_and_unknown_work_starts_first():
    base = RunSpec(model="vit", depth=2, steps=4, batch_size=8)
    more = [dataclasses.replace(base, steps=8), dataclasses.replace(base, batch_size=16),
            dataclasses.replace(base, depth=3), dataclasses.replace(base, width=256, heads=4),
            dataclasses.replace(base, recipe="fp8-block"), dataclasses.replace(base, extra_formats=("mxfp8",))]
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
