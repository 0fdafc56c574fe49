"""The pytest plugin, driven through pytester: options, markers, fixtures, regen, failures, charts.

Inner test sessions check synthetic run datasets (docs/architecture.md schema) saved next to them,
so no training happens here.
"""

from __future__ import annotations

import math
import sys
import types
import xml.etree.ElementTree as ET

# pytester drops the modules an inner run imported; h5py cannot load twice and matplotlib's classes
# must stay the same objects, so both are loaded once here, before any inner run
import h5py  # noqa: F401
import pytest
import xarray as xr

import precision_suite.charts  # noqa: F401

from precision_suite.baselines import DEFAULT_TOLERANCES, baseline_path
from precision_suite.runs import RunSpec
from synthetic_data import make_run_dataset

pytest_plugins = ["pytester"]

CHECK_FILE = """
import pytest
import xarray as xr

@pytest.mark.precision
def test_case(precision_check):
    precision_check(xr.load_dataset("current.nc", engine="h5netcdf"){args})
"""


@pytest.fixture
def run() -> xr.Dataset:
    ds = make_run_dataset(depth=3, steps=20, sample_every=10)
    ds.attrs["N"] = 17
    return ds


def save_current(pytester: pytest.Pytester, ds: xr.Dataset) -> None:
    ds.to_netcdf(pytester.path / "current.nc", engine="h5netcdf")


def make_check(pytester: pytest.Pytester, ds: xr.Dataset, args: str = "") -> None:
    save_current(pytester, ds)
    pytester.makepyfile(test_inner_case=CHECK_FILE.format(args=args))


def junit_properties(path) -> dict[str, list[str]]:
    props: dict[str, list[str]] = {}
    for prop in ET.parse(path).getroot().iter("property"):
        props.setdefault(prop.get("name"), []).append(prop.get("value"))
    return props


def regressed(ds: xr.Dataset) -> xr.Dataset:
    """`ds` with layer 1's attention norm three tolerances higher (a planted regression)."""
    out = ds.copy(deep=True)
    out["attention_norm"].loc[{"layer": 1}] *= math.exp(3 * DEFAULT_TOLERANCES["attention_norm"].tol)
    return out


# --------------------------------------------------------------------------- options and markers


def test_options_ini_keys_and_markers_are_registered(pytester):
    help_text = pytester.runpytest("--help").stdout.str()
    for option in ("--precision-regen", "--precision-baseline-dir", "--precision-report-dir",
                   "--precision-device", "precision_baseline_dir", "precision_report_dir", "precision_device"):
        assert option in help_text
    markers = pytester.runpytest("--markers").stdout.str()
    assert "@pytest.mark.precision:" in markers and "@pytest.mark.slow:" in markers


def test_a_project_slow_marker_is_kept(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: the project's own words\n")
    markers = pytester.runpytest("--markers").stdout.str()
    assert "the project's own words" in markers and markers.count("@pytest.mark.slow:") == 1


def test_bad_device_is_a_usage_error(pytester):
    result = pytester.runpytest("--precision-device", "gpu0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--precision-device*'gpu0' is not a device*"])


# --------------------------------------------------------------------------- baselines


def test_missing_baseline_regen_then_pass(pytester, run):
    make_check(pytester, run)
    first = pytester.runpytest()
    first.assert_outcomes(failed=1)
    first.stdout.fnmatch_lines(["*no baseline*create it with: pytest 'test_inner_case.py::test_case' --precision-regen"
                                "*precision-suite baseline update --case 'vit-softmax-fp32'*"])

    regen = pytester.runpytest("--precision-regen")
    regen.assert_outcomes(passed=1)
    path = baseline_path(pytester.path / "baselines", run.attrs["case"])
    assert path.is_file()
    regen.stdout.fnmatch_lines(["*precision-suite*", f"baseline written  {path}"])

    pytester.runpytest().assert_outcomes(passed=1)
    # regenerating unchanged numbers leaves the file alone (no churn in git)
    written = path.read_bytes()
    assert "baseline written" not in pytester.runpytest("--precision-regen").stdout.str()
    assert path.read_bytes() == written


def test_planted_regression_fails_with_a_chart_and_keeps_the_baseline(pytester, run):
    make_check(pytester, run)
    pytester.runpytest("--precision-regen").assert_outcomes(passed=1)
    path = baseline_path(pytester.path / "baselines", run.attrs["case"])
    golden = path.read_bytes()

    save_current(pytester, regressed(run))
    result = pytester.runpytest("--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*precision check of vit-softmax-fp32: FAIL*",
                                 "*[[]regression[]] vit-softmax-fp32: attention_norm regressed at layer 1*",
                                 "*precision-suite*", "FAIL*vit-softmax-fp32*(test_inner_case.py::test_case)"])
    props = junit_properties(pytester.path / "junit.xml")
    assert props["precision_status"] == ["fail"] and props["precision_case"] == [run.attrs["case"]]
    (chart,) = props["precision_chart"]
    assert chart.startswith(str(pytester.path / "reports")) and chart.endswith(".png")
    assert (pytester.path / "reports" / "charts").is_dir() and open(chart, "rb").read(4) == b"\x89PNG"
    result.stdout.fnmatch_lines([f"chart  {chart}"])
    assert path.read_bytes() == golden  # a failed comparison never rewrites the baseline

    # regeneration is explicit: asked for, it accepts the new numbers
    pytester.runpytest("--precision-regen").assert_outcomes(passed=1)
    assert path.read_bytes() != golden
    pytester.runpytest().assert_outcomes(passed=1)


def test_drift_passes_but_is_reported(pytester, run):
    make_check(pytester, run)
    pytester.runpytest("--precision-regen").assert_outcomes(passed=1)
    better = run.copy(deep=True)
    better["attention_norm"] = run["attention_norm"] / 2
    save_current(pytester, better)
    result = pytester.runpytest("--junitxml=junit.xml")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*precision-suite*", "DRIFT*vit-softmax-fp32*", "chart  *.png"])
    assert junit_properties(pytester.path / "junit.xml")["precision_status"] == ["drift"]


def test_spec_change_fails_naming_the_field(pytester, run):
    make_check(pytester, run)
    pytester.runpytest("--precision-regen").assert_outcomes(passed=1)
    changed = run.copy()
    changed.attrs = {**run.attrs, "spec": run.attrs["spec"].replace('"seed": 0', '"seed": 5')}
    save_current(pytester, changed)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]error[]]*made for another spec (seed: baseline 0, current 5)*--precision-regen*"])


def test_dirs_from_ini_and_command_line(pytester, run):
    pytester.makeini("[pytest]\nprecision_baseline_dir = golden\nprecision_report_dir = out\n")
    make_check(pytester, run)
    pytester.runpytest("--precision-regen").assert_outcomes(passed=1)
    assert baseline_path(pytester.path / "golden", run.attrs["case"]).is_file()
    pytester.runpytest("--precision-regen", "--precision-baseline-dir", "other").assert_outcomes(passed=1)
    assert baseline_path(pytester.path / "other", run.attrs["case"]).is_file()
    save_current(pytester, regressed(run))
    pytester.runpytest("--junitxml=j.xml").assert_outcomes(failed=1)
    (chart,) = junit_properties(pytester.path / "j.xml")["precision_chart"]
    assert chart.startswith(str(pytester.path / "out"))


# --------------------------------------------------------------------------- rules and tolerances


def test_project_rules_and_call_rules_are_checked(pytester, run):
    pytester.makepyprojecttoml('[tool.precision_suite]\nrules = ["attention_norm <= sqrt(N) @ attention=softmax"]\n')
    make_check(pytester, run)
    result = pytester.runpytest("--precision-regen")  # the synthetic norms grow far past sqrt(N)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]threshold[]]*rule 'attention_norm <= sqrt(N) @ attention=softmax' violated at layer 0*",
                                 "*baseline*not written*"])
    assert not baseline_path(pytester.path / "baselines", run.attrs["case"]).exists()

    pytester.makepyprojecttoml("[tool.precision_suite]\nrules = []\n")
    pytester.makepyfile(test_inner_case=CHECK_FILE.format(args=', rules=["growth(attention_norm) <= 2 @ layer=2"]'))
    result = pytester.runpytest("--precision-regen")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rule 'growth(attention_norm) <= 2 @ layer=2' violated at layer 2, step 19*"])


def test_bad_rules_and_config_fail_readably(pytester, run):
    make_check(pytester, run, args=', rules=["underflow < 1"]')
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*precision check configuration: rule 1 ('underflow < 1')*"])
    pytester.makepyprojecttoml("[tool.precision_suite]\nrulez = []\n")
    make_check(pytester, run)
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*pyproject.toml: [[]tool.precision_suite[]] has unknown key(s) rulez*"])


def test_per_call_tolerances(pytester, run):
    make_check(pytester, run, args=', tolerances={"attention_norm": 1.0}')
    pytester.runpytest("--precision-regen").assert_outcomes(passed=1)
    save_current(pytester, regressed(run))
    pytester.runpytest().assert_outcomes(passed=1)


# --------------------------------------------------------------------------- the run fixture


def vit(attention: str = "softmax", device: str = "auto") -> RunSpec:
    return RunSpec(model="vit", attention=attention, device=device)


def test_precision_run_runs_each_spec_once_per_session(pytester, monkeypatch):
    calls = []

    def fake_run(spec):
        calls.append(spec)
        return make_run_dataset(attention=spec.attention, depth=2, steps=10)

    monkeypatch.setitem(sys.modules, "precision_suite.runs", types.SimpleNamespace(run=fake_run, RunSpec=RunSpec))
    pytester.makepyfile(test_inner_runs=f"""
        from {__name__} import vit

        def test_a(precision_run):
            assert precision_run(vit()).attrs["case"] == "vit-softmax-fp32"

        def test_b(precision_run):
            assert precision_run(vit()) is precision_run(vit())
            assert precision_run(dict(model="vit", attention="softmax")) is precision_run(vit())
            assert precision_run(vit("x/1")).attrs["case"] == "vit-x/1-fp32"
    """)
    pytester.runpytest("--precision-device", "cpu").assert_outcomes(passed=2)
    assert calls == [vit("softmax", "cpu"), vit("x/1", "cpu")]


def test_a_bad_spec_fails_with_the_reason_only(pytester, monkeypatch):
    def fake_run(spec):
        raise ValueError(f"unknown attention {spec.attention!r}; known: softmax, x/1")

    monkeypatch.setitem(sys.modules, "precision_suite.runs", types.SimpleNamespace(run=fake_run, RunSpec=RunSpec))
    pytester.makepyfile(test_inner_bad=f"""
        from {__name__} import vit

        def test_bad(precision_check):
            precision_check(vit("nope"))
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["precision run of RunSpec(model='vit', attention='nope'*): "
                                 "unknown attention 'nope'; known: softmax, x/1"])
    assert "Traceback" not in result.stdout.str() and "During handling" not in result.stdout.str()


@pytest.mark.slow
def test_xdist_workers_report_charts_to_the_controller(pytester, run):
    pytester.makepyfile(test_inner_cases="""
        import pytest
        import xarray as xr

        @pytest.mark.parametrize("name", ["a", "b"])
        def test_case(precision_check, name):
            precision_check(xr.load_dataset(f"{name}.nc", engine="h5netcdf"))
    """)
    for name, attention in (("a", "x/1"), ("b", "x^3/1")):
        make_run_dataset(attention=attention, depth=2, steps=10).to_netcdf(
            pytester.path / f"{name}.nc", engine="h5netcdf")
    pytester.runpytest("-n", "2", "--precision-regen").assert_outcomes(passed=2)
    for name in ("a", "b"):
        ds = xr.load_dataset(pytester.path / f"{name}.nc", engine="h5netcdf")
        regressed(ds).to_netcdf(pytester.path / f"{name}.nc", engine="h5netcdf")
    result = pytester.runpytest("-n", "2", "--junitxml=j.xml")
    result.assert_outcomes(failed=2)
    charts = junit_properties(pytester.path / "j.xml")["precision_chart"]
    assert len(set(charts)) == 2
    result.stdout.fnmatch_lines(["*precision-suite*", "chart  *.png", "chart  *.png"])
