"""`precision-suite baseline update`: train the selection's seed ensembles and write their baselines."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, Group, add_baseline_dir, add_execution, add_selection


def add_update_arguments(parser: argparse.ArgumentParser) -> None:
    add_selection(parser)
    add_execution(parser)
    add_baseline_dir(parser)


def update(args: argparse.Namespace) -> int:
    from precision_suite.jobs.regenerate import update_baselines
    from precision_suite.jobs.selection import Selection

    return update_baselines(
        Selection.from_args(args),
        baseline_dir=args.baseline_dir,
        workers=args.workers,
        scheduler=args.scheduler,
    )


COMMAND = Group(
    "baseline",
    help="manage golden baselines",
    description="Manage the golden baseline files.",
    actions=(
        Command(
            "update",
            help="train the selection and (over)write its baselines",
            description="Train each selected case's seed ensemble (and the first step of its first "
            "seed under each rounding twin) and write its baseline atomically; unchanged numbers "
            "leave the file untouched. Review the change (git diff --stat baselines/) "
            "before committing it.",
            add_arguments=add_update_arguments,
            run=update,
        ),
    ),
)
