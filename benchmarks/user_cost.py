"""What a user pays to check a real model: `precision-suite run` and `baseline update` against the
same model's bare training loop, as ratios measured in one script run (issue 39).

    python benchmarks/user_cost.py [--size 20M|100M|both] [--sample-every 2,10] [--steps 8]
                                   [--baseline-dir DIR] [--work DIR] [--json PATH]

The model is a Hugging Face Llama whose projections torchao converts to float8 training
(tensorwise scales; benchmarks/user_models.py): 20M is the 17.3M-parameter one of issue 39 (4
layers, width 512), 100M a 101M-parameter one (8 layers, width 1024). Each is wired through a
`[[case]]` (batch 4 x 128 tokens, 1 thread, as `run` pins it) and measured, each measurement in a
fresh process (its peak RSS, RUSAGE_SELF and RUSAGE_CHILDREN):

  bare            the model built, then `steps` AdamW steps of forward, backward and update
  baseline update the case's seed ensemble, held-out seeds, rounding twins and replays (skipped
                  with --baseline-dir DIR, which holds the case's baseline already)
  run             `precision-suite run --config cases.toml --charts none`, once per sample_every

Printed: one table per size, each row a measurement's wall time (the whole process: imports,
model build, training, judging, report) as a ratio to bare, its peak RSS as a ratio to bare's,
and `run`'s time split by part (each part's own time, a ratio to bare's whole process):
probes (the suite's quantization metrics and attention norms), accumulation error (the emulated
H100 accumulation, numerics/accumulation.py), observation (the rest of the sampled steps' extra
time over bare training: the observation's dispatch, the recorder's hooks), replays (the replay
of the stored state's last steps), baselines read, judging and report.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {"0.1M": 64, "2M": 256, "20M": 512, "100M": 1024}  # the Llama's width (user_models.SIZES)
BATCH = 4
CASE = """[[case]]
name = "llama-fp8-{size}-every-{sample_every}"
model = "user_models:llama_fp8"
batches = "user_models:llama_batch"
width = {width}
batch_size = {batch}
steps = {steps}
sample_every = {sample_every}
"""
# part -> the functions whose time is its own: (module, attribute). "Outer" parts own everything
# that runs inside them (a replay's probes are the replay's); inner parts are timed exclusively.
OUTER_PARTS = {
    "replays": [("precision_suite.jobs.train", "_replay")],
    "baselines read": [("precision_suite.jobs.checking", "load_references")],
    "judging": [("precision_suite.jobs.checking", "judge_case")],
    "report": [("precision_suite.jobs.checking", "finish")],
}
INNER_PARTS = {
    "probes": [
        ("precision_suite.training.recorder", "quant_stats"),
        ("precision_suite.training.recorder", "attention_norm"),
        ("precision_suite.training.attention_capture", "sdpa_attention"),
    ],
    "accumulation error": [
        ("precision_suite.training.gemm_errors", "error_sums_by_mode"),
        ("precision_suite.training.recorder", "gemm_error_sums"),
    ],
}
TRAINING = ("precision_suite.jobs.train", "_train")  # the run's own training (inclusive)
PARTS = ("probes", "observation", "accumulation error", "replays", "baselines read", "judging", "report")


def peak_rss_mb() -> float:
    """The largest resident set of this process or any child it waited for, MB (Linux: KB)."""
    return (
        max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        / 1024
    )


# ----------------------------------------------------------------------------- children


class Spec:
    """What user_models reads of a case."""

    def __init__(self, size: str) -> None:
        self.width, self.batch_size = SIZES[size], BATCH


def bare(size: str, steps: int, device: str = "cpu") -> dict[str, float]:
    """The user's own loop: the same model, data and optimizer, nothing of the suite."""
    import torch
    import torch.nn.functional as F
    import user_models

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = Spec(size)
    model = user_models.llama_fp8(spec).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(steps):
        inputs, targets = (x.to(device) for x in user_models.llama_batch(spec, generator))
        logits = model(inputs).logits
        F.cross_entropy(logits.reshape(targets.numel(), -1), targets.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    logits.detach().sum().item()  # the device has finished
    return {"training_s": time.perf_counter() - started}


def timing_parts(parts: dict[str, list[tuple[str, str]]], outer: tuple[str, ...] = ()) -> dict[str, float]:
    """Wrap each part's functions so that their time adds to the returned dict (seconds, live).
    Parts in `outer` own everything inside them; the others' time excludes the timed calls they
    make; "training" is inclusive."""
    import importlib

    spent = {part: 0.0 for part in parts}
    stack: list[list[float]] = []  # per timed call running: [its start, time of timed calls inside it]
    outer_depth = [0]

    def timed(part: str, fn):
        is_outer = part in outer

        def call(*args, **kwargs):
            if outer_depth[0] and not is_outer:  # inside a replay, judging, ...: that part's time
                return fn(*args, **kwargs)
            outer_depth[0] += is_outer
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                outer_depth[0] -= is_outer
                start, inner = stack.pop()
                elapsed = time.perf_counter() - start
                spent[part] += elapsed if part == "training" else elapsed - inner
                if stack:
                    stack[-1][1] += elapsed

        return call

    for part, targets in parts.items():
        for module, name in targets:
            owner = importlib.import_module(module)
            setattr(owner, name, timed(part, getattr(owner, name)))
    return spent


def cli(arguments: list[str]) -> dict[str, float]:
    """`precision-suite ARGUMENTS` in this process, the time of each part measured."""
    from precision_suite import cli as entry

    spent = timing_parts({**OUTER_PARTS, **INNER_PARTS, "training": [TRAINING]}, tuple(OUTER_PARTS))
    status = entry.main(arguments)
    if status not in (0, 1):
        raise SystemExit(f"precision-suite {' '.join(arguments)}: exit status {status}")
    return {**spent, "status": status}


def training_cost(size: str, steps: int, sample_every: int, device: str) -> dict[str, float]:
    """In this process: the bare loop, then `runs.run` of the case (the training `run` does, without
    baselines, judging or report), its probes and accumulation error timed; the GPU check's part.
    On CUDA also each one's peak allocated memory."""
    import torch

    from precision_suite.training.runs import RunSpec, run

    sys.path.insert(0, str(HERE))
    cuda = device.startswith("cuda")
    figures = {}
    for name in ("bare", "run"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if name == "bare":
            figures["bare_s"] = bare(size, steps, device)["training_s"]
        else:
            spent = timing_parts(INNER_PARTS)
            spec = RunSpec(
                model="user_models:llama_fp8",
                batches="user_models:llama_batch",
                width=SIZES[size],
                batch_size=BATCH,
                steps=steps,
                sample_every=sample_every,
                device=device,
            )
            started = time.perf_counter()
            run(spec)
            figures.update(
                run_s=time.perf_counter() - started, **{f"{part}_s": t for part, t in spent.items()}
            )
        if cuda:
            figures[f"{name}_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return {
        **figures,
        "ratio": figures["run_s"] / figures["bare_s"],
        **({"peak_ratio": figures["run_peak_mb"] / figures["bare_peak_mb"]} if cuda else {}),
    }


def child(argv: list[str]) -> None:
    started = time.perf_counter()
    sys.path.insert(0, str(HERE))
    if argv[0] == "bare":
        figures = bare(argv[1], int(argv[2]))
    elif argv[0] == "training":
        figures = training_cost(argv[1], int(argv[2]), int(argv[3]), "cpu")
    else:
        figures = cli(argv[1:])
    print(json.dumps({**figures, "process_s": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb()}))


# ----------------------------------------------------------------------------- the parent


def measure(argv: list[str], folder: Path) -> dict[str, float]:
    """One measurement in a fresh process (wall time from its start, as a user waits)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *argv],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall}


def measure_size(
    size: str, steps: int, sample_everies: list[int], baseline_dir: str | None, work: str | None = None
) -> dict:
    from precision_suite.jobs.regenerate import regeneration_size
    from precision_suite.jobs.selection import config_specs

    with tempfile.TemporaryDirectory(prefix=f"user-cost-{size}-") as tmp:
        folder = Path(work) / size if work else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        rows: dict[str, dict] = {}
        baselines = baseline_dir or str(folder / "baselines")
        for every in sample_everies:
            config = folder / f"cases-{every}.toml"
            config.write_text(
                CASE.format(size=size, width=SIZES[size], batch=BATCH, steps=steps, sample_every=every)
            )
            if baseline_dir is None:
                sys.path.insert(0, str(HERE))
                runs = sum(regeneration_size(spec) for spec in config_specs(config))
                update = measure(
                    ["cli", "baseline", "update", "--config", config.name, "--baseline-dir", baselines],
                    folder,
                )
                rows[f"baseline update, sample_every {every} ({runs} runs)"] = {
                    **update,
                    "runs": runs,
                    "against": f"bare {every}",
                }
            # bare again before each run: a shared host's load drifts over the minutes an update takes
            rows[f"bare {every}"] = measure(["bare", size, str(steps)], folder)
            rows[f"run, sample_every {every}"] = {"against": f"bare {every}"} | measure(
                [
                    "cli",
                    "run",
                    "--config",
                    config.name,
                    "--baseline-dir",
                    baselines,
                    "--charts",
                    "none",
                    "--workers",
                    "1",
                    "--report-dir",
                    str(folder / f"report-{every}"),
                ],
                folder,
            )
    return rows


def table(size: str, rows: dict[str, dict]) -> str:
    """Each measurement against the bare training measured next to it (the one before its run)."""
    lines = [
        f"## {size}",
        "| measurement | wall s | x bare | peak RSS MB | peak RSS x bare | " + " | ".join(PARTS) + " |",
        "|---|---|---|---|---|" + "---|" * len(PARTS),
    ]
    for name, row in rows.items():
        reference = rows[row.get("against", name)]
        ratio = row["wall_s"] / reference["wall_s"]
        parts = ["" for _ in PARTS]
        if name.startswith("run"):
            own = {part: row[part] for part in (*OUTER_PARTS, *INNER_PARTS)}
            own["observation"] = (
                row["training"] - reference["training_s"] - row["probes"] - row["accumulation error"]
            )
            parts = [f"{own[part] / reference['wall_s']:.2f}" for part in PARTS]
        if "runs" in row:
            name = f"{name}: {ratio / row['runs']:.2f} x bare per run"
        lines.append(
            f"| {name} | {row['wall_s']:.1f} | {ratio:.2f} | {row['peak_rss_mb']:.0f} | "
            f"{row['peak_rss_mb'] / reference['peak_rss_mb']:.2f} | " + " | ".join(parts) + " |"
        )
    return "\n".join(lines)


def training_table(size: str, rows: dict[int, dict]) -> str:
    lines = [
        f"## {size}: the training of `run` against the bare loop (one process per row)",
        "| sample_every | bare s | run s | x bare | probes x bare | accumulation error x bare | rest x bare |",
        "|---|---|---|---|---|---|---|",
    ]
    for every, row in rows.items():
        bare_s = row["bare_s"]
        rest = row["run_s"] - bare_s - row["probes_s"] - row["accumulation error_s"]
        lines.append(
            f"| {every} | {bare_s:.1f} | {row['run_s']:.1f} | {row['ratio']:.2f} | {row['probes_s'] / bare_s:.2f} | "
            f"{row['accumulation error_s'] / bare_s:.2f} | {rest / bare_s:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=[*SIZES, "both"], default="20M", help="both: 20M and 100M")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sample-every", default="2,10", help="comma-separated, e.g. 2,10")
    parser.add_argument(
        "--baseline-dir", help="a folder holding the cases' baselines already: skip baseline update"
    )
    parser.add_argument(
        "--training-only",
        action="store_true",
        help="only the training `run` does (runs.run), against the bare loop, in one process per "
        "sample_every: no baselines, judging or report (minutes where baseline update takes an hour)",
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--work",
        help="measure in this folder and keep it (its baselines serve a later "
        "--baseline-dir WORK/SIZE/baselines), not in a temporary one",
    )
    args = parser.parse_args(argv)
    sample_everies = [int(every) for every in args.sample_every.split(",")]
    figures = {}
    for size in ("20M", "100M") if args.size == "both" else [args.size]:
        started = time.perf_counter()
        if args.training_only:
            figures[size] = {
                every: measure(["training", size, str(args.steps), str(every)], Path.cwd())
                for every in sample_everies
            }
            print(training_table(size, figures[size]))
            print(f"({size}: measured in {time.perf_counter() - started:.0f} s)\n", flush=True)
            continue
        figures[size] = measure_size(size, args.steps, sample_everies, args.baseline_dir, args.work)
        print(table(size, figures[size]))
        print(f"({size}: measured in {time.perf_counter() - started:.0f} s)\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
