"""The precision-suite command line: exit codes, messages, reports, compare, baselines.

Training is replaced by synthetic datasets (tests/synthetic_data.py) shaped by each RunSpec, so
these tests check the command line itself in seconds; one test at the end trains for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from precision_suite import __version__, cli, files
from precision_suite.jobs import execution
from precision_suite.jobs.selection import config_specs
from precision_suite.jobs.twins import rounding_twins
from precision_suite.training import matrix, runs
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts import alarm_statement
from precision_suite.verdicts.ensemble.build import ENSEMBLE_SEEDS, MEAN_Z_HELD_OUT_SEEDS
from synthetic_data import fake_replays, make_run_dataset

TINY_CONFIG = """
[[case]]
model = "vit"
attention = "softmax"
recipe = "fp32"

[[case]]
model = "vit"
attention = "x/1"
recipe = "fp32"
"""
PLANTED = dict(layer=2, tensor="gradient_transpose", layout="128x1")
TESTS = Path(__file__).resolve().parent
# a user's package measured on its first block and head: `mypkg/model.py` is tests/user_code.py
USER_CASES = """
[[case]]
name = "tiny-gpt"
model = "mypkg.model:build"
batches = "mypkg.model:batches"
modules = ["h.0.*", "lm_head"]
steps = 4
sample_every = 2
width = 32
"""


def _synthetic(spec: RunSpec, planted: bool = False):
    ds = make_run_dataset(
        model=spec.model, attention=spec.attention, recipe=spec.recipe, depth=4, seed=spec.seed
    )
    ds.attrs.update(case=case_id(spec), spec=spec.to_json())
    if planted:
        ds["underflow"].loc[PLANTED] = ds["underflow"].loc[PLANTED] + 0.1
    return ds


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty project folder (no pyproject rules) holding the tiny config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cases.toml").write_text(TINY_CONFIG)
    return tmp_path


@pytest.fixture
def fake_training(monkeypatch):
    """runs.run replaced by synthetic data; `planted` holds case ids that get a regression."""
    planted: set[str] = set()
    trained: list[RunSpec] = []

    def fake_run(spec, progress=None):
        trained.append(spec)
        for step in range(1, spec.steps + 1):
            if progress is not None:
                progress(step, spec.steps, 1.0 / step)
        return _synthetic(spec, planted=case_id(spec) in planted)

    monkeypatch.setattr(runs, "run", fake_run)
    # spawned workers, and the fresh interpreters of the rounding twins, would train for real
    monkeypatch.setattr(execution, "default_workers", lambda: 1)
    fake_replays(monkeypatch, fake_run)
    return planted, trained


def _summary(report_dir: Path) -> dict:
    return json.loads((report_dir / "summary.json").read_text())


def test_version_and_help_exit_zero(capsys):
    assert cli.main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    help_text = capsys.readouterr().out
    for command in ("run", "compare", "baseline", "report"):
        assert command in help_text
    assert "exit status" in help_text


def test_help_answers_without_loading_torch_xarray_or_matplotlib():
    """Every command's --help, and --version, in a fresh interpreter: the command modules import
    their jobs only when they run."""
    code = (
        "import sys\n"
        "from precision_suite import cli\n"
        "commands = [[c.name] for c in cli.COMMANDS]\n"
        "commands += [[c.name, a.name] for c in cli.COMMANDS for a in getattr(c, 'actions', ())]\n"
        "codes = {cli.main([*words, '--help']) for words in [[], *commands]} | {cli.main(['--version'])}\n"
        "print(codes, [m for m in ('torch', 'xarray', 'matplotlib') if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "{0} []"


def test_no_command_and_unknown_flags_are_usage_errors(capsys):
    assert cli.main([]) == 2
    assert cli.main(["run", "--no-such-flag"]) == 2
    assert cli.main(["baseline"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_selection_outside_the_matrix_says_what_exists(workdir, capsys):
    assert cli.main(["run", "--attention", "no-such-variant"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("precision-suite: error: --attention no-such-variant is not in the default matrix")
    assert "softmax" in err and "--config" in err and "Traceback" not in err


def test_a_new_attention_variant_is_a_figure_a_case_and_its_hint_recreates_it(
    workdir, fake_training, capsys, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # user_code, as a user's package
    _, trained = fake_training
    assert cli.main(["run", "--attention", "user_code:half_softmax"]) == 2
    hint = capsys.readouterr().err.split("create it with: ")[1].split("\n")[0].strip()
    assert (
        hint
        == "precision-suite baseline update --case vit-user_code-half_softmax-fp32 --attention user_code:half_softmax"
    )
    assert cli.main(hint.split()[1:]) == 0  # the hint works as printed
    assert {(s.model, s.attention, s.recipe) for s in trained} == {("vit", "user_code:half_softmax", "fp32")}
    assert {s.seed for s in trained} == {*ENSEMBLE_SEEDS, *MEAN_Z_HELD_OUT_SEEDS}
    assert (
        cli.main(["run", "--attention", "user_code:half_softmax", "--attention", "x^2/4"]) == 2
    )  # x^2/4: no baseline
    assert cli.main(["baseline", "update", "--attention", "x^2/4"]) == 0
    assert (
        cli.main(
            ["run", "--attention", "user_code:half_softmax", "--attention", "x^2/4", "--report-dir", "out"]
        )
        == 0
    )


def test_quick_matrix_is_a_subset_of_the_default_matrix():
    quick, full = matrix.default_matrix(quick=True), matrix.default_matrix(quick=False)
    assert quick and set(quick) < set(full)  # same specs, so both share baselines
    assert len({case_id(spec) for spec in full}) == len(full)
    for spec in full:
        spec.validate()


def test_missing_baseline_is_a_configuration_error_naming_the_command(workdir, fake_training, capsys):
    _, trained = fake_training
    assert cli.main(["run", "--config", "cases.toml"]) == 2
    err = capsys.readouterr().err
    assert "no baseline" in err
    assert (
        "create it with: precision-suite baseline update --case vit-softmax-fp32 --config cases.toml" in err
    )
    assert trained == []  # nothing trains before every baseline is known to exist


def test_baseline_update_then_run_passes_and_writes_a_report(workdir, fake_training, capsys):
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    assert sorted(p.name for p in (workdir / "baselines").iterdir()) == [
        "replays",
        "vit-softmax-fp32.nc",
        "vit-x-1-fp32.nc",
    ]
    assert sorted(p.name for p in (workdir / "baselines" / "replays").iterdir()) == [
        "vit-softmax-fp32.nc",
        "vit-x-1-fp32.nc",
    ]
    capsys.readouterr()
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "out"]) == 0
    captured = capsys.readouterr()
    assert "step 50/50" in captured.err  # progress goes to stderr
    assert "PASS  vit-softmax-fp32" in captured.out and "report: out/index.html" in captured.out
    summary = _summary(workdir / "out")
    assert summary["overall"] == "pass" and len(summary["cases"]) == 2


def test_planted_regression_exits_1_with_a_chart_of_the_case(workdir, fake_training, capsys):
    planted, _ = fake_training
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    planted.add("vit-x-1-fp32")
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "out"]) == 1
    assert "FAIL  vit-x-1-fp32: underflow changed (worse) at layer 2" in capsys.readouterr().out
    summary = _summary(workdir / "out")
    assert summary["overall"] == "fail"
    failed = summary["cases"][0]
    assert failed["case"] == "vit-x-1-fp32" and failed["status"] == "fail"
    drift_chart = workdir / "out" / failed["charts"][0]
    assert drift_chart.name == "vit-x-1-fp32-drift.png" and drift_chart.stat().st_size > 0
    assert failed["charts"][0] in (workdir / "out" / "index.html").read_text()
    assert summary["cases"][1] == {**summary["cases"][1], "case": "vit-softmax-fp32", "status": "pass"}


def test_failing_comparison_never_touches_the_baseline(workdir, fake_training):
    planted, _ = fake_training
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    before = (workdir / "baselines" / "vit-x-1-fp32.nc").read_bytes()
    planted.add("vit-x-1-fp32")
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "out", "--charts", "none"]) == 1
    assert (workdir / "baselines" / "vit-x-1-fp32.nc").read_bytes() == before


def test_rules_from_pyproject_are_checked(workdir, fake_training, capsys):
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    (workdir / "pyproject.toml").write_text(
        '[tool.precision_suite]\nrules = ["attention_norm <= 3 @ layer=3"]\n'
    )
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "out", "--charts", "none"]) == 1
    assert "rule 'attention_norm <= 3 @ layer=3' violated" in capsys.readouterr().out
    (workdir / "pyproject.toml").write_text('[tool.precision_suite]\nrules = ["attention_norm <<= 3"]\n')
    assert cli.main(["run", "--config", "cases.toml"]) == 2
    assert "rule 1" in capsys.readouterr().err


def test_known_violations_report_but_do_not_fail_unless_the_baseline_regresses(
    workdir, fake_training, capsys, monkeypatch
):
    planted, _ = fake_training
    monkeypatch.setitem(
        matrix.KNOWN_VIOLATIONS,
        "vit-x-1-fp32",
        (matrix.KnownViolation("a documented numerics problem", rule="attention_norm <= 3 @ attention=x/1"),),
    )
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    (workdir / "pyproject.toml").write_text(
        '[tool.precision_suite]\nrules = ["attention_norm <= 3 @ attention=x/1"]\n'
    )
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "known", "--charts", "none"]) == 0
    out = capsys.readouterr().out
    assert "KNOWN vit-x-1-fp32" in out and "known violation, not failing the run: a documented" in out
    summary = _summary(workdir / "known")
    reported = summary["cases"][0]
    assert reported["status"] == "known" and reported["known_violation"] == "a documented numerics problem"
    assert summary["overall"] == "pass" and summary["counts"]["known"] == 1
    assert "known violation, not failing the run" in (workdir / "known" / "summary.md").read_text()
    (workdir / "pyproject.toml").write_text(
        '[tool.precision_suite]\nrules = ["attention_norm <= 3 @ attention=x/1", "loss <= 0"]\n'
    )
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "another", "--charts", "none"]) == 1
    assert "FAIL  vit-x-1-fp32" in capsys.readouterr().out  # another rule's finding is not excused
    planted.add("vit-x-1-fp32")
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "regressed", "--charts", "none"]) == 1


@pytest.mark.parametrize(
    "config, message",
    [
        ('[[case]]\nmodel = "vit"\ncolour = "red"\n', "unknown field(s) colour"),
        ('[[case]]\nmodel = "vit"\nsteps = 0\n', "steps must be a positive integer"),
        ("[[case]\n", "TOML"),
        ("title = 'no cases'\n", "no [[case]] tables"),
        (
            '[[case]]\nmodel = "vit"\n\n[[case]]\nname = "my case"\n',
            "bad.toml: [[case]] number 2: name must be 1 to 80",
        ),
        (
            '[[case]]\nmodel = "vit"\nmodules = "blocks.*"\n',
            "bad.toml: [[case]] number 1: modules must be a list",
        ),
        ("[[case]]\nmodel = 3\n", "bad.toml: [[case]] number 1: model must be a string, got 3"),
        (
            '[[case]]\nmodel = "vit"\nmodules = ["block.*"]\n',
            "modules pattern 'block.*' matches none of the 50",
        ),
        (
            '[[case]]\nname = "a"\nmodel = "vit"\n\n[[case]]\nname = "a"\nmodel = "vit"\n',
            "several specs for case a-",
        ),
    ],
)
def test_bad_config_files_are_usage_errors(workdir, capsys, config, message):
    (workdir / "bad.toml").write_text(config)
    assert cli.main(["run", "--config", "bad.toml"]) == 2
    err = capsys.readouterr().err
    assert message in err and "bad.toml" in err and "Traceback" not in err


def test_named_cases_are_their_names_and_hashes_from_config_to_baseline_files(workdir, fake_training, capsys):
    """One name for two cases that measure different modules: two ids, two baselines, each
    selectable with --case."""
    (workdir / "named.toml").write_text(
        '[[case]]\nname = "tiny"\nmodel = "vit"\nmodules = ["blocks.0.*"]\n\n'
        '[[case]]\nname = "tiny"\nmodel = "vit"\nmodules = ["blocks.1.*"]\n'
    )
    specs = config_specs(Path("named.toml"))
    ids = [case_id(spec) for spec in specs]
    assert [spec.modules for spec in specs] == [("blocks.0.*",), ("blocks.1.*",)]
    assert len(set(ids)) == 2 and all(i.startswith("tiny-") for i in ids)
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "named.toml"]) == 0
    assert sorted(p.name for p in (workdir / "baselines").glob("*.nc")) == sorted(f"{i}.nc" for i in ids)
    assert (
        cli.main(
            ["run", "--config", "named.toml", "--case", ids[1], "--report-dir", "one", "--charts", "none"]
        )
        == 0
    )
    assert [c["case"] for c in _summary(workdir / "one")["cases"]] == [ids[1]]


def test_report_from_saved_results_without_training(workdir, fake_training, capsys):
    _, trained = fake_training
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    assert (
        cli.main(
            [
                "run",
                "--config",
                "cases.toml",
                "--save-results",
                "results",
                "--report-dir",
                "first",
                "--charts",
                "none",
            ]
        )
        == 0
    )
    trained.clear()
    assert cli.main(["report", "results", "--report-dir", "again"]) == 0
    assert trained == []
    summary = _summary(workdir / "again")
    assert {c["case"] for c in summary["cases"]} == {"vit-softmax-fp32", "vit-x-1-fp32"}
    assert all(len(c["charts"]) == 2 for c in summary["cases"])  # figures A and B of every case
    assert summary["overview_charts"]
    assert cli.main(["report", "nothing-here"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _save(folder: Path, ds) -> Path:
    return files.save_dataset(ds, folder / f"{ds.attrs['case']}.nc")


def test_compare_files_with_mismatched_specs_fails_clearly(workdir, capsys):
    base = _save(workdir / "a", _synthetic(RunSpec(model="vit", attention="softmax")))
    new = _save(workdir / "b", _synthetic(RunSpec(model="vit", attention="softmax", steps=60)))
    assert cli.main(["compare", str(base), str(new)]) == 2
    err = capsys.readouterr().err
    assert "different specs" in err and "steps: baseline 50, current 60" in err
    other = _save(workdir / "c", _synthetic(RunSpec(model="vit", attention="x/1")))
    assert cli.main(["compare", str(base), str(other)]) == 2
    err = capsys.readouterr().err
    assert "BASE is case 'vit-softmax-fp32', NEW is case 'vit-x-1-fp32'" in err
    assert "attention: baseline 'softmax', current 'x/1'" in err


def test_compare_folders_exit_codes_and_fail_overrides(workdir, capsys):
    specs = [RunSpec(model="vit", attention=a) for a in ("softmax", "x/1")]
    for spec in specs:
        _save(workdir / "base", _synthetic(spec))
        _save(workdir / "same", _synthetic(spec))
        _save(workdir / "worse", _synthetic(spec, planted=spec.attention == "x/1"))
    # the verdicts alone: no chart, the drift chart of the failing case and the overviews included
    fast = ["--charts", "none"]
    assert cli.main(["compare", "base", "same", "--report-dir", "r1", *fast]) == 0
    assert cli.main(["compare", "base", "worse", "--report-dir", "r2", *fast]) == 1
    failing = _summary(workdir / "r2")["cases"][0]
    assert failing["case"] == "vit-x-1-fp32" and failing["charts"] == []
    assert not (workdir / "r2" / "charts").exists() and not _summary(workdir / "r2")["overview_charts"]
    # a looser underflow tolerance on the command line accepts the planted +0.1
    assert cli.main(["compare", "base", "worse", "--fail", "underflow:0.5", "--report-dir", "r3", *fast]) == 0
    # and a tighter one catches a change that the default tolerance (5e-4) accepts
    for spec in specs:
        slightly = _synthetic(spec)
        slightly["underflow"].loc[PLANTED] = slightly["underflow"].loc[PLANTED] + 1e-4
        _save(workdir / "slightly", slightly)
    assert cli.main(["compare", "base", "slightly", "--report-dir", "r4", *fast]) == 0
    assert (
        cli.main(["compare", "base", "slightly", "--fail", "underflow:1e-5", "--report-dir", "r5", *fast])
        == 1
    )
    capsys.readouterr()
    for bad in ("underflow", "underflow:-1", "underflow:abc", "bogus_metric:1"):
        assert cli.main(["compare", "base", "worse", "--fail", bad]) == 2
        assert "--fail" in capsys.readouterr().err


def test_compare_folders_with_different_cases_fail_clearly(workdir, capsys):
    _save(workdir / "base", _synthetic(RunSpec(model="vit", attention="softmax")))
    _save(workdir / "base", _synthetic(RunSpec(model="vit", attention="x/1")))
    _save(workdir / "new", _synthetic(RunSpec(model="vit", attention="softmax")))
    assert cli.main(["compare", "base", "new"]) == 2
    assert "only in BASE: vit-x-1-fp32" in capsys.readouterr().err
    (workdir / "empty").mkdir()
    assert cli.main(["compare", "base", "empty"]) == 2
    assert "holds no .nc files" in capsys.readouterr().err
    (workdir / "junk.nc").write_text("not netcdf")
    assert cli.main(["compare", "junk.nc", "junk.nc"]) == 2
    assert "not a readable result file" in capsys.readouterr().err


def test_real_training_end_to_end(workdir, capsys):
    """No fakes: a two-step tiny ViT trains, becomes a baseline and then passes against it."""
    (workdir / "tiny.toml").write_text(
        '[[case]]\nmodel = "vit"\nattention = "x^3/sqrt(N)"\nrecipe = "fp8-block"\n'
        'steps = 2\nsample_every = 1\ndepth = 2\nwidth = 128\nbatch_size = 8\ndevice = "cpu"\n'
    )
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "tiny.toml"]) == 0
    assert cli.main(["run", "--config", "tiny.toml", "--report-dir", "out"]) == 0
    summary = _summary(workdir / "out")
    (spec,) = config_specs(Path("tiny.toml"))
    assert [(c["case"], c["status"]) for c in summary["cases"]] == [(case_id(spec), "pass")]
    assert np.isfinite(
        files.load_dataset(workdir / "baselines" / f"{case_id(spec)}.nc")["attention_norm"].values
    ).all()


def test_calibrate_measures_false_alarms_and_every_later_report_states_them(workdir, fake_training, capsys):
    assert cli.main(["baseline", "update", "--workers", "1", "--config", "cases.toml"]) == 0
    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "before", "--charts", "none"]) == 0
    assert "Not measured on these baselines yet" in (workdir / "before" / "summary.md").read_text()

    assert (
        cli.main(
            [
                "calibrate",
                "--workers",
                "1",
                "--config",
                "cases.toml",
                "--report-dir",
                "cal",
                "--held-out-seeds",
                "100",
                "101",
                "--charts",
                "none",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # 2 cases x (this host's rounding twins + 2 held-out seeds) trained, 2 x one replay per twin
    # judged against the others' tolerance, 2 x 4 members left out
    trained, replays = 2 * (len(rounding_twins()) + 2), 2 * len(rounding_twins())
    runs = trained + replays + 8
    assert (
        f"{runs} judged: {trained} perturbed runs (with their replays), {replays} replays against a "
        "tolerance measured without their twin, 8 members left out of their ensemble; 0 with a FAIL"
    ) in out
    measured = json.loads(alarm_statement.measured_path(workdir / "baselines").read_text())
    assert (measured["runs"], measured["runs_with_alarms"]) == (runs, 0)
    assert {"seed 3 left out", "ATen default kernels"} <= set(measured["perturbations"])

    assert cli.main(["run", "--config", "cases.toml", "--report-dir", "after", "--charts", "none"]) == 0
    summary = _summary(workdir / "after")
    assert summary["sensitivity"]["measured"] == measured
    assert set(summary["sensitivity"]["detectable_change"]) == {"vit-softmax-fp32", "vit-x-1-fp32"}
    assert f"0 of {runs} perturbed runs with a false alarm" in (workdir / "after" / "summary.md").read_text()
    assert "Sensitivity of the comparison" in (workdir / "after" / "index.html").read_text()


def test_shards_split_the_matrix_and_one_report_merges_them(workdir, fake_training, capsys):
    _, trained = fake_training
    every = [case_id(s) for s in matrix.default_matrix()]
    assert cli.main(["baseline", "update", "--shard", "2/3"]) == 0  # shards regenerate apart too
    assert cli.main(["baseline", "update", "--shard", "1/3"]) == 0
    assert cli.main(["baseline", "update", "--shard", "3/3"]) == 0
    shards = []
    for index in (1, 2, 3):
        trained.clear()
        assert (
            cli.main(
                [
                    "run",
                    "--shard",
                    f"{index}/3",
                    "--save-results",
                    f"shard{index}",
                    "--report-dir",
                    f"report{index}",
                    "--charts",
                    "none",
                ]
            )
            == 0
        )
        shards.append([case_id(s) for s in trained])
    assert sorted(sum(shards, [])) == sorted(every)  # every case in exactly one shard
    assert all(shards) and shards[0] == every[0::3]  # deterministic: dealt in matrix order
    capsys.readouterr()

    assert (
        cli.main(["report", "shard1", "shard2", "shard3", "--report-dir", "merged", "--charts", "failing"])
        == 0
    )
    assert {c["case"] for c in _summary(workdir / "merged")["cases"]} == set(every)
    assert cli.main(["report", "shard1", "shard1"]) == 2
    assert "both hold case" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--shard", "3/2"], "the shard number I must be between 1 and N=2"),
        (["run", "--shard", "two"], "'two' is not a shard: write I/N"),
        (["run", "--shard", "1/11"], "the selection has only 10 case(s); use at most 10 shards"),
        (["run", "--workers", "0"], "'0' is not a positive number of worker processes"),
        (["baseline", "update", "--workers", "0"], "'0' is not a positive number of worker processes"),
    ],
)
def test_bad_shards_and_workers_are_usage_errors(workdir, capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_every_command_family_finds_the_users_package_from_the_project_root(tmp_path):
    """As a user runs them: the console script (which puts its own folder on sys.path, not the
    current directory), from the project's root, no PYTHONPATH; the runs train in this process,
    in spawned workers and in the rounding twins' fresh interpreters."""
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").touch()
    shutil.copy(TESTS / "user_code.py", project / "mypkg" / "model.py")
    (project / "cases.toml").write_text(USER_CASES)
    script = tmp_path / "bin" / "precision-suite"  # what pip's console script does
    script.parent.mkdir()
    script.write_text(
        "import sys\nfrom precision_suite.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}

    def suite(*args: str, cwd: Path = project) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True
        )

    (spec,) = config_specs(project / "cases.toml")
    case = case_id(spec)
    assert re.fullmatch(r"tiny-gpt-[0-9a-f]{8}", case)
    made = suite("baseline", "update", "--config", "cases.toml", "--workers", "2")
    assert made.returncode == 0, made.stderr[-3000:]
    baseline = files.load_dataset(project / "baselines" / f"{case}.nc")
    assert baseline.module.values.tolist() == [
        "h.0.attn.c_attn",
        "h.0.attn.c_proj",
        "h.0.mlp.0",
        "h.0.mlp.2",
        "lm_head",
    ]
    checked = suite(
        "run",
        "--config",
        "cases.toml",
        "--workers",
        "1",
        "--charts",
        "none",
        "--report-dir",
        "r",
        "--save-results",
        "results",
    )
    assert checked.returncode == 0 and f"PASS  {case}" in checked.stdout, checked.stderr[-3000:]
    for args in (
        ["init", "-q"],
        ["add", "mypkg", "cases.toml"],
        ["-c", "user.name=T", "-c", "user.email=t@example.com", "commit", "-q", "-m", "model"],
    ):
        subprocess.run(["git", *args], cwd=project, check=True, capture_output=True)
    recorded = suite("history", "record", "results", "--store", "store")
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    reported = suite("history", "report", "--store", "store", "--report-dir", "h", "--charts", "none")
    assert reported.returncode == 0, reported.stderr[-3000:]
    assert [c["case"] for c in _summary(project / "h")["cases"]] == [case]
    calibrated = suite("calibrate", "--config", "cases.toml", "--workers", "2", "--report-dir", "c")
    # trained and judged every perturbed run (status 1 would be a false alarm it found, 2 an import error)
    assert calibrated.returncode in (0, 1) and re.search(
        r"\d+ judged: [1-9]\d* perturbed runs", calibrated.stdout
    ), calibrated.stderr[-3000:]
    assert (project / "c" / "calibration.json").is_file()
    # from another folder the package is not there, and the error says where it was looked for
    elsewhere = suite("run", "--config", str(project / "cases.toml"), cwd=tmp_path)
    assert elsewhere.returncode == 2
    assert f"no module 'mypkg' under {tmp_path.resolve()} (the project root" in elsewhere.stderr
