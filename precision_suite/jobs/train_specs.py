"""`python -m precision_suite.jobs.train_specs SPECS.json OUT_DIR [--workers N] [--stored-replays DIR |
--first-step-twins | --keep-state-at T[,T...] [--twins] | --replay-from DIR]`: train the RunSpecs of a
JSON list (each a `RunSpec.to_json` object) and save each run as OUT_DIR/<case>.nc, and:

- `--stored-replays DIR`: each case's replay from the state stored in DIR (a baseline folder),
  where it has one, as OUT_DIR/replays/<case>.nc (what `run` judges beside the run);
- `--first-step-twins`: instead of the runs, each spec's first step under every rounding twin
  (jobs/twins.py), as OUT_DIR/twins/<case>/<i>.nc: the rounding noise of a case without a baseline;

or replay them from training states (training.replays):

- `--keep-state-at T[,T...]`, a step per spec in order: keep the state before that step
  (OUT_DIR/<case>.state.nc, training only the steps before it), then replay from it; with
  `--twins`, the replay under every rounding twin too, as OUT_DIR/twins/<case>/<i>.nc;
- `--replay-from DIR`: replay each spec from DIR/<case>.state.nc (a state another commit's code kept).

A replay is saved as OUT_DIR/<case>.nc; a case whose replay cannot run goes on to the next, its
reason in OUT_DIR/problems.json (case -> one line).

How `diff` and `bisect` train one commit's code: in a fresh interpreter whose PYTHONPATH starts
with a copy of the running precision_suite and then that commit's tree (jobs/two_commits.py), so the
user's code comes from the commit and the measuring tool from the command. A side that cannot
run ends with its reason as the last line on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

import xarray as xr

from precision_suite.files import load_dataset, safe_filename, save_dataset, write_json
from precision_suite.jobs import results, train
from precision_suite.jobs.execution import Task
from precision_suite.jobs.twins import rounding_twins
from precision_suite.jobs.usage import EXIT_USAGE, UsageError
from precision_suite.training.replays import keep_state, replay, replay_start, replay_steps, state_start
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts.stored_replays import replay_path

PROBLEMS = "problems.json"  # the replays that could not run: case -> reason


def train_specs(
    specs: Sequence[RunSpec], workers: int | None, stored: Mapping[str, xr.Dataset] | None = None
) -> tuple[dict[str, xr.Dataset], dict[str, xr.Dataset]]:
    """(case -> run, case -> replay from its `stored` state) of every spec, trained with the code
    this interpreter imports; UsageError for a spec that does not validate with it (a model that
    cannot be imported, a field it lacks)."""
    _validate(specs)
    runs, replayed = train.train_and_replay(list(specs), stored or {}, train.placement(workers, None))
    return {case_id(spec): ds for spec, ds in zip(specs, runs)}, replayed


def first_step_twins(specs: Sequence[RunSpec], workers: int | None) -> dict[str, list[xr.Dataset]]:
    """case -> the first step of its spec under every rounding twin (jobs/twins.py)."""
    _validate(specs)
    tasks = [
        [
            Task(
                dataclasses.replace(spec, steps=1, **twin.spec_changes),
                env=twin.env,
                label=f"{case_id(spec)} first step, {twin.name}",
            )
            for twin in rounding_twins()
        ]
        for spec in specs
    ]
    done = train.run_tasks([task for per_spec in tasks for task in per_spec], train.placement(workers, None))
    size = len(tasks[0]) if tasks else 0
    return {case_id(spec): done[i * size : (i + 1) * size] for i, spec in enumerate(specs)}


def _validate(specs: Sequence[RunSpec]) -> None:
    for spec in specs:
        try:
            spec.validate()
        except ValueError as exc:
            raise UsageError(f"{case_id(spec)}: {exc}") from None


def stored_states(specs: Sequence[RunSpec], baseline_dir: Path) -> dict[str, xr.Dataset]:
    """The stored replay (its state) of each spec that has one in `baseline_dir`, by case."""
    found = {}
    for spec in specs:
        path = replay_path(baseline_dir, case_id(spec))
        if replay_start(spec) is not None and path.is_file():
            found[case_id(spec)] = load_dataset(path)
    return found


def twins_folder(out: Path, case: str) -> Path:
    """`out/twins/<case>/`: a case's runs or replays under the rounding twins, as 0.nc, 1.nc, ..."""
    return out / "twins" / safe_filename(case)


def save_twins(out: Path, case: str, runs: Sequence[xr.Dataset]) -> None:
    for i, ds in enumerate(runs):
        save_dataset(ds, twins_folder(out, case) / f"{i}.nc")


def load_twins(out: Path, case: str) -> list[xr.Dataset]:
    folder = twins_folder(out, case)
    return (
        [load_dataset(path) for path in sorted(folder.glob("*.nc"), key=lambda p: int(p.stem))]
        if folder.is_dir()
        else []
    )


def state_path(folder: Path, case: str) -> Path:
    """`folder/<case>.state.nc`: the training state a case's replays start from."""
    return results.result_path(str(folder), case).with_suffix(".state.nc")


def replay_specs(
    specs: Sequence[RunSpec],
    out: Path,
    starts: Sequence[int] | None = None,
    states: Path | None = None,
    twins: bool = False,
) -> dict[str, str]:
    """Replay every spec with this interpreter's code from a state kept here before step
    `starts[i]` (saved in `out`), or else read from `states`; each replay saved in `out` (and,
    with `twins`, the replay under every rounding twin in `twins_folder`). Returns case -> why its
    replay could not run (one line), the other cases going on regardless."""
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
            if twins:
                save_twins(
                    out,
                    case,
                    train.run_tasks(
                        [
                            Task(
                                dataclasses.replace(spec, **twin.spec_changes),
                                env=twin.env,
                                replay_from=state,
                                replay_at=start,
                                label=f"{case} replay, {twin.name}",
                            )
                            for twin in rounding_twins()
                        ],
                        train.placement(None, None),
                    ),
                )
        except Exception as exc:  # the user's code at this commit, or a state it cannot load
            traceback.print_exc()
            problems[case] = cannot_run(exc)
            print(f"{label}: cannot replay: {problems[case]}", file=sys.stderr, flush=True)
            continue
        print(
            f"{label}: replayed {replay_steps(spec, start)} step(s) from step {start} in "
            f"{time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return problems


def cannot_run(exc: BaseException) -> str:
    """One line for an exception of the user's code: type, message, innermost frame."""
    message = (str(exc).strip().splitlines() or [""])[0]
    frames = [
        frame for frame in traceback.extract_tb(exc.__traceback__) if not frame.filename.startswith("<")
    ]
    where = (
        f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})"
        if frames and not isinstance(exc, SyntaxError)
        else ""
    )
    return message if isinstance(exc, UsageError) else f"{type(exc).__name__}: {message}{where}"


def _steps(text: str) -> list[int]:
    return [int(step) for step in text.split(",")]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m precision_suite.jobs.train_specs")
    parser.add_argument("specs", help="a JSON list of RunSpec objects")
    parser.add_argument("out", help="folder for <case>.nc")
    parser.add_argument("--workers", type=int, default=None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--stored-replays",
        type=Path,
        metavar="DIR",
        help="also replay each case from the state stored in DIR, where it has one",
    )
    mode.add_argument(
        "--first-step-twins",
        action="store_true",
        help="train each spec's first step under every rounding twin instead",
    )
    mode.add_argument(
        "--keep-state-at",
        type=_steps,
        metavar="T[,T...]",
        help="per spec, in order: keep the state before step T in OUT/<case>.state.nc, replay from it",
    )
    mode.add_argument(
        "--replay-from", type=Path, metavar="DIR", help="replay each spec from DIR/<case>.state.nc"
    )
    parser.add_argument(
        "--twins", action="store_true", help="with --keep-state-at: replay under every twin too"
    )
    args = parser.parse_args(argv)
    try:
        specs = [RunSpec.from_json(json.dumps(fields)) for fields in json.loads(Path(args.specs).read_text())]
        out = Path(args.out)
        if args.keep_state_at is not None or args.replay_from is not None:
            if args.keep_state_at is not None and len(args.keep_state_at) != len(specs):
                raise UsageError(
                    f"--keep-state-at names {len(args.keep_state_at)} step(s) for {len(specs)} spec(s)"
                )
            out.mkdir(parents=True, exist_ok=True)
            write_json(
                replay_specs(specs, out, args.keep_state_at, args.replay_from, args.twins), out / PROBLEMS
            )
            return 0
        if args.first_step_twins:
            for case, twins in first_step_twins(specs, args.workers).items():
                save_twins(out, case, twins)
            return 0
        stored = stored_states(specs, args.stored_replays) if args.stored_replays else {}
        runs, replayed = train_specs(specs, args.workers, stored)
        for case, ds in runs.items():
            save_dataset(ds, results.result_path(args.out, case))
        for case, ds in replayed.items():
            save_dataset(ds, results.replay_result_path(args.out, case))
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
