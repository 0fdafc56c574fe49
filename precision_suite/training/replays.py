"""Replays from stored training states: deterministic comparisons after step 0.

Short training is chaotic: after a few steps two hosts' runs of one seed differ as much as two
seeds do, so a run's trained steps can only be compared statistically. A replay avoids the chaos
instead of modelling it. Baseline generation keeps the state of the seed-0 run before its last
`REPLAY_STEPS` steps (`run_keeping_state`); a replay (`replay`) loads that state and trains those
steps again with probes on each, then takes the loss of one more batch without training on it
(the visible effect of the last update). Both the baseline's replay and every later one start
from the same stored state, so they differ only by rounding until the code changes: a change that
begins at any step up to the replayed ones shows in them as it does at step 0.

The stored state is compact (about one byte per parameter): the seeded initial weights are not
stored, since every run rebuilds them from the seed (identical up to rounding on any host), only
the trained change of each weight, W_start - W_0, as int8 with one float32 scale per 128
consecutive elements (plain rounding; no code under test). AdamW moves every weight by about the
learning rate per step, so the changes of a block have similar sizes and a uniform grid keeps them
to 0.4% of the block's largest (float8 E4M3, with its 3 mantissa bits, lost 6% and moved the
loss at the stored state by 2%). The rounded weights W_0 + dequant(dW) are the replay's start on
both sides. The optimizer starts afresh (AdamW's moments would triple
the storage); the data stream continues where the run was (its generator state and token count).
Stochastic rounding's generators restart from their seeds, the same on both sides.

`diff` uses the same machinery at any step and for any model, storing nothing: `keep_state` trains
BASE's code up to the first step at which BASE's and HEAD's runs differ and keeps the state there,
then `replay(spec, state, start)` trains the next steps from it with each side's code.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import torch
import xarray as xr

from precision_suite.training.runs import RunSpec, Trainer, run, seeded, trained_dataset

REPLAY_STEPS = 2  # >= 2: a quantized operand that goes stale after an optimizer step shows
STATE_BLOCK = 128  # elements per float32 scale of the stored weight change
STATE_PREFIX = "state_"  # the state's variables, beside the replay's metrics in one dataset
_INT8_MAX = 127.0


def replay_start(spec: RunSpec) -> int | None:
    """The first replayed step of `spec` (its last REPLAY_STEPS steps), None when the run is too
    short to leave a trained step before them or the model is a user's (its states are not stored:
    a user's larger model is compared against its base commit instead)."""
    if spec.user_model or spec.steps <= REPLAY_STEPS:
        return None
    return spec.steps - REPLAY_STEPS


def replay_steps(spec: RunSpec, start: int) -> int:
    """How many steps a replay from before step `start` trains: REPLAY_STEPS, fewer where the
    run ends sooner (a stored baseline's replay, from replay_start, always trains REPLAY_STEPS)."""
    return min(REPLAY_STEPS, spec.steps - start)


def replay_spec(spec: RunSpec, stored: xr.Dataset) -> RunSpec:
    """`spec` as its replay from the state in `stored` (a stored replay, or any dataset whose
    `spec` attribute names the seed that kept the state) runs: that seed, the spec's own threads
    and device."""
    return dataclasses.replace(spec, seed=int(json.loads(stored.attrs["spec"])["seed"]))


def run_keeping_state(spec: RunSpec) -> xr.Dataset:
    """`runs.run(spec)`, its dataset carrying the state before the first replayed step
    (`split_state` takes it apart)."""
    start = replay_start(spec)
    if start is None:
        raise ValueError(
            f"{spec.model} runs of {spec.steps} steps keep no replay state "
            f"(a built-in model and more than {REPLAY_STEPS} steps are needed)"
        )
    kept: dict[str, Any] = {}

    def keep(trainer: Trainer, step: int) -> None:
        if step == 0:
            kept["initial"] = _weights(trainer)
        elif step == start:
            kept["state"] = _encode_state(trainer, kept.pop("initial"), start)

    ds = run(spec, before_step=keep)
    return ds.assign(kept["state"].data_vars)


def keep_state(spec: RunSpec, start: int) -> xr.Dataset:
    """The state of `spec`'s run before step `start` (0 < start < steps), training only the steps
    before it, exactly as `runs.run` trains them (probes on the same steps). Any model, a user's
    too: `diff` keeps the state in a temporary file, never stores it."""
    _check_start(spec, start)
    with seeded(spec) as device:
        trainer = Trainer(spec, device)
        initial = _weights(trainer)
        sampled = set(spec.sampled_steps())
        for step in range(start):
            trainer.step(step, sample=step in sampled)
        return _encode_state(trainer, initial, start)


def split_state(ds: xr.Dataset) -> tuple[xr.Dataset, xr.Dataset]:
    """(the dataset without the state, the state's variables)."""
    names = [name for name in ds.data_vars if str(name).startswith(STATE_PREFIX)]
    return ds.drop_vars(names), ds[names]


def has_state(ds: xr.Dataset) -> bool:
    return f"{STATE_PREFIX}weight_change" in ds.data_vars


def state_start(state: xr.Dataset) -> int:
    """The step `state` was kept before: its replay's first step."""
    return int(state[f"{STATE_PREFIX}start_step"])


def replay(spec: RunSpec, state: xr.Dataset, start: int | None = None) -> xr.Dataset:
    """Train `replay_steps(spec, start)` steps of `spec` from `state` (a dataset holding `state_*`
    variables), probes on every one; a run dataset whose steps are the replayed ones and whose
    loss and accuracy run one step further (the batch after them, not trained on).

    `start`: the step the state was kept before (`keep_state`); None: a stored baseline's state,
    kept before `replay_start(spec)` (a state of another step or model asks for regeneration)."""
    if not has_state(state):
        raise ValueError(
            "replay: the dataset holds no training state (state_weight_change); "
            "regenerate the baseline to store one"
        )
    kept = state_start(state)
    expected = replay_start(spec) if start is None else _check_start(spec, start)
    hint = "; regenerate the baseline" if start is None else ""
    if kept != expected:
        raise ValueError(
            f"replay: the state was kept before step {kept}, but this spec replays from step {expected}{hint}"
        )
    with seeded(spec) as device:
        trainer = Trainer(spec, device)  # the seeded initial weights W_0 (and the recipe's generators)
        _load_state(trainer, state, hint)
        steps = np.arange(kept, kept + replay_steps(spec, kept) + 1)
        losses, accuracies = np.empty(steps.size), np.empty(steps.size)
        tokens = []
        for i, step in enumerate(steps[:-1]):
            losses[i], accuracies[i] = trainer.step(int(step), sample=True)
            tokens.append(trainer.tokens_seen)
        losses[-1], accuracies[-1] = trainer.evaluate()
        return trained_dataset(trainer, steps, losses, accuracies, tokens, attrs={"replayed_from": kept})


def _check_start(spec: RunSpec, start: int) -> int:
    if not 0 < start < spec.steps:
        raise ValueError(
            f"a state is kept before one of the run's steps 1 to {spec.steps - 1}, not before step {start}"
        )
    return start


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    """A copy of the model's weights, on the CPU (the seeded W_0 a state's change is taken from)."""
    return [p.detach().to("cpu", copy=True) for p in trainer.model.parameters()]


def _encode_state(trainer: Trainer, initial: list[torch.Tensor], start: int) -> xr.Dataset:
    params = list(trainer.model.named_parameters())
    change = torch.cat(
        [(p.detach().cpu().float() - w0.float()).reshape(-1) for (_, p), w0 in zip(params, initial)]
    )
    n = change.numel()
    blocks = torch.nn.functional.pad(change, (0, -n % STATE_BLOCK)).reshape(-1, STATE_BLOCK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    codes = torch.round(blocks / scale).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    table = [[name, list(p.shape)] for name, p in params]
    rng = trainer.data_rng.get_state().numpy()
    return xr.Dataset(
        {
            f"{STATE_PREFIX}weight_change": (
                ("state_element",),
                codes.reshape(-1)[:n].numpy(),
                {
                    "description": "W_start - W_0 of every parameter, concatenated in "
                    "named_parameters order, in units of its block's scale",
                    "parameters": json.dumps(table),
                },
            ),
            f"{STATE_PREFIX}weight_scale": (
                ("state_block",),
                scale.reshape(-1).numpy(),
                {"description": f"float32 scale of each {STATE_BLOCK} elements"},
            ),
            f"{STATE_PREFIX}data_generator": (
                ("state_generator_byte",),
                rng,
                {"description": "torch.Generator state of the data stream"},
            ),
            f"{STATE_PREFIX}tokens_seen": ((), np.int64(trainer.tokens_seen)),
            f"{STATE_PREFIX}start_step": ((), np.int64(start), {"description": "the first replayed step"}),
        }
    )


def _load_state(trainer: Trainer, state: xr.Dataset, hint: str = "; regenerate the baseline") -> None:
    codes = state[f"{STATE_PREFIX}weight_change"]
    table = json.loads(codes.attrs["parameters"])
    params = list(trainer.model.named_parameters())
    if [[name, list(p.shape)] for name, p in params] != table:
        raise ValueError(
            "replay: the state holds the parameters of another model "
            f"({len(table)} tensors stored, the model has {len(params)}: "
            f"{_mismatch(dict(table), {name: list(p.shape) for name, p in params})}){hint}"
        )
    n = codes.size
    raw = torch.from_numpy(np.asarray(codes.values, dtype=np.float32))
    raw = torch.nn.functional.pad(raw, (0, -n % STATE_BLOCK)).reshape(-1, STATE_BLOCK)
    scale = torch.from_numpy(np.asarray(state[f"{STATE_PREFIX}weight_scale"].values, dtype=np.float32))
    change = (raw * scale[:, None]).reshape(-1)[:n]
    offset = 0
    with torch.no_grad():
        for _, p in params:
            p.add_(change[offset : offset + p.numel()].view(p.shape).to(p.device))
            offset += p.numel()
    trainer.data_rng.set_state(
        torch.from_numpy(np.asarray(state[f"{STATE_PREFIX}data_generator"].values, dtype=np.uint8))
    )
    trainer.tokens_seen = int(state[f"{STATE_PREFIX}tokens_seen"])


def _mismatch(stored: dict[str, list[int]], model: dict[str, list[int]], most: int = 3) -> str:
    """How the state's parameters (name -> shape) differ from the model's, the first `most`."""
    found = [
        f"{name} {tuple(shape)} only in the model" for name, shape in model.items() if name not in stored
    ]
    found += [
        f"{name} {tuple(shape)} only in the state" for name, shape in stored.items() if name not in model
    ]
    found += [
        f"{name} {tuple(shape)} in the state, {tuple(model[name])} in the model"
        for name, shape in stored.items()
        if name in model and model[name] != shape
    ]
    more = f" (+{len(found) - most} more)" if len(found) > most else ""
    return "; ".join(found[:most]) + more if found else "the same tensors in another order"
