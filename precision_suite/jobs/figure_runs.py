"""The runs of each seed figure, trained, then written as figure, datasets and note by
reports.paper_claims (which also holds the claims and the measured choices' reasons):
`precision-suite reproduce` (`reproduce_figure`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import xarray as xr

from precision_suite.jobs.execution import Task, run_tasks
from precision_suite.jobs.train import placement, train_all
from precision_suite.jobs.usage import EXIT_OK, UsageError
from precision_suite.reports.figure_names import check_figure
from precision_suite.reports.paper_claims import FIGURE_A_VARIANTS
from precision_suite.reports.reproduction import Reproduction, write_reproduction
from precision_suite.training.runs import RunSpec

# figure A: a 4-block GPT, N = 196 tokens per sequence (reports/paper_claims.py says why)
FIGURE_A_RUN = {
    "model": "gpt",
    "recipe": "fp32",
    "depth": 4,
    "seq_len": 196,
    "batch_size": 4,
    "lr": 3e-3,
    "steps": 200,
    "sample_every": 10,
}
# figure B: the default GPT, its GEMM operands measured under the FP8 block recipe (the default
# measurement) every 10th step
FIGURE_B_RUN = {"model": "gpt", "recipe": "fp32", "steps": 300, "sample_every": 10}

Trainer = Callable[[Sequence[RunSpec]], list[xr.Dataset]]


def figure_specs(figure: str) -> list[RunSpec]:
    """The RunSpecs a figure trains (figure A: one per variant, in FIGURE_A_VARIANTS order)."""
    check_figure(figure)
    if figure == "figure-a":
        return [RunSpec(attention=variant, **FIGURE_A_RUN) for variant in FIGURE_A_VARIANTS]
    return [RunSpec(**FIGURE_B_RUN)]


def reproduce(
    figure: str, out_dir: str | Path, train: Trainer | None = None, workers: int = 1
) -> Reproduction:
    """Train `figure`'s runs, then write its chart, datasets and note into `out_dir`.

    `train(specs) -> datasets` trains the runs (the command line passes one that prints
    progress); the default trains them in `workers` processes (execution.run_tasks).
    """
    specs = figure_specs(figure)
    if train is None:

        def train(specs: Sequence[RunSpec]) -> list[xr.Dataset]:
            return run_tasks([Task(spec) for spec in specs], workers)

    started = time.monotonic()
    datasets = train(specs)
    return write_reproduction(figure, out_dir, specs, datasets, time.monotonic() - started)


def reproduce_figure(figure: str, out_dir: str, *, workers: int | None, scheduler: str | None) -> int:
    """Train a seed figure's runs, write figure, datasets and note; print which claims hold."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the figure, datasets and note")
    where = placement(workers, scheduler)
    specs = figure_specs(figure)
    print(
        f"{figure}: {len(specs)} run(s) of {specs[0].steps} steps (a few minutes on 2 cores)",
        file=sys.stderr,
        flush=True,
    )
    result = reproduce(figure, out, train=lambda specs: train_all(list(specs), where))
    for claim in result.claims:
        print(f"{'shown' if claim.holds else 'NOT shown':9} {claim.text}")
    print(
        f"{sum(c.holds for c in result.claims)} of {len(result.claims)} claims shown; "
        f"trained in {result.seconds:.0f} s"
    )
    print(f"figure: {result.chart}\nnote: {result.note}")
    return EXIT_OK
