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
    rules, tolerances = judging.load_rules(rules_file)
    references = {}
    for spec in specs:  # every baseline is checked before the first minute of training
        case = case_id(spec)
        references[case] = judging.load_reference(baseline_dir, case, spec.to_json(),
                                                  regen_command(selection, baseline_dir, case))
    stored_replays = judging.load_stored_replays(specs, baseline_dir,
                                                 lambda case: regen_command(selection, baseline_dir, case))
    folder = judging.report_dir(report_dir)
    verdicts, datasets = [], {}
    trained, replayed = train.train_and_replay(specs, stored_replays, where)
    for spec, ds in zip(specs, trained):
        case = case_id(spec)
        if save_results:
            save_dataset(ds, results.result_path(save_results, case))
            if case in replayed:
                save_dataset(replayed[case], results.replay_result_path(save_results, case))
        verdicts.append(judging.judge_case(case, ds, references[case], rules, tolerances, folder, charts,
                                           regen_command(selection, baseline_dir, case),
                                           replay=replayed.get(case), stored_replay=stored_replays.get(case)))
        datasets[case] = ds
    return judging.finish(verdicts, datasets, folder, charts,
                          judging.sensitivity(references, datasets, baseline_dir))


def compare_results(base_location: str, new_location: str, fail: Sequence[str], *, rules_file: str,
                    report_dir: str | None, charts: str) -> int:
    """Judge saved results NEW against BASE, case by case."""
    base = results.load_results(base_location, "BASE")
    new = results.load_results(new_location, "NEW")
    pairs = results.pair_results(base, new, base_location, new_location)
    rules, tolerances = judging.load_rules(rules_file)
    layered = [tolerances, results.parse_fail_rules(fail)]  # --fail applies over the project's
    folder = judging.report_dir(report_dir)
    verdicts = [judging.judge_case(case, current, reference, rules, layered, folder, charts)
                for case, (reference, current) in pairs.items()]
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
    rules, tolerances = judging.load_rules(rules_file)
    folder = judging.report_dir(report_dir)
    verdicts = []
    references = {}
    for case, ds in datasets.items():
        reference = None
        if baseline_dir is not None:
            reference = references[case] = judging.load_reference(baseline_dir, case, ds.attrs.get("spec"),
                                                                   baselines.default_regen_hint(case))
        verdicts.append(judging.judge_case(case, ds, reference, rules, tolerances, folder, charts))
    sensitivity = judging.sensitivity(references, datasets, baseline_dir) if references else None
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
