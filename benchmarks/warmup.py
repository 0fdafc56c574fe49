"""Warm-up tax: how much longer a fresh process's first quant_error call takes than its steady state.

    python benchmarks/warmup.py [--cold] [--formats e4m3,nvfp4] [--small-runs] [--grad-modes]

For each format and orientation a new Python process times three calls of quant_error on a
4096 x 4096 float32 tensor, compiled (the default) and eager (PRECISION_SUITE_COMPILE=0). The tax
is call 1 minus the faster of calls 2 and 3; the goal is at most 3 s. Call 1 includes
importing torch.compile's machinery, which the first compiled call of any process pays.
--cold first points inductor's caches at an empty folder, so the compiled rows include compiling
the kernels (what the first run on a machine pays); without it they read whatever the cache
holds, as every later run does.

--small-runs then times a small run in a fresh process per recipe (a 2-layer GPT, 5 steps, probes
every step: a test's or a user's first try), as a run decides by itself (too small: eager) and
with PRECISION_SUITE_COMPILE=1 (compiled anyway, what every run did before runs decided).

--grad-modes then times, in a fresh process, what a sampled step's hooks first call: two
quantizers and the promoted accumulation chain with grad on (forward hooks), then with grad off
(gradient hooks), and prints the graphs dynamo compiled or loaded (both modes share each one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

GOAL_S = 3.0
CASES = [
    ("e4m3", (1, 128)),
    ("e4m3", (128, 1)),
    ("e5m2", (1, 128)),
    ("e5m2", (128, 1)),
    ("mxfp8", (1, 32)),
    ("mxfp8", (32, 1)),
    ("nvfp4", (1, 16)),
    ("nvfp4", (16, 1)),
]
CHILD = """
import json, sys, time
import torch
from precision_suite import quant_error
x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0))
times = []
for _ in range(3):
    start = time.perf_counter()
    quant_error(x, sys.argv[1], (int(sys.argv[2]), int(sys.argv[3])))
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""
SMALL_RUN = """
import json, sys, time
from precision_suite.training.runs import RunSpec, run
spec = RunSpec(model="gpt", depth=2, steps=5, sample_every=1, recipe=sys.argv[1])
start = time.perf_counter()
run(spec)
print(json.dumps(time.perf_counter() - start))
"""
SMALL_RUN_RECIPES = ("fp8-block", "mxfp8", "nvfp4")
GRAD_MODES = """
import json, os, time
os.environ["PRECISION_SUITE_COMPILE"] = "1"
import torch
from torch._dynamo.utils import counters
from precision_suite import quantize
from precision_suite.numerics.accumulation import accumulate
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 384, generator=g)
a, w = (torch.randn(64, 4096, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(2))
start = time.perf_counter()
for grad in (True, False):
    with torch.set_grad_enabled(grad):
        quantize(x, "e4m3", (1, 128)), quantize(x, "e5m2", (1, 128)), accumulate(a, w.t(), "hopper-promoted")
print(json.dumps([counters["stats"]["unique_graphs"], time.perf_counter() - start]))
"""


def child_output(code: str, args: list[str], env: dict[str, str]) -> object:
    """The JSON that `code` prints last, run in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="start from an empty inductor cache")
    parser.add_argument("--formats", help="comma-separated subset, e.g. e4m3,nvfp4")
    parser.add_argument("--small-runs", action="store_true", help="also time a small run per recipe")
    parser.add_argument(
        "--grad-modes",
        action="store_true",
        help="also time the first calls of a step's hooks in both grad modes",
    )
    args = parser.parse_args()
    cases = [c for c in CASES if not args.formats or c[0] in args.formats.split(",")]
    env = dict(os.environ)
    if args.cold:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="precision-suite-cold-")
    print(f"{'case':18s} {'mode':8s} {'call 1':>8s} {'steady':>8s} {'tax':>8s}  goal: tax <= {GOAL_S:g} s")
    for fmt, layout in cases:
        for mode, extra in (("compiled", {}), ("eager", {"PRECISION_SUITE_COMPILE": "0"})):
            times = child_output(CHILD, [fmt, *map(str, layout)], {**env, **extra})
            steady = min(times[1:])
            tax = times[0] - steady
            print(
                f"{fmt + ' ' + str(layout):18s} {mode:8s} {times[0]:7.2f}s {steady:7.3f}s {tax:7.2f}s  "
                f"{'met' if tax <= GOAL_S else 'not met'}",
                flush=True,
            )
    if args.small_runs:
        print(
            f"\n{'small run (2-layer GPT)':24s} {'as decided':>11s} {'compiled':>9s}  (runs.run, imports excluded)"
        )
        for recipe in SMALL_RUN_RECIPES:
            decided = child_output(SMALL_RUN, [recipe], env)
            compiled = child_output(SMALL_RUN, [recipe], {**env, "PRECISION_SUITE_COMPILE": "1"})
            print(f"{recipe:24s} {decided:10.1f}s {compiled:8.1f}s", flush=True)
    if args.grad_modes:
        graphs, seconds = child_output(GRAD_MODES, [], env)
        print(f"\nfirst calls in both grad modes: {seconds:.2f} s, {graphs} graphs", flush=True)


if __name__ == "__main__":
    main()
