"""The pytest plugin, driven through pytester: options, markers, fixtures, regen, failures, charts.

Inner test sessions run in subprocesses (`runpytest_subprocess`), so an inner session can never
change `sys.modules` for the tests after it; they check RunSpecs; their conftest (INNER_CONFTEST) replaces `runs.run` by
synthetic datasets (tests/synthetic_data.py, one per seed), so no training happens here. The
outer test plants a regression or a drift through the environment variable PLANT_ENV.

Laws checked here:
- the plugin registers its options, ini keys and markers, keeps a project's own `slow` marker,
  and refuses a bad --precision-device as a usage error;
- the report header names the loaded [tool.precision_suite] configuration, or says there is none;
- a missing baseline fails naming the regen command; --precision-regen writes a seed ensemble
  (listed in the summary), the next run passes, and regenerating unchanged numbers writes nothing;
- a planted regression fails with a PNG chart named after the test (reported in the summary and
  the JUnit XML) and never rewrites the baseline; only an explicit regen accepts it;
- two tests of the same case get two chart files;
- a drift (a change in the good direction) passes but is reported with a chart;
- a baseline made for another spec fails naming the field (seed, threads and device do not count);
- an old single-run baseline fails saying so and naming the regen command;
- --precision-seed runs the spec with that seed, judged against the ensemble's spread;
- baseline and report folders come from the ini file, or from the command line;
- project rules and per-call rules are checked, and a run that breaks them is not made golden;
- a listed known violation passes with status "known", but never excuses a regression;
- bad rules, tolerances or [tool.precision_suite] keys fail with a readable message;
- a dataset (not a RunSpec) under --precision-regen fails with a clear error;
- precision_run trains each spec once per session; a bad spec fails with the reason only;
- pytest-xdist workers report their charts to the controller.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from precision_suite import files
from precision_suite.files import safe_filename
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts import alarm_statement
from precision_suite.verdicts.baseline_files import baseline_path
from precision_suite.verdicts.ensemble.build import ENSEMBLE_SEEDS, MEAN_Z_HELD_OUT_SEEDS
from precision_suite.verdicts.stored_replays import replay_path

TESTS_DIR = Path(__file__).resolve().parent
PLANT_ENV = "PRECISION_SUITE_TEST_PLANT"  # "regression" or "drift": what the fake training plants
CASE = "vit-softmax-fp32"
NODE = "test_inner_case.py::test_case"

# The inner project's conftest: every precision run is a synthetic dataset of the spec's seed
# (also the runs --precision-regen makes for the ensemble and its rounding twins).
INNER_CONFTEST = f"""
import json
import os
import sys

import pytest

sys.path.insert(0, {str(TESTS_DIR)!r})
from synthetic_data import fake_replays, make_run_dataset

import precision_suite.training.runs as runs

PLANTED = dict(layer=2, tensor="gradient_transpose", layout="128x1")


def fake_run(spec, progress=None):
    ds = make_run_dataset(attention=spec.attention, depth=3, steps=20, sample_every=10, seed=spec.seed)
    ds.attrs.update(case=runs.case_id(spec), spec=spec.to_json(), N=17)
    plant = os.environ.get({PLANT_ENV!r}, "")
    if plant == "regression":  # 8x the underflow at every step of one series (the synthetic
        # seeds spread by 25%: a factor 3 is the smallest change the comparison flags there)
        ds["underflow"].loc[PLANTED] = ds["underflow"].loc[PLANTED] + 0.3
    elif plant == "drift":  # smaller attention norms after the seeded initialisation
        trained = ds["step"] > 0
        ds["attention_norm"] = ds["attention_norm"].where(~trained, ds["attention_norm"] / 2)
    with open("trained.jsonl", "a") as log:
        log.write(spec.to_json() + "\\n")
    return ds


@pytest.fixture(autouse=True)
def synthetic_training(monkeypatch):
    monkeypatch.setattr(runs, "run", fake_run)
    fake_replays(monkeypatch, fake_run)  # and the rounding twins' fresh interpreters are not started
"""

CHECK_FILE = """
import pytest
from precision_suite.training.matrix import KnownViolation
from precision_suite.training.runs import RunSpec

@pytest.mark.precision
def test_case(precision_check):
    precision_check(RunSpec(model="vit"{spec}){args})
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester project whose precision runs are synthetic."""
    pytester.makeconftest(INNER_CONFTEST)
    return pytester


def make_check(pytester: pytest.Pytester, args: str = "", spec: str = "") -> None:
    pytester.makepyfile(test_inner_case=CHECK_FILE.format(args=args, spec=spec))


def in_fresh_python(pytester: pytest.Pytester, code: str) -> str:
    """Run `code` in a fresh interpreter (tests/ on its path) and return what it printed.

    The test's own netCDF reads and writes go here: xarray's I/O first imports dask and scipy,
    and pytester's fixture drops every module first imported during its test when it tears down,
    which breaks C extensions and lazily imported packages (transformers) for the tests after it.
    """
    result = pytester.run(
        sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r})\n" + textwrap.dedent(code)
    )
    assert result.ret == 0, result.stderr.str()
    return result.stdout.str()


def junit_properties(path) -> dict[str, list[str]]:
    props: dict[str, list[str]] = {}
    for prop in ET.parse(path).getroot().iter("property"):
        props.setdefault(prop.get("name"), []).append(prop.get("value"))
    return props


def chart_of(pytester: pytest.Pytester, nodeid: str, report_dir: str = "reports") -> Path:
    return pytester.path / report_dir / "charts" / f"{safe_filename(nodeid)}.png"


def trained_seeds(pytester: pytest.Pytester) -> list[int]:
    log = pytester.path / "trained.jsonl"
    return [json.loads(line)["seed"] for line in log.read_text().splitlines()] if log.exists() else []


def is_png(path: Path | str) -> bool:
    return Path(path).is_file() and open(path, "rb").read(4) == b"\x89PNG"


# --------------------------------------------------------------------------- options and markers


def test_options_ini_keys_and_markers_are_registered(pytester):
    help_text = pytester.runpytest_subprocess("--help").stdout.str()
    for option in (
        "--precision-regen",
        "--precision-baseline-dir",
        "--precision-report-dir",
        "--precision-device",
        "--precision-seed",
        "precision_baseline_dir",
        "precision_report_dir",
        "precision_device",
    ):
        assert option in help_text
    markers = pytester.runpytest_subprocess("--markers").stdout.str()
    assert "@pytest.mark.precision:" in markers and "@pytest.mark.slow:" in markers


def test_a_project_slow_marker_is_kept(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: the project's own words\n")
    markers = pytester.runpytest_subprocess("--markers").stdout.str()
    assert "the project's own words" in markers and markers.count("@pytest.mark.slow:") == 1


def test_bad_device_is_a_usage_error(pytester):
    result = pytester.runpytest_subprocess("--precision-device", "gpu0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--precision-device*'gpu0' is not a device*"])


def test_report_header_names_the_loaded_config_or_says_none(pytester):
    pyproject = pytester.path / "pyproject.toml"
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        [f"precision-suite: no {pyproject} *no project rules or tolerance overrides apply"]
    )

    pytester.makepyprojecttoml(
        '[tool.precision_suite]\nrules = ["underflow <= 1e-3", "overflow <= 0"]\n'
        "[tool.precision_suite.tolerances]\nunderflow = 0.1\n"
    )
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        [
            f"precision-suite: 2 rule(s), 1 tolerance override(s) from {pyproject}*",
            "precision-suite: *designed false-alarm rate <= 0.001 per case.",
            "precision-suite: Not measured on these baselines yet*calibrate*",
        ]
    )
    assert "no project rules" not in result.stdout.str()

    measured = {
        "created": "2026-12-03",
        "fingerprint": {"cpu_capability": "AVX512"},
        "runs": 90,
        "runs_with_alarms": 0,
        "perturbations": ["threads=2", "seed 100"],
    }
    files.write_json(measured, alarm_statement.measured_path(pytester.path / "baselines"))
    pytester.runpytest_subprocess().stdout.fnmatch_lines(
        [
            "precision-suite: Measured by `precision-suite calibrate` on 2026-12-03 (AVX512, ?): 0 of 90 "
            "perturbed runs with a false alarm (threads=2, seed 100)."
        ]
    )
    alarm_statement.measured_path(pytester.path / "baselines").write_text("{not json")
    pytester.runpytest_subprocess().stdout.fnmatch_lines(
        ["precision-suite: *calibration.json is unreadable*rewrite it with `precision-suite calibrate`"]
    )


# --------------------------------------------------------------------------- baselines


def test_missing_baseline_regen_then_pass(inner):
    make_check(inner)
    first = inner.runpytest_subprocess()
    first.assert_outcomes(failed=1)
    first.stdout.fnmatch_lines(
        [
            f"*no baseline*create it with: pytest '{NODE}' --precision-regen"
            f"*precision-suite baseline update --case '{CASE}'*"
        ]
    )

    regen = inner.runpytest_subprocess("--precision-regen")
    regen.assert_outcomes(passed=1)
    path = baseline_path(inner.path / "baselines", CASE)
    assert path.is_file()
    regen.stdout.fnmatch_lines(["*precision-suite*", f"baseline written  {path}"])
    seeds, has_tolerance = json.loads(
        in_fresh_python(
            inner,
            f"""
        import json, xarray as xr
        ensemble = xr.load_dataset({str(path)!r}, engine="h5netcdf")
        print(json.dumps([[int(s) for s in ensemble["seed"].values], "first_step_tolerance" in ensemble.attrs]))
    """,
        )
    )
    assert seeds == [0, 1, 2, 3] and has_tolerance

    inner.runpytest_subprocess().assert_outcomes(passed=1)
    # regenerating unchanged numbers leaves the file alone (no churn in git)
    written = path.read_bytes()
    assert "baseline written" not in inner.runpytest_subprocess("--precision-regen").stdout.str()
    assert path.read_bytes() == written


def test_a_check_replays_its_stored_state_and_a_missing_replay_is_an_error(inner):
    make_check(inner)
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    stored = replay_path(inner.path / "baselines", CASE)
    assert stored.is_file()  # regeneration stores the replay beside the ensemble
    inner.runpytest_subprocess().assert_outcomes(passed=1)
    stored.unlink()
    missing = inner.runpytest_subprocess()
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(
        [f"*no baseline {stored}*create it with: pytest '{NODE}' --precision-regen*"]
    )


def test_planted_regression_fails_with_a_chart_and_keeps_the_baseline(inner, monkeypatch):
    make_check(inner)
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    path = baseline_path(inner.path / "baselines", CASE)
    golden = path.read_bytes()

    monkeypatch.setenv(PLANT_ENV, "regression")
    result = inner.runpytest_subprocess("--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*precision check of {CASE}: FAIL*",
            f"*[[]regression[]] {CASE}: underflow regressed at layer 2, "
            "tensor gradient_transpose, layout 128x1*",
            "*precision-suite*",
            f"FAIL*{CASE}*({NODE})",
        ]
    )
    props = junit_properties(inner.path / "junit.xml")
    assert props["precision_status"] == ["fail"] and props["precision_case"] == [CASE]
    (chart,) = props["precision_chart"]
    assert chart == str(chart_of(inner, NODE)) and is_png(chart)
    result.stdout.fnmatch_lines([f"chart  {chart}"])
    obtained = inner.path / "reports" / "obtained" / f"{safe_filename(NODE)}.nc"
    assert obtained.is_file()  # the failing run is kept beside the report
    assert path.read_bytes() == golden  # a failed comparison never rewrites the baseline

    # regeneration is explicit: asked for, it accepts the new numbers
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    assert path.read_bytes() != golden
    inner.runpytest_subprocess().assert_outcomes(passed=1)


def test_two_tests_of_one_case_write_two_charts(inner, monkeypatch):
    inner.makepyfile(
        test_inner_two="""
        from precision_suite.training.runs import RunSpec

        def test_one(precision_check):
            precision_check(RunSpec(model="vit"))

        def test_two(precision_check):
            precision_check(RunSpec(model="vit"))
    """
    )
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=2)
    monkeypatch.setenv(PLANT_ENV, "regression")
    result = inner.runpytest_subprocess("--junitxml=j.xml")
    result.assert_outcomes(failed=2)
    charts = junit_properties(inner.path / "j.xml")["precision_chart"]
    expected = [str(chart_of(inner, f"test_inner_two.py::{name}")) for name in ("test_one", "test_two")]
    assert sorted(charts) == sorted(expected) and len(set(charts)) == 2
    assert all(is_png(chart) for chart in charts)


def test_drift_passes_but_is_reported(inner, monkeypatch):
    make_check(inner)
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    monkeypatch.setenv(PLANT_ENV, "drift")
    result = inner.runpytest_subprocess("--junitxml=junit.xml")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*precision-suite*", f"DRIFT*{CASE}*", "chart  *.png"])
    props = junit_properties(inner.path / "junit.xml")
    assert props["precision_status"] == ["drift"] and is_png(props["precision_chart"][0])


def test_spec_change_is_another_case_with_a_hint_that_works(inner):
    make_check(inner, spec=", steps=20")
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    make_check(inner, spec=", steps=30, threads=2")  # threads only changes rounding: same case
    result = inner.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    case = case_id(RunSpec(model="vit", steps=30))
    result.stdout.fnmatch_lines(
        [f"*[[]error[]]*no baseline*{case}.nc; create it with: pytest '{NODE}' --precision-regen"]
    )
    # the CLI cannot make a case outside its matrix from --case alone: not suggested
    assert "precision-suite baseline update --case" not in result.stdout.str()


def test_an_old_single_run_baseline_says_so_and_how_to_regenerate(inner):
    make_check(inner)
    in_fresh_python(
        inner,
        f"""
        from precision_suite.verdicts.baseline_files import baseline_path, save_baseline
        from precision_suite.training.runs import RunSpec
        from synthetic_data import make_run_dataset
        old = make_run_dataset(depth=3, steps=20, sample_every=10)
        old.attrs.update(case={CASE!r}, spec=RunSpec(model="vit").to_json())
        save_baseline(old, baseline_path("baselines", {CASE!r}))
    """,
    )
    result = inner.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"*[[]error[]]*single run, not a seed ensemble*recreate it with: pytest '{NODE}' --precision-regen*"]
    )


def test_precision_seed_runs_that_seed_against_the_ensemble(inner, monkeypatch):
    make_check(inner)
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    assert sorted(set(trained_seeds(inner))) == [
        *ENSEMBLE_SEEDS,
        *MEAN_Z_HELD_OUT_SEEDS,
    ]  # and held-out seeds
    (inner.path / "trained.jsonl").unlink()

    inner.runpytest_subprocess("--precision-seed", "7").assert_outcomes(passed=1)
    assert trained_seeds(inner) == [7]
    # a seed outside the ensemble is still judged: the planted regression fails
    monkeypatch.setenv(PLANT_ENV, "regression")
    result = inner.runpytest_subprocess("--precision-seed", "7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]regression[]]*underflow regressed at layer 2*"])


def test_dirs_from_ini_and_command_line(inner, monkeypatch):
    inner.makeini("[pytest]\nprecision_baseline_dir = golden\nprecision_report_dir = out\n")
    make_check(inner)
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    assert baseline_path(inner.path / "golden", CASE).is_file()
    inner.runpytest_subprocess("--precision-regen", "--precision-baseline-dir", "other").assert_outcomes(
        passed=1
    )
    assert baseline_path(inner.path / "other", CASE).is_file()
    monkeypatch.setenv(PLANT_ENV, "regression")
    inner.runpytest_subprocess("--junitxml=j.xml").assert_outcomes(failed=1)
    (chart,) = junit_properties(inner.path / "j.xml")["precision_chart"]
    assert chart == str(chart_of(inner, NODE, "out"))
    inner.runpytest_subprocess("--junitxml=k.xml", "--precision-report-dir", "elsewhere").assert_outcomes(
        failed=1
    )
    (chart,) = junit_properties(inner.path / "k.xml")["precision_chart"]
    assert chart == str(chart_of(inner, NODE, "elsewhere"))


# --------------------------------------------------------------------------- rules


def test_project_rules_and_call_rules_are_checked(inner):
    inner.makepyprojecttoml(
        '[tool.precision_suite]\nrules = ["attention_norm <= sqrt(N) @ attention=softmax"]\n'
    )
    make_check(inner)
    result = inner.runpytest_subprocess("--precision-regen")  # the synthetic norms grow far past sqrt(N)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*[[]error[]]*baseline*not written: a run that breaks its rules is not golden",
            "*[[]threshold[]]*rule 'attention_norm <= sqrt(N) @ attention=softmax' violated at layer 0*",
        ]
    )
    assert not baseline_path(inner.path / "baselines", CASE).exists()

    inner.makepyprojecttoml("[tool.precision_suite]\nrules = []\n")
    make_check(inner, args=', rules=["growth(attention_norm) <= 2 @ layer=2"]')
    result = inner.runpytest_subprocess("--precision-regen")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*rule 'growth(attention_norm) <= 2 @ layer=2' violated at layer 2, step 19*"]
    )


def test_a_known_violation_passes_as_known_but_never_excuses_another_rule_or_a_regression(inner, monkeypatch):
    known = 'known_violation=KnownViolation("norms start at 2, issue #7", rule="attention_norm <= 1")'
    make_check(inner, args=f', rules=["attention_norm <= 1"], {known}')
    inner.runpytest_subprocess("--precision-regen").assert_outcomes(
        passed=1
    )  # known: the baseline is written
    assert baseline_path(inner.path / "baselines", CASE).is_file()
    result = inner.runpytest_subprocess("--junitxml=j.xml")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*precision-suite*", f"KNOWN*{CASE}*({NODE})"])
    assert junit_properties(inner.path / "j.xml")["precision_status"] == ["known"]

    make_check(inner, args=f', rules=["attention_norm <= 1", "loss <= 0"], {known}')
    result = inner.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rule 'loss <= 0' violated*"])

    make_check(inner, args=f', rules=["attention_norm <= 1"], {known}')
    monkeypatch.setenv(PLANT_ENV, "regression")
    inner.runpytest_subprocess().assert_outcomes(failed=1)


def test_bad_rules_tolerances_and_config_fail_readably(inner):
    make_check(inner, args=', rules=["underflow < 1"]')
    inner.runpytest_subprocess().stdout.fnmatch_lines(
        ["*precision check configuration: rule 1 ('underflow < 1')*"]
    )
    make_check(inner, args=', known_violation="a reason alone"')
    inner.runpytest_subprocess().stdout.fnmatch_lines(
        ["*precision check configuration: known violation 'a reason alone' does not name what it excuses*"]
    )
    make_check(inner, args=', tolerances={"no_such_metric": 1.0}')
    inner.runpytest_subprocess().stdout.fnmatch_lines(
        ["*precision check configuration: metric 'no_such_metric' has no default tolerance*"]
    )
    inner.makepyprojecttoml("[tool.precision_suite]\nrulez = []\n")
    make_check(inner)
    result = inner.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*pyproject.toml: [[]tool.precision_suite[]] has unknown key(s) rulez*"])


def test_a_dataset_under_regen_is_a_clear_error(inner):
    inner.makepyfile(
        test_inner_case="""
        from synthetic_data import make_run_dataset

        def test_case(precision_check):
            precision_check(make_run_dataset(depth=3, steps=20, sample_every=10))
    """
    )
    result = inner.runpytest_subprocess("--precision-regen")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]error[]]*--precision-regen needs a RunSpec*not a dataset*"])
    assert not (inner.path / "baselines").exists() or not any((inner.path / "baselines").iterdir())


# --------------------------------------------------------------------------- the run fixture


def vit(attention: str = "softmax", device: str = "auto") -> RunSpec:
    return RunSpec(model="vit", attention=attention, device=device)


VIT = """
from precision_suite.training.runs import RunSpec

def vit(attention="softmax"):
    return RunSpec(model="vit", attention=attention)
"""


def test_precision_run_runs_each_spec_once_per_session(inner):
    inner.makepyfile(
        test_inner_runs=VIT
        + """
def test_a(precision_run):
    assert precision_run(vit()).attrs["case"] == "vit-softmax-fp32"

def test_b(precision_run):
    assert precision_run(vit()) is precision_run(vit())
    assert precision_run(dict(model="vit", attention="softmax")) is precision_run(vit())
    assert precision_run(vit("x/1")).attrs["case"] == "vit-x-1-fp32"
"""
    )
    inner.runpytest_subprocess("--precision-device", "cpu").assert_outcomes(passed=2)
    trained = [json.loads(line) for line in (inner.path / "trained.jsonl").read_text().splitlines()]
    assert trained == [json.loads(vit(attention, "cpu").to_json()) for attention in ("softmax", "x/1")]


def test_a_bad_spec_fails_with_the_reason_only(pytester):
    pytester.makeconftest("""
import pytest
import precision_suite.training.runs as runs

def refuse(spec, progress=None):
    raise ValueError(f"unknown attention {spec.attention!r}; known: softmax, x/1")

@pytest.fixture(autouse=True)
def bad_training(monkeypatch):
    monkeypatch.setattr(runs, "run", refuse)
""")
    pytester.makepyfile(
        test_inner_bad=VIT
        + """
def test_bad(precision_check):
    precision_check(vit("nope"))
"""
    )
    result = pytester.runpytest_subprocess("--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "precision run of RunSpec(model='vit', attention='nope'*): "
            "unknown attention 'nope'; known: softmax, x/1"
        ]
    )
    assert "Traceback" not in result.stdout.str() and "During handling" not in result.stdout.str()
    # a check that could not be made still tells CI its case and status
    props = junit_properties(pytester.path / "junit.xml")
    assert props["precision_status"] == ["error"] and props["precision_case"] == ["vit-nope-fp32"]


@pytest.mark.slow
def test_xdist_workers_report_charts_to_the_controller(inner, monkeypatch):
    inner.makepyfile(
        test_inner_cases="""
        import pytest
        from precision_suite.training.runs import RunSpec

        @pytest.mark.parametrize("attention", ["x/1", "x^3/1"])
        def test_case(precision_check, attention):
            precision_check(RunSpec(model="vit", attention=attention))
    """
    )
    inner.runpytest_subprocess("-n", "2", "--precision-regen").assert_outcomes(passed=2)
    monkeypatch.setenv(PLANT_ENV, "regression")  # the workers inherit the environment
    result = inner.runpytest_subprocess("-n", "2", "--junitxml=j.xml")
    result.assert_outcomes(failed=2)
    charts = junit_properties(inner.path / "j.xml")["precision_chart"]
    assert len(set(charts)) == 2 and all(is_png(chart) for chart in charts)
    result.stdout.fnmatch_lines(["*precision-suite*", "chart  *.png", "chart  *.png"])


@pytest.mark.slow
def test_a_session_imports_the_users_package_from_the_rootdir(pytester, monkeypatch):
    """pytest started below the rootdir, no PYTHONPATH naming it: the specs' import strings
    resolve from the rootdir, in the session and in the fresh interpreters of the rounding twins
    that --precision-regen trains."""
    shutil.copy(TESTS_DIR / "user_code.py", pytester.mkpydir("mypkg") / "model.py")
    pytester.makeini("[pytest]\n")  # the rootdir
    fields = dict(
        name="tiny-gpt",
        model="mypkg.model:build",
        batches="mypkg.model:batches",
        modules=["h.0.*", "lm_head"],
        steps=4,
        sample_every=2,
        width=32,
    )
    (pytester.mkdir("tests") / "test_model.py").write_text(
        "from precision_suite import RunSpec\n\n"
        f"def test_tiny_gpt(precision_check):\n    precision_check(RunSpec(**{fields!r}))\n"
    )
    monkeypatch.chdir(pytester.path / "tests")  # pytester puts the current directory on PYTHONPATH
    monkeypatch.delenv("PYTHONPATH", raising=False)
    pytester.runpytest_subprocess("--precision-regen").assert_outcomes(passed=1)
    pytester.runpytest_subprocess().assert_outcomes(passed=1)
    case = case_id(RunSpec(**fields))
    assert in_fresh_python(
        pytester,
        f"""
        from precision_suite.files import load_dataset
        print(load_dataset({str(pytester.path / "baselines" / f"{case}.nc")!r}).module.values.tolist())
    """,
    ).strip() == str(["h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.0", "h.0.mlp.2", "lm_head"])
