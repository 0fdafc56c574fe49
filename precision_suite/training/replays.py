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
        raise ValueError(f"{spec.model} runs of {spec.steps} steps keep no replay state "
                         f"(a built-in model and more than {REPLAY_STEPS} steps are needed)")
    kept: dict[str, Any] = {}

    def keep(trainer: Trainer, step: int) -> None:
        if step == 0:
            kept["initial"] = [p.detach().to("cpu", copy=True) for p in trainer.model.parameters()]
        elif step == start:
            kept["state"] = _encode_state(trainer, kept.pop("initial"), start)

    ds = run(spec, before_step=keep)
    return ds.assign(kept["state"].data_vars)


def split_state(ds: xr.Dataset) -> tuple[xr.Dataset, xr.Dataset]:
    """(the dataset without the state, the state's variables)."""
    names = [name for name in ds.data_vars if str(name).startswith(STATE_PREFIX)]
    return ds.drop_vars(names), ds[names]


def has_state(ds: xr.Dataset) -> bool:
    return f"{STATE_PREFIX}weight_change" in ds.data_vars


def replay(spec: RunSpec, state: xr.Dataset) -> xr.Dataset:
    """Train `spec`'s replayed steps from `state` (a dataset holding `state_*` variables), probes
    on every one; a run dataset whose steps are the replayed ones and whose loss and accuracy run
    one step further (the batch after them, not trained on)."""
    if not has_state(state):
        raise ValueError("replay: the dataset holds no training state (state_weight_change); "
                         "regenerate the baseline to store one")
    start = int(state[f"{STATE_PREFIX}start_step"])
    if start != replay_start(spec):
        raise ValueError(f"replay: the state was kept before step {start}, but this spec replays "
                         f"from step {replay_start(spec)}; regenerate the baseline")
    with seeded(spec) as device:
        trainer = Trainer(spec, device)  # the seeded initial weights W_0 (and the recipe's generators)
        _load_state(trainer, state)
        steps = np.arange(start, start + REPLAY_STEPS + 1)
        losses, accuracies = np.empty(steps.size), np.empty(steps.size)
        tokens = []
        for i, step in enumerate(steps[:-1]):
            losses[i], accuracies[i] = trainer.step(int(step), sample=True)
            tokens.append(trainer.tokens_seen)
        losses[-1], accuracies[-1] = trainer.evaluate()
        return trained_dataset(trainer, steps, losses, accuracies, tokens, attrs={"replayed_from": start})


def _encode_state(trainer: Trainer, initial: list[torch.Tensor], start: int) -> xr.Dataset:
    params = list(trainer.model.named_parameters())
    change = torch.cat([(p.detach().cpu().float() - w0.float()).reshape(-1) for (_, p), w0 in zip(params, initial)])
    n = change.numel()
    blocks = torch.nn.functional.pad(change, (0, -n % STATE_BLOCK)).reshape(-1, STATE_BLOCK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / _INT8_MAX, torch.ones_like(amax))
    codes = torch.round(blocks / scale).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    table = [[name, list(p.shape)] for name, p in params]
    rng = trainer.data_rng.get_state().numpy()
    return xr.Dataset({
        f"{STATE_PREFIX}weight_change": (("state_element",), codes.reshape(-1)[:n].numpy(),
                                         {"description": "W_start - W_0 of every parameter, concatenated in "
                                          "named_parameters order, in units of its block's scale",
                                          "parameters": json.dumps(table)}),
        f"{STATE_PREFIX}weight_scale": (("state_block",), scale.reshape(-1).numpy(),
                                        {"description": f"float32 scale of each {STATE_BLOCK} elements"}),
        f"{STATE_PREFIX}data_generator": (("state_generator_byte",), rng,
                                          {"description": "torch.Generator state of the data stream"}),
        f"{STATE_PREFIX}tokens_seen": ((), np.int64(trainer.tokens_seen)),
        f"{STATE_PREFIX}start_step": ((), np.int64(start), {"description": "the first replayed step"}),
    })


def _load_state(trainer: Trainer, state: xr.Dataset) -> None:
    codes = state[f"{STATE_PREFIX}weight_change"]
    table = json.loads(codes.attrs["parameters"])
    params = list(trainer.model.named_parameters())
    if [[name, list(p.shape)] for name, p in params] != table:
        raise ValueError("replay: the stored state holds the parameters of another model "
                         f"({len(table)} tensors stored, the model has {len(params)}); regenerate the baseline")
    n = codes.size
    raw = torch.from_numpy(np.asarray(codes.values, dtype=np.float32))
    raw = torch.nn.functional.pad(raw, (0, -n % STATE_BLOCK)).reshape(-1, STATE_BLOCK)
    scale = torch.from_numpy(np.asarray(state[f"{STATE_PREFIX}weight_scale"].values, dtype=np.float32))
    change = (raw * scale[:, None]).reshape(-1)[:n]
    offset = 0
    with torch.no_grad():
        for _, p in params:
            p.add_(change[offset:offset + p.numel()].view(p.shape).to(p.device))
            offset += p.numel()
    trainer.data_rng.set_state(torch.from_numpy(np.asarray(state[f"{STATE_PREFIX}data_generator"].values,
                                                           dtype=np.uint8)))
    trainer.tokens_seen = int(state[f"{STATE_PREFIX}tokens_seen"])
