"""`precision-suite compare BASE NEW`: saved results judged against saved results."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, add_checking, add_fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE", help="reference results: a .nc file or a folder")
    parser.add_argument("new", metavar="NEW", help="results to judge: a .nc file or a folder")
    add_fail(parser)
    add_checking(parser, baselines=False)


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.checking import compare_results

    return compare_results(
        args.base, args.new, args.fail, rules_file=args.rules, report_dir=args.report_dir, charts=args.charts
    )


COMMAND = Command(
    "compare",
    help="compare saved results NEW against BASE (files or folders of .nc files)",
    description="Compare saved results NEW against BASE with the baseline tolerances and the "
    "[tool.precision_suite] rules. BASE and NEW are .nc files or folders of them "
    "(as written by `run --save-results`); cases are matched by case id.",
    add_arguments=add_arguments,
    run=run,
)
