"""Synthetic run datasets that follow docs/architecture.md (the run dataset schema).

Charts, reports and the CLI only depend on that schema, so their tests build datasets here instead
of training. The numbers are shaped like the seed figures (attention norm growing over steps,
small (1, 128) underflow, larger (128, 1) gradient-transpose underflow, distortion near 1) and are
fully determined by the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import xarray as xr

from precision_suite.files import SCHEMA_VERSION

TENSORS = ("activation", "gradient", "gradient_transpose", "weight")
OPERANDS = ("fprop.a", "fprop.b", "dgrad.a", "dgrad.b", "wgrad.a", "wgrad.b")
LAYOUTS = ("1x128", "128x1", "128x128")

# which (tensor, layout) pairs a run measures; every other pair is NaN, as the schema says
MEASURED = {
    ("activation", "1x128"),
    ("gradient", "1x128"),
    ("gradient_transpose", "128x1"),
    ("weight", "128x128"),
}


def spec_dict(
    model: str = "vit",
    attention: str = "softmax",
    recipe: str = "fp32",
    steps: int = 40,
    batch_size: int = 8,
    seed: int = 0,
    sample_every: int = 10,
) -> dict:
    """The RunSpec fields a dataset's `spec` attribute holds (as JSON)."""
    return {
        "model": model,
        "attention": attention,
        "recipe": recipe,
        "extra_formats": [],
        "steps": steps,
        "batch_size": batch_size,
        "seed": seed,
        "device": "cpu",
        "sample_every": sample_every,
    }


def case_name(spec: dict) -> str:
    return f"{spec['model']}-{spec['attention']}-{spec['recipe']}"


def make_run_dataset(
    model: str = "vit",
    attention: str = "softmax",
    recipe: str = "fp32",
    depth: int = 6,
    steps: int = 40,
    sample_every: int = 10,
    tokens_per_step: int = 512,
    seed: int = 0,
    growth: float = 1.0,
    observed: bool = False,
) -> xr.Dataset:
    """A dataset with the schema of `runs.run(spec)`; `growth` scales the attention-norm growth;
    `observed` adds the metrics of a model's own quantization per GEMM operand."""
    spec = spec_dict(model, attention, recipe, steps, 8, seed, sample_every)
    rng = np.random.default_rng(seed)
    sampled = np.unique(np.r_[np.arange(0, steps, sample_every), steps - 1]).astype(np.int64)
    train_step = np.arange(steps, dtype=np.int64)
    layer = np.arange(depth, dtype=np.int64)
    progress = (sampled / max(steps - 1, 1))[:, None]
    depth_factor = (1.0 + layer / max(depth - 1, 1))[None, :]
    attention_norm = (
        2.0
        * np.exp(growth * 3.0 * progress * depth_factor)
        * (1.0 + 0.05 * rng.random((sampled.size, depth)))
    )

    shape = (sampled.size, depth, len(TENSORS), len(LAYOUTS))
    measured = np.zeros(shape[2:], dtype=bool)
    for t, tensor in enumerate(TENSORS):
        for lo, layout in enumerate(LAYOUTS):
            measured[t, lo] = (tensor, layout) in MEASURED
    transpose = np.zeros(shape[2:], dtype=bool)
    transpose[TENSORS.index("gradient_transpose"), LAYOUTS.index("128x1")] = True
    base_underflow = np.where(transpose, 3e-2, 2e-4)
    underflow = base_underflow * (1.0 + rng.random(shape))
    distortion = 1.0 - np.where(transpose, 1e-2, 2e-4) * (1.0 + rng.random(shape))
    metrics = {
        "underflow": underflow,
        "zeros_after": underflow * 1.5,
        "overflow": np.zeros(shape),
        "distortion": distortion,
        "sqnr_db": 30.0 + 3.0 * rng.random(shape),
        "mse": 1e-6 * (1.0 + rng.random(shape)),
    }
    dims4 = ("step", "layer", "tensor", "layout")
    data_vars = {name: (dims4, np.where(measured, values, np.nan)) for name, values in metrics.items()}
    data_vars["attention_norm"] = (("step", "layer"), attention_norm)
    data_vars["nonfinite"] = (
        ("step", "layer", "tensor"),
        np.zeros((sampled.size, depth, len(TENSORS)), dtype=np.int64),
    )
    data_vars["numel"] = (("layer", "tensor"), np.full((depth, len(TENSORS)), 100_000, dtype=np.int64))
    coords = {
        "step": sampled,
        "tokens": ("step", (sampled + 1) * tokens_per_step),
        "layer": layer,
        "tensor": list(TENSORS),
        "layout": list(LAYOUTS),
        "train_step": train_step,
    }
    if observed:  # E4M3 forward, E5M2 gradients: the gradients' operands underflow more
        gradient = np.array(
            [operand.split(".")[1] == "a" and not operand.startswith("fprop") for operand in OPERANDS]
        )
        shape3 = (sampled.size, depth, len(OPERANDS))
        underflow3 = np.where(gradient, 1e-3, 1e-4) * (1.0 + rng.random(shape3))
        observed_metrics = {
            "underflow": underflow3,
            "zeros_after": 2.0 * underflow3,
            "overflow": np.zeros(shape3),
            "distortion": 1.0 - np.where(gradient, 1e-3, 3e-4) * (1.0 + rng.random(shape3)),
            "sqnr_db": 25.0 + 3.0 * rng.random(shape3),
            "mse": 1e-6 * (1.0 + rng.random(shape3)),
        }
        dims3 = ("step", "layer", "operand")
        data_vars.update({f"observed_{name}": (dims3, values) for name, values in observed_metrics.items()})
        data_vars["observed_numel"] = (dims3, np.full(shape3, 50_000, dtype=np.int64))
        coords["operand"] = list(OPERANDS)
    data_vars["loss"] = (("train_step",), 2.5 * np.exp(-train_step / steps) + 0.01 * rng.random(steps))
    data_vars["accuracy"] = (("train_step",), 1.0 - np.exp(-train_step / steps))
    return xr.Dataset(
        data_vars,
        coords=coords,
        attrs={
            "schema_version": SCHEMA_VERSION,
            "case": case_name(spec),
            "spec": json.dumps(spec),
            "fingerprint": json.dumps({"torch": "synthetic", "device": "cpu", "threads": 1}),
            "package_version": "0.1.0",
        },
    )


def synthetic_replay(spec) -> xr.Dataset:
    """A stand-in for `training.replays.replay(spec, state)`: the last sampled step and the last
    training steps of a synthetic run of `spec` (deterministic: a replay and its stored one agree)."""
    from precision_suite.training.replays import REPLAY_STEPS, replay_start
    from precision_suite.training.runs import case_id

    start = replay_start(spec)
    ds = make_run_dataset(
        model=spec.model,
        attention=spec.attention,
        recipe=spec.recipe,
        depth=2,
        steps=spec.steps + 1,
        sample_every=spec.steps,
        seed=spec.seed,
    )
    ds = ds.isel(step=[-1], train_step=slice(start, start + REPLAY_STEPS + 1))
    return ds.assign_attrs(case=case_id(spec), spec=spec.to_json(), replayed_from=start)


def fake_replays(monkeypatch, fake_run) -> None:
    """Make regeneration keep a stand-in state with `fake_run`'s runs and replays give
    `synthetic_replay`; fresh interpreters (rounding twins) are not started: their tasks run here."""
    from precision_suite.jobs import execution
    from precision_suite.training import replays

    def keep_state(spec):
        return fake_run(spec).assign(
            state_weight_change=("state_element", np.zeros(8, dtype=np.int8)),
            state_start_step=((), np.int64(replays.replay_start(spec))),
        )

    monkeypatch.setattr(replays, "run_keeping_state", keep_state)
    monkeypatch.setattr(replays, "replay", lambda spec, state, start=None: synthetic_replay(spec))
    monkeypatch.setattr(execution, "run_in_fresh_process", execution.train_here)


def history_store(
    store, baseline_dir, cases, n_commits: int, *, epoch_every: int = 5, plant=None, seed: int = 0
) -> list[str]:
    """A history store of `n_commits` commits of `cases`, built from their committed baselines
    without training: a commit changes the numbers every `epoch_every` commits (the same numbers in
    between, as on one host). Each change re-rolls every trained series by a fresh normal draw of
    its recorded noise (in the detection space: chaos moves a short run as far as another seed),
    and every replay delta by a normal draw of half its noise (the largest change the twins made).
    `plant` = (case, metric, where, factor, replay_shift, from_commit): from that commit on, the
    trained series at `where` is `factor` times larger and its replay delta `replay_shift` noise
    units larger. Returns the commits' SHAs, oldest first."""
    import datetime
    import hashlib

    from precision_suite.files import load_dataset
    from precision_suite.jobs.history_store import (
        encode_record,
        host_of,
        record_path,
        store_schema,
        write_record,
    )
    from precision_suite.verdicts.history_records import HEADLINE_METRICS, summarize

    store_schema(store, create=True)
    rng = np.random.default_rng(seed)
    shas = [hashlib.sha1(f"commit {i}".encode()).hexdigest() for i in range(n_commits)]
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    for case in cases:
        baseline = load_dataset(Path(baseline_dir) / f"{case}.nc")
        stored_path = Path(baseline_dir) / "replays" / f"{case}.nc"
        stored = load_dataset(stored_path) if stored_path.is_file() else None
        first = summarize(
            baseline.isel(seed=0, drop=True), ensemble=baseline, replay=stored, stored_replay=stored
        )
        host, fingerprint = host_of(baseline)
        record = None
        for i, sha in enumerate(shas):
            if i % epoch_every == 0:  # a commit that changes the numbers
                record = first.copy(deep=True)
                for metric in HEADLINE_METRICS:
                    name = f"trained_{metric}"
                    if f"{name}_noise" in record:
                        record[name] = _redrawn(
                            metric, record[name], record[f"{name}_noise"], record.get("numel"), rng
                        )
                    if f"replay_{metric}_delta" in record:
                        noise = record[f"replay_{metric}_noise"]
                        delta = first[f"replay_{metric}_delta"]  # NaN where the replay measures nothing
                        record[f"replay_{metric}_delta"] = (
                            0.5 * noise * rng.standard_normal(noise.shape)
                        ).where(delta.notnull())
            planted = record.copy(deep=True)
            if plant is not None and plant[0] == case and i >= plant[5]:
                _, metric, where, factor, shift, _ = plant
                planted[f"trained_{metric}"].loc[where] = planted[f"trained_{metric}"].loc[where] * factor
                if f"replay_{metric}_delta" in planted:
                    noise = planted[f"replay_{metric}_noise"].loc[where]
                    planted[f"replay_{metric}_delta"].loc[where] = (
                        planted[f"replay_{metric}_delta"].loc[where] + shift * noise
                    )
            write_record(
                encode_record(
                    planted.assign_attrs(
                        case=case,
                        seed=0,
                        spec=baseline.attrs["spec"],
                        host=host,
                        fingerprint=json.dumps(fingerprint),
                        recorded=start.isoformat(),
                        package_version="synthetic",
                        commit=sha,
                        commit_time=(start + datetime.timedelta(hours=i)).isoformat(),
                        commit_depth=i + 1,
                        subject=f"commit {i}",
                        branch="main",
                    )
                ),
                record_path(store, host, case, sha),
            )
    return shas


def _redrawn(metric, values, noise, numel, rng):
    """`values` moved by a normal draw of `noise` in the detection space (`Space.detection`)."""
    from precision_suite.numerics.metric_table import SPACES

    space = SPACES[metric]
    n = None if numel is None or not space.is_count else numel.broadcast_like(values).values
    y = space.detection(values.values, n) + noise.values * rng.standard_normal(values.shape)
    if space.is_count:  # the inverse of 2 sqrt(count + 3/8)
        moved = np.maximum((y / 2.0) ** 2 - 0.375, 0.0) / (1.0 if n is None else n)
    else:
        moved = space.inverse(y)
    return values.copy(data=np.where(np.isfinite(moved), moved, values.values))
