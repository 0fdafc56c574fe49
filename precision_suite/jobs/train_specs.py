"""`python -m precision_suite.jobs.train_specs SPECS.json OUT_DIR [--workers N | --keep-state-at
T[,T...] | --replay-from DIR]`: train the RunSpecs of a JSON list (each a `RunSpec.to_json` object)
and save each run as OUT_DIR/<case>.nc; or replay them from training states (training.replays):

- `--keep-state-at T[,T...]`, a step per spec in order: keep the state before that step
  (OUT_DIR/<case>.state.nc, training only the steps before it), then replay from it;
- `--replay-from DIR`: replay each spec from DIR/<case>.state.nc (a state another commit's code kept).

A replay is saved as OUT_DIR/<case>.nc; a case whose replay cannot run goes on to the next, its
reason in OUT_DIR/problems.json (case -> one line).

How `diff` and `bisect` train one commit's code: in a fresh interpreter whose PYTHONPATH starts
with a copy of the running precision_suite and then that commit's tree (jobs/two_commits.py), so the
user's code comes from the commit and the measuring tool from the command. A side that cannot
run ends with its reason as the last line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import xarray as xr

from precision_suite.files import load_dataset, save_dataset, write_json
from precision_suite.jobs import results, train
from precision_suite.jobs.usage import EXIT_USAGE, UsageError
from precision_suite.training.replays import keep_state, replay, replay_steps, state_start
from precision_suite.training.runs import RunSpec, case_id

PROBLEMS = "problems.json"  # the replays that could not run: case -> reason


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


def state_path(folder: Path, case: str) -> Path:
    """`folder/<case>.state.nc`: the training state a case's replays start from."""
    return results.result_path(str(folder), case).with_suffix(".state.nc")


def replay_specs(specs: Sequence[RunSpec], out: Path, starts: Sequence[int] | None = None,
                 states: Path | None = None) -> dict[str, str]:
    """Replay every spec with this interpreter's code from a state kept here before step
    `starts[i]` (saved in `out`), or else read from `states`; each replay saved in `out`. Returns
    case -> why its replay could not run (one line), the other cases going on regardless."""
    problems = {}
    for i, spec in enumerate(specs):
        case, started = case_id(spec), time.monotonic()
        label = f"[{i + 1}/{len(specs)}] {case}"
        try:
            if starts is not None:
                print(f"{label}: keeping the state before step {starts[i]}", file=sys.stderr, flush=True)
                save_dataset(keep_state(spec, starts[i]), state_path(out, case))
            # both sides replay the state as read back from its file: the same numbers on each
            state = load_dataset(state_path(out if states is None else states, case))
            start = state_start(state)
            save_dataset(replay(spec, state, start), results.result_path(str(out), case))
        except Exception as exc:  # the user's code at this commit, or a state it cannot load
            traceback.print_exc()
            problems[case] = cannot_run(exc)
            print(f"{label}: cannot replay: {problems[case]}", file=sys.stderr, flush=True)
            continue
        print(f"{label}: replayed {replay_steps(spec, start)} step(s) from step {start} in "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return problems


def cannot_run(exc: BaseException) -> str:
    """One line for an exception of the user's code: type, message, innermost frame."""
    message = (str(exc).strip().splitlines() or [""])[0]
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if not frame.filename.startswith("<")]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames and not isinstance(exc, SyntaxError) else ""
    return message if isinstance(exc, UsageError) else f"{type(exc).__name__}: {message}{where}"


def _steps(text: str) -> list[int]:
    return [int(step) for step in text.split(",")]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m precision_suite.jobs.train_specs")
    parser.add_argument("specs", help="a JSON list of RunSpec objects")
    parser.add_argument("out", help="folder for <case>.nc")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--workers", type=int, default=None)
    mode.add_argument("--keep-state-at", type=_steps, metavar="T[,T...]",
                      help="per spec, in order: keep the state before step T in OUT/<case>.state.nc, replay from it")
    mode.add_argument("--replay-from", type=Path, metavar="DIR", help="replay each spec from DIR/<case>.state.nc")
    args = parser.parse_args(argv)
    try:
        specs = [RunSpec.from_json(json.dumps(fields)) for fields in json.loads(Path(args.specs).read_text())]
        if args.keep_state_at is not None or args.replay_from is not None:
            if args.keep_state_at is not None and len(args.keep_state_at) != len(specs):
                raise UsageError(f"--keep-state-at names {len(args.keep_state_at)} step(s) for {len(specs)} spec(s)")
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            write_json(replay_specs(specs, out, args.keep_state_at, args.replay_from), out / PROBLEMS)
            return 0
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
