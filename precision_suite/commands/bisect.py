"""`precision-suite bisect GOOD BAD`: the first commit after GOOD whose `diff GOOD` fails."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import (
    CHANGE_RULES,
    Command,
    add_diff_judging,
    add_selection,
    workers,
)
from precision_suite.jobs.usage import DEFAULT_RULES_FILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("good", metavar="GOOD", help="a commit whose numbers are right")
    parser.add_argument("bad", metavar="BAD", help="a later commit whose `diff GOOD` fails")
    add_selection(parser)
    add_diff_judging(parser)
    parser.add_argument("--rules", default=DEFAULT_RULES_FILE, metavar="FILE", help=CHANGE_RULES)
    parser.add_argument(
        "--workers",
        type=workers,
        default=None,
        metavar="N",
        help="local worker processes (default: the number of cores)",
    )


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.first_bad_commit import bisect_commits
    from precision_suite.jobs.selection import Selection

    return bisect_commits(
        args.good,
        args.bad,
        Selection.from_args(args),
        strict=args.strict,
        metric=args.metric,
        rules_file=args.rules,
        baseline_dir=args.baseline_dir,
        workers=args.workers,
    )


COMMAND = Command(
    "bisect",
    help="find the first commit after GOOD whose `diff GOOD` fails",
    description="Drive `git bisect run` between GOOD and BAD: a commit is bad when `diff GOOD "
    "<commit>` fails (with --metric: a finding of that metric), good when it passes, "
    "skipped when its code cannot run. Needs a clean working tree; the starting branch "
    "is restored however it ends. Prints the first bad commit and what changed there. "
    "Exit 1 a first bad commit found, 0 BAD passes against GOOD, 2 bad usage.",
    add_arguments=add_arguments,
    run=run,
)
