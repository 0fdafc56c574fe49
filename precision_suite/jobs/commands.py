"""The commands of `precision-suite`, one function each, called by cli.py with its parsed flags:
train and judge (`run`), `compare` saved results, `baseline update`, `report`, `reproduce`
(`calibrate` is jobs/calibrate.py; `diff` and `bisect`, which train other commits' code, are
jobs/diff.py and jobs/bisect.py, and `history record|report` jobs/history.py, named here). Each returns the exit status; UsageError for bad usage."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from precision_suite.files import save_dataset
from precision_suite.jobs import judging, results, train
from precision_suite.jobs.baselines import regenerate, regeneration_size
# the command line calls every command through this module, these included
from precision_suite.jobs.bisect import bisect_commits
from precision_suite.jobs.diff import diff_commits
from precision_suite.jobs.history import record_results, report_history
from precision_suite.jobs.reference import REQUIRED, SKIPPED, Reference, load_project, load_reference, load_references
from precision_suite.jobs.reproduce import figure_specs, reproduce
from precision_suite.jobs.selection import Selection, regen_command, selected_specs
from precision_suite.jobs.usage import EXIT_OK, UsageError
from precision_suite.training.runs import case_id
from precision_suite.verdicts import baselines


def run_cases(selection: Selection, *, baseline_dir: str, rules_file: str, report_dir: str | None,
              charts: str, workers: int | None, scheduler: str | None, save_results: str | None) -> int:
    """Train the selection, judge each case against its baseline and the rules, write a report."""
    specs = selected_specs(selection)
    where = train.placement(workers, scheduler)
    if save_results and Path(save_results).resolve() == Path(baseline_dir).resolve():
        raise UsageError(f"--save-results {save_results} is the baseline folder: results would "
                         "replace baselines before they are judged; save them elsewhere and use "
                         "`precision-suite baseline update` to regenerate baselines")
    project = load_project(rules_file)
    # every baseline and stored replay is read before the first minute of training
    references = load_references(specs, project, baseline_dir,
                                 lambda case: regen_command(selection, baseline_dir, case))
    stored_replays = {case: ref.stored_replay for case, ref in references.items()
                      if ref.stored_replay is not None}
    folder = judging.report_dir(report_dir)
    verdicts, datasets = [], {}
    trained, replayed = train.train_and_replay(specs, stored_replays, where)
    for spec, ds in zip(specs, trained):
        case = case_id(spec)
        if save_results:
            save_dataset(ds, results.result_path(save_results, case))
            if case in replayed:
                save_dataset(replayed[case], results.replay_result_path(save_results, case))
        verdicts.append(judging.judge_case(ds, references[case], folder, charts, replay=replayed.get(case)))
        datasets[case] = ds
    return judging.finish(verdicts, datasets, folder, charts,
                          judging.sensitivity(references, datasets, baseline_dir))


def compare_results(base_location: str, new_location: str, fail: Sequence[str], *, rules_file: str,
                    report_dir: str | None, charts: str) -> int:
    """Judge saved results NEW against BASE, case by case."""
    base = results.load_results(base_location, "BASE")
    new = results.load_results(new_location, "NEW")
    pairs = results.pair_results(base, new, base_location, new_location)
    project = load_project(rules_file)
    layered = (project.tolerances, results.parse_fail_rules(fail))  # --fail applies over the project's
    folder = judging.report_dir(report_dir)
    verdicts = [judging.judge_case(current, Reference(case, project.rules, layered, baseline), folder, charts)
                for case, (baseline, current) in pairs.items()]
    return judging.finish(verdicts, {case: current for case, (_, current) in pairs.items()}, folder, charts)


def update_baselines(selection: Selection, *, baseline_dir: str, workers: int | None,
                     scheduler: str | None) -> int:
    """Train the selection's seed ensembles and (over)write their baselines."""
    specs = selected_specs(selection)
    where = train.placement(workers, scheduler)
    n_tasks = sum(regeneration_size(spec) for spec in specs)
    print(f"{len(specs)} case(s), {n_tasks} runs (seed ensembles and held-out seeds, the first steps of their rounding "
          f"twins, replays of their last steps) {train.describe(where, n_tasks)}", file=sys.stderr, flush=True)
    with train.execution_errors(where):  # raised before any baseline is written
        written = regenerate(specs, baseline_dir, where.workers, train.task_progress(n_tasks),
                             scheduler=where.scheduler)
    for path, changed in written:
        print(f"{'wrote' if changed else 'unchanged'} {path}")
    print(f"{len(specs)} baseline(s) updated; review with `git diff --stat {baseline_dir}` "
          "and commit them with the change that explains them")
    return EXIT_OK


def report_results(locations: Sequence[str], *, baseline_dir: str | None, rules_file: str,
                   report_dir: str | None, charts: str) -> int:
    """A report of saved results (shards merged), compared with baselines when a folder is given."""
    datasets = results.merge_shards(locations)
    project = load_project(rules_file)
    folder = judging.report_dir(report_dir)
    references = {case: load_reference(case, ds.attrs.get("spec"), baseline_dir=baseline_dir, project=project,
                                       regen_hint=baselines.default_regen_hint(case),
                                       baseline=SKIPPED if baseline_dir is None else REQUIRED)
                  for case, ds in datasets.items()}
    verdicts = [judging.judge_case(ds, references[case], folder, charts) for case, ds in datasets.items()]
    sensitivity = judging.sensitivity(references, datasets, baseline_dir) if baseline_dir is not None else None
    return judging.finish(verdicts, datasets, folder, charts, sensitivity)


def reproduce_figure(figure: str, out_dir: str, *, workers: int | None, scheduler: str | None) -> int:
    """Train a seed figure's runs, write figure, datasets and note; print which claims hold."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the figure, datasets and note")
    where = train.placement(workers, scheduler)
    specs = figure_specs(figure)
    print(f"{figure}: {len(specs)} run(s) of {specs[0].steps} steps (a few minutes on 2 cores)",
          file=sys.stderr, flush=True)
    result = reproduce(figure, out, train=lambda specs: train.train_all(list(specs), where))
    for claim in result.claims:
        print(f"{'shown' if claim.holds else 'NOT shown':9} {claim.text}")
    print(f"{sum(c.holds for c in result.claims)} of {len(result.claims)} claims shown; "
          f"trained in {result.seconds:.0f} s")
    print(f"figure: {result.chart}\nnote: {result.note}")
    return EXIT_OK
