"""Baseline regeneration: train each spec's seed ensemble (and the first step of its first seed
under each rounding twin), then replay its last steps from the state its first seed kept (under
each rounding twin too), and write the baselines and stored replays that changed. Used by
`precision-suite baseline update` (`update_baselines`) and by the plugin's --precision-regen;
reading and writing the files is verdicts.baseline_files and verdicts.stored_replays.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import xarray as xr

from precision_suite.jobs import train
from precision_suite.jobs.execution import Done, Task, run_tasks
from precision_suite.jobs.selection import Selection, selected_specs
from precision_suite.jobs.twins import rounding_twins
from precision_suite.jobs.usage import EXIT_OK
from precision_suite.training.replays import has_state, replay_start, split_state
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.baseline_files import baseline_path, update_baseline
from precision_suite.verdicts.ensemble.build import ENSEMBLE_SEEDS, MEAN_Z_HELD_OUT_SEEDS, build_ensemble
from precision_suite.verdicts.stored_replays import build_replay, replay_path


def ensemble_tasks(spec: RunSpec, seeds: Sequence[int] | None = None) -> list[Task]:
    """The runs that make `spec`'s baseline: one per ensemble seed (the first keeping the state
    its replays start from, where the case has replays), one per held-out seed (the null samples
    of the case-level trained check), then the first step of the first seed
    under each rounding twin (which measures the first-point tolerance). One seed's twins
    suffice: the tolerance is the largest difference over hundreds of series, and each twin that
    needs a fresh process costs seconds of start-up."""
    seeds = tuple(ENSEMBLE_SEEDS if seeds is None else seeds)
    case = case_id(spec)  # a first-step twin is another case by its own id: progress names this one
    keeps_state = replay_start(spec) is not None
    tasks = [
        Task(
            dataclasses.replace(spec, seed=seed),
            label=f"{case} seed {seed}",
            keep_state=keeps_state and seed == seeds[0],
        )
        for seed in seeds
    ]
    tasks += [
        Task(dataclasses.replace(spec, seed=seed), label=f"{case} held-out seed {seed}")
        for seed in held_out_seeds(seeds)
    ]
    for twin in rounding_twins():
        first_step = dataclasses.replace(spec, seed=seeds[0], steps=1, **twin.spec_changes)
        tasks.append(Task(first_step, env=twin.env, label=f"{case} seed {seeds[0]} first step, {twin.name}"))
    return tasks


def held_out_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    """The seeds trained beside an ensemble of `seeds` for its case-level trained check."""
    return tuple(seed for seed in MEAN_Z_HELD_OUT_SEEDS if seed not in seeds)


def replay_tasks(spec: RunSpec, state: xr.Dataset, seed: int = ENSEMBLE_SEEDS[0]) -> list[Task]:
    """The replay of `spec`'s last steps from `state`, then the same replay under each rounding
    twin (which measures the replay's tolerance)."""
    case, replayed = case_id(spec), dataclasses.replace(spec, seed=seed)
    tasks = [Task(replayed, label=f"{case} replay", replay_from=state)]
    for twin in rounding_twins():
        tasks.append(
            Task(
                dataclasses.replace(replayed, **twin.spec_changes),
                env=twin.env,
                label=f"{case} replay, {twin.name}",
                replay_from=state,
            )
        )
    return tasks


def regeneration_size(spec: RunSpec) -> int:
    """How many runs and replays `regenerate` trains for `spec` (progress lines count them)."""
    return len(ensemble_tasks(spec)) + (1 + len(rounding_twins()) if replay_start(spec) is not None else 0)


def regenerate(
    specs: Sequence[RunSpec],
    baseline_dir: str | os.PathLike,
    workers: int = 1,
    progress: Done | None = None,
    seeds: Sequence[int] | None = None,
    *,
    scheduler: str | None = None,
) -> list[tuple[Path, bool]]:
    """Train every spec's ensemble (all cases' runs share one pool, or the Dask cluster at
    `scheduler`) and write each baseline that changed; returns (path, written) per spec. Nothing
    is written until every run has finished. Used by the command line and --precision-regen."""
    seeds = tuple(ENSEMBLE_SEEDS if seeds is None else seeds)
    n_seeds, n_held_out = len(seeds), len(held_out_seeds(seeds))
    per_spec = [ensemble_tasks(spec, seeds) for spec in specs]
    results = _grouped(
        run_tasks([t for tasks in per_spec for t in tasks], workers, progress, scheduler=scheduler), per_spec
    )
    states: dict[int, xr.Dataset] = {}
    for index, runs in enumerate(results):
        if has_state(runs[0]):  # the first seed's run keeps its replays' state
            runs[0], states[index] = split_state(runs[0])
    # the replays start from the stored (rounded) state, so they wait for the runs that keep it
    per_replay = [replay_tasks(specs[index], state, seeds[0]) for index, state in states.items()]
    replayed = _grouped(
        run_tasks([t for tasks in per_replay for t in tasks], workers, progress, scheduler=scheduler),
        per_replay,
    )
    written = []
    for spec, runs in zip(specs, results):
        path = baseline_path(baseline_dir, case_id(spec))
        written.append((path, update_baseline(build_ensemble(runs, n_seeds, n_held_out), path)))
    for index, (replay, *twins) in zip(states, replayed):
        path = replay_path(baseline_dir, case_id(specs[index]))
        written.append((path, update_baseline(build_replay(replay, twins, states[index]), path)))
    return written


def _grouped(results: Sequence[xr.Dataset], per_spec: Sequence[Sequence[Task]]) -> list[list[xr.Dataset]]:
    """`results` of the flattened tasks of `per_spec`, back in one list per spec."""
    grouped, start = [], 0
    for tasks in per_spec:
        grouped.append(list(results[start : start + len(tasks)]))
        start += len(tasks)
    return grouped


def update_baselines(
    selection: Selection, *, baseline_dir: str, workers: int | None, scheduler: str | None
) -> int:
    """Train the selection's seed ensembles and (over)write their baselines."""
    specs = selected_specs(selection)
    where = train.placement(workers, scheduler)
    n_tasks = sum(regeneration_size(spec) for spec in specs)
    print(
        f"{len(specs)} case(s), {n_tasks} runs (seed ensembles and held-out seeds, the first steps of their rounding "
        f"twins, replays of their last steps) {train.describe(where, n_tasks)}",
        file=sys.stderr,
        flush=True,
    )
    with train.execution_errors(where):  # raised before any baseline is written
        written = regenerate(
            specs, baseline_dir, where.workers, train.task_progress(n_tasks), scheduler=where.scheduler
        )
    for path, changed in written:
        print(f"{'wrote' if changed else 'unchanged'} {path}")
    print(
        f"{len(specs)} baseline(s) updated; review with `git diff --stat {baseline_dir}` "
        "and commit them with the change that explains them"
    )
    return EXIT_OK
