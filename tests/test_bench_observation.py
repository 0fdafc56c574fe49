"""What observing the model's own quantization costs a sampled step (training/observation.py): the
same sampled training step (probes on) with the observation mode and without it, on the default-size
GPT trained with fp8-block (the suite's recipe is not observed: the mode only looks), on a torchao float8 model (every
cast and scaled GEMM observed, measured and checked) and on a fake-quantized model (tests/user_qdq.py: every
dequantized cast followed through its views into the GEMMs, its blocks read, measured and checked). Unsampled
steps never observe.

The consumed-operand check of the suite's own recipes compares what each GEMM's matrix products
received (quant_linear._layer_gemm, a dispatch mode around each GEMM): timed against reporting what the
quantizer returned, on the same sampled step of the default GPT fp8-block.

Measure with ``make bench``; tests/conftest.py prints each ratio of medians against its goal. No
test asserts a time. Without --benchmark-enable each mode runs once as a test.
"""

from __future__ import annotations

import pytest
import torch

from precision_suite.training import quant_linear
from precision_suite.training.runs import RunSpec, Trainer

MODELS = {
    "GPT fp8-block": RunSpec(model="gpt", recipe="fp8-block", device="cpu"),
    "torchao float8 MLP": RunSpec(model="user_torchao:build", batches="user_torchao:batches", device="cpu"),
    "blockwise QDQ GPT": RunSpec(model="user_qdq:build", batches="user_qdq:batches", device="cpu"),
}
GOAL = 1.5  # at most this many sampled steps without observation


def trainer(spec: RunSpec) -> Trainer:
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    return Trainer(spec.validate(), torch.device("cpu"))


def timed_sampled_steps(benchmark, spec: RunSpec, prepare=lambda run: None) -> Trainer:
    """Time sampled training steps of `spec`, the trainer set up by `prepare` first; the trainer."""
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            run = trainer(spec)
            prepare(run)
            steps = iter(range(10**6))
            benchmark.pedantic(lambda: run.step(next(steps), sample=True), rounds=5, warmup_rounds=1)
    finally:
        torch.set_num_threads(threads)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("observe", [False, True], ids=["without", "observing"])
@pytest.mark.parametrize("model", list(MODELS))
def test_sampled_step_with_and_without_observation(benchmark, model, observe):
    benchmark.group = f"observation on a sampled step: {model}"
    if observe:
        benchmark.extra_info.update(subject="sampled step, observing", goal=GOAL)
    else:
        benchmark.extra_info.update(subject="sampled step, not observing", reference=True)
    run = timed_sampled_steps(benchmark, MODELS[model], lambda run: setattr(run.recorder, "observe", observe))
    ds = run.recorder.dataset()
    # what was timed: a torchao model's own quantization is observed, the GPT's suite recipe is not
    assert ("observed_format" in ds) == (observe and model != "GPT fp8-block")


def quantizer_outputs_reported(layer, recipe, gemm, a, b, bias=None):
    """The reference: the GEMM run as it is, the check handed what the quantizer returned."""
    out = quant_linear._product(layer, recipe, gemm, a, b, bias)
    if recipe is not None and quant_linear._observers:
        quant_linear._observe(layer, recipe, (f"{gemm}.a", *a), (f"{gemm}.b", *b))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("received", [False, True], ids=["quantizer outputs", "gemm arguments"])
def test_sampled_step_checking_what_the_gemms_received(benchmark, received, monkeypatch):
    benchmark.group = "consumed-operand check on a sampled step: GPT fp8-block"
    if received:
        benchmark.extra_info.update(subject="sampled step, the GEMMs' arguments checked", goal=1.05)
    else:
        monkeypatch.setattr(quant_linear, "_layer_gemm", quantizer_outputs_reported)
        benchmark.extra_info.update(subject="sampled step, the quantizer's outputs checked", reference=True)
    ds = timed_sampled_steps(benchmark, MODELS["GPT fp8-block"]).recorder.dataset()
    assert int(ds["operand_numel"].sum()) > 0 and int(ds["operand_mismatch"].sum()) == 0  # checked, unplanted
