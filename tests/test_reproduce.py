"""`precision-suite reproduce`: the claims of figures A and B, the command's files and errors.

The claim logic is checked on synthetic datasets built to hold or to break one claim at a time
(each claim must be able to fail); the command line on synthetic training; the slow tests train
the real reproductions and assert the papers' central claims on them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from precision_suite import cli, files
from precision_suite.jobs import execution, figure_runs
from precision_suite.reports.figure_names import FIGURE_NAMES
from precision_suite.reports.paper_claims import (
    FIGURE_A_VARIANTS,
    SCALED_TWINS,
    figure_a_claims,
    figure_b_claims,
)
from precision_suite.reports.reports import markdown_cell
from precision_suite.training import runs
from precision_suite.verdicts.rule_check import run_spec
from synthetic_data import make_run_dataset

N_TOKENS = 196
DEPTH_A = 4  # figure A draws layer 1 and the last layer
STEPS = 100


# --------------------------------------------------------------------------- figure A


def _figure_a(end_norms: dict[str, float], depth_growth: dict[str, float] | None = None):
    """One synthetic run per variant: attention norm rising from 1 (softmax) or end/20 to its
    `end_norms` value in layer 1, scaled by `depth_growth[variant]` in the last layer."""
    depth_growth = depth_growth or {}
    datasets = {}
    for variant in FIGURE_A_VARIANTS:
        ds = make_run_dataset(model="gpt", attention=variant, depth=DEPTH_A, steps=STEPS, sample_every=5)
        ds.attrs["N"] = N_TOKENS
        progress = np.linspace(0.0, 1.0, ds.sizes["step"])[:, None]
        end = end_norms[variant]
        start = min(1.0, end) if variant == "softmax" else end / 20
        layer_factor = np.ones(DEPTH_A)
        layer_factor[-1] = depth_growth.get(variant, 1.0)
        # geometric growth from start to end; the deep layer's growth scaled by its factor
        norms = start * (end / start) ** progress * layer_factor[None, :] ** progress
        ds["attention_norm"] = (("step", "layer"), norms)
        datasets[variant] = ds
    return datasets


PAPER_LIKE = {"softmax": 3.0, "x/1": 900.0, "x/sqrt(N)": 30.0, "x^3/1": 5000.0, "x^3/sqrt(N)": 2.0}
# growth of the last layer relative to layer 1: different for 4 of the 5 variants
DEEP_DIFFERENT = {"softmax": 3.0, "x/1": 0.4, "x/sqrt(N)": 0.3, "x^3/1": 10.0, "x^3/sqrt(N)": 1.0}


def _by_key(claims):
    return {claim.key: claim for claim in claims}


def test_figure_a_claims_hold_on_the_papers_picture():
    claims = _by_key(figure_a_claims(_figure_a(PAPER_LIKE, DEEP_DIFFERENT)))
    assert list(claims) == [
        "softmax_bounded",
        "scaled_twins_apart",
        "unscaled_largest",
        "depth_changes_growth",
    ]
    assert all(claim.holds for claim in claims.values()), [c for c in claims.values() if not c.holds]
    twins = claims["scaled_twins_apart"].numbers
    # layer 1 keeps the constructed ratios; the last layer's are scaled by the depth factors
    constructed = PAPER_LIKE["x/1"] / PAPER_LIKE["x/sqrt(N)"]
    assert twins["x/1 ÷ x/sqrt(N), layer 1"] == pytest.approx(constructed, rel=0.1)
    assert claims["softmax_bounded"].numbers["sqrt(N)"] == pytest.approx(math.sqrt(N_TOKENS))


def test_softmax_above_its_bound_breaks_the_claim():
    datasets = _figure_a(PAPER_LIKE)
    datasets["softmax"]["attention_norm"][3, 2] = 1.01 * math.sqrt(N_TOKENS)
    claim = _by_key(figure_a_claims(datasets))["softmax_bounded"]
    assert not claim.holds and claim.numbers["softmax largest norm"] > claim.numbers["sqrt(N)"]


@pytest.mark.parametrize("twin", list(SCALED_TWINS))
def test_a_scaled_twin_only_5x_lower_breaks_the_tenfold_claim(twin):
    ends = {**PAPER_LIKE, SCALED_TWINS[twin]: PAPER_LIKE[twin] / 5}
    claim = _by_key(figure_a_claims(_figure_a(ends)))["scaled_twins_apart"]
    assert not claim.holds
    assert claim.numbers[f"{twin} ÷ {SCALED_TWINS[twin]}, layer 1"] == pytest.approx(5, rel=0.1)


def test_unscaled_variants_below_100_or_outranked_break_the_largest_claim():
    small = {**PAPER_LIKE, "x/1": 90.0, "x/sqrt(N)": 2.0}
    assert not _by_key(figure_a_claims(_figure_a(small)))["unscaled_largest"].holds
    outranked = {**PAPER_LIKE, "x^3/sqrt(N)": 1000.0, "x^3/1": 20000.0, "x/1": 500.0}
    assert not _by_key(figure_a_claims(_figure_a(outranked)))["unscaled_largest"].holds


def test_equal_growth_in_shallow_and_deep_layers_breaks_the_depth_claim():
    claim = _by_key(figure_a_claims(_figure_a(PAPER_LIKE)))["depth_changes_growth"]
    assert not claim.holds and claim.numbers["variants that differ"] == 0


def test_by_the_end_means_the_last_tenth_of_the_run_not_one_spike():
    datasets = _figure_a(PAPER_LIKE)
    datasets["x/sqrt(N)"]["attention_norm"][-1, :] = 1000.0  # one spike at the last sample
    assert _by_key(figure_a_claims(datasets))["scaled_twins_apart"].holds


def test_figure_a_claims_name_what_is_missing():
    datasets = _figure_a(PAPER_LIKE)
    with pytest.raises(ValueError, match=r"lack the variant\(s\) x\^3/1"):
        figure_a_claims({k: v for k, v in datasets.items() if k != "x^3/1"})
    del datasets["softmax"].attrs["N"]
    with pytest.raises(ValueError, match="no attribute N"):
        figure_a_claims(datasets)


# --------------------------------------------------------------------------- figure B


PANELS = {"activation": "1x128", "gradient": "1x128", "gradient_transpose": "128x1"}


def _figure_b(
    underflow: dict[str, float],
    distortion: float = 0.9997,
    spike: tuple[str, int, float] | None = None,
    dip: tuple[str, int, float] | None = None,
):
    """A GPT run of 18 layers, every panel's underflow constant at `underflow[tensor]` (a small
    alternation keeps medians honest); `spike` sets one step of (tensor, layer) to that value,
    `dip` one step's distortion."""
    ds = make_run_dataset(model="gpt", recipe="fp8-block", depth=18, steps=STEPS, sample_every=5)
    wobble = 1 + 0.1 * (np.arange(ds.sizes["step"]) % 2)[:, None]
    for tensor, layout in PANELS.items():
        ds["underflow"].loc[dict(tensor=tensor, layout=layout)] = underflow[tensor] * wobble
        ds["distortion"].loc[dict(tensor=tensor, layout=layout)] = distortion
    for change, variable in ((spike, "underflow"), (dip, "distortion")):
        if change is not None:
            tensor, layer, value = change
            ds[variable].loc[dict(tensor=tensor, layout=PANELS[tensor], layer=layer, step=50)] = value
    return ds


LING_LIKE = {"activation": 2e-5, "gradient": 1e-4, "gradient_transpose": 5e-3}


def test_figure_b_claims_hold_on_the_papers_picture():
    ds = _figure_b(LING_LIKE, spike=("gradient_transpose", 16, 0.1), dip=("gradient_transpose", 16, 0.9))
    claims = _by_key(figure_b_claims(ds))
    assert list(claims) == [
        "tiny_1x128_underflow",
        "transpose_above_gradient",
        "transpose_far_larger",
        "transpose_spiky",
        "transpose_worst_in_tail",
        "distortion_near_one",
        "transpose_distortion_dips",
    ]
    assert all(claim.holds for claim in claims.values()), [c for c in claims.values() if not c.holds]
    assert claims["transpose_worst_in_tail"].numbers["worst layer"] == 16
    assert claims["transpose_far_larger"].numbers["gradient transpose ÷ gradient"] == pytest.approx(
        LING_LIKE["gradient_transpose"] / LING_LIKE["gradient"], rel=0.1
    )


def test_flat_underflow_without_spikes_or_dips_breaks_those_claims():
    claims = _by_key(figure_b_claims(_figure_b(LING_LIKE)))
    assert not claims["transpose_spiky"].holds
    assert not claims["transpose_distortion_dips"].holds


def test_transpose_at_or_below_the_gradient_breaks_the_above_and_far_claims():
    claims = _by_key(figure_b_claims(_figure_b({**LING_LIKE, "gradient_transpose": 1e-4})))
    assert not claims["transpose_above_gradient"].holds and not claims["transpose_far_larger"].holds
    twice = _by_key(figure_b_claims(_figure_b({**LING_LIKE, "gradient_transpose": 2e-4})))
    assert twice["transpose_above_gradient"].holds and not twice["transpose_far_larger"].holds


def test_a_spike_in_a_shallow_layer_is_not_a_tail_layer_spike():
    claims = _by_key(figure_b_claims(_figure_b(LING_LIKE, spike=("gradient_transpose", 4, 0.1))))
    assert claims["transpose_spiky"].holds and not claims["transpose_worst_in_tail"].holds


def test_gradient_underflow_above_1e2_is_not_tiny_and_low_distortion_not_near_one():
    claims = _by_key(figure_b_claims(_figure_b(LING_LIKE, distortion=0.99, spike=("gradient", 8, 0.02))))
    assert not claims["tiny_1x128_underflow"].holds
    assert claims["tiny_1x128_underflow"].numbers["gradient (1,128) largest"] == pytest.approx(0.02)
    assert not claims["distortion_near_one"].holds


def test_figure_b_claims_name_bad_layers_and_unmeasured_panels():
    ds = _figure_b(LING_LIKE)
    with pytest.raises(ValueError, match=r"layers \[20\] not in the run"):
        figure_b_claims(ds, layers=(0, 20))
    with pytest.raises(ValueError, match="did not measure gradient_transpose under 128x1"):
        figure_b_claims(ds.sel(layout=["1x128", "128x128"]))


# --------------------------------------------------------------------------- the command


@pytest.fixture
def synthetic_training(monkeypatch):
    """runs.run replaced by synthetic datasets of each spec's shape (no training)."""

    def fake_run(spec, progress=None):
        config = spec.model_config()
        ds = make_run_dataset(
            model=spec.model,
            attention=spec.attention,
            recipe=spec.recipe,
            depth=config.depth,
            steps=spec.steps,
            sample_every=spec.sample_every,
        )
        ds.attrs.update(case=runs.case_id(spec), spec=spec.to_json(), N=config.tokens)
        if progress is not None:
            progress(spec.steps, spec.steps, 1.0)
        return ds

    monkeypatch.setattr(runs, "run", fake_run)
    monkeypatch.setattr(execution, "default_workers", lambda: 1)  # spawned workers would train


@pytest.mark.parametrize("figure", FIGURE_NAMES)
def test_reproduce_writes_figure_datasets_and_a_note_of_every_claim(
    tmp_path, capsys, figure, synthetic_training
):
    assert cli.main(["reproduce", figure, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    specs = figure_runs.figure_specs(figure)
    saved = sorted(tmp_path.glob(f"{figure}-*.nc"))
    assert len(saved) == len(specs)
    datasets = [files.load_dataset(path) for path in saved]
    assert {ds.attrs["case"] for ds in datasets} == {runs.case_id(spec) for spec in specs}
    assert (tmp_path / f"{figure}.png").read_bytes().startswith(b"\x89PNG")
    if figure == "figure-a":
        claims = figure_a_claims({run_spec(ds)["attention"]: ds for ds in datasets})
    else:
        claims = figure_b_claims(datasets[0])
    note = (tmp_path / f"{figure}.md").read_text(encoding="utf-8")
    assert f"![{figure}]({figure}.png)" in note
    for claim in claims:  # the note and stdout state every claim, with its verdict
        row = next(line for line in note.splitlines() if line.startswith(f"| {markdown_cell(claim.text)} |"))
        assert ("| yes |" in row) == claim.holds
        assert claim.text in out
    assert f"{sum(c.holds for c in claims)} of {len(claims)} claims shown" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["reproduce"], "the following arguments are required: FIGURE"),
        (["reproduce", "figure-c"], "invalid choice: 'figure-c' (choose from 'figure-a', 'figure-b')"),
        (["reproduce", "figure-a", "--workers", "0"], "'0' is not a positive number of worker processes"),
        (["reproduce", "figure-b", "--out", "{file}"], "is a file; give a folder"),
    ],
)
def test_reproduce_argument_errors_exit_2_with_a_clear_message(tmp_path, capsys, argv, message):
    (tmp_path / "taken").write_text("")
    argv = [arg.format(file=tmp_path / "taken") for arg in argv]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_figure_names_the_choices():
    with pytest.raises(ValueError, match="unknown figure 'figure-z'; choose one of figure-a, figure-b"):
        figure_runs.figure_specs("figure-z")


# --------------------------------------------------------------------------- the real runs


@pytest.mark.slow
def test_figure_a_reproduction_shows_the_papers_picture(tmp_path):
    result = figure_runs.reproduce("figure-a", tmp_path, workers=2)
    claims = _by_key(result.claims)
    assert claims["scaled_twins_apart"].holds, claims["scaled_twins_apart"]
    assert claims["softmax_bounded"].holds, claims["softmax_bounded"]
    assert result.note.is_file() and result.chart.is_file() and len(result.datasets) == len(FIGURE_A_VARIANTS)


@pytest.mark.slow
def test_figure_b_reproduction_shows_gradient_transpose_underflow_above_the_gradients(tmp_path):
    result = figure_runs.reproduce("figure-b", tmp_path, workers=1)
    claim = _by_key(result.claims)["transpose_above_gradient"]
    assert claim.holds, claim
    assert result.note.is_file() and result.chart.is_file()
