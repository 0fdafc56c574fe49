"""A seed-ensemble baseline made from its runs: the K members along `seed`, the first-point
rounding tolerance their twins measured, and the spread of the case-level mean z under no change,
from held-out seeds and each member left out of the others (`build_ensemble`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import xarray as xr

from precision_suite.verdicts.ensemble.compare import case_mean_z, mean_z_spread
from precision_suite.verdicts.ensemble.first_point import first_step_count_noise, first_step_tolerance
from precision_suite.verdicts.ensemble.series import ENSEMBLE_ATTRS, EnsembleError, ensemble_seeds

# Four seeds: each costs a full training run per case on regeneration, and the pooled spread
# (below) supplies the degrees of freedom that four seeds alone do not.
ENSEMBLE_SEEDS = (0, 1, 2, 3)
# Seeds trained at regeneration beside the ensemble and judged against it: with each member left
# out of the others, the null samples of the case-level mean z (`trained_mean_z_spread`)
MEAN_Z_HELD_OUT_SEEDS = (4, 5)


def make_ensemble(
    runs: Sequence[xr.Dataset],
    first_step_tolerance: Mapping[str, float],
    first_step_count_noise: Mapping[str, float],
    trained_mean_z_spread: Mapping[str, Sequence[float]] | None = None,
) -> xr.Dataset:
    """K runs of one case (one per seed) as one dataset with a `seed` dimension. Without
    `trained_mean_z_spread` (see `mean_z_spread`) the case-level trained check is not made."""
    seeds = [int(json.loads(r.attrs["spec"])["seed"]) for r in runs]
    if len(set(seeds)) != len(seeds) or len(seeds) < 2:
        raise EnsembleError(f"an ensemble needs at least 2 distinct seeds, got {seeds}")
    ds = xr.concat(
        list(runs),
        dim=xr.DataArray(seeds, dims="seed", name="seed"),
        data_vars="all",
        coords="minimal",
        compat="override",
        combine_attrs="override",
    )
    spec = json.loads(runs[0].attrs["spec"])
    spec.pop("seed")
    ds.attrs["spec"] = json.dumps(spec, sort_keys=True)
    ds.attrs["ensemble_seeds"] = json.dumps(seeds)
    ds.attrs["first_step_tolerance"] = json.dumps(dict(first_step_tolerance), sort_keys=True)
    ds.attrs["first_step_count_noise"] = json.dumps(dict(first_step_count_noise), sort_keys=True)
    ds.attrs["trained_mean_z_spread"] = json.dumps(
        {m: list(v) for m, v in (trained_mean_z_spread or {}).items()}, sort_keys=True
    )
    return ds


def leave_one_out(ensemble: xr.Dataset) -> list[tuple[int, xr.Dataset, xr.Dataset]]:
    """(seed, that member as a run, the other members as an ensemble) for every member: K free
    held-out runs to measure false alarms with (calibrate), no training needed. Needs K >= 3."""
    seeds = ensemble_seeds(ensemble)
    if len(seeds) < 3:
        raise EnsembleError(f"leaving one seed out of {len(seeds)} leaves no spread to judge by")
    spec = json.loads(ensemble.attrs["spec"])
    out = []
    for seed in seeds:
        rest = [s for s in seeds if s != seed]
        others = ensemble.sel(seed=rest).assign_attrs(ensemble_seeds=json.dumps(rest))
        member = ensemble.sel(seed=seed, drop=True).assign_attrs(
            spec=json.dumps({**spec, "seed": seed}, sort_keys=True)
        )
        for name in ENSEMBLE_ATTRS:
            member.attrs.pop(name, None)
        out.append((seed, member, others))
    return out


def build_ensemble(results: Sequence[xr.Dataset], n_seeds: int, n_held_out: int = 0) -> xr.Dataset:
    """The ensemble baseline from the results of `jobs.regenerate.ensemble_tasks` (in their order:
    the ensemble's seeds, held-out seeds, rounding twins). The held-out seeds and each member left
    out of the others are the null samples of the case-level trained check."""
    runs, held_out = list(results[:n_seeds]), list(results[n_seeds : n_seeds + n_held_out])
    twins = list(results[n_seeds + n_held_out :])
    tolerance, count_noise = first_step_tolerance(runs, twins), first_step_count_noise(runs, twins)
    ensemble = make_ensemble(runs, tolerance, count_noise)
    samples = [case_mean_z(run, ensemble) for run in held_out]
    if len(runs) >= 3:
        samples += [case_mean_z(member, others) for _, member, others in leave_one_out(ensemble)]
    return make_ensemble(runs, tolerance, count_noise, mean_z_spread(samples))
