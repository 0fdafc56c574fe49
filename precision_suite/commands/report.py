"""`precision-suite report RESULTS...`: charts and summary of saved results, without training."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, add_checking


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "results",
        metavar="RESULTS",
        nargs="+",
        help="a .nc result file or a folder of them; several (e.g. one per CI shard) merge into one report",
    )
    add_checking(parser, baselines=False, charts_default="all")
    parser.add_argument(
        "--baseline-dir", metavar="DIR", default=None, help="also compare with the baselines in DIR"
    )


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.checking import report_results

    return report_results(
        args.results,
        baseline_dir=args.baseline_dir,
        rules_file=args.rules,
        report_dir=args.report_dir,
        charts=args.charts,
    )


COMMAND = Command(
    "report",
    help="charts and summary of saved results, without training",
    description="Write a report (charts of every case, rules checked) from saved results, "
    "merging several folders (one per CI shard) into one. With --baseline-dir the "
    "results are also compared with their baselines.",
    add_arguments=add_arguments,
    run=run,
)
