"""`history report` on a store of many commits x the default matrix, and the step detectors compared.

    python benchmarks/history_report.py [--commits 50] [--store DIR] [--compare-asv]

Without --store it builds a store of --commits commits of every case with a committed baseline
(tests/synthetic_data.history_store: the numbers change every 5 commits, re-rolled to another
seed's as chaos does on one host; from commit 30 one series of the GPT FP8 case has 4x the
underflow and its replay 10 noise units more), then times `precision-suite history report` on it
in this process, with every chart and with none. `--store DIR` reports an existing store instead
(e.g. the toy store tests/test_history.py builds).

`--compare-asv` (needs `pip install asv`, which precision-suite does not depend on) also runs asv's
`step_detect.detect_steps` on every series (its own noise estimate: it takes no noise level) and
prints, per detector, the steps found at the plant and elsewhere.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from precision_suite import cli  # noqa: E402
from precision_suite.jobs.history_store import load_histories  # noqa: E402
from precision_suite.jobs.selection import Selection  # noqa: E402
from synthetic_data import history_store  # noqa: E402

ROOT = Path(__file__).parents[1]
PLANT_CASE, PLANT_CELL, PLANT_FROM = (
    "gpt-softmax-fp8-block",
    dict(layer=5, tensor="gradient", layout="1x128"),
    30,
)


def build(store: Path, n_commits: int) -> list[str]:
    cases = sorted(p.stem for p in (ROOT / "baselines").glob("*.nc"))
    return history_store(
        store,
        ROOT / "baselines",
        cases,
        n_commits,
        plant=(PLANT_CASE, "underflow", PLANT_CELL, 4.0, 10.0, PLANT_FROM),
    )


def time_report(store: Path, charts: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        assert (
            cli.main(["history", "report", "--store", str(store), "--report-dir", out, "--charts", charts])
            == 0
        )
        return time.perf_counter() - start


def compare_asv(store: Path, planted: set[tuple]) -> None:
    from asv.step_detect import detect_steps

    found = {"precision-suite (ruptures PELT, twins' noise)": [], "asv detect_steps (own noise estimate)": []}
    cases = load_histories(store, Selection(), None)
    for case in cases:
        for step in case.steps:
            found["precision-suite (ruptures PELT, twins' noise)"].append(
                (case.case, step.kind, step.metric, tuple(step.where.items()), step.index)
            )
        for s in case.series:
            segments = detect_steps([float(v) for v in s.y])
            found["asv detect_steps (own noise estimate)"] += [
                (case.case, s.kind, s.metric, tuple(s.where.items()), left) for left, *_ in segments[1:]
            ]
    n_series = sum(len(c.series) for c in cases)
    print(f"\n{n_series} series; planted: {len(planted)}")
    print("| detector | steps at the plant | steps elsewhere |\n|---|---|---|")
    for name, steps in found.items():
        hits = sum(step in planted for step in steps)
        print(f"| {name} | {hits} of {len(planted)} | {len(steps) - hits} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=50)
    parser.add_argument("--store", type=Path, default=None, help="report this store instead of building one")
    parser.add_argument("--compare-asv", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        store = args.store or Path(folder) / "store"
        planted: set[tuple] = set()
        if args.store is None:
            start = time.perf_counter()
            build(store, args.commits)
            print(f"built {args.commits} commits in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            planted = {
                (PLANT_CASE, kind, "underflow", tuple(PLANT_CELL.items()), PLANT_FROM)
                for kind in ("trained", "replay")
                if PLANT_FROM < args.commits
            }
        records = len(list(store.glob("*/*/*.nc")))
        for charts in ("all", "none"):
            print(f"history report --charts {charts}: {records} records, {time_report(store, charts):.1f} s")
        if args.compare_asv:
            compare_asv(store, planted)


if __name__ == "__main__":
    with np.errstate(all="ignore"):
        main()
