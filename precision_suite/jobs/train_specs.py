"""`python -m precision_suite.jobs.train_specs SPECS.json OUT_DIR [--workers N]`: train the RunSpecs
of a JSON list (each a `RunSpec.to_json` object) and save each run as OUT_DIR/<case>.nc.

How `diff` and `bisect` train one commit's code: in a fresh interpreter whose PYTHONPATH starts
with a copy of the running precision_suite and then that commit's tree (jobs/diff.py), so the
user's code comes from the commit and the measuring tool from the command. A side that cannot
run ends with its reason as the last line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import xarray as xr

from precision_suite.files import save_dataset
from precision_suite.jobs import results, train
from precision_suite.jobs.usage import EXIT_USAGE, UsageError
from precision_suite.training.runs import RunSpec, case_id


def train_specs(specs: Sequence[RunSpec], workers: int | None) -> dict[str, xr.Dataset]:
    """case -> run of every spec, trained with the code this interpreter imports; UsageError for
    a spec that does not validate with it (a model that cannot be imported, a field it lacks)."""
    for spec in specs:
        try:
            spec.validate()
        except ValueError as exc:
            raise UsageError(f"{case_id(spec)}: {exc}") from None
    runs = train.train_all(list(specs), train.placement(workers, None))
    return {case_id(spec): ds for spec, ds in zip(specs, runs)}


def cannot_run(exc: BaseException) -> str:
    """One line for an exception of the user's code: type, message, innermost frame."""
    message = (str(exc).strip().splitlines() or [""])[0]
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if not frame.filename.startswith("<")]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames and not isinstance(exc, SyntaxError) else ""
    return message if isinstance(exc, UsageError) else f"{type(exc).__name__}: {message}{where}"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m precision_suite.jobs.train_specs")
    parser.add_argument("specs", help="a JSON list of RunSpec objects")
    parser.add_argument("out", help="folder for <case>.nc")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        specs = [RunSpec.from_json(json.dumps(fields)) for fields in json.loads(Path(args.specs).read_text())]
        for case, ds in train_specs(specs, args.workers).items():
            save_dataset(ds, results.result_path(args.out, case))
    except UsageError as exc:
        print(cannot_run(exc), file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # the user's code at this commit: any error is "cannot run"
        traceback.print_exc()
        print(cannot_run(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
