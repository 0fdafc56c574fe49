"""How a command of the command line is declared (`Command`, `Group`), and the argument groups
and value checks the commands share (selection, execution, checking, --fail)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

# light modules only (no torch, xarray or matplotlib): the parser needs their names and choices
from precision_suite.jobs.execution import DASK_INSTALL_HINT, scheduler_address
from precision_suite.jobs.usage import DEFAULT_BASELINE_DIR, DEFAULT_REPORT_ROOT, DEFAULT_RULES_FILE
from precision_suite.verdicts.findings import CHART_CHOICES


@dataclass(frozen=True)
class Command:
    """One command: its name, its one-line help (listed by `precision-suite --help`), its
    description (`precision-suite NAME --help`), the function that declares its arguments and the
    one that runs it on the parsed arguments, returning the exit status."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Group:
    """A command whose actions are commands of their own (`precision-suite history record`)."""

    name: str
    help: str
    description: str
    actions: tuple[Command, ...]


CHANGE_RULES = (
    f"pyproject.toml whose [tool.precision_suite] rules and diff_strict apply (default: "
    f"./{DEFAULT_RULES_FILE}, skipped if absent): a rule the change newly breaks fails it"
)


def add_selection(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("selection (default: the whole matrix; repeat a flag to pick several)")
    group.add_argument("--model", action="append", metavar="NAME", help="e.g. vit, gpt")
    group.add_argument(
        "--attention", action="append", metavar="NAME", help="e.g. softmax, x/1, 'x^3/sqrt(N)'"
    )
    group.add_argument("--recipe", action="append", metavar="NAME", help="e.g. fp32, fp8-block")
    group.add_argument("--case", action="append", metavar="ID", help="an exact case id")
    group.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of [[case]] tables (RunSpec fields) replacing the matrix",
    )
    group.add_argument("--quick", action="store_true", help="the fast smoke matrix")
    group.add_argument("--device", metavar="DEVICE", help="auto, cpu or cuda (overrides the specs)")
    group.add_argument(
        "--seed",
        metavar="S",
        type=seed,
        default=None,
        help="train with seed S (any non-negative integer; judged against the "
        "baseline's seed ensemble) instead of the specs' seed",
    )
    group.add_argument(
        "--shard",
        metavar="I/N",
        type=shard,
        default=None,
        help="only the I-th of N shards of the selection (cases dealt round-robin "
        "in matrix order: every case in exactly one shard); merge the shards' "
        "saved results with `precision-suite report DIR1 DIR2 ...`",
    )


def add_execution(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("where the runs train (the numbers are the same either way)")
    group.add_argument(
        "--workers",
        type=workers,
        default=None,
        metavar="N",
        help="local worker processes, one run each (default: the number of cores; "
        "`run --workers 1` trains in this process with live progress)",
    )
    group.add_argument(
        "--scheduler",
        type=scheduler,
        default=None,
        metavar="tcp://HOST:PORT",
        help="send each run to the Dask cluster of this scheduler instead "
        f"(needs {DASK_INSTALL_HINT}; see docs/ci.md)",
    )


def add_fail(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fail",
        metavar="METRIC:TOL",
        action="append",
        default=[],
        help="override a metric's tolerance, e.g. underflow:1e-3 or "
        "attention_norm:0.1 (in the metric's comparison space, "
        "see docs/baselines.md); repeatable",
    )


def add_diff_judging(parser: argparse.ArgumentParser) -> None:
    """How `diff` and `bisect` judge a change: beyond noise (default) or any change (--strict)."""
    gate = parser.add_mutually_exclusive_group()
    gate.add_argument(
        "--strict",
        dest="strict",
        action="store_true",
        default=None,
        help="fail on any change of the numbers at all (default: only on a change beyond "
        "the noise run judges with; [tool.precision_suite] diff_strict = true sets it)",
    )
    gate.add_argument(
        "--beyond-noise",
        dest="strict",
        action="store_false",
        help="fail only on a change beyond noise, whatever diff_strict says",
    )
    parser.add_argument(
        "--metric", metavar="NAME", default=None, help="only findings of this metric decide (e.g. underflow)"
    )
    add_baseline_dir(
        parser,
        "where the cases' baselines live: a case with one is judged against its noise, "
        "one without against BASE's rounding twins",
    )


def add_baseline_dir(parser: argparse.ArgumentParser, help_text: str = "where baselines live") -> None:
    parser.add_argument(
        "--baseline-dir",
        default=DEFAULT_BASELINE_DIR,
        metavar="DIR",
        help=f"{help_text} (default: {DEFAULT_BASELINE_DIR}/)",
    )


def add_report_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-dir",
        metavar="DIR",
        help=f"write the report here (default: a new {DEFAULT_REPORT_ROOT}/<timestamp>/)",
    )


def add_checking(
    parser: argparse.ArgumentParser,
    baselines: bool = True,
    charts_default: str = "failing",
    rules_help: str | None = None,
) -> None:
    if baselines:
        add_baseline_dir(parser)
    parser.add_argument(
        "--rules",
        default=DEFAULT_RULES_FILE,
        metavar="FILE",
        help=rules_help
        or "pyproject.toml holding [tool.precision_suite] rules "
        f"(default: ./{DEFAULT_RULES_FILE}, skipped if absent)",
    )
    add_report_dir(parser)
    parser.add_argument(
        "--charts",
        choices=CHART_CHOICES,
        default=charts_default,
        help="draw charts for failing/drifting cases, all, or none (the verdicts, summaries and "
        f"tables only: seconds faster per chart) (default: {charts_default})",
    )


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer seed, e.g. --seed 7")
    return value


def shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard: write I/N, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: the shard number I must be between 1 and N={n}")
    return i, n


def workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of worker processes")
    return value


def scheduler(text: str) -> str:
    try:
        return scheduler_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
