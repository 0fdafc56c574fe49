"""`precision-suite diff BASE [HEAD]`: the selection trained with two commits' code, compared (the
pull-request gate)."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import (
    CHANGE_RULES,
    Command,
    add_checking,
    add_diff_judging,
    add_selection,
    workers,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE", help="the reference commit: a branch, tag or SHA")
    parser.add_argument(
        "head",
        metavar="HEAD",
        nargs="?",
        default=None,
        help="the commit to judge (default: the working tree as it is, uncommitted changes included)",
    )
    add_selection(parser)
    add_diff_judging(parser)
    add_checking(parser, baselines=False, rules_help=CHANGE_RULES)
    parser.add_argument(
        "--workers",
        type=workers,
        default=None,
        metavar="N",
        help="local worker processes per side (default: the number of cores)",
    )


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.selection import Selection
    from precision_suite.jobs.two_commits import diff_commits

    return diff_commits(
        args.base,
        args.head,
        Selection.from_args(args),
        strict=args.strict,
        metric=args.metric,
        rules_file=args.rules,
        baseline_dir=args.baseline_dir,
        report_dir=args.report_dir,
        charts=args.charts,
        workers=args.workers,
    )


COMMAND = Command(
    "diff",
    help="train the selection with commit BASE's code and with HEAD's, and compare (the pull-request gate)",
    description="Train the selection with the code of commit BASE (checked out in a temporary git "
    "worktree) and with HEAD's (default: the working tree), on this machine with the "
    "same seeds, so the runs are bitwise identical unless the code changed the numbers. "
    "Prints per case the first step at which each metric differs and the change's size "
    "there measured cleanly (both codes replay from BASE's state at that step), and judges "
    "the change as `run` judges a run: against the case's baseline (what BASE's run shows "
    "set aside), or, for a case without one, within BASE's rounding twins measured now; "
    "--strict fails any change. Each side takes its numerics from its own commit: your "
    "code, the config's recipe tables, and precision_suite itself when the repository "
    "holds it. Writes a report naming both commits and drawing both runs. "
    "Exit 0 unchanged or within noise, 1 a change beyond it (any change with --strict), "
    "2 bad usage or a side that cannot run.",
    add_arguments=add_arguments,
    run=run,
)
