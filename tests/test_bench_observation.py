"""What observing the model's own quantization costs a sampled step (training/observation.py): the
same sampled training step (probes on) with the observation mode and without it, on the default-size
GPT trained with fp8-block (the suite's recipe is not observed: the mode only looks) and on a torchao float8 model (every
cast and scaled GEMM observed, measured and checked). Unsampled steps never observe.

Measure with ``make bench``; tests/conftest.py prints each ratio of medians against its goal. No
test asserts a time. Without --benchmark-enable each mode runs once as a test.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite.training.runs import RunSpec, Trainer

MODELS = {"GPT fp8-block": RunSpec(model="gpt", recipe="fp8-block", device="cpu"),
          "torchao float8 MLP": RunSpec(model="user_torchao:build", batches="user_torchao:batches", device="cpu")}
GOAL = 1.5  # at most this many sampled steps without observation


def trainer(spec: RunSpec) -> Trainer:
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    return Trainer(spec.validate(), torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("observe", [False, True], ids=["without", "observing"])
@pytest.mark.parametrize("model", list(MODELS))
def test_sampled_step_with_and_without_observation(benchmark, model, observe):
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            run = trainer(MODELS[model])
            run.recorder.observe = observe
            benchmark.group = f"observation on a sampled step: {model}"
            if observe:
                benchmark.extra_info.update(subject="sampled step, observing", goal=GOAL)
            else:
                benchmark.extra_info.update(subject="sampled step, not observing", reference=True)
            steps = iter(range(10**6))
            benchmark.pedantic(lambda: run.step(next(steps), sample=True), rounds=5, warmup_rounds=1)
    finally:
        torch.set_num_threads(threads)
    ds = run.recorder.dataset()
    # what was timed: a torchao model's own quantization is observed, the GPT's suite recipe is not
    assert ("observed_format" in ds) == (observe and model != "GPT fp8-block")
