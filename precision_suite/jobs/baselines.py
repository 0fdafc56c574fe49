"""Baseline regeneration: train each spec's seed ensemble (and the first step of its first seed
under each rounding twin) and write the baselines that changed. Used by `precision-suite baseline update` and
by the plugin's --precision-regen; reading, writing and comparing the files is verdicts.baselines.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from precision_suite.jobs.execution import Done, Task, run_tasks
from precision_suite.jobs.twins import rounding_twins
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.baselines import baseline_path, build_ensemble, update_baseline
from precision_suite.verdicts.ensemble import ENSEMBLE_SEEDS


def ensemble_tasks(spec: RunSpec, seeds: Sequence[int] | None = None) -> list[Task]:
    """The runs that make `spec`'s baseline: one per ensemble seed, then the first step of the
    first seed under each rounding twin (which measures the first-point tolerance). One seed's
    twins suffice: the tolerance is the largest difference over hundreds of series, and each
    twin that needs a fresh process costs seconds of start-up."""
    seeds = tuple(ENSEMBLE_SEEDS if seeds is None else seeds)
    case = case_id(spec)  # a first-step twin is another case by its own id: progress names this one
    tasks = [Task(dataclasses.replace(spec, seed=seed), label=f"{case} seed {seed}") for seed in seeds]
    for twin in rounding_twins():
        first_step = dataclasses.replace(spec, seed=seeds[0], steps=1, **twin.spec_changes)
        tasks.append(Task(first_step, env=twin.env, label=f"{case} seed {seeds[0]} first step, {twin.name}"))
    return tasks


def regenerate(specs: Sequence[RunSpec], baseline_dir: str | os.PathLike, workers: int = 1,
               progress: Done | None = None, seeds: Sequence[int] | None = None, *,
               scheduler: str | None = None) -> list[tuple[Path, bool]]:
    """Train every spec's ensemble (all cases' runs share one pool, or the Dask cluster at
    `scheduler`) and write each baseline that changed; returns (path, written) per spec. Nothing
    is written until every run has finished. Used by the command line and --precision-regen."""
    n_seeds = len(tuple(ENSEMBLE_SEEDS if seeds is None else seeds))
    per_spec = [ensemble_tasks(spec, seeds) for spec in specs]
    flat = [task for tasks in per_spec for task in tasks]
    results = run_tasks(flat, workers, progress, scheduler=scheduler)
    written, start = [], 0
    for spec, tasks in zip(specs, per_spec):
        ensemble = build_ensemble(results[start:start + len(tasks)], n_seeds)
        start += len(tasks)
        path = baseline_path(baseline_dir, case_id(spec))
        written.append((path, update_baseline(ensemble, path)))
    return written
