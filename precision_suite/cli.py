"""The `precision-suite` command line: train, compare with baselines, check rules, write reports.

Exit status: 0 when every check holds (drift is reported but holds), 1 on a numerics regression
(a failing or erroring case), 2 on bad usage or configuration (unknown names, unreadable files,
missing or mismatched baselines), always with a one-line message saying what to do next.

Every command imports the user's code (models, batches, attention variants named by import
strings) from the current directory, as `python -m` would, and from the installed packages, in
its own process and in every worker it starts.

A loop over the commands of precision_suite.commands, each a module that declares its arguments
and runs; a command imports its job once the arguments are parsed, so that `--help` and
`--version` answer at once without loading torch, xarray or matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from precision_suite.commands import (
    baseline,
    bisect,
    calibrate,
    compare,
    diff,
    history,
    report,
    reproduce,
    run,
)
from precision_suite.commands.arguments import Command, Group
from precision_suite.jobs.usage import EXIT_USAGE, UsageError
from precision_suite.training.imports import project_importable
from precision_suite.version import __version__

# in the order `precision-suite --help` lists them
COMMANDS = tuple(
    module.COMMAND for module in (run, compare, diff, bisect, history, baseline, calibrate, report, reproduce)
)

EPILOG = """\
examples:
  precision-suite run --quick                  smoke matrix (about a minute on 2 CPU cores)
  precision-suite run                          the full default matrix
  precision-suite run --model vit --attention x/1 --save-results results/
  precision-suite baseline update --quick      (re)create the baselines the quick run uses
  precision-suite compare old/ new/ --fail underflow:1e-3
  precision-suite diff origin/main --config cases.toml   this change's numbers against main's, same machine
  precision-suite bisect v1.2 HEAD --config cases.toml   the first commit whose diff against v1.2 fails
  precision-suite report results/              charts and summary of saved results
  precision-suite history record results/ --store history/   add this commit's results to a history
  precision-suite history report --store history/            the series over commits and their steps
  precision-suite reproduce figure-a           the paper's figure A, with a note of its claims

exit status: 0 all checks hold, 1 numerics regression, 2 bad usage or configuration.
More in docs/cli.md.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status instead of raising SystemExit."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    if not getattr(args, "command_func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        with project_importable(Path.cwd()):  # the user's code named by import strings: docs/cli.md
            return args.command_func(args)
    except UsageError as exc:
        print(f"precision-suite: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("precision-suite: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="precision-suite",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Numerics regression suite for low-precision transformer training: attention "
        "norms and FP8/MXFP8/NVFP4 quantization error per layer, checked against "
        "golden baselines and thresholds.",
    )
    parser.add_argument("--version", action="version", version=f"precision-suite {__version__}")
    add_commands(parser.add_subparsers(title="commands", metavar="COMMAND"), COMMANDS)
    return parser


def add_commands(subparsers: argparse._SubParsersAction, commands: Sequence[Command | Group]) -> None:
    """A parser per command; a group's actions get parsers of their own under it, and the group
    alone prints its help (exit status 2)."""
    for command in commands:
        parser = subparsers.add_parser(command.name, help=command.help, description=command.description)
        if isinstance(command, Group):
            add_commands(
                parser.add_subparsers(title=f"{command.name} commands", metavar="ACTION"), command.actions
            )
            parser.set_defaults(
                command_func=lambda _args, parser=parser: parser.print_help(sys.stderr) or EXIT_USAGE
            )
        else:
            command.add_arguments(parser)
            parser.set_defaults(command_func=command.run)


if __name__ == "__main__":
    sys.exit(main())
