"""Replays from stored states (training.replays) and their deterministic comparison (verdicts.stored_replays)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from precision_suite.files import load_dataset, save_dataset
from precision_suite.training import replays
from precision_suite.training.runs import RunSpec, Trainer, run, seeded
from precision_suite.verdicts.baseline_files import BaselineError
from precision_suite.verdicts.stored_replays import (
    build_replay,
    compare_replay,
    is_replay_finding,
    load_replay,
    replay_path,
)

SPEC = RunSpec(model="gpt", recipe="fp8-block", depth=1, steps=5, sample_every=2)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """SPEC's run with the state it keeps, the state read back from a file, and a replay of it."""
    run_ds, state = replays.split_state(replays.run_keeping_state(SPEC))
    path = save_dataset(state, tmp_path_factory.mktemp("state") / "state.nc")
    stored_state = load_dataset(path)
    return run_ds, stored_state, replays.replay(SPEC, stored_state)


def test_a_replay_from_a_stored_state_is_deterministic(kept):
    run_ds, state, first = kept
    again = replays.replay(SPEC, state)
    assert first.equals(again)
    start = replays.replay_start(SPEC)
    assert list(first["step"].values) == list(range(start, SPEC.steps))  # probes on every replayed step
    assert list(first["train_step"].values) == list(range(start, SPEC.steps + 1))  # and the next batch's loss
    assert not run_ds.equals(first)


def test_the_stored_state_is_the_runs_state_within_half_a_step_of_its_grid(kept):
    _, state, _ = kept
    start = replays.replay_start(SPEC)
    truth = {}

    def keep(trainer, step):
        if step == start:
            truth["weights"] = [p.detach().clone() for p in trainer.model.parameters()]
            truth["generator"] = trainer.data_rng.get_state()

    run(SPEC, before_step=keep)
    with seeded(SPEC) as device:
        trainer = Trainer(SPEC, device)
        replays._load_state(trainer, state)
        loaded = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    exact = torch.cat([w.reshape(-1) for w in truth["weights"]])
    scale = torch.from_numpy(state["state_weight_scale"].values).repeat_interleave(replays.STATE_BLOCK)[
        : exact.numel()
    ]
    # int8 rounding: half a grid step, plus float32 rounding of W_0 + change
    assert torch.all((loaded - exact).abs() <= scale / 2 + 1e-6 * exact.abs().clamp(min=1.0))
    assert torch.equal(trainer.data_rng.get_state(), truth["generator"])


def test_the_replays_first_loss_is_the_runs_loss_at_that_step(kept):
    run_ds, _, replay_ds = kept
    start = replays.replay_start(SPEC)
    losses = run_ds["loss"].values
    first = float(replay_ds["loss"].sel(train_step=start))
    # the same batch at nearly the same weights: nearer the run's loss there than at its neighbours
    assert abs(first - losses[start]) < min(abs(first - losses[start - 1]), abs(first - losses[start + 1]))


def _stored(kept) -> xr.Dataset:  # noqa: F821
    _, state, replay_ds = kept
    twin = replays.replay(dataclasses.replace(SPEC, threads=2), state)
    return build_replay(replay_ds, [twin], state)


def test_a_replay_agrees_with_its_stored_replay_and_a_changed_one_fails_marked(kept):
    stored = _stored(kept)
    _, _, replay_ds = kept
    assert compare_replay(replay_ds, stored) == []
    changed = replay_ds.copy(deep=True)
    changed["underflow"].loc[dict(tensor="gradient", layout="1x128", layer=0)] += 0.01
    findings = compare_replay(changed, stored, regen_hint="precision-suite baseline update")
    assert findings and all(is_replay_finding(f) and f.kind == "regression" for f in findings)
    assert any(
        f.metric == "underflow"
        and f.where["tensor"] == "gradient"
        and f.where["layer"] == 0
        and "replayed step" in f.message
        and "baseline update" in f.message
        for f in findings
    )


def test_a_new_nan_in_a_replay_is_a_regression(kept):
    stored = _stored(kept)
    _, _, replay_ds = kept
    broken = replay_ds.copy(deep=True)
    broken["loss"][-1] = np.nan
    findings = compare_replay(broken, stored)
    assert [f.metric for f in findings] == ["loss"] and "non-finite" in findings[0].message


def test_a_state_of_another_model_or_step_is_refused_clearly(kept):
    _, state, _ = kept
    with pytest.raises(ValueError, match="parameters of another model"):
        replays.replay(dataclasses.replace(SPEC, depth=2), state)
    with pytest.raises(ValueError, match="replays from step"):
        replays.replay(dataclasses.replace(SPEC, steps=SPEC.steps + 1), state)
    with pytest.raises(ValueError, match="holds no training state"):
        replays.replay(SPEC, state.drop_vars("state_weight_change"))


def test_a_state_kept_at_any_step_is_the_runs_and_replays_deterministically(kept, tmp_path):
    _, stored, _ = kept
    # trained only up to its step, the state is the one the whole run keeps there, to the bit
    assert replays.keep_state(SPEC, replays.replay_start(SPEC)).equals(stored)
    assert replays.replay(SPEC, stored, replays.replay_start(SPEC)).equals(kept[2])  # as a stored baseline's
    state = load_dataset(save_dataset(replays.keep_state(SPEC, 1), tmp_path / "state.nc"))
    first, again = replays.replay(SPEC, state, 1), replays.replay(SPEC, state, 1)
    assert first.equals(again) and first.attrs["replayed_from"] == 1
    assert list(first["step"].values) == [1, 2] and list(first["train_step"].values) == [1, 2, 3]
    with pytest.raises(ValueError, match="kept before step 1, but this spec replays from step 2$"):
        replays.replay(SPEC, state, 2)
    with pytest.raises(
        ValueError, match="regenerate the baseline"
    ):  # a stored baseline's replay starts later
        replays.replay(SPEC, state)


def test_a_replay_near_the_end_trains_the_steps_left():
    state = replays.keep_state(SPEC, SPEC.steps - 1)
    assert replays.replay_steps(SPEC, SPEC.steps - 1) == 1
    assert list(replays.replay(SPEC, state, SPEC.steps - 1)["train_step"].values) == [
        SPEC.steps - 1,
        SPEC.steps,
    ]
    for start in (0, SPEC.steps):
        with pytest.raises(ValueError, match=f"steps 1 to {SPEC.steps - 1}, not before step {start}"):
            replays.keep_state(SPEC, start)


def test_a_users_model_keeps_a_state_for_diff():
    spec = RunSpec(model="user_code:build", batches="user_code:batches", steps=3, sample_every=1)
    state = replays.keep_state(spec, 1)
    assert replays.replay(spec, state, 1).equals(replays.replay(spec, state, 1))
    with pytest.raises(ValueError, match="parameters of another model .*only in the"):
        replays.replay(dataclasses.replace(spec, depth=1), state, 1)


def test_short_runs_and_user_models_keep_no_state():
    assert replays.replay_start(dataclasses.replace(SPEC, steps=replays.REPLAY_STEPS)) is None
    with pytest.raises(ValueError, match="keep no replay state"):
        replays.run_keeping_state(dataclasses.replace(SPEC, steps=1))


def test_a_missing_or_incomplete_stored_replay_says_how_to_create_it(kept, tmp_path):
    with pytest.raises(BaselineError, match="create it with: make-it"):
        load_replay(tmp_path, "gpt-softmax-fp8-block", regen_hint="make-it")
    stored = _stored(kept)
    path = replay_path(tmp_path, str(stored.attrs["case"]))
    save_dataset(
        stored.drop_attrs(deep=False).assign_attrs(
            {k: v for k, v in stored.attrs.items() if k != "replay_tolerance"}
        ),
        path,
    )
    with pytest.raises(BaselineError, match="lacks attribute.*replay_tolerance.*make-it"):
        load_replay(
            tmp_path,
            str(stored.attrs["case"]),
            expected_spec=json.loads(stored.attrs["spec"]),
            regen_hint="make-it",
        )
