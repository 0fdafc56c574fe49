"""`precision-suite diff BASE [HEAD]`: the selection trained with two commits' code, compared (the
pull-request gate)."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import (
    TOLERANCES_ONLY,
    Command,
    add_checking,
    add_diff_judging,
    add_selection,
    workers,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE", help="the reference commit: a branch, tag or SHA")
    parser.add_argument("head", metavar="HEAD", nargs="?", default=None,
                        help="the commit to judge (default: the working tree as it is, uncommitted changes included)")
    add_selection(parser)
    add_diff_judging(parser)
    add_checking(parser, baselines=False, rules_help=TOLERANCES_ONLY)
    parser.add_argument("--workers", type=workers, default=None, metavar="N",
                        help="local worker processes per side (default: the number of cores)")


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.selection import Selection
    from precision_suite.jobs.two_commits import diff_commits

    return diff_commits(args.base, args.head, Selection.from_args(args), fail=args.fail, metric=args.metric,
                        rules_file=args.rules, report_dir=args.report_dir, charts=args.charts, workers=args.workers)


COMMAND = Command(
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
                "a side that cannot run.",
    add_arguments=add_arguments, run=run)
