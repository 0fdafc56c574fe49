"""The calibrated comparison against seed ensembles (precision_suite.verdicts.ensemble): laws it promises.

Synthetic runs (tests/synthetic_data.py) differ between seeds like short training does; each law
is checked on both sides: the unchanged case passes, the change fails.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import xarray as xr

from precision_suite import cli
from precision_suite.numerics.metric_table import SPACES
from precision_suite.verdicts.baseline_files import BaselineError, load_ensemble, save_baseline
from precision_suite.verdicts.ensemble.build import leave_one_out, make_ensemble
from precision_suite.verdicts.ensemble.compare import compare_ensemble
from precision_suite.verdicts.ensemble.first_point import (
    FIRST_STEP_FLIPS,
    FIRST_STEP_SAFETY,
    count_allowance,
    first_step_count_noise,
    first_step_tolerance,
)
from precision_suite.verdicts.ensemble.series import EnsembleError
from synthetic_data import make_run_dataset

SEEDS = (0, 1, 2, 3)
CELL = dict(layer=1, tensor="gradient", layout="1x128")


# the rounding noise of a machine whose twins moved nothing: the floors, and counts by FIRST_STEP_FLIPS
FLOORS = {metric: space.first_step_floor for metric, space in SPACES.items() if space.kind != "log_count"}
NO_COUNT_NOISE = {metric: 0.0 for metric, space in SPACES.items() if space.kind == "log_count"}


def ensemble_of(seeds=SEEDS, **kwargs):
    runs = [make_run_dataset(seed=s, **kwargs) for s in seeds]
    return make_ensemble(runs, FLOORS, NO_COUNT_NOISE)


def kinds(findings):
    return sorted({(f.kind, f.metric) for f in findings})


def test_held_out_seeds_pass():
    ensemble = ensemble_of()
    for seed in (4, 5, 6, 11):
        assert compare_ensemble(make_run_dataset(seed=seed), ensemble) == []


def test_ensemble_members_pass_their_own_first_point():
    ensemble = ensemble_of()
    assert compare_ensemble(make_run_dataset(seed=2), ensemble) == []


@pytest.mark.parametrize("level", [1e-5, 1e-2])
def test_a_fourfold_fraction_change_is_visible_at_any_level(level):
    """Count-aware floor: visibility follows the number of elements counted, not the level. At
    1e-5 of 1e7 elements and at 1e-2 of 1e4 the count is 100 either way (Poisson spread 0.1 in
    log count, as large as the seeds' 10%); a factor 4 (ln 4 = 1.39) is about 8 spreads there."""

    def run(seed, factor=1.0):
        ds = make_run_dataset(seed=seed)
        ds["numel"][:] = round(100 / level)
        rng = np.random.default_rng(100 + seed)
        ds["underflow"].loc[CELL] = level * factor * (1 + 0.1 * rng.standard_normal(ds.sizes["step"]))
        return ds

    ensemble = make_ensemble([run(s) for s in SEEDS], FLOORS, NO_COUNT_NOISE)
    assert compare_ensemble(run(7), ensemble) == []
    found = compare_ensemble(run(7, factor=4.0), ensemble)
    assert ("regression", "underflow") in kinds(found)
    assert all(f.where["layer"] == 1 for f in found if f.metric == "underflow")


def test_one_excursion_of_a_seed_passes_and_a_shift_of_most_points_fails():
    """Persistence: a loss-spike-like excursion at one trained point, however large, is what
    seeds do; a change of the code shows at most points (the median moves)."""
    ensemble = ensemble_of()
    spiked = make_run_dataset(seed=9)
    spiked["attention_norm"].loc[{"step": spiked["step"][2]}] *= 50.0
    assert compare_ensemble(spiked, ensemble) == []
    shifted = make_run_dataset(seed=9)
    later = shifted["step"][shifted.sizes["step"] // 2 :]
    shifted["attention_norm"].loc[{"step": later}] *= 3.0
    found = [f for f in compare_ensemble(shifted, ensemble) if f.metric == "attention_norm"]
    assert found and {f.kind for f in found} == {"regression"}
    assert all("median over the" in f.message for f in found)


@pytest.mark.parametrize("factor", [0.2, 5.0])
def test_any_change_at_the_first_point_of_a_member_seed_fails(factor):
    ensemble = ensemble_of()
    current = make_run_dataset(seed=1)
    current["attention_norm"][0] = current["attention_norm"][0] * factor
    found = [f for f in compare_ensemble(current, ensemble) if f.metric == "attention_norm"]
    assert len(found) == current.sizes["layer"]  # one finding per layer, all at the first point
    for finding in found:
        assert finding.kind == "regression" and finding.where["step"] == 0
        assert "the computation itself changed" in finding.message


def test_rounding_sized_change_at_the_first_point_passes():
    ensemble = ensemble_of()
    current = make_run_dataset(seed=1)
    current["attention_norm"][0] = current["attention_norm"][0] * (1 + 1e-6)
    assert compare_ensemble(current, ensemble) == []


def first_point_count(ds, cell=CELL, metric="underflow"):
    numel = float(ds["numel"].sel(layer=cell["layer"], tensor=cell["tensor"]))
    return float(ds[metric].sel(step=0, **cell)) * numel, numel


@pytest.mark.parametrize("count_noise", [0.0, 0.5, 3.0])
def test_a_first_point_count_moves_within_the_twins_allowance_and_fails_beyond_it(count_noise):
    """The count model: a count may move by max(FIRST_STEP_FLIPS, SAFETY k sqrt(count + 1))
    elements by rounding alone, whatever the count, in either direction."""
    runs = [make_run_dataset(seed=s) for s in SEEDS]
    ensemble = make_ensemble(runs, FLOORS, {**NO_COUNT_NOISE, "underflow": count_noise})
    count, numel = first_point_count(runs[1])
    allowed = count_allowance(count_noise, count)
    assert allowed == max(FIRST_STEP_FLIPS, FIRST_STEP_SAFETY * count_noise * math.sqrt(count + 1))
    for elements, fails in [(math.floor(allowed), False), (math.floor(allowed) + 1, True)]:
        for sign in (1, -1):
            if count + sign * elements < 0:
                continue
            current = make_run_dataset(seed=1)
            current["underflow"].loc[dict(step=0, **CELL)] = (count + sign * elements) / numel
            found = [
                f
                for f in compare_ensemble(current, ensemble)
                if f.metric == "underflow" and f.where.get("step") == 0
            ]
            assert bool(found) == fails, (elements, sign, allowed)
            if fails:
                assert f"of {numel:,.0f} elements against {count:,.0f} in seed 1" in found[0].message
                assert f"allow ±{allowed:,.1f}" in found[0].message


def test_first_point_counts_that_all_move_one_way_fail_together_and_scattered_ones_pass():
    """Every series moves by about half its allowance (never beyond it alone): moves that cancel
    over the case (another host's rounding, up here and down there) pass; the same moves all up
    (a wrong block scale, a few elements in every series) fail, as one case-level finding."""
    runs = [make_run_dataset(seed=s) for s in SEEDS]
    ensemble = make_ensemble(runs, FLOORS, {**NO_COUNT_NOISE, "underflow": 0.5})
    counts = (runs[1]["underflow"].isel(step=0) * runs[1]["numel"]).transpose(*runs[1]["underflow"].dims[1:])
    half = count_allowance(0.5, counts) / 2
    up = np.zeros(counts.size, dtype=bool)
    up[np.argsort(half.values, axis=None)[::2]] = True  # every other series by size: halves alike
    up = xr.DataArray(up.reshape(counts.shape), dims=counts.dims)
    down_scale = float(half.where(up).sum() / half.where(~up).sum())  # so that the moves cancel
    assert 0.5 < down_scale < 2  # each move still within its series' allowance
    cancelling = xr.where(up, half, -half * down_scale)
    for moved, fails in [(cancelling, False), (half, True)]:
        current = make_run_dataset(seed=1)
        current["underflow"].loc[dict(step=0)] = (counts + moved) / runs[1]["numel"]
        found = [f for f in compare_ensemble(current, ensemble) if f.metric == "underflow"]
        assert all("moved together" in f.message for f in found)
        assert len(found) == int(fails), [f.message for f in found]


def test_count_noise_is_the_largest_twin_change_per_sqrt_count():
    reference = make_run_dataset(seed=0)
    twin = make_run_dataset(seed=0)
    count, numel = first_point_count(reference)
    twin["underflow"].loc[dict(step=0, **CELL)] = (count + 6) / numel
    noise = first_step_count_noise([reference], [twin])
    assert noise["underflow"] == pytest.approx(6 / math.sqrt(count + 1))
    assert noise["overflow"] == 0.0 and "distortion" not in noise
    tolerance = first_step_tolerance([reference], [twin])
    assert "underflow" not in tolerance and tolerance["distortion"] == SPACES["distortion"].first_step_floor


def test_a_new_nan_is_a_regression():
    ensemble = ensemble_of()
    current = make_run_dataset(seed=9)
    current["sqnr_db"].loc[{**CELL, "step": 20}] = np.nan
    assert ("regression", "sqnr_db") in kinds(compare_ensemble(current, ensemble))


def test_a_shift_of_every_trained_point_is_caught_by_persistence():
    ensemble = ensemble_of()
    current = make_run_dataset(seed=9)
    current["loss"][1:] = current["loss"][1:] * 1.5
    assert ("regression", "loss") in kinds(compare_ensemble(current, ensemble))


def test_old_single_run_and_one_seed_baselines_are_clear_errors(tmp_path):
    single = save_baseline(make_run_dataset(seed=0), tmp_path / "single.nc")
    with pytest.raises(BaselineError, match="single run, not a seed ensemble.*recreate it with"):
        load_ensemble(single)
    one = ensemble_of().isel(seed=[0])
    path = save_baseline(one, tmp_path / "one.nc")
    with pytest.raises(BaselineError, match="holds 1 seed; an ensemble needs at least 2"):
        load_ensemble(path)
    with pytest.raises(ValueError, match="at least 2 distinct seeds"):
        make_ensemble([make_run_dataset(seed=0)] * 2, {}, {})


def test_a_seed_that_is_not_an_integer_is_a_usage_error(capsys):
    assert cli.main(["run", "--seed", "seven"]) == 2
    assert "'seven' is not a non-negative integer seed" in capsys.readouterr().err


def test_ensemble_keeps_every_seed_and_the_spec_without_seed():
    ensemble = ensemble_of()
    assert list(ensemble["seed"].values) == list(SEEDS)
    assert "seed" not in json.loads(ensemble.attrs["spec"])
    assert json.loads(ensemble.attrs["ensemble_seeds"]) == list(SEEDS)


def test_each_member_left_out_is_judged_as_a_seed_outside_the_rest():
    ensemble = ensemble_of()
    left_out = leave_one_out(ensemble)
    assert [seed for seed, _, _ in left_out] == list(SEEDS)
    for seed, member, others in left_out:
        assert json.loads(member.attrs["spec"])["seed"] == seed
        assert seed not in others["seed"].values and others.sizes["seed"] == len(SEEDS) - 1
        assert compare_ensemble(member, others) == []
    with pytest.raises(EnsembleError, match="leaves no spread"):
        leave_one_out(ensemble.isel(seed=[0, 1]))


def test_the_case_level_band_is_a_student_t_band_that_tends_to_the_normal_one():
    from precision_suite.verdicts.ensemble.compare import mean_z_band
    from precision_suite.verdicts.ensemble.series import z_threshold

    metrics = len(SPACES)
    bands = [mean_z_band(1.0, n, metrics) for n in (3, 6, 30, 10**6)]
    assert bands == sorted(bands, reverse=True)  # fewer null runs: a wider band
    assert bands[-1] == pytest.approx(z_threshold(metrics), rel=1e-4)  # t with infinite df is normal
    assert mean_z_band(2.0, 6, metrics) == pytest.approx(2 * bands[1])


def test_every_series_moved_a_little_fails_the_case_level_check_and_no_series_alone():
    """A change that moves every series of a metric by less than the series band, but the mean
    of their medians beyond its band measured from runs of other seeds."""
    from precision_suite.verdicts.ensemble.build import build_ensemble
    from precision_suite.verdicts.ensemble.compare import mean_z_band, series_median_z
    from precision_suite.verdicts.ensemble.series import all_series, metric_series, spread, trained_threshold

    held_out = (4, 5)
    ensemble = build_ensemble(
        [make_run_dataset(seed=s) for s in (*SEEDS, *held_out)], len(SEEDS), len(held_out)
    )
    sigma, n = json.loads(ensemble.attrs["trained_mean_z_spread"])["distortion"]
    band = mean_z_band(sigma, int(n), len(json.loads(ensemble.attrs["trained_mean_z_spread"])))
    current = make_run_dataset(seed=100)
    assert compare_ensemble(current, ensemble) == []
    s = metric_series("distortion", current, ensemble)
    medians = series_median_z(s)
    shift = band - float(np.nanmean(medians)) + 0.5  # spreads added to every trained point
    series_band = trained_threshold(sum(len(x.groups) for x in all_series(current, ensemble)))
    assert np.nanmax(medians) + shift < series_band  # no series alone beyond its band
    _, sd = spread(s, 1)
    one_minus = np.exp(np.log(1.0 - s.cur_values) + shift * sd)  # y = ln(1 - cos): up is worse
    moved = current.copy(deep=True)
    order = [d for d in moved["distortion"].dims if d != "step"] + ["step"]
    values = moved["distortion"].transpose(*order).values.reshape(len(s.groups), -1)
    values[:, 1:] = 1.0 - one_minus[:, 1:]
    moved["distortion"] = (
        moved["distortion"]
        .transpose(*order)
        .copy(data=values.reshape(moved["distortion"].transpose(*order).shape))
        .transpose(*current["distortion"].dims)
    )
    findings = compare_ensemble(moved, ensemble)
    assert [(f.kind, f.metric) for f in findings] == [("regression", "distortion")]
    assert "case level" in findings[0].message and "moved together" in findings[0].message
