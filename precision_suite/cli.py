"""The `precision-suite` command line: train, compare with baselines, check rules, write reports.

Exit status: 0 when every check holds (drift is reported but holds), 1 on a numerics regression
(a failing or erroring case), 2 on bad usage or configuration (unknown names, unreadable files,
missing or mismatched baselines), always with a one-line message saying what to do next.

Heavy modules (torch, xarray, matplotlib) are imported inside the command functions so that
`--help` and `--version` answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from precision_suite import __version__

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2
DEFAULT_BASELINE_DIR = "baselines"
DEFAULT_REPORT_ROOT = "reports"
DEFAULT_RULES_FILE = "pyproject.toml"

class UsageError(Exception):
    """Bad usage or configuration: reported as one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status instead of raising SystemExit."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    if not getattr(args, "command_func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.command_func(args)
    except UsageError as exc:
        print(f"precision-suite: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("precision-suite: interrupted", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------- parser

_EPILOG = """\
examples:
  precision-suite run --quick                  smoke matrix (about a minute on 2 CPU cores)
  precision-suite run                          the full default matrix
  precision-suite run --model vit --attention x/1 --save-results results/
  precision-suite baseline update --quick      (re)create the baselines the quick run uses
  precision-suite compare old/ new/ --fail underflow:1e-3
  precision-suite report results/              charts and summary of saved results
  precision-suite reproduce figure-a           the paper's figure A, with a note of its claims

exit status: 0 all checks hold, 1 numerics regression, 2 bad usage or configuration.
More in docs/cli.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precision-suite", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Numerics regression suite for low-precision transformer training: attention "
                    "norms and FP8/MXFP8/NVFP4 quantization error per layer, checked against "
                    "golden baselines and thresholds.")
    parser.add_argument("--version", action="version", version=f"precision-suite {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    run = commands.add_parser(
        "run", help="train the matrix, compare with baselines, check rules, write a report",
        description="Train each case of the matrix (or of the selection), compare it with its "
                    "baseline, check the [tool.precision_suite] rules and write a report. "
                    "Progress goes to stderr, the summary to stdout.")
    _add_selection(run)
    _add_checking(run)
    _add_execution(run)
    run.add_argument("--save-results", metavar="DIR",
                     help="also save each run as DIR/<case>.nc, for `compare` and `report` later")
    run.set_defaults(command_func=_cmd_run)

    compare = commands.add_parser(
        "compare", help="compare saved results NEW against BASE (files or folders of .nc files)",
        description="Compare saved results NEW against BASE with the baseline tolerances and the "
                    "[tool.precision_suite] rules. BASE and NEW are .nc files or folders of them "
                    "(as written by `run --save-results`); cases are matched by case id.")
    compare.add_argument("base", metavar="BASE", help="reference results: a .nc file or a folder")
    compare.add_argument("new", metavar="NEW", help="results to judge: a .nc file or a folder")
    compare.add_argument("--fail", metavar="METRIC:TOL", action="append", default=[],
                         help="override a metric's tolerance, e.g. underflow:1e-3 or "
                              "attention_norm:0.1 (in the metric's comparison space, "
                              "see docs/baselines.md); repeatable")
    _add_checking(compare, baselines=False)
    compare.set_defaults(command_func=_cmd_compare)

    baseline = commands.add_parser("baseline", help="manage golden baselines",
                                   description="Manage the golden baseline files.")
    baseline_commands = baseline.add_subparsers(title="baseline commands", metavar="ACTION")
    update = baseline_commands.add_parser(
        "update", help="train the selection and (over)write its baselines",
        description="Train each selected case's seed ensemble (and the rounding perturbations "
                    "of its first step) and write its baseline atomically; unchanged numbers "
                    "leave the file untouched. Review the change (git diff --stat baselines/) "
                    "before committing it.")
    _add_selection(update)
    _add_execution(update)
    update.add_argument("--baseline-dir", default=DEFAULT_BASELINE_DIR, metavar="DIR",
                        help=f"where baselines live (default: {DEFAULT_BASELINE_DIR}/)")
    update.set_defaults(command_func=_cmd_baseline_update)
    baseline.set_defaults(command_func=lambda _args: _missing_action(baseline))

    calibrate = commands.add_parser(
        "calibrate", help="measure false alarms and the smallest detected change on this machine",
        description="Run every selected case under perturbations that must not fail it (2 threads, "
                    "eager PRECISION_SUITE_COMPILE=0, held-out seeds), judge each against its "
                    "baseline ensemble, judge each baseline seed against the others (no training), "
                    "and print per metric the false alarms seen and the "
                    "smallest change the comparison detects. Run it once on your CI runners.")
    _add_selection(calibrate)
    _add_checking(calibrate)
    calibrate.add_argument("--held-out-seeds", type=_seed, nargs="+", default=[100, 101, 102],
                           metavar="S", help="seeds outside the ensemble (default: 100 101 102)")
    _add_execution(calibrate)
    calibrate.set_defaults(command_func=_cmd_calibrate)

    report = commands.add_parser(
        "report", help="charts and summary of saved results, without training",
        description="Write a report (charts of every case, rules checked) from saved results, "
                    "merging several folders (one per CI shard) into one. With --baseline-dir the "
                    "results are also compared with their baselines.")
    report.add_argument("results", metavar="RESULTS", nargs="+",
                        help="a .nc result file or a folder of them; several (e.g. one per CI "
                             "shard) merge into one report")
    _add_checking(report, baselines=False, charts_default="all")
    report.add_argument("--baseline-dir", metavar="DIR", default=None,
                        help="also compare with the baselines in DIR")
    report.set_defaults(command_func=_cmd_report)

    from precision_suite.reproduce import DEFAULT_OUT, FIGURE_NAMES

    reproduce = commands.add_parser(
        "reproduce", help="longer runs that reproduce a seed figure and say which claims hold",
        description="Train the runs of one of the papers' figures (a few minutes on 2 cores), draw "
                    "it as the paper does, and write the figure (PNG), the datasets (netCDF) and a "
                    "Markdown note stating each qualitative claim of the paper and whether this "
                    "reproduction shows it, with the numbers. figure-a: attention norm of every "
                    "attention variant; figure-b: FP8 underflow and distortion per layer.")
    reproduce.add_argument("figure", metavar="FIGURE", choices=FIGURE_NAMES,
                           help=f"which figure: {' or '.join(FIGURE_NAMES)}")
    reproduce.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                           help=f"folder for the figure, datasets and note (default: {DEFAULT_OUT}/)")
    _add_execution(reproduce)
    reproduce.set_defaults(command_func=_cmd_reproduce)
    return parser


def _add_selection(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("selection (default: the whole matrix; repeat a flag to pick several)")
    group.add_argument("--model", action="append", metavar="NAME", help="e.g. vit, gpt")
    group.add_argument("--attention", action="append", metavar="NAME",
                       help="e.g. softmax, x/1, 'x^3/sqrt(N)'")
    group.add_argument("--recipe", action="append", metavar="NAME", help="e.g. fp32, fp8-block")
    group.add_argument("--case", action="append", metavar="ID", help="an exact case id")
    group.add_argument("--config", metavar="FILE",
                       help="a TOML file of [[case]] tables (RunSpec fields) replacing the matrix")
    group.add_argument("--quick", action="store_true", help="the fast smoke matrix")
    group.add_argument("--device", metavar="DEVICE", help="auto, cpu or cuda (overrides the specs)")
    group.add_argument("--seed", metavar="S", type=_seed, default=None,
                       help="train with seed S (any non-negative integer; judged against the "
                            "baseline's seed ensemble) instead of the specs' seed")
    group.add_argument("--shard", metavar="I/N", type=_shard, default=None,
                       help="only the I-th of N shards of the selection (cases dealt round-robin "
                            "in matrix order: every case in exactly one shard); merge the shards' "
                            "saved results with `precision-suite report DIR1 DIR2 ...`")


def _add_execution(parser: argparse.ArgumentParser) -> None:
    from precision_suite.execution import DASK_INSTALL_HINT

    group = parser.add_argument_group("where the runs train (the numbers are the same either way)")
    group.add_argument("--workers", type=_workers, default=None, metavar="N",
                       help="local worker processes, one run each (default: the number of cores; "
                            "`run --workers 1` trains in this process with live progress)")
    group.add_argument("--scheduler", type=_scheduler, default=None, metavar="tcp://HOST:PORT",
                       help="send each run to the Dask cluster of this scheduler instead "
                            f"(needs {DASK_INSTALL_HINT}; see docs/ci.md)")


def _add_checking(parser: argparse.ArgumentParser, baselines: bool = True,
                  charts_default: str = "failing") -> None:
    # from findings (numpy only), not reports: parsing arguments imports no matplotlib
    from precision_suite.findings import CHART_CHOICES

    if baselines:
        parser.add_argument("--baseline-dir", default=DEFAULT_BASELINE_DIR, metavar="DIR",
                            help=f"where baselines live (default: {DEFAULT_BASELINE_DIR}/)")
    parser.add_argument("--rules", default=DEFAULT_RULES_FILE, metavar="FILE",
                        help="pyproject.toml holding [tool.precision_suite] rules "
                             f"(default: ./{DEFAULT_RULES_FILE}, skipped if absent)")
    parser.add_argument("--report-dir", metavar="DIR",
                        help=f"write the report here (default: a new {DEFAULT_REPORT_ROOT}/<timestamp>/)")
    parser.add_argument("--charts", choices=CHART_CHOICES, default=charts_default,
                        help="draw charts for failing/drifting cases, all, or none (the verdicts, summaries and "
                             f"tables only: seconds faster per chart) (default: {charts_default})")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer seed, e.g. --seed 7")
    return value


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard: write I/N, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: the shard number I must be between 1 and N={n}")
    return i, n


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of worker processes")
    return value


def _scheduler(text: str) -> str:
    from precision_suite.execution import scheduler_address

    try:
        return scheduler_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _missing_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


# --------------------------------------------------------------------------- commands


def _cmd_run(args: argparse.Namespace) -> int:
    from precision_suite import baselines, files, runs

    specs = _selected_specs(args)
    where = _execution(args)
    if args.save_results and Path(args.save_results).resolve() == Path(args.baseline_dir).resolve():
        raise UsageError(f"--save-results {args.save_results} is the baseline folder: results would "
                         "replace baselines before they are judged; save them elsewhere and use "
                         "`precision-suite baseline update` to regenerate baselines")
    rules, tolerances = _load_rules(args.rules)
    references = {}
    for spec in specs:  # every baseline is checked before the first minute of training
        case = runs.case_id(spec)
        references[case] = _load_reference(baselines, args.baseline_dir, case, spec.to_json(),
                                           _regen_command(args, case))
    report_dir = _report_dir(args.report_dir)
    verdicts, datasets = [], {}
    for spec, ds in zip(specs, _train_all(runs, specs, where)):
        case = runs.case_id(spec)
        if args.save_results:
            files.save_dataset(ds, _result_path(args.save_results, case))
        verdicts.append(_judge(case, ds, references[case], rules, tolerances, report_dir, args.charts,
                               _regen_command(args, case)))
        datasets[case] = ds
    return _finish(verdicts, datasets, report_dir, args.charts,
                   _sensitivity(references, datasets, args.baseline_dir))


def _cmd_compare(args: argparse.Namespace) -> int:
    base = _load_results(args.base, "BASE")
    new = _load_results(args.new, "NEW")
    pairs = _pair_results(base, new, args.base, args.new)
    rules, tolerances = _load_rules(args.rules)
    tolerances = [tolerances, _parse_fail_rules(args.fail)]  # --fail applies over the project's
    report_dir = _report_dir(args.report_dir)
    verdicts = [_judge(case, current, reference, rules, tolerances, report_dir, args.charts)
                for case, (reference, current) in pairs.items()]
    return _finish(verdicts, {case: current for case, (_, current) in pairs.items()},
                   report_dir, args.charts)


def _cmd_baseline_update(args: argparse.Namespace) -> int:
    from precision_suite import baselines

    specs = _selected_specs(args)
    where = _execution(args)
    n_tasks = sum(len(baselines.ensemble_tasks(spec)) for spec in specs)
    print(f"{len(specs)} case(s), {n_tasks} runs (seed ensembles and their first-step rounding "
          f"perturbations) {_describe(where, n_tasks)}", file=sys.stderr, flush=True)
    with _execution_errors(where):  # raised before any baseline is written
        written = baselines.regenerate(specs, args.baseline_dir, where["workers"],
                                       _task_progress(n_tasks), scheduler=where["scheduler"])
    for path, changed in written:
        print(f"{'wrote' if changed else 'unchanged'} {path}")
    print(f"{len(specs)} baseline(s) updated; review with `git diff --stat {args.baseline_dir}` "
          "and commit them with the change that explains them")
    return EXIT_OK


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from precision_suite import reproduce, runs

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the figure, datasets and note")
    where = _execution(args)
    specs = reproduce.figure_specs(args.figure)
    print(f"{args.figure}: {len(specs)} run(s) of {specs[0].steps} steps (a few minutes on 2 cores)",
          file=sys.stderr, flush=True)
    result = reproduce.reproduce(args.figure, out,
                                 train=lambda specs: _train_all(runs, list(specs), where))
    for claim in result.claims:
        print(f"{'shown' if claim.holds else 'NOT shown':9} {claim.text}")
    print(f"{sum(c.holds for c in result.claims)} of {len(result.claims)} claims shown; "
          f"trained in {result.seconds:.0f} s")
    print(f"figure: {result.chart}\nnote: {result.note}")
    return EXIT_OK


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import datetime

    from precision_suite import calibration, ensemble, execution, files, reports, runs
    from precision_suite.execution import Task

    specs = _selected_specs(args)
    where = _execution(args)
    rules, tolerances = _load_rules(args.rules)
    references = {runs.case_id(s): _load_reference(_baselines(), args.baseline_dir, runs.case_id(s),
                                                   s.to_json(), _regen_command(args, runs.case_id(s)))
                  for s in specs}
    perturbations = [("threads=2", {"threads": 2}, {}),
                     ("PRECISION_SUITE_COMPILE=0", {}, {"PRECISION_SUITE_COMPILE": "0"})]
    perturbations += [(f"seed {seed}", {"seed": seed}, {}) for seed in args.held_out_seeds]
    runs_to_judge = [(spec, label, Task(dataclasses.replace(spec, **changes), env, f"{runs.case_id(spec)} {label}"))
                     for spec in specs for label, changes, env in perturbations]
    tasks = [task for _, _, task in runs_to_judge]
    print(f"calibrating {len(specs)} case(s) x {len(perturbations)} perturbations "
          f"{_describe(where, len(tasks))}", file=sys.stderr)
    with _execution_errors(where):
        results = execution.run_tasks(tasks, where["workers"], _task_progress(len(tasks)),
                                      scheduler=where["scheduler"])
    report_dir = _report_dir(args.report_dir)
    verdicts, table = [], []
    for (spec, label, _), ds in zip(runs_to_judge, results):
        case = runs.case_id(spec)
        ds = ds.assign_attrs(case=f"{case} [{label}]")
        files.save_dataset(ds, report_dir / "results" / f"{files.safe_filename(ds.attrs['case'])}.nc")
        _tabulate(table, verdicts, case, label, _judge(case, ds, references[case], rules, tolerances,
                                                     report_dir, args.charts))
    for case, reference in references.items():  # free held-out runs: each member against the rest
        if len(ensemble.ensemble_seeds(reference)) < 3:
            continue  # one seed left: no spread to judge by
        for seed, member, others in ensemble.leave_one_out(reference):
            label = f"seed {seed} left out"
            member = member.assign_attrs(case=f"{case} [{label}]")
            outcome = _judge(case, member, others, rules, tolerances, report_dir, args.charts)
            _tabulate(table, verdicts, case, label, outcome)
    detectable = {runs.case_id(spec): ensemble.detectable_change(ds, references[runs.case_id(spec)])
                  for spec, ds in zip(specs, results[::len(perturbations)])}
    alarms_by_metric = {m: sum(row["false_alarms"][m] for row in table) for m in ensemble.SPACES}
    failing = [row for row in table if row["status"] in ("fail", "error", "drift")]
    measured = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "fingerprint": _host_fingerprint(results[0]) if results else {},
                "cases": sorted(references), "perturbations": sorted({row["perturbation"] for row in table}),
                "runs": len(table), "runs_with_alarms": len(failing), "false_alarms": alarms_by_metric}
    sensitivity = {"design_false_alarm_rate": ensemble.FALSE_ALARM_RATE, "measured": measured,
                   "detectable_change": detectable}
    reports.write_report(verdicts, report_dir, charts=args.charts, sensitivity=sensitivity)
    files.write_json({"runs": table, **sensitivity}, report_dir / "calibration.json")
    # beside the baselines it measured, so every later run report can state it
    files.write_json(measured, calibration.measured_path(args.baseline_dir))
    print(f"{len(table)} perturbed runs ({len(tasks)} trained, {len(table) - len(tasks)} members left out of "
          f"their ensemble), {len(failing)} with a FAIL/DRIFT/ERROR (known violations aside)")
    for row in failing:
        print(f"  {row['status'].upper():5} {row['case']} [{row['perturbation']}]")
    for metric, count in alarms_by_metric.items():
        print(f"{metric:15} false alarms {count}")
    for case, changes in detectable.items():
        print(f"smallest detected change, {case}:")
        for metric, text in changes.items():
            print(f"  {metric:15} {text}")
    print(f"report: {report_dir / 'index.html'}; table: {report_dir / 'calibration.json'}; "
          f"summary for later run reports: {calibration.measured_path(args.baseline_dir)} (commit it)")
    return EXIT_REGRESSION if failing else EXIT_OK


def _host_fingerprint(ds: Any) -> dict:
    """The host a calibration measured: a run's fingerprint without its own thread count."""
    import json

    return {k: v for k, v in json.loads(ds.attrs["fingerprint"]).items() if k != "threads"}


def _tabulate(table: list, verdicts: list, case: str, label: str, outcome: Any) -> None:
    from precision_suite import ensemble

    alarms = [f for f in outcome.findings if f.kind in ("regression", "drift")]
    verdicts.append(outcome)
    table.append({"case": case, "perturbation": label, "status": outcome.status,
                  "false_alarms": {m: sum(f.metric == m for f in alarms) for m in ensemble.SPACES}})


def _baselines():
    from precision_suite import baselines

    return baselines


def _cmd_report(args: argparse.Namespace) -> int:
    results: dict = {}
    origin: dict = {}
    for location in args.results:
        for case, ds in _load_results(location, "RESULTS").items():
            if case in results:
                raise UsageError(f"RESULTS {origin[case]} and {location} both hold case {case!r}; "
                                 "each case belongs to one shard: give each folder once")
            results[case], origin[case] = ds, location
    rules, tolerances = _load_rules(args.rules)
    report_dir = _report_dir(args.report_dir)
    verdicts = []
    if args.baseline_dir is not None:
        from precision_suite import baselines
    references = {}
    for case, ds in results.items():
        reference = None
        if args.baseline_dir is not None:
            reference = references[case] = _load_reference(baselines, args.baseline_dir, case,
                                                           ds.attrs.get("spec"),
                                                           baselines.default_regen_hint(case))
        verdicts.append(_judge(case, ds, reference, rules, tolerances, report_dir, args.charts))
    sensitivity = _sensitivity(references, results, args.baseline_dir) if references else None
    return _finish(verdicts, results, report_dir, args.charts, sensitivity)


# --------------------------------------------------------------------------- specs


def _selected_specs(args: argparse.Namespace) -> list:
    from precision_suite import matrix, runs

    specs = _config_specs(Path(args.config)) if args.config else matrix.default_matrix(args.quick)
    if args.device:
        specs = [dataclasses.replace(spec, device=args.device) for spec in specs]
    if getattr(args, "seed", None) is not None:
        specs = [dataclasses.replace(spec, seed=args.seed) for spec in specs]
    source = f"config file {args.config}" if args.config else \
        ("the quick matrix" if args.quick else "the default matrix")
    if args.attention and not args.config:
        specs += _new_attention_specs(args.attention, specs)
    filters = {"model": args.model, "attention": args.attention, "recipe": args.recipe}
    for field, wanted in filters.items():
        if not wanted:
            continue
        available = sorted({str(getattr(spec, field)) for spec in specs})
        unknown = [w for w in wanted if w not in available]
        if unknown:
            raise UsageError(f"--{field} {', '.join(unknown)} is not in {source} (it has "
                             f"{', '.join(available)}); for other cases write a --config file "
                             "(see docs/cli.md)")
        specs = [spec for spec in specs if str(getattr(spec, field)) in wanted]
    if args.case:
        cases = {runs.case_id(spec): spec for spec in specs}
        unknown = [c for c in args.case if c not in cases]
        if unknown:
            raise UsageError(f"--case {', '.join(unknown)} is not in the selection from {source} "
                             f"(it has {', '.join(sorted(cases)) or 'no cases'})")
        specs = [cases[c] for c in args.case]
    if not specs:
        raise UsageError(f"the selection from {source} is empty; widen --model/--attention/--recipe")
    if getattr(args, "shard", None) is not None:
        index, count = args.shard
        if count > len(specs):
            raise UsageError(f"--shard {index}/{count}: the selection has only {len(specs)} case(s); "
                             f"use at most {len(specs)} shards")
        specs = specs[index - 1::count]
    for spec in specs:  # type errors first: a case id is built from these fields
        for field in ("model", "attention", "recipe"):
            if not isinstance(getattr(spec, field), str):
                raise UsageError(f"{source}: {field} must be a string, got {getattr(spec, field)!r}")
    ids = [runs.case_id(spec) for spec in specs]
    duplicates = sorted({case for case in ids if ids.count(case) > 1})
    if duplicates:
        raise UsageError(f"{source} has several specs for case {', '.join(duplicates)}; a case "
                         "(model, attention, recipe) has one baseline file, so give each one once")
    for spec in specs:  # every spec is checked before the first one trains
        try:
            spec.validate()
        except ValueError as exc:
            raise UsageError(f"{runs.case_id(spec)} from {source}: {exc}") from None
    return specs


def _new_attention_specs(names: Sequence[str], specs: list) -> list:
    """A figure-A case (the matrix's ViT recipe) for each --attention outside the matrix that names
    a variant: a polynomial such as x^2/4 or a user's function, package.module:function."""
    from precision_suite import matrix
    from precision_suite.attention import get_attention
    from precision_suite.runs import RunSpec

    known = {spec.attention for spec in specs}
    added = []
    for name in dict.fromkeys(names):
        if name in known:
            continue
        try:
            get_attention(name)
        except ValueError:
            continue  # left to the filter's error, which lists what the matrix has
        added.append(RunSpec(model="vit", attention=name, recipe=matrix.VIT_RECIPE))
    return added


def _config_specs(path: Path) -> list:
    """RunSpecs from a TOML file of [[case]] tables whose keys are RunSpec fields, and the user
    recipes its [recipes.NAME] tables declare (made known to this process and the workers it
    spawns through recipes.RECIPES_ENV)."""
    from precision_suite import recipes
    from precision_suite.runs import RunSpec

    table = _read_toml(path)
    cases = table.get("case")
    if not isinstance(cases, list) or not cases:
        raise UsageError(f"{path}: no [[case]] tables; write one per run, e.g.\n"
                         '[[case]]\nmodel = "vit"\nattention = "softmax"\nrecipe = "fp32"')
    unknown_tables = sorted(set(table) - {"case", "recipes"})
    if unknown_tables:
        raise UsageError(f"{path}: unknown top-level key(s) {', '.join(unknown_tables)}; a config has "
                         "[[case]] tables and optional [recipes.NAME] tables")
    try:
        declared = recipes.recipes_from_toml(table.get("recipes", {}), str(path))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    os.environ.update(recipes.recipes_environment(declared))
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    specs = []
    for number, case in enumerate(cases, 1):
        if not isinstance(case, dict):
            raise UsageError(f"{path}: case number {number} is not a table; write [[case]] tables")
        unknown = sorted(set(case) - fields)
        if unknown:
            raise UsageError(f"{path}: [[case]] number {number} has unknown field(s) "
                             f"{', '.join(unknown)}; RunSpec fields are {', '.join(sorted(fields))}")
        specs.append(RunSpec(**case))
    return specs


def _read_toml(path: Path) -> dict:
    from precision_suite.files import read_toml

    try:
        return read_toml(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _regen_command(args: argparse.Namespace, case: str) -> str:
    """The `baseline update` command that creates `case` with the same selection source."""
    words = ["precision-suite", "baseline", "update", "--case", case]
    if args.quick:
        words.append("--quick")
    if args.config:
        words += ["--config", args.config]
    for name in dict.fromkeys(args.attention or ()):  # a variant outside the matrix makes its case
        words += ["--attention", name]
    if args.device:
        words += ["--device", args.device]
    if args.baseline_dir != DEFAULT_BASELINE_DIR:
        words += ["--baseline-dir", args.baseline_dir]
    return shlex.join(words)


# --------------------------------------------------------------------------- training and judging


def _train_all(runs: Any, specs: list, where: dict) -> list:
    """Every spec's run: serially with live per-step progress, or in a pool of worker processes
    or on a Dask cluster with a line per finished case (identical numbers either way)."""
    from precision_suite import execution

    if where["scheduler"] is None and (where["workers"] == 1 or len(specs) == 1):
        return [_train(runs, spec, f"[{i}/{len(specs)}] {runs.case_id(spec)}")
                for i, spec in enumerate(specs, 1)]
    print(f"training {len(specs)} case(s) {_describe(where, len(specs))}", file=sys.stderr, flush=True)
    with _execution_errors(where):
        return execution.run_tasks([execution.Task(spec) for spec in specs], where["workers"],
                                   _task_progress(len(specs)), scheduler=where["scheduler"])


def _execution(args: argparse.Namespace) -> dict:
    """Where the runs train: {"workers": N, "scheduler": address or None} from the flags."""
    from precision_suite import execution

    if args.scheduler is not None and args.workers is not None:
        raise UsageError(f"--workers {args.workers} trains in local processes, --scheduler "
                         f"{args.scheduler} on the Dask cluster's workers; give one of them (size "
                         "a cluster with `dask worker ADDRESS --nworkers N --nthreads 1`)")
    return {"workers": args.workers or execution.default_workers(), "scheduler": args.scheduler}


def _describe(where: dict, n_tasks: int) -> str:
    if where["scheduler"] is not None:
        return f"on the Dask cluster at {where['scheduler']}"
    if where["workers"] == 1 or n_tasks <= 1:
        return "in this process"
    return f"on {min(where['workers'], n_tasks)} worker processes"


@contextmanager
def _execution_errors(where: dict) -> Iterator[None]:
    """Errors of execution.run_tasks as one-line usage errors (status 2)."""
    from precision_suite.execution import ExecutorError

    try:
        yield
    except ExecutorError as exc:  # Dask missing, scheduler unreachable, a worker process died
        raise UsageError(f"--scheduler: {exc}" if where["scheduler"] else str(exc)) from None
    except ValueError as exc:  # e.g. --device cuda on a machine without CUDA
        raise UsageError(str(exc)) from None


def _task_progress(total: int) -> Callable[[int, Any, float], None]:
    """execution.run_tasks' `done` callback: one stderr line per finished task (its label, or its
    case id), counted in the order they finish (a pool finishes them out of order)."""
    from precision_suite import runs

    finished = [0]

    def done(_index: int, task: Any, seconds: float) -> None:
        finished[0] += 1
        print(f"[{finished[0]}/{total}] {task.label or runs.case_id(task.spec)} ({seconds:.0f} s so far)",
              file=sys.stderr, flush=True)

    return done


def _train(runs: Any, spec: Any, label: str):
    """`runs.run(spec)` with progress on stderr (a live line on a terminal, a few lines in CI)."""
    started = time.monotonic()
    print(f"{label}: training", file=sys.stderr, flush=True)
    try:
        ds = runs.run(spec, progress=_progress_printer(label))
    except ValueError as exc:  # e.g. --device cuda on a machine without CUDA
        raise UsageError(f"{label}: {exc}") from None
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"{label}: done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return ds


def _progress_printer(label: str) -> Callable[[int, int, float], None]:
    live = sys.stderr.isatty()
    last_decile = [-1]

    def progress(steps_done: int, total: int, loss: float) -> None:
        line = f"{label}: step {steps_done}/{total}, loss {loss:.4g}"
        if live:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
            return
        decile = (10 * steps_done) // max(total, 1)
        if decile > last_decile[0]:  # about ten lines per case in a CI log
            last_decile[0] = decile
            print(line, file=sys.stderr, flush=True)

    return progress


def _load_reference(baselines: Any, baseline_dir: str, case: str, spec_json: str, regen_hint: str):
    try:
        return baselines.load_ensemble(baselines.baseline_path(baseline_dir, case),
                                       expected_spec=spec_json, regen_hint=regen_hint)
    except baselines.BaselineError as exc:
        raise UsageError(str(exc)) from None


def _load_rules(pyproject: str) -> tuple[tuple, dict]:
    """Threshold rules and tolerance overrides from [tool.precision_suite]; none if no file."""
    if not Path(pyproject).is_file() and pyproject != DEFAULT_RULES_FILE:
        raise UsageError(f"--rules {pyproject} does not exist; give the pyproject.toml that "
                         "holds [tool.precision_suite]")
    from precision_suite import checks

    try:
        config = checks.load_project_config(pyproject)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"{exc}; fix the rule (grammar in docs/baselines.md)") from None
    return config.rules, dict(config.tolerances)


def _judge(case: str, current, reference, rules: Sequence, tolerances: dict | list, report_dir: Path,
           charts: str, regen_hint: str = ""):
    """The verdict of one case by the one judging engine (precision_suite.judge); chart and
    obtained files are named by the dataset's case label (calibrate labels its perturbations);
    `charts="none"` draws no drift chart."""
    from precision_suite import files, judge, matrix

    name = files.safe_filename(str(current.attrs.get("case", case)))
    try:
        return judge.judge_case(current, reference, rules=rules, tolerances=tolerances,
                                known=matrix.KNOWN_VIOLATIONS.get(case, ""),
                                chart_path=None if charts == "none" else report_dir / "charts" / f"{name}-drift.png",
                                obtained_path=report_dir / "obtained" / f"{name}.nc",
                                regen_hint=regen_hint)
    except ValueError as exc:  # a tolerance override that does not make sense
        raise UsageError(f"tolerances: {exc}") from None


def _sensitivity(references: dict, datasets: dict, baseline_dir: str) -> dict:
    """What a report states about its comparison: the designed false-alarm rate, the rate
    `calibrate` measured on these baselines (if it was run), the smallest change detected."""
    from precision_suite import calibration, ensemble

    try:
        measured = calibration.read_measured(baseline_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return {"design_false_alarm_rate": ensemble.FALSE_ALARM_RATE, "measured": measured,
            "detectable_change": {case: ensemble.detectable_change(ds, references[case])
                                  for case, ds in datasets.items()
                                  if case in references and "seed" in references[case].dims}}


def _finish(verdicts: list, datasets: dict, report_dir: Path, charts: str,
            sensitivity: dict | None = None) -> int:
    from precision_suite import judge, reports

    reports.write_report(verdicts, report_dir, datasets=datasets, charts=charts, sensitivity=sensitivity)
    for verdict in verdicts:
        # a finding's message names its case for the plugin's reports; this line already does
        first = f": {verdict.findings[0].message.removeprefix(verdict.case + ': ')}" if verdict.findings else ""
        more = f" (+{len(verdict.findings) - 1} more)" if len(verdict.findings) > 1 else ""
        print(f"{verdict.status.upper():5} {verdict.case}{first}{more}")
        if verdict.known:
            print(f"      known violation, not failing the run: {verdict.known}")
    print(f"report: {report_dir / 'index.html'}")
    return EXIT_REGRESSION if any(judge.blocks(v) for v in verdicts) else EXIT_OK


def _report_dir(given: str | None) -> Path:
    from precision_suite import reports

    if given is None:
        return reports.new_report_dir(DEFAULT_REPORT_ROOT)
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------- saved results


def _result_path(folder: str, case: str) -> Path:
    from precision_suite import files

    return Path(folder) / f"{files.safe_filename(case)}.nc"


def _load_results(location: str, what: str) -> dict:
    """case -> dataset for a .nc file or every .nc file in a folder."""
    from precision_suite.files import load_dataset

    path = Path(location)
    if path.is_dir():
        result_files = sorted(path.glob("*.nc"))
        if not result_files:
            raise UsageError(f"{what} {path} holds no .nc files; save results with "
                             "`precision-suite run --save-results DIR`")
    elif path.is_file():
        result_files = [path]
    else:
        raise UsageError(f"{what} {path} does not exist; give a .nc result file or a folder of them")
    results: dict = {}
    for file in result_files:
        try:
            ds = load_dataset(file)
        except Exception as exc:  # h5py/xarray raise many types for a damaged file
            raise UsageError(f"{what} {file} is not a readable result file ({type(exc).__name__}: "
                             f"{exc}); write results with `precision-suite run --save-results DIR`") from None
        case = ds.attrs.get("case")
        if not case:
            raise UsageError(f"{what} {file} has no `case` attribute; it was not written by "
                             "precision-suite (use `run --save-results`)")
        if case in results:
            raise UsageError(f"{what} {path} holds case {case!r} twice; keep one file per case")
        results[case] = ds
    return results


def _pair_results(base: dict, new: dict, base_location: str, new_location: str) -> dict:
    """case -> (base, new); any case or spec that does not match is a usage error."""
    from precision_suite.baselines import spec_differences

    if len(base) == 1 and len(new) == 1 and Path(base_location).is_file() and Path(new_location).is_file():
        (base_case, base_ds), (new_case, new_ds) = next(iter(base.items())), next(iter(new.items()))
        pairs = {new_case: (base_ds, new_ds)}
        if base_case != new_case:
            _raise_spec_mismatch(new_case, base_ds, new_ds, spec_differences,
                                 f"BASE is case {base_case!r}, NEW is case {new_case!r}")
    else:
        only_base, only_new = sorted(set(base) - set(new)), sorted(set(new) - set(base))
        if only_base or only_new:
            parts = ([f"only in BASE: {', '.join(only_base)}"] if only_base else []) + \
                    ([f"only in NEW: {', '.join(only_new)}"] if only_new else [])
            raise UsageError(f"BASE and NEW hold different cases ({'; '.join(parts)}); compare "
                             "results of the same cases, or pass two single .nc files")
        pairs = {case: (base[case], new[case]) for case in sorted(new)}
    for case, (base_ds, new_ds) in pairs.items():
        if base_ds.attrs.get("spec") != new_ds.attrs.get("spec"):
            _raise_spec_mismatch(case, base_ds, new_ds, spec_differences, "")
    return pairs


def _raise_spec_mismatch(case: str, base_ds, new_ds, spec_differences, context: str) -> None:
    from precision_suite.checks import run_spec

    def spec(ds) -> dict:  # an unreadable spec is compared as its raw text
        return run_spec(ds) or {"spec": ds.attrs.get("spec")}

    differences = spec_differences(spec(base_ds), spec(new_ds)) or ["spec attributes differ"]
    prefix = f"{context}; " if context else f"case {case}: "
    raise UsageError(f"{prefix}BASE and NEW were made from different specs "
                     f"({'; '.join(differences)}, with BASE as the baseline and NEW as current); "
                     "compare results of the same spec")


def _parse_fail_rules(rules: Sequence[str]) -> dict[str, float]:
    """`--fail metric:tolerance` flags as tolerance overrides {metric: tolerance}."""
    from precision_suite.baselines import resolve_tolerances

    overrides: dict[str, float] = {}
    for rule in rules:
        metric, sep, number = rule.partition(":")
        try:
            tolerance = float(number)
        except ValueError:
            tolerance = float("nan")
        if not sep or not metric or not (tolerance >= 0 and tolerance != float("inf")):
            raise UsageError(f"--fail {rule!r}: write METRIC:TOLERANCE with a finite tolerance "
                             ">= 0, e.g. --fail underflow:1e-3")
        overrides[metric.strip()] = tolerance
    try:
        resolve_tolerances(overrides)
    except ValueError as exc:
        from precision_suite.baselines import DEFAULT_TOLERANCES

        raise UsageError(f"--fail: {exc}; metrics with a tolerance: "
                         f"{', '.join(DEFAULT_TOLERANCES)}") from None
    return overrides


if __name__ == "__main__":
    sys.exit(main())
