"""The power table of docs/baselines.md: planted bugs that start after step 0, run through the
main job against the committed baselines, and where each case's verdict first sees them.

    python benchmarks/late_plants.py [--cases CASE ...] [--out DIR]

Each plant (tests/test_teeth.py defines them) is monkeypatched into this process, then
`precision-suite run --workers 1` trains the cases (one worker: the plant lives here). Prints a
Markdown table: per plant and case the status and the first finding's origin (first point,
trained points, replay from step k) and step. Takes about 2 minutes per plant on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from precision_suite import cli  # noqa: E402
from test_teeth import scale_four_times_too_large, stale_quantized_weight, switched_on_late, wrong_scale  # noqa: E402

DEFAULT_CASES = (
    "vit-softmax-fp32",
    "gpt-softmax-fp8-block",
    "gpt-softmax-mxfp8-2d293d63",
    "gpt-softmax-nvfp4-2d293d63",
)
PLANTS = {
    "block scale 4x from step 0": scale_four_times_too_large,
    "block scale 4x from step 10": functools.partial(
        switched_on_late, plant=scale_four_times_too_large, onset=10
    ),
    "block scale 4x from step 40": functools.partial(
        switched_on_late, plant=scale_four_times_too_large, onset=40
    ),
    "block scale 256x from step 10": functools.partial(switched_on_late, plant=wrong_scale, onset=10),
    "weight quantized once, reused after every update": stale_quantized_weight,
}


def origin(finding: dict) -> tuple[str, int]:
    where = finding["where"]
    step = where.get("step", where.get("train_step", -1))
    if "replayed_from" in where:
        return f"replay from {where['replayed_from']}", step
    if finding["metric"] == "operand_mismatch":
        return "consumed operand", step
    return ("first point" if step == 0 else "trained points"), step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    parser.add_argument("--out", default=None, help="report folders (default: a temporary folder)")
    parser.add_argument("--plant", action="append", choices=list(PLANTS), help="only these plants (repeat)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="late-plants-"))
    selection = [flag for case in args.cases for flag in ("--case", case)]
    rows = []
    for name, plant in PLANTS.items():
        if args.plant and name not in args.plant:
            continue
        patch = pytest.MonkeyPatch()
        try:
            plant(patch)
            report = out / name.replace(" ", "-").replace(",", "")
            cli.main(["run", "--workers", "1", *selection, "--report-dir", str(report), "--charts", "none"])
        finally:
            patch.undo()
        for case in json.loads((report / "summary.json").read_text())["cases"]:
            failing = [
                f for f in case["findings"] if f["kind"] in ("regression", "threshold") and not f["known"]
            ]
            seen = sorted({origin(f) for f in failing}, key=lambda o: (o[1], o[0]))
            where = ", ".join(f"{o} (step {s})" for o, s in seen[:3]) or "-"
            rows.append(f"| {name} | {case['case']} | {case['status'].upper()} | {len(failing)} | {where} |")
    print("| plant | case | verdict | failing findings | where they are (first three, by step) |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
