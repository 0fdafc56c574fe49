"""`python -m precision_suite.jobs.fresh_run OUT.nc [--replay STATE.nc [--replay-at T]] [--keep-state]`: train the
RunSpec given as JSON on standard input (or replay its last steps from a stored state) and save
its dataset to OUT.nc. A run whose environment must be set before torch loads
(`execution.PROCESS_START_ENV`, such as the rounding twins' ATEN_CPU_CAPABILITY) runs here."""

from __future__ import annotations

import argparse
import sys

from precision_suite.files import load_dataset, save_dataset
from precision_suite.jobs.execution import Task, train_here
from precision_suite.jobs.usage import EXIT_USAGE
from precision_suite.training.runs import RunSpec


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m precision_suite.jobs.fresh_run", description="the RunSpec as JSON on stdin"
    )
    parser.add_argument("out")
    parser.add_argument("--replay", metavar="STATE.nc")
    parser.add_argument("--keep-state", action="store_true")
    parser.add_argument(
        "--replay-at",
        type=int,
        default=None,
        metavar="T",
        help="the step the state was kept before (default: a stored baseline's)",
    )
    args = parser.parse_args(argv)
    try:
        spec = RunSpec.from_json(sys.stdin.read())
        state = load_dataset(args.replay) if args.replay else None
        ds = train_here(Task(spec, replay_from=state, keep_state=args.keep_state, replay_at=args.replay_at))
    except (ValueError, TypeError) as exc:  # a bad spec: its reason alone, as an in-process run gives it
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    save_dataset(ds, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
