"""`precision-suite run`: train the matrix, compare with baselines, check rules, write a report."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, add_checking, add_execution, add_selection


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_selection(parser)
    add_checking(parser)
    add_execution(parser)
    parser.add_argument(
        "--save-results",
        metavar="DIR",
        help="also save each run as DIR/<case>.nc (and its replay as DIR/replays/<case>.nc), "
        "for `compare`, `report` and `history record` later",
    )


def run(args: argparse.Namespace) -> int:
    # lazy, as in every command: torch, xarray and matplotlib load once the arguments are parsed
    from precision_suite.jobs.checking import run_cases
    from precision_suite.jobs.selection import Selection

    return run_cases(
        Selection.from_args(args),
        baseline_dir=args.baseline_dir,
        rules_file=args.rules,
        report_dir=args.report_dir,
        charts=args.charts,
        workers=args.workers,
        scheduler=args.scheduler,
        save_results=args.save_results,
    )


COMMAND = Command(
    "run",
    help="train the matrix, compare with baselines, check rules, write a report",
    description="Train each case of the matrix (or of the selection), compare it with its "
    "baseline, check the [tool.precision_suite] rules and write a report. "
    "Progress goes to stderr, the summary to stdout.",
    add_arguments=add_arguments,
    run=run,
)
