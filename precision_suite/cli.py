"""The `precision-suite` command line: train, compare with baselines, check rules, write reports.

Exit status: 0 when every check holds (drift is reported but holds), 1 on a numerics regression
(a failing or erroring case), 2 on bad usage or configuration (unknown names, unreadable files,
missing or mismatched baselines), always with a one-line message saying what to do next.

Argument parsing only: each command calls its function in jobs/commands.py (or jobs/calibrate.py),
imported once the arguments are parsed, so that `--help` and `--version` answer at once without
loading torch, xarray or matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

# light modules only (no torch, xarray or matplotlib): the parser needs their names and choices
from precision_suite.jobs.execution import DASK_INSTALL_HINT, scheduler_address
from precision_suite.jobs.usage import (DEFAULT_BASELINE_DIR, DEFAULT_REPORT_ROOT, DEFAULT_RULES_FILE, EXIT_USAGE,
                                        UsageError)
from precision_suite.reports.figure_names import DEFAULT_OUT, FIGURE_NAMES
from precision_suite.verdicts.findings import CHART_CHOICES
from precision_suite.version import __version__


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
        # lazy: torch, xarray and matplotlib load once a command runs, never for --help or a usage error
        from precision_suite.jobs import commands, false_alarms as calibrate

        return args.command_func(args, commands, calibrate)
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
  precision-suite diff origin/main --config cases.toml   this change's numbers against main's, same machine
  precision-suite bisect v1.2 HEAD --config cases.toml   the first commit whose diff against v1.2 fails
  precision-suite report results/              charts and summary of saved results
  precision-suite history record results/ --store history/   add this commit's results to a history
  precision-suite history report --store history/            the series over commits and their steps
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
                     help="also save each run as DIR/<case>.nc (and its replay as DIR/replays/<case>.nc), "
                          "for `compare`, `report` and `history record` later")
    run.set_defaults(command_func=_cmd_run)

    compare = commands.add_parser(
        "compare", help="compare saved results NEW against BASE (files or folders of .nc files)",
        description="Compare saved results NEW against BASE with the baseline tolerances and the "
                    "[tool.precision_suite] rules. BASE and NEW are .nc files or folders of them "
                    "(as written by `run --save-results`); cases are matched by case id.")
    compare.add_argument("base", metavar="BASE", help="reference results: a .nc file or a folder")
    compare.add_argument("new", metavar="NEW", help="results to judge: a .nc file or a folder")
    _add_fail(compare)
    _add_checking(compare, baselines=False)
    compare.set_defaults(command_func=_cmd_compare)

    diff = commands.add_parser(
        "diff", help="train the selection with commit BASE's code and with HEAD's, and compare (the "
                     "pull-request gate)",
        description="Train the selection with the code of commit BASE (checked out in a temporary git "
                    "worktree) and with HEAD's (default: the working tree), on this machine with the "
                    "same seeds, so the runs are bitwise identical unless the code changed the numbers. "
                    "Prints per case the first step at which each metric differs and the change's size "
                    "there measured cleanly (both codes replay from BASE's state at that step), judges "
                    "HEAD against BASE with the baseline tolerances (and --fail) and writes a report "
                    "drawing both. "
                    "Exit 0 unchanged or within tolerance, 1 a metric moved beyond it, 2 bad usage or "
                    "a side that cannot run.")
    diff.add_argument("base", metavar="BASE", help="the reference commit: a branch, tag or SHA")
    diff.add_argument("head", metavar="HEAD", nargs="?", default=None,
                      help="the commit to judge (default: the working tree as it is, uncommitted changes included)")
    _add_selection(diff)
    _add_diff_judging(diff)
    _add_checking(diff, baselines=False, rules_help=_TOLERANCES_ONLY)
    diff.add_argument("--workers", type=_workers, default=None, metavar="N",
                      help="local worker processes per side (default: the number of cores)")
    diff.set_defaults(command_func=_cmd_diff)

    bisect = commands.add_parser(
        "bisect", help="find the first commit after GOOD whose `diff GOOD` fails",
        description="Drive `git bisect run` between GOOD and BAD: a commit is bad when `diff GOOD "
                    "<commit>` fails (with --metric: a finding of that metric), good when it passes, "
                    "skipped when its code cannot run. Needs a clean working tree; the starting branch "
                    "is restored however it ends. Prints the first bad commit and what changed there. "
                    "Exit 1 a first bad commit found, 0 BAD passes against GOOD, 2 bad usage.")
    bisect.add_argument("good", metavar="GOOD", help="a commit whose numbers are right")
    bisect.add_argument("bad", metavar="BAD", help="a later commit whose `diff GOOD` fails")
    _add_selection(bisect)
    _add_diff_judging(bisect)
    bisect.add_argument("--rules", default=DEFAULT_RULES_FILE, metavar="FILE", help=_TOLERANCES_ONLY)
    bisect.add_argument("--workers", type=_workers, default=None, metavar="N",
                        help="local worker processes (default: the number of cores)")
    bisect.set_defaults(command_func=_cmd_bisect)

    history = commands.add_parser("history", help="numerics over commits: record runs, report their steps",
                                  description="A history store of every recorded commit's numerics per "
                                              "host and case (docs/cli.md).")
    history_commands = history.add_subparsers(title="history commands", metavar="ACTION")
    record = history_commands.add_parser(
        "record", help="add saved results to a history store as one commit's",
        description="Record saved results (`run --save-results DIR` folders, several for CI shards) as "
                    "commit --commit of the repository holding the working directory, per host and case: "
                    "the headline series, the replay deltas and their noise levels from the baselines. "
                    "The same commit, host and case recorded again replaces its record.")
    record.add_argument("results", metavar="RESULTS", nargs="+", help="a folder of saved results (or a .nc file)")
    record.add_argument("--store", required=True, metavar="DIR", help="the history store (created if new)")
    record.add_argument("--commit", default="HEAD", metavar="REF",
                        help="the commit the results were trained at (default: HEAD)")
    record.add_argument("--branch", default=None, metavar="NAME",
                        help="the branch to record (default: the checked-out one; none on a detached HEAD)")
    record.add_argument("--baseline-dir", default=DEFAULT_BASELINE_DIR, metavar="DIR",
                        help=f"where the noise levels come from (default: {DEFAULT_BASELINE_DIR}/)")
    record.set_defaults(command_func=_cmd_history_record)
    history_report = history_commands.add_parser(
        "report", help="the headline series over commits and their detected steps",
        description="Per host and case of the store: the headline series over commits (loss, attention "
                    "norm, underflow and distortion per layer, tensor and layout, the replay deltas), "
                    "each series' steps detected (PELT with a penalty from the baselines' noise levels) "
                    "and named by commit, as index.html, summary.md and summary.json.")
    history_report.add_argument("--store", required=True, metavar="DIR", help="the history store")
    group = history_report.add_argument_group("selection (default: every case of the store)")
    for flag, meta, example in (("--case", "ID", "an exact case id"), ("--model", "NAME", "e.g. vit, gpt"),
                                ("--attention", "NAME", "e.g. softmax, x/1"), ("--recipe", "NAME", "e.g. fp8-block")):
        group.add_argument(flag, action="append", metavar=meta, help=f"{example} (repeat to pick several)")
    history_report.add_argument("--branch", metavar="NAME", default=None,
                                help="only the records of this branch (default: every record of the store)")
    history_report.add_argument("--since", metavar="REF", default=None,
                                help="only commits from this one on (by depth in the first-parent history)")
    history_report.add_argument("--report-dir", metavar="DIR",
                                help=f"write the report here (default: a new {DEFAULT_REPORT_ROOT}/<timestamp>/)")
    history_report.add_argument("--charts", choices=CHART_CHOICES, default="all",
                                help="chart every case, those with a step (failing), or none (default: all)")
    history_report.set_defaults(command_func=_cmd_history_report)
    history.set_defaults(command_func=lambda *_: history.print_help(sys.stderr) or EXIT_USAGE)

    baseline = commands.add_parser("baseline", help="manage golden baselines",
                                   description="Manage the golden baseline files.")
    baseline_commands = baseline.add_subparsers(title="baseline commands", metavar="ACTION")
    update = baseline_commands.add_parser(
        "update", help="train the selection and (over)write its baselines",
        description="Train each selected case's seed ensemble (and the first step of its first "
                    "seed under each rounding twin) and write its baseline atomically; unchanged numbers "
                    "leave the file untouched. Review the change (git diff --stat baselines/) "
                    "before committing it.")
    _add_selection(update)
    _add_execution(update)
    update.add_argument("--baseline-dir", default=DEFAULT_BASELINE_DIR, metavar="DIR",
                        help=f"where baselines live (default: {DEFAULT_BASELINE_DIR}/)")
    update.set_defaults(command_func=_cmd_baseline_update)
    baseline.set_defaults(command_func=lambda *_: baseline.print_help(sys.stderr) or EXIT_USAGE)

    calibrate = commands.add_parser(
        "calibrate", help="measure false alarms and the smallest detected change on this machine",
        description="Run every selected case under perturbations that must not fail it (this "
                    "host's rounding twins: ATen's narrower kernels, MKL's compatible path, 2 threads, "
                    "eager; held-out seeds), judge each against its "
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
    group = parser.add_argument_group("where the runs train (the numbers are the same either way)")
    group.add_argument("--workers", type=_workers, default=None, metavar="N",
                       help="local worker processes, one run each (default: the number of cores; "
                            "`run --workers 1` trains in this process with live progress)")
    group.add_argument("--scheduler", type=_scheduler, default=None, metavar="tcp://HOST:PORT",
                       help="send each run to the Dask cluster of this scheduler instead "
                            f"(needs {DASK_INSTALL_HINT}; see docs/ci.md)")


_TOLERANCES_ONLY = (f"pyproject.toml whose [tool.precision_suite] tolerances apply (default: ./{DEFAULT_RULES_FILE}, "
                    "skipped if absent); its threshold rules are not checked: a diff judges the change")


def _add_fail(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fail", metavar="METRIC:TOL", action="append", default=[],
                        help="override a metric's tolerance, e.g. underflow:1e-3 or "
                             "attention_norm:0.1 (in the metric's comparison space, "
                             "see docs/baselines.md); repeatable")


def _add_diff_judging(parser: argparse.ArgumentParser) -> None:
    _add_fail(parser)
    parser.add_argument("--metric", metavar="NAME", default=None,
                        help="only findings of this metric decide (e.g. underflow)")


def _add_checking(parser: argparse.ArgumentParser, baselines: bool = True,
                  charts_default: str = "failing", rules_help: str | None = None) -> None:
    if baselines:
        parser.add_argument("--baseline-dir", default=DEFAULT_BASELINE_DIR, metavar="DIR",
                            help=f"where baselines live (default: {DEFAULT_BASELINE_DIR}/)")
    parser.add_argument("--rules", default=DEFAULT_RULES_FILE, metavar="FILE",
                        help=rules_help or "pyproject.toml holding [tool.precision_suite] rules "
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
    try:
        return scheduler_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --------------------------------------------------------------------------- commands
# Each gets the parsed flags and the jobs modules (imported by `main` once parsing succeeded).


def _cmd_run(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.run_cases(commands.Selection.from_args(args), baseline_dir=args.baseline_dir,
                              rules_file=args.rules, report_dir=args.report_dir, charts=args.charts,
                              workers=args.workers, scheduler=args.scheduler, save_results=args.save_results)


def _cmd_compare(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.compare_results(args.base, args.new, args.fail, rules_file=args.rules,
                                    report_dir=args.report_dir, charts=args.charts)


def _cmd_diff(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.diff_commits(args.base, args.head, commands.Selection.from_args(args), fail=args.fail,
                                 metric=args.metric, rules_file=args.rules, report_dir=args.report_dir,
                                 charts=args.charts, workers=args.workers)


def _cmd_bisect(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.bisect_commits(args.good, args.bad, commands.Selection.from_args(args), fail=args.fail,
                                   metric=args.metric, rules_file=args.rules, workers=args.workers)


def _cmd_history_record(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.record_results(args.results, args.store, commit=args.commit, branch=args.branch,
                                   baseline_dir=args.baseline_dir)


def _cmd_history_report(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.report_history(args.store, commands.Selection.from_args(args), since=args.since, branch=args.branch, report_dir=args.report_dir,
                                   charts=args.charts)


def _cmd_baseline_update(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.update_baselines(commands.Selection.from_args(args), baseline_dir=args.baseline_dir,
                                     workers=args.workers, scheduler=args.scheduler)


def _cmd_calibrate(args: argparse.Namespace, commands: ModuleType, calibrate: ModuleType) -> int:
    return calibrate.calibrate(commands.Selection.from_args(args), args.held_out_seeds,
                               baseline_dir=args.baseline_dir, rules_file=args.rules,
                               report_dir=args.report_dir, charts=args.charts, workers=args.workers,
                               scheduler=args.scheduler)


def _cmd_report(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.report_results(args.results, baseline_dir=args.baseline_dir, rules_file=args.rules,
                                   report_dir=args.report_dir, charts=args.charts)


def _cmd_reproduce(args: argparse.Namespace, commands: ModuleType, _calibrate: ModuleType) -> int:
    return commands.reproduce_figure(args.figure, args.out, workers=args.workers, scheduler=args.scheduler)


if __name__ == "__main__":
    sys.exit(main())
