"""`precision-suite reproduce FIGURE`: longer runs that reproduce a seed figure and say which claims hold."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, add_execution
from precision_suite.reports.figure_names import DEFAULT_OUT, FIGURE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "figure", metavar="FIGURE", choices=FIGURE_NAMES, help=f"which figure: {' or '.join(FIGURE_NAMES)}"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=DEFAULT_OUT,
        help=f"folder for the figure, datasets and note (default: {DEFAULT_OUT}/)",
    )
    add_execution(parser)


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.figure_runs import reproduce_figure

    return reproduce_figure(args.figure, args.out, workers=args.workers, scheduler=args.scheduler)


COMMAND = Command(
    "reproduce",
    help="longer runs that reproduce a seed figure and say which claims hold",
    description="Train the runs of one of the papers' figures (a few minutes on 2 cores), draw "
    "it as the paper does, and write the figure (PNG), the datasets (netCDF) and a "
    "Markdown note stating each qualitative claim of the paper and whether this "
    "reproduction shows it, with the numbers. figure-a: attention norm of every "
    "attention variant; figure-b: FP8 underflow and distortion per layer.",
    add_arguments=add_arguments,
    run=run,
)
