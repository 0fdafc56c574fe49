"""What `precision-suite reproduce figure-a|figure-b` writes into one folder from a figure's trained
runs: the run datasets (netCDF), the figure drawn as the paper draws it (PNG) and a short Markdown
note: the paper, the runs, the figure, and each of the paper's claims with its verdict and numbers
(reports.paper_claims computes them from the datasets)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xarray as xr

from precision_suite.files import atomic_file, safe_filename, save_dataset
from precision_suite.reports.canvas import save_figure
from precision_suite.reports.figure_names import check_figure
from precision_suite.reports.figures import plot_attention_norm, plot_quant_error
from precision_suite.reports.paper_claims import (
    FIGURE_A_VARIANTS,
    FIGURE_B_LAYERS,
    Claim,
    figure_a_claims,
    figure_b_claims,
)
from precision_suite.reports.reports import markdown_cell
from precision_suite.training.runs import RunSpec, case_id


@dataclass(frozen=True)
class Reproduction:
    """What `reproduce` wrote, and what the note says."""

    figure: str
    chart: Path
    datasets: tuple[Path, ...]
    note: Path
    claims: tuple[Claim, ...]
    seconds: float


# --------------------------------------------------------------------------- the files


def write_reproduction(
    figure: str, out_dir: str | Path, specs: Sequence[RunSpec], datasets: Sequence[xr.Dataset], seconds: float
) -> Reproduction:
    """Write `figure`'s datasets, chart and note into `out_dir` from its trained runs (`specs` in
    the order of `jobs.figure_runs.figure_specs`, `seconds` the training time the note states)."""
    out = Path(out_dir)
    paths = tuple(
        save_dataset(ds, out / f"{figure}-{safe_filename(case_id(spec))}.nc")
        for spec, ds in zip(specs, datasets)
    )
    if figure == "figure-a":
        by_variant = dict(zip(FIGURE_A_VARIANTS, datasets))
        claims = figure_a_claims(by_variant)
        fig = plot_attention_norm(by_variant, x="tokens")
    else:
        claims = figure_b_claims(datasets[0])
        fig = plot_quant_error(datasets[0], layers=FIGURE_B_LAYERS)
    chart = save_figure(fig, out / f"{figure}.png")
    note = out / f"{figure}.md"
    with atomic_file(note) as handle:
        handle.write(note_markdown(figure, specs, claims, chart.name, paths, seconds).encode("utf-8"))
    return Reproduction(figure, chart, paths, note, tuple(claims), seconds)


# --------------------------------------------------------------------------- the note


_TITLES = {
    "figure-a": (
        "Figure A reproduced: attention norm across training",
        'Saratchandran et al., "Rethinking Softmax: Self-Attention with Polynomial '
        'Activations" (arXiv 2410.18613), attention norm across epochs in layers 2 and 12',
    ),
    "figure-b": (
        "Figure B reproduced: FP8 underflow and distortion per layer",
        '"Ling 2.0 Technical Report" (arXiv 2510.22115), figure 16: FP8 quantization '
        "error of Ling-mini-2.0 layers 0, 4, 8, 12, 16 over tokens seen",
    ),
}
_SETUP = {
    "figure-a": (
        "One run per attention variant ({variants}) of a {depth}-block GPT on Shakespeare "
        "bytes, trained in float32 for {steps} steps of {batch_size} x {seq_len} tokens "
        "at lr {lr:g}, probed every {sample_every} steps. N = {seq_len} as in the paper's "
        "ImageNet ViT, so x/sqrt(N) is the paper's x/14. The x axis is tokens seen (the "
        "paper's: ImageNet epochs). The digits ViT cannot show the paper's tenfold gap "
        "between twins: its N is at most 64, and with similar trained scores a twin's "
        "norm ratio is sqrt(N) <= 8."
    ),
    "figure-b": (
        "One run of the default {depth}-block GPT on Shakespeare bytes, {steps} steps of "
        "{batch_size} x {seq_len} tokens; every {sample_every} steps each GEMM operand "
        "is quantized as the FP8 block recipe does (E4M3, (1,128) activations and "
        "gradients, (128,128) weights, (128,1) gradient transpose for the weight-gradient "
        "GEMM). It trains in float32 (the paper trains in FP8): training through the "
        "emulated FP8 GEMMs costs 2.6x the time here and gave the same verdict on every "
        "claim. Underflow counts elements non-zero before and zero after quantization "
        "(Transformer Engine's definition); distortion is the cosine similarity of a "
        "tensor and its reconstruction."
    ),
}


def note_markdown(
    figure: str,
    specs: Sequence[RunSpec],
    claims: Sequence[Claim],
    chart_name: str,
    dataset_paths: Sequence[Path],
    seconds: float,
) -> str:
    """The Markdown note: source, runs, figure, each claim with its verdict and numbers."""
    check_figure(figure)
    title, source = _TITLES[figure]
    spec = specs[0]
    config = spec.model_config()
    setup = _SETUP[figure].format(
        variants=", ".join(s.attention for s in specs),
        depth=config.depth,
        steps=spec.steps,
        batch_size=spec.resolved_batch_size(),
        seq_len=config.tokens,
        lr=spec.resolved_lr(),
        sample_every=spec.sample_every,
    )
    shown = sum(claim.holds for claim in claims)
    lines = [
        f"# {title}",
        "",
        f"Paper: {source}.",
        "",
        setup,
        "",
        f"![{figure}]({chart_name})",
        "",
        f"**{shown} of {len(claims)} claims shown** (computed from the datasets by "
        f"`precision_suite.reports.paper_claims.{figure.replace('-', '_')}_claims`).",
        "",
        "| claim | shown | numbers |",
        "|---|---|---|",
    ]
    for claim in claims:
        numbers = "; ".join(f"{name} {value:.4g}" for name, value in claim.numbers.items())
        lines.append(
            f"| {markdown_cell(claim.text)} | {'yes' if claim.holds else '**no**'} | "
            f"{markdown_cell(numbers)} |"
        )
    lines += [
        "",
        f"Training took {seconds:.0f} s. Datasets: "
        + ", ".join(f"`{path.name}`" for path in dataset_paths)
        + ".",
        f"Made with `precision-suite reproduce {figure}`.",
        "",
    ]
    return "\n".join(lines)
