"""Probe overhead on the default GPT: 10 training steps with probes off, every 10th step, every step.

Measure with ``make bench`` (``pytest tests/test_bench_probes.py --benchmark-enable``): the ratios
to the ``off`` median are printed at the end (tests/conftest.py). Without --benchmark-enable each
mode runs once as a test.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite.runs import RunSpec, Trainer

STEPS_PER_ROUND = 10
SAMPLE_EVERY = {"off": None, "every-10th": 10, "every-step": 1}


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
@pytest.mark.parametrize("mode", list(SAMPLE_EVERY))
def test_step_time_with_probes(benchmark, default_gpt_trainer, mode):
    every = SAMPLE_EVERY[mode]

    def train_round() -> list:
        recorder = default_gpt_trainer.recorder
        before = len(recorder.steps)
        for i in range(STEPS_PER_ROUND):
            default_gpt_trainer.step(i, sample=every is not None and i % every == 0)
        return recorder.steps[before:]  # the steps that were measured

    benchmark.group = f"probe overhead: default GPT, {STEPS_PER_ROUND} steps"
    benchmark.extra_info["reference"] = every is None  # ratios are to the probe-free steps
    measured = benchmark.pedantic(train_round, rounds=3, warmup_rounds=1)
    expected_samples = 0 if every is None else STEPS_PER_ROUND // every
    assert len(measured) == expected_samples
