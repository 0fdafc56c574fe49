"""Probe overhead on the default GPT: 10 training steps with probes off, every 10th step, every step.

Measure with ``make bench`` (``pytest tests/test_bench_probes.py --benchmark-enable -p no:xdist``).
The reference is the plain training step: probes off, so every ``QuantLinear`` takes the
``F.linear`` fast path. tests/conftest.py prints each ratio of medians against its goal;
no test asserts a time. Without --benchmark-enable each mode runs once as a test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precision_suite.training.runs import RunSpec, Trainer

STEPS_PER_ROUND = 10
# mode: (probes fire every this many steps, goal: at most this many plain steps' time)
MODES = {"off": (None, None), "every-10th": (10, 1.1), "every-step": (1, 1.5)}


@pytest.fixture
def default_gpt_trainer():
    spec = RunSpec(model="gpt", device="cpu")  # default sizes: depth 18, width 128, 8 x 64 tokens
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            yield Trainer(spec.validate(), torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_step_time_with_probes(benchmark, default_gpt_trainer, mode):
    every, goal = MODES[mode]

    def train_round() -> list:
        recorder = default_gpt_trainer.recorder
        before = len(recorder.steps)
        for i in range(STEPS_PER_ROUND):
            default_gpt_trainer.step(i, sample=every is not None and i % every == 0)
        return recorder.steps[before:]  # the steps that were measured

    benchmark.group = f"probe overhead: default GPT, {STEPS_PER_ROUND} steps"
    if every is None:
        benchmark.extra_info.update(subject="plain step (probes off)", reference=True)
    else:
        benchmark.extra_info.update(subject=f"probes {mode}", goal=goal)
    # the warm-up round compiles the probes' kernels (or loads them from the cache)
    measured = benchmark.pedantic(train_round, rounds=7, warmup_rounds=1)
    assert len(measured) == (0 if every is None else STEPS_PER_ROUND // every)
    if measured:  # the probes measured what they time: FP8-block distortion of a trained GPT
        # NaN where a tensor is not measured under a layout (activation under (128, 1), ...)
        distortion = default_gpt_trainer.recorder.dataset()["distortion"].values
        measured_cells = distortion[~np.isnan(distortion)]
        assert measured_cells.size and ((measured_cells > 0.99) & (measured_cells <= 1.0)).all()
