"""Report directories: content of index.html, summary.md and summary.json, order, charts."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from precision_suite import files
from precision_suite.reports import canvas, drift_chart, reports
from precision_suite.verdicts.findings import CaseVerdict, Finding, verdict
from precision_suite.verdicts.tolerances import compare
from synthetic_data import make_run_dataset


class _Images(HTMLParser):
    """Collects <img> tags and section headings; html.parser raises nothing, so also count tags."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict] = []
        self.headings: list[str] = []
        self._in_heading = False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
        if tag == "h2":
            self._in_heading = True
            self.headings.append("")

    def handle_endtag(self, tag):
        if tag == "h2":
            self._in_heading = False

    def handle_data(self, data):
        if self._in_heading:
            self.headings[-1] += data


def _parse(path: Path) -> _Images:
    parser = _Images()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    return parser


def _strict_json(path: Path):
    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constants)


def _planted_case(tmp_path: Path):
    """A GPT case whose layer-2 gradient-transpose underflow jumps: a regression with a chart."""
    baseline = make_run_dataset(model="gpt", recipe="fp8-block", depth=6)
    current = baseline.copy(deep=True)
    cell = dict(layer=2, tensor="gradient_transpose", layout="128x1")
    current["underflow"].loc[cell] = current["underflow"].loc[cell] + 0.1
    findings = compare(current, baseline)
    chart = canvas.save_figure(
        drift_chart.plot_drift(current, baseline, findings), tmp_path / "plugin-charts" / "drift.png"
    )
    return current, verdict(current.attrs["case"], findings, [str(chart)])


def test_planted_regression_report_fails_and_shows_the_case_chart(tmp_path):
    current, failing = _planted_case(tmp_path)
    passing_ds = make_run_dataset(attention="x/1")
    passing = verdict(passing_ds.attrs["case"], [])
    out = reports.write_report(
        [passing, failing],
        tmp_path / "report",
        datasets={current.attrs["case"]: current, passing_ds.attrs["case"]: passing_ds},
    )

    summary = _strict_json(out / "summary.json")
    assert summary["overall"] == "fail"
    assert [c["case"] for c in summary["cases"]] == [failing.case, passing.case]  # failing first
    failed = summary["cases"][0]
    assert failed["status"] == "fail"
    assert any(
        f["kind"] == "regression" and f["metric"] == "underflow" and f["where"]["layer"] == 2
        for f in failed["findings"]
    )
    # the drift chart is copied in, and figures A and B of the failing case are drawn
    assert failed["charts"][0].startswith("charts/") and failed["charts"][0].endswith("drift.png")
    assert any(c.endswith("quant-error.png") for c in failed["charts"])
    assert any(c.endswith("attention-norm.png") for c in failed["charts"])
    assert summary["cases"][1]["charts"] == []  # passing cases get charts only on request
    for chart in failed["charts"]:
        assert (out / chart).is_file()

    # figure B of the one low-precision run joins the overview (figure A needs two variants)
    assert summary["overview_charts"] == [f"charts/overview-{failing.case}-quant-error.png"]
    page = _parse(out / "index.html")
    charted = [img["data-chart"] for img in page.images]
    assert charted == failed["charts"] + summary["overview_charts"]
    for img in page.images:
        assert img["src"].startswith("data:image/png;base64,")  # opens from disk, self-contained
    assert f"FAIL {failing.case}" in page.headings  # status as a word, not only an emoji
    text = (out / "index.html").read_text(encoding="utf-8")
    section = text[text.index(f"{failing.case}</h2>") :]
    # the chart first, then the worst findings (linking to it), then the full table folded
    assert section.index("<img") < section.index("Worst findings") < section.index("<details>")
    assert f'href="#{section.split("<figure id=")[1].split(chr(34))[1]}"' in section
    value = next(f.value for f in failing.findings if len(repr(f.value)) > 8)  # many digits
    assert f"<td>{value:.4g}</td>" in section and f"<td>{value!r}</td>" not in section

    markdown = (out / "summary.md").read_text(encoding="utf-8")
    assert markdown.startswith("## precision-suite: FAIL (1 failing, 1 passing)")
    assert f"`{failing.case}`" in markdown and "underflow regressed" in markdown


def test_cases_are_ordered_fail_error_drift_pass(tmp_path):
    made = [
        verdict(f"case-{status}", findings)
        for status, findings in (
            ("pass", []),
            ("drift", [Finding("case-drift", "drift", "loss", {}, 1.0, 2.0, 0.1, "better")]),
            ("error", [Finding("case-error", "error", "loss", {}, np.nan, np.nan, np.nan, "broken")]),
            ("fail", [Finding("case-fail", "threshold", "loss", {}, 3.0, 2.0, np.nan, "too high")]),
        )
    ]
    out = reports.write_report(made, tmp_path)
    summary = _strict_json(out / "summary.json")
    assert [c["status"] for c in summary["cases"]] == ["fail", "error", "drift", "pass"]
    assert summary["counts"] == {"fail": 1, "error": 1, "drift": 1, "pass": 1, "known": 0}
    nan_finding = summary["cases"][1]["findings"][0]
    assert nan_finding["value"] == "nan"  # JSON has no NaN; strict parsing above succeeded


def test_charts_all_draws_every_case_and_a_variant_overview(tmp_path):
    datasets = {
        ds.attrs["case"]: ds
        for ds in (make_run_dataset(attention="softmax"), make_run_dataset(attention="x/1", growth=2.0))
    }
    made = [verdict(case, []) for case in datasets]
    out = reports.write_report(made, tmp_path, datasets=datasets, charts="all")
    summary = _strict_json(out / "summary.json")
    assert all(len(c["charts"]) == 2 for c in summary["cases"])
    assert summary["overview_charts"] == [
        "charts/overview-vit-fp32-attention-norm.png",
        "charts/overview-vit-softmax-fp32-quant-error.png",
    ]
    referenced = {img["data-chart"] for img in _parse(out / "index.html").images}
    every_chart = {c for case in summary["cases"] for c in case["charts"]} | set(summary["overview_charts"])
    assert referenced == every_chart
    assert {p.relative_to(out).as_posix() for p in (out / "charts").iterdir()} == every_chart


def test_figure_b_overview_prefers_a_low_precision_run_and_needs_quant_metrics(tmp_path):
    fp32 = make_run_dataset(model="gpt", recipe="fp32")  # "gpt-softmax-fp32" sorts first
    fp8 = make_run_dataset(model="gpt", recipe="fp8-block")
    out = reports.write_report(
        [verdict(ds.attrs["case"], []) for ds in (fp32, fp8)],
        tmp_path / "a",
        datasets={ds.attrs["case"]: ds for ds in (fp32, fp8)},
    )
    assert _strict_json(out / "summary.json")["overview_charts"] == [
        f"charts/overview-{fp8.attrs['case']}-quant-error.png"
    ]
    unmeasured = fp8.copy(deep=True)
    unmeasured["underflow"][:] = np.nan  # a run without quantization metrics has no figure B
    out = reports.write_report(
        [verdict(fp8.attrs["case"], [])], tmp_path / "b", datasets={fp8.attrs["case"]: unmeasured}
    )
    assert _strict_json(out / "summary.json")["overview_charts"] == []


def test_missing_chart_file_is_reported_not_fatal(tmp_path):
    finding = Finding("c", "threshold", "loss", {}, 3.0, 2.0, np.nan, "too high")
    made = CaseVerdict("c", "fail", (finding,), (str(tmp_path / "gone.png"),))
    out = reports.write_report([made], tmp_path / "r")
    case = _strict_json(out / "summary.json")["cases"][0]
    assert case["charts"] == [] and case["missing_charts"] == [str(tmp_path / "gone.png")]
    assert "chart not found" in (out / "index.html").read_text(encoding="utf-8")


def test_case_ids_with_symbols_get_distinct_safe_file_names():
    names = {files.safe_filename(case) for case in ("vit-x^3/1-fp32", "vit-x^3_1-fp32", "vit-x3-1-fp32")}
    assert len(names) == 3
    assert all("/" not in name and "^" not in name for name in names)
    assert files.safe_filename("vit-x3-1-fp32") == "vit-x3-1-fp32"


def test_report_leaves_no_temp_files_and_html_escapes_messages(tmp_path):
    finding = Finding("<b>case</b>", "threshold", "loss", {}, 3.0, 2.0, np.nan, "a < b & c")
    out = reports.write_report([verdict("<b>case</b>", [finding])], tmp_path)
    text = (out / "index.html").read_text(encoding="utf-8")
    assert "<b>case</b>" not in text and "&lt;b&gt;case&lt;/b&gt;" in text
    assert "a &lt; b &amp; c" in text
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "summary.json", "summary.md"]


def test_new_report_dirs_are_distinct(tmp_path):
    first, second = reports.new_report_dir(tmp_path), reports.new_report_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="charts='some'"):
        reports.write_report([], tmp_path, charts="some")
    with pytest.raises(ValueError, match="unknown verdict status"):
        reports.write_report([CaseVerdict("c", "maybe")], tmp_path)


def test_summary_md_fits_a_ci_job_summary_with_the_worst_finding_per_case(tmp_path, monkeypatch):
    monkeypatch.setattr(reports, "MAX_MARKDOWN_BYTES", 4000)  # the real limit, 1 MiB, scaled down
    mild = Finding("big-case", "drift", "loss", {"step": 1}, 1.0, 1.1, 0.1, "mild drift", score=-5.5)
    worst = Finding(
        "big-case",
        "regression",
        "underflow",
        {"step": 2},
        0.3,
        0.01,
        5.0,
        "underflow regressed far",
        score=40.0,
    )
    many = [
        Finding("big-case", "drift", "loss", {"step": i}, 1.0, 1.1, 0.1, "x" * 600, score=-6.0)
        for i in range(40)
    ]
    out = reports.write_report([verdict("big-case", [mild, *many, worst])], tmp_path)
    text = (out / "summary.md").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= 4000
    assert text.startswith("## precision-suite: FAIL")
    table_row = next(line for line in text.splitlines() if line.startswith("| ❌"))
    assert "underflow regressed far" in table_row  # the worst finding, not the first
    assert "cut to fit a CI job summary" in text and "Full report:" in text
