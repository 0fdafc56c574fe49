"""`python -m precision_suite.jobs.fresh_run OUT.nc`: train the RunSpec given as JSON on standard
input and save its dataset to OUT.nc. A run whose environment must be set before torch loads
(`execution.PROCESS_START_ENV`, such as the rounding twins' ATEN_CPU_CAPABILITY) runs here."""

from __future__ import annotations

import sys

from precision_suite.jobs.usage import EXIT_USAGE
from precision_suite.files import save_dataset
from precision_suite.training.runs import RunSpec, run


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m precision_suite.jobs.fresh_run OUT.nc  (the RunSpec as JSON on stdin)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        ds = run(RunSpec.from_json(sys.stdin.read()))
    except (ValueError, TypeError) as exc:  # a bad spec: its reason alone, as an in-process run gives it
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    save_dataset(ds, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
