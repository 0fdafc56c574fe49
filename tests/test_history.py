"""`precision-suite history record` and `history report` on real git and real files: the toy
package of tests/test_diff.py trained and recorded at each of its 8 commits (commit 5 plants a
numerics change after step 0), a concurrent record, every bad input; and the step detection's
laws on synthetic series (verdicts/history_steps.py)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from precision_suite import cli
from precision_suite.numerics.metric_table import POISSON_SPREAD, SPACES
from precision_suite.verdicts import history_records, history_steps
from synthetic_data import history_store
from test_diff import git, make_toy_repo

BASELINES = Path(__file__).parents[1] / "baselines"
TOY_CASE = ["--config", "cases.toml"]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.fixture(scope="module")
def toy_history(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The toy repository, its baseline (made at c1: the noise levels), and a store holding a
    record of each commit: trained in this process with each commit checked out."""
    root = tmp_path_factory.mktemp("history")
    repo, baselines, store = root / "toy-project", root / "baselines", root / "store"
    shas = make_toy_repo(repo)
    # Training runs beside a link to the checkout's package alone (here and in the rounding twins'
    # interpreters, which put their working directory on sys.path): the checkout also holds a
    # precision_suite that must never be imported. Recording runs in the checkout (its commit).
    train_dir = root / "train"
    train_dir.mkdir()
    (train_dir / "toy").symlink_to(repo / "toy")
    config = ["--config", str(repo / "cases.toml")]
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(train_dir))
        git(repo, "checkout", "-q", "c1")
        patch.chdir(train_dir)
        assert (
            cli.main(["baseline", "update", *config, "--workers", "1", "--baseline-dir", str(baselines)]) == 0
        )
        for number in sorted(shas):
            git(repo, "checkout", "-q", f"c{number}")
            for name in [m for m in sys.modules if m == "toy" or m.startswith("toy.")]:
                del sys.modules[name]  # each commit's code, freshly imported
            results = root / "results" / f"c{number}"
            patch.chdir(train_dir)
            assert cli.main(
                [
                    "run",
                    *config,
                    "--workers",
                    "1",
                    "--baseline-dir",
                    str(baselines),
                    "--charts",
                    "none",
                    "--report-dir",
                    str(root / "reports" / f"c{number}"),
                    "--save-results",
                    str(results),
                ]
            ) in (0, 1)
            patch.chdir(repo)
            assert (
                cli.main(
                    [
                        "history",
                        "record",
                        str(results),
                        "--store",
                        str(store),
                        "--baseline-dir",
                        str(baselines),
                    ]
                )
                == 0
            )
        git(repo, "checkout", "-q", "main")
        for name in [m for m in sys.modules if m == "toy" or m.startswith("toy.")]:
            del sys.modules[name]
    return {"repo": repo, "shas": shas, "store": store, "root": root, "baselines": baselines}


def test_report_marks_the_planted_step_at_commit_5_and_nowhere_else(
    toy_history, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(toy_history["repo"])
    out = tmp_path / "report"
    assert (
        cli.main(["history", "report", "--store", str(toy_history["store"]), "--report-dir", str(out)]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    (case,) = summary["cases"]
    assert [c["commit"] for c in case["commits"]] == [toy_history["shas"][n] for n in range(1, 9)]
    assert case["searched"] == case["series"] > 0  # every series has a noise level from the baseline
    steps = case["steps"]
    assert steps, "the planted change at commit 5 was not detected"
    assert {s["commit"] for s in steps} == {toy_history["shas"][5]}
    # the plant shrinks half the hidden features into FP8's underflow: the activations feeding
    # fc2 and, through the same factor in the backward pass, the gradients reaching fc1
    assert {(s["kind"], s["metric"], s["where"]["layer"], s["where"]["tensor"]) for s in steps} == {
        ("trained", "underflow", 0, "activation"),
        ("trained", "underflow", 0, "gradient"),
    }, steps
    assert all(s["after"] > s["before"] for s in steps)
    assert "toy: shrink half the hidden features" in capsys.readouterr().out
    assert (out / case["chart"]).is_file() and (out / "summary.md").read_text().count(
        toy_history["shas"][5][:12]
    ) >= 1


def test_since_keeps_the_commits_from_that_one_on(toy_history, tmp_path, monkeypatch):
    monkeypatch.chdir(toy_history["repo"])
    out = tmp_path / "report"
    assert (
        cli.main(
            [
                "history",
                "report",
                "--store",
                str(toy_history["store"]),
                "--since",
                "c5",
                "--report-dir",
                str(out),
                "--charts",
                "none",
            ]
        )
        == 0
    )
    (case,) = json.loads((out / "summary.json").read_text())["cases"]
    assert [c["commit"] for c in case["commits"]] == [toy_history["shas"][n] for n in range(5, 9)]


def test_recording_a_commit_again_replaces_its_record(toy_history, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(toy_history["repo"])
    store = tmp_path / "store"
    results = str(toy_history["root"] / "results" / "c2")
    for expected in ("recorded", "replaced"):
        assert (
            cli.main(
                [
                    "history",
                    "record",
                    results,
                    "--store",
                    str(store),
                    "--commit",
                    "c2",
                    "--baseline-dir",
                    str(toy_history["baselines"]),
                ]
            )
            == 0
        )
        assert capsys.readouterr().out.splitlines()[1].strip().startswith(expected)
    records = [p for p in files_under(store) if p.suffix == ".nc"]
    assert len(records) == 1 and records[0].stem == toy_history["shas"][2]

    # another seed's run of the case is another series, never a step of the first one
    from precision_suite.files import load_dataset, save_dataset

    (result,) = [load_dataset(p) for p in Path(results).glob("*.nc")]
    spec = json.loads(result.attrs["spec"])
    save_dataset(result.assign_attrs(spec=json.dumps({**spec, "seed": 7})), tmp_path / "seed7" / "toy.nc")
    assert (
        cli.main(
            [
                "history",
                "record",
                str(tmp_path / "seed7"),
                "--store",
                str(store),
                "--commit",
                "c2",
                "--baseline-dir",
                str(toy_history["baselines"]),
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "history",
                "report",
                "--store",
                str(store),
                "--report-dir",
                str(tmp_path / "report"),
                "--charts",
                "none",
            ]
        )
        == 0
    )
    cases = json.loads((tmp_path / "report" / "summary.json").read_text())["cases"]
    assert sorted(c["case"] for c in cases) == [result.attrs["case"], f"{result.attrs['case']} seed 7"]


def test_two_processes_recording_at_once_both_land(toy_history, tmp_path):
    store = tmp_path / "store"
    # the console script: `python -m` would import the checkout's own precision_suite
    commands = [
        [
            str(Path(sys.executable).parent / "precision-suite"),
            "history",
            "record",
            str(toy_history["root"] / "results" / f"c{n}"),
            "--store",
            str(store),
            "--commit",
            f"c{n}",
            "--baseline-dir",
            str(toy_history["baselines"]),
        ]
        for n in (3, 6)
    ]
    processes = [
        subprocess.Popen(
            command, cwd=toy_history["repo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for command in commands
    ]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    out = tmp_path / "report"
    assert (
        cli.main(["history", "report", "--store", str(store), "--report-dir", str(out), "--charts", "none"])
        == 0
    )
    (case,) = json.loads((out / "summary.json").read_text())["cases"]
    assert {c["commit"] for c in case["commits"]} == {toy_history["shas"][3], toy_history["shas"][6]}
    assert not [p for p in files_under(store) if p.name.endswith(".tmp")]


def _usage_error(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("precision-suite: error: "), err
    return err[0]


def test_bad_input_is_one_line_and_writes_nothing(toy_history, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(toy_history["repo"])
    results = str(toy_history["root"] / "results" / "c1")
    baselines = ["--baseline-dir", str(toy_history["baselines"])]

    other = tmp_path / "other-schema"
    other.mkdir()
    (other / "precision-suite-history.json").write_text('{"history_schema_version": 99}')
    before = files_under(other)
    assert "history schema 99" in _usage_error(
        ["history", "record", results, "--store", str(other), *baselines], capsys
    )
    assert "history schema 99" in _usage_error(["history", "report", "--store", str(other)], capsys)
    assert files_under(other) == before

    fresh = tmp_path / "fresh"
    message = _usage_error(
        ["history", "record", results, "--store", str(fresh), "--commit", "0" * 40, *baselines], capsys
    )
    assert "is not a commit of the repository" in message and not fresh.exists()

    empty_results = tmp_path / "no-results"
    empty_results.mkdir()
    assert "holds no .nc files" in _usage_error(
        ["history", "record", str(empty_results), "--store", str(fresh)], capsys
    )
    assert not fresh.exists()

    old = tmp_path / "old-results"
    old.mkdir()
    from precision_suite.files import load_dataset, save_dataset

    (dataset,) = [load_dataset(p) for p in Path(results).glob("*.nc")]
    save_dataset(dataset.assign_attrs(schema_version=2), old / "toy.nc")
    message = _usage_error(["history", "record", str(old), "--store", str(fresh), *baselines], capsys)
    assert "schema 2" in message and "run --save-results" in message and not fresh.exists()

    empty_store = tmp_path / "empty-store"
    empty_store.mkdir()
    (empty_store / "precision-suite-history.json").write_text('{"history_schema_version": 1}')
    report = tmp_path / "report"
    assert "holds no records" in _usage_error(
        ["history", "report", "--store", str(empty_store), "--report-dir", str(report)], capsys
    )
    assert not report.exists()
    assert "holds no history yet" in _usage_error(
        ["history", "report", "--store", str(tmp_path / "nowhere")], capsys
    )


def test_damaged_records_and_empty_selections_are_one_line(toy_history, tmp_path, monkeypatch, capsys):
    import shutil

    monkeypatch.chdir(toy_history["repo"])
    store = tmp_path / "store"
    shutil.copytree(toy_history["store"], store)
    report = ["--report-dir", str(tmp_path / "report")]
    assert "with --since c8 and --branch feature" in _usage_error(
        ["history", "report", "--store", str(store), "--since", "c8", "--branch", "feature", *report], capsys
    )
    assert "of the selected cases" in _usage_error(
        ["history", "report", "--store", str(store), "--model", "vit", *report], capsys
    )
    record = sorted(store.glob("*/*/*.nc"))[0]
    record.write_bytes(record.read_bytes()[:200])  # cut short
    assert "is unreadable" in _usage_error(["history", "report", "--store", str(store), *report], capsys)
    from precision_suite.files import load_dataset
    from precision_suite.jobs.history_store import encode_record, write_record

    whole = load_dataset(sorted(toy_history["store"].glob("*/*/*.nc"))[0], engine="scipy")
    del whole.attrs["commit_depth"]  # a record written by something else
    write_record(encode_record(whole), record)
    assert "lacks commit_depth" in _usage_error(["history", "report", "--store", str(store), *report], capsys)
    assert not (tmp_path / "report").exists()


def test_a_shallow_clone_is_refused(toy_history, tmp_path, monkeypatch, capsys):
    clone = tmp_path / "shallow"
    subprocess.run(
        ["git", "clone", "-q", "--depth", "1", f"file://{toy_history['repo']}", str(clone)], check=True
    )
    monkeypatch.chdir(clone)
    message = _usage_error(
        [
            "history",
            "record",
            str(toy_history["root"] / "results" / "c8"),
            "--store",
            str(tmp_path / "store"),
        ],
        capsys,
    )
    assert "shallow clone" in message and "fetch-depth: 0" in message and not (tmp_path / "store").exists()


def test_a_store_being_created_by_another_recorder_is_not_foreign(tmp_path):
    """Another recorder's temp marker (files.atomic_path names it .<name>.<uuid>.tmp) does not make
    the folder 'not a store': both recorders create it."""
    from precision_suite.jobs.history_store import STORE_MARKER, store_schema

    store = tmp_path / "store"
    store.mkdir()
    (store / f".{STORE_MARKER}.0123abcd.tmp").write_text("{")
    assert store_schema(store, create=True) == store and (store / STORE_MARKER).is_file()


# --------------------------------------------------------------------------- the detection's laws


def test_a_store_of_the_default_matrix_finds_the_plants_and_no_other_step(tmp_path):
    """Records built from the committed baselines (tests/synthetic_data.history_store): every 5
    commits a commit changes the numbers and re-rolls each series by a fresh draw of its noise;
    from commit 22 one underflow series is 16x and its replay 10 noise units off. Of the other
    ~1450 series none may step: the design rate is 1e-3 per case."""
    cell = dict(layer=5, tensor="gradient", layout="1x128")
    cases = ["gpt-softmax-fp8-block", "vit-softmax-fp32", "gpt-softmax-nvfp4-2d293d63"]
    shas = history_store(
        tmp_path / "store",
        BASELINES,
        cases,
        40,
        plant=("gpt-softmax-fp8-block", "underflow", cell, 16.0, 10.0, 22),
    )
    from precision_suite.jobs.history_store import load_histories
    from precision_suite.jobs.selection import Selection

    found = {c.case: c for c in load_histories(tmp_path / "store", Selection(), None)}
    assert sum(len(c.series) for c in found.values()) > 1000
    steps = [(c, s) for c, h in found.items() for s in h.steps]
    assert {(c, s.kind, s.metric, tuple(s.where.items()), shas[s.index]) for c, s in steps} == {
        ("gpt-softmax-fp8-block", kind, "underflow", tuple(cell.items()), shas[22])
        for kind in ("trained", "replay")
    }


@given(st.floats(5.0, 1e5))
@settings(max_examples=20, deadline=None)
def test_counts_have_unit_spread_in_the_detection_space_at_any_level(level):
    """Anscombe: 2 sqrt(c + 3/8) of Poisson counts has spread 1 (within 5% from 5 counts up),
    which is what lets one noise floor serve a count at 5 and at 1e5."""
    counts = np.random.default_rng(0).poisson(level, 20_000)
    spread = SPACES["underflow"].detection(counts / 1e6, np.full(counts.shape, 1e6)).std()
    assert abs(spread - POISSON_SPREAD) < 0.05 + 4 / np.sqrt(2 * counts.size)


def test_unchanged_commits_are_one_epoch():
    starts, values = history_steps.epochs(np.array([1.0, 1.0, np.nan, 1.0, 2.0, 2.0, 1.0]))
    assert starts.tolist() == [0, 4, 6] and values.tolist() == [1.0, 2.0, 1.0]


def test_null_series_give_no_step_at_the_design_rate_and_a_step_is_found_where_it_is():
    """500 series of 30 epochs of unit noise, the noise of each estimated as the records estimate
    it: 4 seeds per cell, pooled over the 18 layers of its pool (54 degrees of freedom), with the
    Student t penalty Bonferroni-corrected over the series. A false step anywhere has probability at
    most FALSE_ALARM_RATE (1e-3), so none is expected; a step of 8 noise units is found at its
    commit, also when commits repeat."""
    rng = np.random.default_rng(1)
    n_series, n, layers, seeds = 500, 30, 18, 4
    false = 0
    for _ in range(n_series // layers + 1):
        noise = float(np.sqrt(rng.standard_normal((layers, seeds)).var(axis=1, ddof=1).mean()))
        dof = layers * (seeds - 1)
        penalty = functools.partial(history_steps.step_penalty, n_series, dof=dof)
        false += sum(
            bool(history_steps.change_points(rng.standard_normal(n), noise, penalty)) for _ in range(layers)
        )
    assert false == 0
    y = rng.standard_normal(n)
    y[17:] += 8.0
    penalty = lambda epochs: history_steps.step_penalty(n_series, epochs, 54)  # noqa: E731
    assert history_steps.change_points(y, 1.0, penalty) == [17]
    assert history_steps.change_points(np.repeat(y, 3), 1.0, penalty) == [
        51
    ]  # repeated commits are one epoch


def test_a_seed_estimated_noise_needs_the_t_penalty():
    """With 3 degrees of freedom (one cell's 4 seeds) the normal penalty false-alarms on a few
    percent of null series; the t penalty does not: the reason the noise is pooled and its
    degrees of freedom recorded."""
    rng = np.random.default_rng(2)
    n_series, n = 300, 20
    noises = np.sqrt(rng.standard_normal((n_series, 4)).var(axis=1, ddof=1))
    series = rng.standard_normal((n_series, n))
    normal = sum(
        bool(history_steps.change_points(y, s, lambda e: history_steps.step_penalty(n_series, e)))
        for y, s in zip(series, noises)
    )
    student = sum(
        bool(history_steps.change_points(y, s, lambda e: history_steps.step_penalty(n_series, e, 3)))
        for y, s in zip(series, noises)
    )
    assert normal > 0 and student == 0


def test_a_run_whose_every_trained_point_is_nan_is_recorded_as_diverged():
    """NaN at every trained point is a diverged run (its first point was a number), not a cell the
    run does not measure: the record says 100%, and the history steps there."""
    from precision_suite.files import load_dataset

    run = load_dataset(BASELINES / "vit-softmax-fp32.nc").isel(seed=0, drop=True)
    diverged = run.assign(loss=run["loss"].where(run["train_step"] == 0))
    assert float(history_records.summarize(diverged)["trained_loss_nonfinite"]) == 1.0
    assert float(history_records.summarize(run)["trained_loss_nonfinite"]) == 0.0
    unmeasured = history_records.summarize(run)["trained_underflow_nonfinite"].sel(
        tensor="activation", layout="128x1"
    )
    assert unmeasured.isnull().all()  # a pair the run never measures stays unmeasured


def test_a_series_that_turns_non_finite_is_a_step():
    series = history_steps.Series(
        "trained",
        "loss",
        {},
        np.array([2.0, 2.0, np.nan, np.nan]),
        np.array([0.7, 0.7, np.nan, np.nan]),
        0.02,
        54,
        np.array([0.0, 0.0, 0.4, 1.0]),
    )
    (step,) = history_steps.find_steps([series])
    assert step.index == 2 and step.nonfinite and "NaN or Inf at 40% of the trained points" in step.describe()
