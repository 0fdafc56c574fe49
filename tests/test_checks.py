"""Threshold and growth rules: parsing, selection, violation messages; verdicts; project config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from hypothesis import given
from hypothesis import strategies as st

from precision_suite.training.matrix import KnownViolation
from precision_suite.verdicts.findings import CaseVerdict, Finding, verdict
from precision_suite.verdicts.judge import blocks, judge_case, known_violations
from precision_suite.verdicts.project_config import load_project_config
from precision_suite.verdicts.rule_check import check_rules
from precision_suite.verdicts.rules import BoundRule, GrowthRule, evaluate_expression, parse_rule, parse_rules
from synthetic_data import make_run_dataset

REPO_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
N_TOKENS = 17  # the synthetic run's attention size, recorded as attr N like a ViT on 8x8 digits


@pytest.fixture(scope="module")
def run() -> xr.Dataset:
    ds = make_run_dataset(depth=4, steps=30, sample_every=10)
    ds.attrs["N"] = N_TOKENS
    return ds


def planted(ds: xr.Dataset, metric: str, cell: dict, value: float) -> xr.Dataset:
    out = ds.copy(deep=True)
    out[metric].loc[cell] = value
    return out


# --------------------------------------------------------------------------- parsing

EXAMPLES = [
    (
        "underflow <= 1e-3 @ tensor=gradient, layout=1x128",
        BoundRule("underflow", "<=", 1e-3, (("tensor", ("gradient",)), ("layout", ("1x128",)))),
    ),
    (
        "distortion>=0.999@tensor=activation,steps=last",
        BoundRule("distortion", ">=", 0.999, (("tensor", ("activation",)),), "last"),
    ),
    (
        "attention_norm <= sqrt(N) @ attention=softmax",
        BoundRule("attention_norm", "<=", "sqrt(N)", (("attention", ("softmax",)),)),
    ),
    ("growth(attention_norm) <= 4 @ layer=0|3", GrowthRule("attention_norm", 4.0, (("layer", ("0", "3")),))),
    (
        "attention_norm <= 2*sqrt(N) @ attention=x^3/sqrt(N)|x/1",
        BoundRule("attention_norm", "<=", "2*sqrt(N)", (("attention", ("x^3/sqrt(N)", "x/1")),)),
    ),
]


@pytest.mark.parametrize("text, rule", EXAMPLES)
def test_string_rules_parse_and_print_back(text, rule):
    assert parse_rule(text) == rule
    assert parse_rule(str(rule)) == rule


def test_table_form_equals_string_form():
    assert parse_rule(
        {"metric": "underflow", "max": 1e-3, "tensor": "gradient", "layout": "1x128"}
    ) == parse_rule("underflow <= 1e-3 @ tensor=gradient, layout=1x128")
    assert parse_rule(
        {"metric": "distortion", "min": 0.999, "tensor": "activation", "steps": "last"}
    ) == parse_rule("distortion >= 0.999 @ tensor=activation, steps=last")
    assert parse_rule({"metric": "attention_norm", "growth": 4, "layer": [0, 3]}) == parse_rule(
        "growth(attention_norm) <= 4 @ layer=0|3"
    )


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("underflow < 1e-3", "expected 'metric <= bound'"),
        ("underflow <= 1e-3 @ tensor", "not key=value"),
        ("underflow <= 1e-3 @ steps=sometimes", "steps=all or steps=last"),
        ("growth(attention_norm) >= 4", "growth rule is 'growth"),
        ("growth(attention_norm) <= 4 @ steps=last", "drop steps"),
        ("growth(attention_norm) <= 0", "must be > 0"),
        ("underflow <= 1e-3 @ layer=first", "layers are integers"),
        ("underflow <= __import__('os')", "only numbers, names"),
        ("underflow <= N.real", "only numbers, names"),
        ("underflow <= 1e-3 +", "not an arithmetic expression"),
        ({"metric": "underflow", "max": 1, "min": 0}, "exactly one of max, min or growth"),
        ({"max": 1}, "needs metric"),
        (42, "must be a string"),
    ],
)
def test_bad_rules_fail_with_the_reason(bad, reason):
    with pytest.raises(ValueError, match=f"rule 1 .*{reason}".replace("(", r"\(").replace(")", r"\)")):
        parse_rules([bad])


@given(st.floats(0.5, 100), st.floats(0.5, 100))
def test_expressions_are_arithmetic(n, d):
    names = {"N": n, "d_head": d}
    assert evaluate_expression("2*sqrt(N) + d_head**2 / 4 - -1", names) == 2 * math.sqrt(n) + d**2 / 4 + 1
    assert evaluate_expression("max(N, d_head) * exp(log(2))", names) == pytest.approx(2 * max(n, d))


# --------------------------------------------------------------------------- checking


def test_rules_that_hold_give_no_findings(run):
    worst = float(run["underflow"].sel(tensor="gradient", layout="1x128").max())
    assert (
        check_rules(
            run,
            [f"underflow <= {worst} @ tensor=gradient, layout=1x128", "attention_norm >= 0", "loss <= 1e9"],
        )
        == []
    )


def test_violation_names_case_metric_layer_step_value_and_bound(run):
    cell = {"step": 10, "layer": 2, "tensor": "gradient", "layout": "1x128"}
    bound = float(run["underflow"].sel(tensor="gradient", layout="1x128").max()) * 2
    current = planted(run, "underflow", cell, bound * 3)
    (finding,) = check_rules(current, [f"underflow <= {bound!r} @ tensor=gradient, layout=1x128"])
    assert (finding.kind, finding.metric, finding.value, finding.reference) == (
        "threshold",
        "underflow",
        bound * 3,
        bound,
    )
    assert finding.where == cell
    for text in (run.attrs["case"], "underflow", "layer 2", "step 10", f"{bound * 3:.6g}", f"{bound:.6g}"):
        assert text in finding.message


def test_worst_step_is_reported_once_per_layer(run):
    series = {"layer": 1, "tensor": "activation", "layout": "1x128"}
    current = run.copy(deep=True)
    current["distortion"].loc[series] = np.linspace(0.9, 0.5, run.sizes["step"])
    (finding,) = check_rules(current, ["distortion >= 0.99 @ tensor=activation, layout=1x128"])
    assert finding.where == {**series, "step": int(run["step"][-1])} and finding.value == 0.5
    assert f"{run.sizes['step']} of {run.sizes['step']} steps violate" in finding.message


def test_steps_last_checks_only_the_last_sampled_step(run):
    early = {"step": int(run["step"][0]), "layer": 0, "tensor": "activation", "layout": "1x128"}
    current = planted(run, "distortion", early, 0.5)
    assert check_rules(current, ["distortion >= 0.9 @ tensor=activation, layout=1x128, steps=last"]) == []
    assert len(check_rules(current, ["distortion >= 0.9 @ tensor=activation, layout=1x128"])) == 1


def test_bound_expressions_use_run_attrs_and_spec(run):
    cell = {"step": 20, "layer": 3}
    current = planted(run, "attention_norm", cell, 1.01 * math.sqrt(N_TOKENS))
    current["attention_norm"].loc[{"layer": [0, 1, 2]}] = 1.0
    current["attention_norm"].loc[{"layer": 3, "step": [0, 10, 29]}] = 1.0
    (finding,) = check_rules(current, ["attention_norm <= sqrt(N)"])
    assert finding.reference == pytest.approx(math.sqrt(N_TOKENS)) and finding.where == cell
    steps = json.loads(run.attrs["spec"])["steps"]
    (same,) = check_rules(current, [f"attention_norm <= sqrt(N) * steps / {steps}"])  # spec field
    assert (same.where, same.reference) == (finding.where, finding.reference)
    (error,) = check_rules(current, ["attention_norm <= sqrt(tokens_per_row)"])
    assert error.kind == "error" and "unknown name 'tokens_per_row'" in error.message and "N" in error.message


def test_spec_selectors_choose_the_runs_a_rule_applies_to(run):
    softmax_rule = "attention_norm <= 1 @ attention=softmax"
    assert run.attrs["case"].startswith("vit-softmax")
    assert len(check_rules(run, [softmax_rule])) == run.sizes["layer"]
    other = make_run_dataset(attention="x/1", depth=4, steps=30)
    assert check_rules(other, [softmax_rule]) == []
    assert len(check_rules(other, ["attention_norm <= 1 @ attention=softmax|x/1, model=vit"])) == 4


@pytest.mark.parametrize(
    "rule, message",
    [
        ("attention_norm <= 1 @ attentoin=softmax", "'attentoin' is neither a dimension"),
        ("atention_norm <= 1", "no metric 'atention_norm'"),
        ("attention_norm <= 1 @ tensor=gradient", "attention_norm has no tensor dimension"),
    ],
)
def test_rules_that_cannot_apply_are_errors(run, rule, message):
    (finding,) = check_rules(run, [rule])
    assert finding.kind == "error" and message in finding.message and run.attrs["case"] in finding.message


def test_selectors_matching_nothing_skip_unless_strict(run):
    rule = "underflow <= 0 @ layout=nvfp4"
    assert check_rules(run, [rule]) == []
    (finding,) = check_rules(run, [rule], strict=True)
    assert finding.kind == "error" and "layout=nvfp4 matches nothing" in finding.message
    unmeasured = "underflow <= 0 @ tensor=weight, layout=1x128"  # a pair the run leaves NaN
    assert check_rules(run, [unmeasured]) == []
    assert [f.kind for f in check_rules(run, [unmeasured], strict=True)] == ["error"]


def test_nan_among_measured_steps_violates(run):
    cell = {"step": 10, "layer": 0, "tensor": "gradient", "layout": "1x128"}
    (finding,) = check_rules(planted(run, "underflow", cell, np.nan), ["underflow <= 1 @ tensor=gradient"])
    assert finding.where == cell and math.isnan(finding.value)


@pytest.mark.parametrize("ratio, violates", [(0.99, False), (1.01, True)])
def test_growth_rule_compares_last_with_first_per_layer(run, ratio, violates):
    factor = 3.0
    current = run.copy(deep=True)
    norm = current["attention_norm"]
    norm[-1, :] = norm[0, :] * factor * ratio
    current["attention_norm"] = norm
    findings = check_rules(current, [f"growth(attention_norm) <= {factor}"])
    if not violates:
        assert findings == []
        return
    assert [f.where["layer"] for f in findings] == list(range(run.sizes["layer"]))
    first = float(norm[0, 2])
    finding = findings[2]
    assert finding.value == pytest.approx(first * factor * ratio)
    assert finding.reference == pytest.approx(first * factor)
    assert finding.where["step"] == int(run["step"][-1])
    assert f"grew from {first:.6g}" in finding.message and "layer 2" in finding.message


# --------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    "kinds, status",
    [
        ((), "pass"),
        (("drift",), "drift"),
        (("error", "drift"), "error"),
        (("regression", "error", "drift"), "fail"),
        (("threshold",), "fail"),
    ],
)
def test_verdict_status(kinds, status):
    findings = [Finding("c", kind, "m", {}, 0.0, 0.0, 0.0, "") for kind in kinds]
    result = verdict("c", findings, charts=[Path("reports/c.png")])
    assert result == CaseVerdict("c", status, tuple(findings), ("reports/c.png",))


def test_verdicts_serialise_to_strict_json():
    finding = Finding("c", "regression", "loss", {"train_step": 3}, math.nan, 1.0, math.inf, "msg")
    text = json.dumps(verdict("c", [finding]).to_dict(), allow_nan=False)
    assert json.loads(text)["findings"][0]["value"] == "nan"
    with pytest.raises(ValueError, match="kind"):
        Finding("c", "oops", "loss", {}, 0.0, 0.0, 0.0, "")


# --------------------------------------------------------------------------- known violations

GRADIENT_UNDERFLOW = "underflow <= 1e-3 @ tensor=gradient, layout=1x128"
FLUSHED_CELL = {"step": 10, "layer": 2, "tensor": "gradient", "layout": "1x128"}
FLUSHING = KnownViolation("gradient tiles flush, issue #7", rule=GRADIENT_UNDERFLOW)


@pytest.fixture(scope="module")
def flushing_run(run) -> xr.Dataset:
    """The run with 2% of one layer's gradient tiles flushed: it breaks GRADIENT_UNDERFLOW there."""
    return planted(run, "underflow", FLUSHED_CELL, 0.02)


@pytest.mark.parametrize(
    "known",
    [
        FLUSHING,
        KnownViolation("written as printed", rule="underflow<=0.001@tensor=gradient,layout=1x128"),
        KnownViolation("by metric", metric="underflow"),
        KnownViolation("by metric and place", metric="underflow", where={"tensor": "gradient", "layer": 2}),
    ],
    ids=["rule", "rule-as-printed", "metric", "metric-where"],
)
def test_a_known_violation_excuses_what_it_names(flushing_run, known):
    outcome = judge_case(flushing_run, None, rules=[GRADIENT_UNDERFLOW], known=[known])
    (finding,) = outcome.findings
    assert (outcome.status, outcome.known, finding.known) == ("known", known.reason, known.reason)
    assert f"(known violation: {known.reason})" in finding.message and not blocks(outcome)


@pytest.mark.parametrize(
    "known",
    [
        KnownViolation("another rule", rule="underflow <= 1e-2 @ tensor=gradient, layout=1x128"),
        KnownViolation("another metric", metric="overflow"),
        KnownViolation("another layer", metric="underflow", where={"layer": 3}),
    ],
)
def test_a_known_violation_excuses_nothing_it_does_not_name(flushing_run, known):
    outcome = judge_case(flushing_run, None, rules=[GRADIENT_UNDERFLOW], known=[known])
    assert outcome.status == "fail" and outcome.known == "" and blocks(outcome)
    assert [f.known for f in outcome.findings] == [""]


def test_the_case_still_fails_on_a_rule_the_known_violation_does_not_name(flushing_run):
    outcome = judge_case(
        flushing_run, None, rules=[GRADIENT_UNDERFLOW, "attention_norm <= 0"], known=[FLUSHING]
    )
    assert outcome.status == "fail" and outcome.known == "" and blocks(outcome)
    excused = {f.metric for f in outcome.findings if f.known}
    failing = {f.metric for f in outcome.findings if not f.known}
    assert (excused, failing) == ({"underflow"}, {"attention_norm"})


def test_a_baseline_regression_is_never_excused(run, flushing_run):
    # the loss regresses against the run itself: not excused, even by a violation naming its metric
    regressed = flushing_run.assign(loss=flushing_run["loss"] * 10)
    outcome = judge_case(
        regressed,
        run,
        rules=[GRADIENT_UNDERFLOW],
        known=[FLUSHING, KnownViolation("even by metric", metric="loss")],
    )
    regressions = [f for f in outcome.findings if f.kind == "regression"]
    assert regressions and not any(f.known for f in regressions)
    assert [f.known for f in outcome.findings if f.kind == "threshold"] == [FLUSHING.reason]
    assert outcome.status == "fail" and blocks(outcome)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: known_violations("a reason alone"), "does not name what it excuses"),
        (lambda: KnownViolation("a reason alone"), "must name what it excuses"),
        (lambda: KnownViolation("both", rule=GRADIENT_UNDERFLOW, metric="underflow"), "exactly one of"),
        (
            lambda: KnownViolation("where without metric", rule=GRADIENT_UNDERFLOW, where={"layer": 2}),
            "narrows a metric",
        ),
        (lambda: KnownViolation("", rule=GRADIENT_UNDERFLOW), "needs a reason"),
        (
            lambda: known_violations(KnownViolation("bad rule", rule="underflow < 1")),
            "bad rule.*underflow < 1",
        ),
    ],
)
def test_a_known_violation_must_say_why_and_what_it_excuses(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --------------------------------------------------------------------------- configuration


def test_project_config(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[tool.precision_suite]\n"
        'rules = ["underflow <= 1e-3 @ tensor=gradient",'
        ' {metric = "attention_norm", growth = 4}]\n'
        "tolerances = {attention_norm = 0.1, loss = {tol = 0.05}}\n"
    )
    config = load_project_config(pyproject)
    assert config.rules == parse_rules(["underflow <= 1e-3 @ tensor=gradient", "growth(attention_norm) <= 4"])
    assert config.tolerances == {"attention_norm": 0.1, "loss": {"tol": 0.05}}
    assert load_project_config(tmp_path / "absent.toml").rules == ()


@pytest.mark.parametrize(
    "body, message",
    [
        ('rules = ["underflow <= 1e-3", "underflow <<= 1"]', "rule 2"),
        ("rule = []", "unknown key.*rule"),
        ('rules = "underflow <= 1"', "must be a list"),
        ("tolerances = {underflow = {toll = 1}}", "unknown field"),
        ("rules = [", "not valid TOML"),
    ],
)
def test_bad_project_config_names_file_and_key(tmp_path, body, message):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f"[tool.precision_suite]\n{body}\n")
    with pytest.raises(ValueError, match=f"pyproject.toml.*{message}"):
        load_project_config(pyproject)


def test_the_repository_config_is_valid():
    assert load_project_config(REPO_PYPROJECT).rules
