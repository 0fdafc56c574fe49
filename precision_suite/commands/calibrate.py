"""`precision-suite calibrate`: false alarms and the smallest detected change, measured on this host."""

from __future__ import annotations

import argparse

from precision_suite.commands.arguments import Command, add_checking, add_execution, add_selection, seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_selection(parser)
    add_checking(parser)
    parser.add_argument(
        "--held-out-seeds",
        type=seed,
        nargs="+",
        default=[100, 101, 102],
        metavar="S",
        help="seeds outside the ensemble (default: 100 101 102)",
    )
    add_execution(parser)


def run(args: argparse.Namespace) -> int:
    from precision_suite.jobs.false_alarms import calibrate
    from precision_suite.jobs.selection import Selection

    return calibrate(
        Selection.from_args(args),
        args.held_out_seeds,
        baseline_dir=args.baseline_dir,
        rules_file=args.rules,
        report_dir=args.report_dir,
        charts=args.charts,
        workers=args.workers,
        scheduler=args.scheduler,
    )


COMMAND = Command(
    "calibrate",
    help="measure false alarms and the smallest detected change on this machine",
    description="Run every selected case under perturbations that must not fail it (this "
    "host's rounding twins: ATen's narrower kernels, MKL's compatible path, 2 threads, "
    "eager; held-out seeds), judge each against its "
    "baseline ensemble, judge each baseline seed against the others (no training), "
    "and print per metric the false alarms seen and the "
    "smallest change the comparison detects. Run it once on your CI runners.",
    add_arguments=add_arguments,
    run=run,
)
