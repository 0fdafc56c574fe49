"""`precision-suite history record|report`: numerics over commits, per host and case."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, Group, add_baseline_dir, add_report_dir
from precision_suite.verdicts.findings import CHART_CHOICES


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "results", metavar="RESULTS", nargs="+", help="a folder of saved results (or a .nc file)"
    )
    parser.add_argument("--store", required=True, metavar="DIR", help="the history store (created if new)")
    parser.add_argument(
        "--commit",
        default="HEAD",
        metavar="REF",
        help="the commit the results were trained at (default: HEAD)",
    )
    parser.add_argument(
        "--branch",
        default=None,
        metavar="NAME",
        help="the branch to record (default: the checked-out one; none on a detached HEAD)",
    )
    add_baseline_dir(parser, "where the noise levels come from")


def record(args: argparse.Namespace) -> int:
    from precision_suite.jobs.history_store import record_results

    return record_results(
        args.results, args.store, commit=args.commit, branch=args.branch, baseline_dir=args.baseline_dir
    )


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, metavar="DIR", help="the history store")
    group = parser.add_argument_group("selection (default: every case of the store)")
    for flag, meta, example in (
        ("--case", "ID", "an exact case id"),
        ("--model", "NAME", "e.g. vit, gpt"),
        ("--attention", "NAME", "e.g. softmax, x/1"),
        ("--recipe", "NAME", "e.g. fp8-block"),
    ):
        group.add_argument(flag, action="append", metavar=meta, help=f"{example} (repeat to pick several)")
    parser.add_argument(
        "--branch",
        metavar="NAME",
        default=None,
        help="only the records of this branch (default: every record of the store)",
    )
    parser.add_argument(
        "--since",
        metavar="REF",
        default=None,
        help="only commits from this one on (by depth in the first-parent history)",
    )
    add_report_dir(parser)
    parser.add_argument(
        "--charts",
        choices=CHART_CHOICES,
        default="all",
        help="chart every case, those with a step (failing), or none (default: all)",
    )


def report(args: argparse.Namespace) -> int:
    from precision_suite.jobs.history_store import report_history
    from precision_suite.jobs.selection import Selection

    return report_history(
        args.store,
        Selection.from_args(args),
        since=args.since,
        branch=args.branch,
        report_dir=args.report_dir,
        charts=args.charts,
    )


COMMAND = Group(
    "history",
    help="numerics over commits: record runs, report their steps",
    description="A history store of every recorded commit's numerics per host and case (docs/cli.md).",
    actions=(
        Command(
            "record",
            help="add saved results to a history store as one commit's",
            description="Record saved results (`run --save-results DIR` folders, several for CI shards) as "
            "commit --commit of the repository holding the working directory, per host and case: "
            "the headline series, the replay deltas and their noise levels from the baselines. "
            "The same commit, host and case recorded again replaces its record.",
            add_arguments=add_record_arguments,
            run=record,
        ),
        Command(
            "report",
            help="the headline series over commits and their detected steps",
            description="Per host and case of the store: the headline series over commits (loss, attention "
            "norm, underflow and distortion per layer, tensor and layout, the replay deltas), "
            "each series' steps detected (PELT with a penalty from the baselines' noise levels) "
            "and named by commit, as index.html, summary.md and summary.json.",
            add_arguments=add_report_arguments,
            run=report,
        ),
    ),
)
