"""Golden baselines: file safety (atomic, clear errors) and the per-metric comparison rules.

Expected numbers are derived from DEFAULT_TOLERANCES and `tolerance_band`, never pasted, so the
tests keep their meaning when a tolerance is retuned.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_suite.files import SCHEMA_VERSION
from precision_suite.verdicts.baseline_files import BaselineError, baseline_path, load_baseline, save_baseline
from precision_suite.verdicts.tolerances import (
    DEFAULT_TOLERANCES,
    Tolerance,
    compare,
    deviation,
    resolve_tolerances,
    tolerance_band,
)
from synthetic_data import make_run_dataset

COMPARED = sorted(DEFAULT_TOLERANCES)
WITH_TOLERANCE = [m for m in COMPARED if DEFAULT_TOLERANCES[m].tol > 0]


@pytest.fixture(scope="module")
def base() -> xr.Dataset:
    ds = make_run_dataset(depth=4, steps=30, sample_every=10, observed=True)
    ds["nonfinite"][:] = 2  # so that fewer non-finite values (a good move) is possible
    return ds


def probe_cell(ds: xr.Dataset, metric: str) -> dict:
    """Coordinates of a finite cell of `metric` at its first time point (where `tol` applies)."""
    da = ds[metric]
    time = [i for i, d in enumerate(da.dims) if d in ("step", "train_step")][0]
    finite = np.argwhere(np.isfinite(da.values))
    finite = finite[finite[:, time] == 0]
    index = finite[len(finite) // 2]
    return {dim: da[dim].values[i].item() for dim, i in zip(da.dims, index)}


def with_value(ds: xr.Dataset, metric: str, cell: dict, value: float) -> xr.Dataset:
    out = ds.copy(deep=True)
    out[metric].loc[cell] = value
    return out


def shifted(metric: str, reference: float, k: float) -> float:
    """The value whose deviation from `reference` is k tolerances in the bad (k > 0) direction."""
    tol = DEFAULT_TOLERANCES[metric]
    lower, upper = tolerance_band(
        metric, np.array([reference]), dataclasses.replace(tol, tol=abs(k) * tol.tol)
    )
    lower, upper = lower[0], upper[0]
    bad_edge = upper if deviation(tol, upper, np.array(reference)) > 0 else lower
    good_edge = lower if bad_edge is upper else upper
    return float(bad_edge if k > 0 else good_edge)


# --------------------------------------------------------------------------- comparison


def test_identical_runs_have_no_findings(base):
    # the synthetic run has NaN (unmeasured) cells: matching NaN must be ignored
    assert np.isnan(base["underflow"].values).any()
    assert compare(base, base.copy(deep=True)) == []


@pytest.mark.parametrize("metric", WITH_TOLERANCE)
@pytest.mark.parametrize("k, kind", [(1.5, "regression"), (-1.5, "drift"), (0.8, None), (-0.8, None)])
def test_direction_and_tolerance(base, metric, k, kind):
    cell = probe_cell(base, metric)
    reference = float(base[metric].loc[cell])
    current = with_value(base, metric, cell, shifted(metric, reference, k))
    findings = compare(current, base)
    if kind is None:
        assert findings == []
        return
    (finding,) = findings
    assert (finding.kind, finding.metric, finding.case) == (kind, metric, base.attrs["case"])
    assert finding.where == cell
    assert finding.reference == reference
    assert finding.value == float(current[metric].loc[cell])
    assert finding.tolerance == DEFAULT_TOLERANCES[metric].tol
    assert metric in finding.message and base.attrs["case"] in finding.message
    assert all(f"{dim} {value}" in finding.message for dim, value in cell.items())


@pytest.mark.parametrize("metric", [m for m in WITH_TOLERANCE if DEFAULT_TOLERANCES[m].trained])
def test_later_time_points_use_the_trained_tolerance(base, metric):
    """A move of 1.5 `tol` is a regression at the first time point and accepted later, while
    1.5 `trained` is a regression there too."""
    tol = DEFAULT_TOLERANCES[metric]
    first = probe_cell(base, metric)
    time_dim = next(d for d in first if d in ("step", "train_step"))
    later = {**first, time_dim: base[time_dim].values[-1].item()}
    assert np.isfinite(float(base[metric].loc[later]))
    trained = dataclasses.replace(tol, tol=tol.trained)
    for cell, k, tolerance, kinds in (
        (first, 1.5, tol, ["regression"]),
        (later, 1.5, tol, []),
        (later, 1.5, trained, ["regression"]),
    ):
        reference = float(base[metric].loc[cell])
        lower, upper = tolerance_band(
            metric, np.array([reference]), dataclasses.replace(tolerance, tol=k * tolerance.tol, trained=None)
        )
        bad = upper[0] if deviation(tol, upper, np.array([reference]))[0] > 0 else lower[0]
        assert [f.kind for f in compare(with_value(base, metric, cell, float(bad)), base)] == kinds


@pytest.mark.parametrize("metric", [m for m in COMPARED if DEFAULT_TOLERANCES[m].tol == 0])
def test_zero_tolerance_counts_any_change(base, metric):
    cell = probe_cell(base, metric)
    reference = float(base[metric].loc[cell])
    bad = 1 if DEFAULT_TOLERANCES[metric].bad == "up" else -1
    assert [f.kind for f in compare(with_value(base, metric, cell, reference + bad), base)] == ["regression"]
    assert [f.kind for f in compare(with_value(base, metric, cell, reference - bad), base)] == ["drift"]


@settings(max_examples=40, deadline=None)
@given(metric=st.sampled_from(WITH_TOLERANCE), k=st.floats(-3, 3).filter(lambda k: 0.02 < abs(abs(k) - 1)))
def test_kind_follows_the_size_and_sign_of_the_move(base, metric, k):
    """Law: a move of k tolerances is a regression iff k > 1, drift iff k < -1, else nothing."""
    cell = probe_cell(base, metric)
    current = with_value(base, metric, cell, shifted(metric, float(base[metric].loc[cell]), k))
    kinds = [f.kind for f in compare(current, base)]
    assert kinds == (["regression"] if k > 1 else ["drift"] if k < -1 else [])


@pytest.mark.parametrize("metric", WITH_TOLERANCE)
def test_band_edges_are_exactly_one_tolerance_away(base, metric):
    """The band that charts shade is the band that `compare` accepts: `tol` at the first time
    point, `trained` after it."""
    tol = DEFAULT_TOLERANCES[metric]
    time_axis = [d for d in base[metric].dims if d in ("step", "train_step")]
    reference = np.moveaxis(base[metric].values, base[metric].dims.index(time_axis[0]), -1)
    expected = np.broadcast_to(tol.at(reference.shape[-1]), reference.shape)
    finite = np.isfinite(reference)
    for edge in tolerance_band(metric, reference, tol):
        np.testing.assert_allclose(
            np.abs(deviation(tol, edge, reference))[finite], expected[finite], rtol=1e-6
        )


def test_each_metric_has_its_documented_direction():
    bad_moves = {
        "attention_norm": 2.0,
        "underflow": 1.0,
        "overflow": 1.0,
        "zeros_after": 1.0,
        "sqnr_db": -1.0,
        "loss": 1.0,
        "nonfinite": 1.0,
        "distortion": -1.0,
    }
    # the model's own quantization is judged as the probes' same metric
    bad_moves.update(
        {
            f"observed_{m}": bad_moves[m]
            for m in ("underflow", "overflow", "zeros_after", "sqnr_db", "distortion")
        }
    )
    assert set(bad_moves) == set(DEFAULT_TOLERANCES)
    for metric, step in bad_moves.items():
        reference = np.array(0.5)
        moved = reference * step if metric == "attention_norm" else reference + step * 0.1
        assert deviation(DEFAULT_TOLERANCES[metric], moved, reference) > 0, metric


def test_new_nan_or_inf_is_a_regression_and_a_newly_measured_cell_is_drift(base):
    cell = probe_cell(base, "underflow")
    for value in (np.nan, np.inf):
        (finding,) = compare(with_value(base, "underflow", cell, value), base)
        assert finding.kind == "regression" and "non-finite" in finding.message
    (finding,) = compare(base, with_value(base, "underflow", cell, np.nan))
    assert finding.kind == "drift"


def test_sqnr_falling_from_an_exact_reconstruction_is_a_regression(base):
    """A baseline SQNR of +inf (x_hat == x) becoming finite is worse, not 'measured now'."""
    cell = probe_cell(base, "sqnr_db")
    exact = with_value(base, "sqnr_db", cell, np.inf)
    (finding,) = compare(base, exact)
    assert (finding.kind, finding.metric) == ("regression", "sqnr_db")


def test_one_finding_per_series_at_its_worst_step(base):
    cell = probe_cell(base, "attention_norm")
    current = base.copy(deep=True)
    series = current["attention_norm"].loc[{"layer": cell["layer"]}]
    # every step beyond its own tolerance, the last one furthest
    n = series.sizes["step"]
    factors = np.exp(DEFAULT_TOLERANCES["attention_norm"].at(n) * np.linspace(1.2, 2.0, n))
    current["attention_norm"].loc[{"layer": cell["layer"]}] = series * factors
    (finding,) = compare(current, base)
    assert finding.where == {"layer": cell["layer"], "step": int(base["step"].values[-1])}
    assert f"{series.sizes['step']} of {series.sizes['step']} steps" in finding.message


def test_mismatched_coordinates_are_an_error_and_common_ones_still_compared(base):
    current = base.isel(layer=slice(0, 3)).copy(deep=True)
    current["attention_norm"].loc[{"layer": 0}] *= 2
    findings = compare(current, base)
    errors = [f for f in findings if f.kind == "error"]
    assert errors and all("layer [3] only in the baseline" in f.message for f in errors)
    assert [f.where["layer"] for f in findings if f.kind == "regression"] == [0]


def test_missing_metric_is_an_error(base):
    (finding,) = compare(base.drop_vars("sqnr_db"), base)
    assert (
        finding.kind == "error"
        and finding.metric == "sqnr_db"
        and "missing from the current run" in finding.message
    )


def test_overrides_per_case(base):
    cell = probe_cell(base, "underflow")
    reference = float(base["underflow"].loc[cell])
    current = with_value(base, "underflow", cell, shifted("underflow", reference, 2.0))
    wider = 3 * DEFAULT_TOLERANCES["underflow"].tol
    assert compare(current, base, {"underflow": wider}) == []
    assert compare(current, base, {"underflow": {"tol": wider}}) == []
    assert compare(current, base, {"underflow": None}) == []
    # later layers win: the test's override replaces the project's
    assert [f.kind for f in compare(current, base, [{"underflow": wider}, {"underflow": None}])] == []
    assert (
        len(compare(current, base, [{"underflow": None}, {"underflow": DEFAULT_TOLERANCES["underflow"]}]))
        == 1
    )


def test_metrics_without_default_need_a_full_tolerance(base):
    with pytest.raises(ValueError, match="'mse' has no default tolerance"):
        resolve_tolerances({"mse": 0.1})
    cell = probe_cell(base, "mse")
    current = with_value(base, "mse", cell, float(base["mse"].loc[cell]) * 2)
    assert compare(current, base) == []  # not compared by default
    (finding,) = compare(current, base, {"mse": Tolerance("relative", 0.5, "up")})
    assert finding.kind == "regression"


@pytest.mark.parametrize("bad", [{"tol": -1}, {"space": "cubic"}, {"bad": "sideways"}, {"toll": 1}, True])
def test_bad_overrides_are_rejected_with_the_field_named(bad):
    with pytest.raises(ValueError, match="tol|space|bad|toll|number"):
        resolve_tolerances({"underflow": bad})


# --------------------------------------------------------------------------- files


def test_round_trip_is_exact(base, tmp_path):
    path = save_baseline(base, tmp_path / "case.nc")
    loaded = load_baseline(path, expected_spec=base.attrs["spec"])
    assert loaded.identical(base)
    assert compare(base, loaded) == []
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # readable like any new file


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_missing_baseline_names_the_command_that_creates_it(tmp_path):
    path = tmp_path / "vit-softmax-fp32.nc"
    with pytest.raises(
        BaselineError, match=r"no baseline .*precision-suite baseline update --case 'vit-softmax-fp32'"
    ):
        load_baseline(path)
    with pytest.raises(BaselineError, match=r"pytest tests/x.py::t --precision-regen"):
        load_baseline(path, regen_hint="pytest tests/x.py::t --precision-regen")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_baseline_fails_clearly(base, tmp_path, damage):
    path = save_baseline(base, tmp_path / "case.nc")
    data = path.read_bytes()
    path.write_bytes(
        {"garbage": b"not a netCDF file" * 10, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    with pytest.raises(BaselineError, match="corrupt or not a netCDF file"):
        load_baseline(path)


def test_other_schema_version_fails(base, tmp_path):
    old = base.copy()
    old.attrs = {**base.attrs, "schema_version": SCHEMA_VERSION - 1}
    path = save_baseline(old, tmp_path / "case.nc")
    with pytest.raises(
        BaselineError,
        match=f"schema_version {SCHEMA_VERSION - 1}, this precision-suite reads {SCHEMA_VERSION}",
    ):
        load_baseline(path)


def test_other_spec_fails_naming_the_fields(base, tmp_path):
    path = save_baseline(base, tmp_path / "case.nc")
    spec = json.loads(base.attrs["spec"])
    # seed, threads and device say how a run of the case was made, not what the case is
    changed = {**spec, "steps": spec["steps"] + 10, "batch_size": 16, "seed": 7}
    with pytest.raises(
        BaselineError, match=r"batch_size: baseline 8, current 16; steps: baseline 30, current 40\)"
    ):
        load_baseline(path, expected_spec=json.dumps(changed))
    # the device says where a case ran, not what it is
    assert load_baseline(path, expected_spec={**spec, "device": "cuda"}).identical(base)


def test_a_dataset_without_the_baseline_attributes_is_not_saved(base, tmp_path):
    bare = base.copy()
    bare.attrs = {k: v for k, v in base.attrs.items() if k != "fingerprint"}
    with pytest.raises(BaselineError, match="fingerprint"):
        save_baseline(bare, tmp_path / "case.nc")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_old_baseline(base, tmp_path, monkeypatch):
    path = save_baseline(base, tmp_path / "case.nc")
    before = path.read_bytes()

    def crash(self, target, **kwargs):
        Path(target).write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(xr.Dataset, "to_netcdf", crash)
    with pytest.raises(OSError, match="disk full"):
        save_baseline(base, path)
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]


def test_concurrent_writers_leave_one_complete_file(base, tmp_path):
    path = tmp_path / "case.nc"
    versions = [base.assign(loss=base["loss"] + i) for i in range(4)]
    threads = [threading.Thread(target=save_baseline, args=(ds, path)) for ds in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    loaded = load_baseline(path)
    assert any(loaded.identical(ds) for ds in versions)
    assert list(tmp_path.iterdir()) == [path]


def test_baseline_file_names_are_safe_and_distinct(tmp_path):
    cases = ["vit-x^3/sqrt(N)-fp32", "vit-x^3_sqrt(N)-fp32", "vit-x^3/sqrt(N)-fp32 ", "gpt-softmax-fp8"]
    paths = [baseline_path(tmp_path, case) for case in cases]
    assert len(set(paths)) == len(cases)
    assert all(p.parent == tmp_path and p.suffix == ".nc" and "/" not in p.name for p in paths)
    assert paths[-1].name == "gpt-softmax-fp8.nc"  # safe ids are kept as they are
