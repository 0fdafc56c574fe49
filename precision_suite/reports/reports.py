"""Report directories: what a person opens when a numerics check fails.

`write_report` turns case verdicts (findings.CaseVerdict) into one folder:

- `index.html`: self-contained (every chart embedded as a data URI), opens from disk or as a CI
  artifact; failing, erroring and drifting cases first, then the passing ones.
- `summary.md`: short Markdown for a CI job summary (`cat summary.md >> $GITHUB_STEP_SUMMARY`).
- `summary.json`: machine-readable: every case, its status, findings and chart paths (relative
  to the report folder).
- `charts/`: the PNG files the other three refer to.

Verdicts are read by attribute (case, status, findings, charts) and findings by their fields
(docs/architecture.md), so this module does not import the run machinery.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import xarray as xr

from precision_suite.files import atomic_file
from precision_suite.reports.report_charts import adopt_charts, draw_case_charts, draw_overviews
from precision_suite.verdicts.alarm_statement import statement_lines
from precision_suite.verdicts.findings import CHART_CHOICES, severity
from precision_suite.version import __version__

STATUS_ORDER = ("fail", "error", "known", "drift", "pass")  # report order: what needs a person first
STATUS_BADGE = {
    "fail": "❌ fail",
    "error": "⚠️ error",
    "known": "🔷 known violation",
    "drift": "🔶 drift",
    "pass": "✅ pass",
}
SUMMARY_SCHEMA_VERSION = 1
MAX_FINDINGS_IN_MARKDOWN = 10  # per case; the full list is in summary.json and index.html
MAX_MARKDOWN_BYTES = 1024 * 1024  # GitHub's job-summary limit: summary.md must fit
MAX_WORST_FINDINGS = 5  # listed under a case's charts; the full table is folded below them
STATUS_WORD = {"fail": "FAIL", "error": "ERROR", "known": "KNOWN", "drift": "DRIFT", "pass": "PASS"}


@dataclass(frozen=True)
class _CaseEntry:
    verdict: object
    charts: tuple[str, ...]  # paths relative to the report folder
    missing_charts: tuple[str, ...]  # chart paths a verdict named that do not exist


def new_report_dir(root: str | Path = "reports") -> Path:
    """Create and return a fresh `root/<UTC timestamp>` folder (suffixed if one already exists)."""
    root = Path(root)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    for attempt in range(1, 1000):
        candidate = root / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a new report folder under {root}; clean it up")


def write_report(
    verdicts: Sequence,
    out_dir: str | Path,
    datasets: Mapping[str, xr.Dataset] | None = None,
    charts: str = "failing",
    known: Mapping[str, str] | None = None,
    sensitivity: Mapping | None = None,
    title: str = "",
    context: Sequence[str] = (),
) -> Path:
    """Write index.html, summary.md, summary.json (and charts/) into `out_dir`; return `out_dir`.

    `datasets` maps case -> current run dataset; with it, figure A and figure B charts are drawn
    for each failing/drifting/erroring case (`charts="failing"`) or every case (`charts="all"`),
    and always the overview: figure A per model and recipe across variants, figure B once;
    `charts="none"` draws nothing (the verdicts and tables only). Chart files named by the
    verdicts (drift charts) are copied into the folder so that it stands alone.
    `known` maps a case to the reason its failure is a known violation (shown beside it).
    `sensitivity` states how trustworthy the comparison is: `design_false_alarm_rate`, `measured`
    (what `precision-suite calibrate` counted on these baselines, or None) and
    `detectable_change` ({case: {metric: text}}).
    """
    if charts not in CHART_CHOICES:
        raise ValueError(f"write_report: charts={charts!r}; use one of {', '.join(CHART_CHOICES)}")
    unknown = sorted({str(v.status) for v in verdicts} - set(STATUS_ORDER))
    if unknown:
        raise ValueError(f"write_report: unknown verdict status {unknown}; expected {STATUS_ORDER}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    datasets = datasets or {}

    ordered = sorted(verdicts, key=lambda v: (STATUS_ORDER.index(v.status), v.case))
    entries = []
    for verdict in ordered:
        adopted, missing = adopt_charts(out, verdict.case, verdict.charts)
        dataset = datasets.get(verdict.case)
        if dataset is not None and charts != "none" and (charts == "all" or verdict.status != "pass"):
            adopted += draw_case_charts(out, verdict.case, dataset)
        entries.append(_CaseEntry(verdict, tuple(adopted), tuple(missing)))
    # figures A and B, unless no chart is wanted: they are the picture
    drawn = {path for entry in entries for path in entry.charts}
    overview = draw_overviews(out, datasets, drawn) if charts != "none" else []

    known = {**{v.case: v.known for v in verdicts if getattr(v, "known", "")}, **(known or {})}
    summary = _summary(
        entries,
        overview,
        known,
        {case: str(ds.attrs.get("quantized_by", "")) for case, ds in datasets.items()},
    )
    summary["sensitivity"] = jsonable(dict(sensitivity)) if sensitivity else None
    # what the report compares, said first (`diff`: HEAD and BASE with their commits, the gate)
    summary["title"], summary["context"] = title, list(context)
    write_text(out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    write_text(out / "summary.md", _markdown(summary, out))
    write_text(out / "index.html", _html(summary, out))
    return out


def overall_status(statuses: Sequence[str]) -> str:
    """The worst status among `statuses` ("pass" for none)."""
    return min(statuses, key=STATUS_ORDER.index, default="pass")


# --------------------------------------------------------------------------- summary


def jsonable(value):
    """Plain JSON values; NaN/Inf become the strings "nan"/"inf"/"-inf" (JSON has no NaN)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _summary(
    entries: Sequence[_CaseEntry],
    overview: Sequence[str],
    known: Mapping[str, str],
    quantized_by: Mapping[str, str],
) -> dict:
    # known violations are listed with their status but do not set the overall verdict
    statuses = [str(e.verdict.status) for e in entries if e.verdict.case not in known]
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "package_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "overall": overall_status(statuses),
        "counts": {
            **{status: statuses.count(status) for status in STATUS_ORDER},
            "known": sum(e.verdict.case in known for e in entries),
        },
        "overview_charts": list(overview),
        "cases": [
            {
                "case": e.verdict.case,
                "status": e.verdict.status,
                "findings": [jsonable(f) for f in e.verdict.findings],
                "charts": list(e.charts),
                "missing_charts": list(e.missing_charts),
                "known_violation": known.get(e.verdict.case),
                # what quantized the run, when the model's own code did (training/observation.py)
                "quantized_by": quantized_by.get(e.verdict.case, ""),
            }
            for e in entries
        ],
    }


def _headline(summary: dict) -> str:
    counts = summary["counts"]
    parts = [
        f"{counts[s]} {word}"
        for s, word in (
            ("fail", "failing"),
            ("error", "erroring"),
            ("drift", "drifting"),
            ("pass", "passing"),
            ("known", "known violations"),
        )
        if counts[s]
    ]
    what = summary.get("title") or "precision-suite"
    return f"{what}: {summary['overall'].upper()} ({', '.join(parts) or 'no cases'})"


def markdown_cell(text: object) -> str:
    """`text` as one cell of a Markdown table: pipes escaped, on one line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _markdown(summary: dict, out: Path) -> str:
    lines = [
        f"## {_headline(summary)}",
        "",
        *(f"{line}  " for line in summary.get("context", ())),
        *([""] if summary.get("context") else []),
        "| status | case | findings | worst finding |",
        "|---|---|---|---|",
    ]
    for case in summary["cases"]:
        worst = _worst(case["findings"])
        first = worst[0]["message"] if worst else ""
        badge = STATUS_BADGE[case["status"]] + (" (known)" if case["known_violation"] else "")
        lines.append(
            f"| {badge} | `{markdown_cell(case['case'])}` | "
            f"{len(case['findings'])} | {markdown_cell(first)} |"
        )
    for case in summary["cases"]:
        if case["status"] == "pass":
            continue
        lines += ["", f"### {STATUS_BADGE[case['status']]} `{case['case']}`", ""]
        if case["known_violation"]:
            lines.append(f"- known violation, not failing the run: {case['known_violation']}")
        if case.get("quantized_by"):
            lines.append(f"- quantized by the model's own code: {case['quantized_by']}")
        shown = _worst(case["findings"], MAX_FINDINGS_IN_MARKDOWN)
        lines += [f"- {f['message']}" for f in shown]
        if len(case["findings"]) > len(shown):
            lines.append(f"- ... and {len(case['findings']) - len(shown)} more (see summary.json)")
        lines += [f"- chart: `{out / path}`" for path in case["charts"]]
    lines += ["", *(f"{line}  " for line in _sensitivity_lines(summary.get("sensitivity")))]
    tail = ["", f"Full report: `{out / 'index.html'}` (self-contained; open it in a browser)", ""]
    text = "\n".join(lines + tail)
    if len(text.encode("utf-8")) <= MAX_MARKDOWN_BYTES:
        return text
    # the headline and table first; the per-case details are cut to fit a CI job summary
    cut = "\n\n(cut to fit a CI job summary of 1 MiB: every finding is in summary.json)\n"
    budget = MAX_MARKDOWN_BYTES - len(("\n".join(tail) + cut).encode("utf-8"))
    kept = text.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
    return kept[: kept.rfind("\n")] + cut + "\n".join(tail)


def _sensitivity_lines(sensitivity: Mapping | None) -> list[str]:
    if not sensitivity:
        return []
    return statement_lines(sensitivity.get("measured"), sensitivity["design_false_alarm_rate"])


# --------------------------------------------------------------------------- HTML

# A case shows its charts and, beside them, its worst findings, so that the first screen of a
# failing report holds the verdict, the failing case's chart and what is wrong (tests/test_browser.py).
CSS = """
body{font-family:system-ui,sans-serif;margin:1em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.6em;margin:.2em 0}h2{font-size:1.3em;margin:.8em 0 .4em}h3{font-size:1.05em;margin:.2em 0}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f3f3f3}.fail{color:#b00020}.error{color:#b36b00}
.drift{color:#a05a00}.pass{color:#1b7a2e}figure{margin:0 0 1em}img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.85em;color:#555}code{background:#f6f6f6;padding:0 .2em}.meta{color:#555;margin:.2em 0}
.badge{display:inline-block;min-width:4.5em;padding:.05em .5em;border-radius:.3em;color:#fff;
font-weight:600;text-align:center;font-size:.9em}.badge.fail{background:#b00020}
.badge.error{background:#b36b00}.badge.known{background:#3a5fa8}.badge.drift{background:#a05a00}
.badge.pass{background:#1b7a2e}details{margin:.5em 0}nav.cases{line-height:2}
nav.cases span{white-space:nowrap;margin-right:1em}
.case{display:grid;grid-template-columns:minmax(0,3fr) minmax(16em,2fr);gap:1em;align-items:start}
.worst{position:sticky;top:0}.worst ul{margin:.3em 0;padding-left:1.2em}.worst li{margin:.3em 0}
@media (max-width:60em){.case{grid-template-columns:1fr}}
"""

_MIME = {".png": "image/png", ".svg": "image/svg+xml"}


def figure_html(out: Path, rel: str, anchor: str = "") -> str:
    path = out / rel
    mime = _MIME.get(path.suffix.lower())
    ident = f' id="{html.escape(anchor)}"' if anchor else ""
    if mime is None:
        return f'<p{ident}><a href="{html.escape(rel)}">{html.escape(rel)}</a></p>'
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f'<figure{ident}><img src="data:{mime};base64,{data}" alt="{html.escape(rel)}" '
        f'data-chart="{html.escape(rel)}"><figcaption>{html.escape(rel)}</figcaption></figure>'
    )


def _number(value: object) -> str:
    """4 significant digits for floats (a report is read, not parsed: summary.json keeps all)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _badge(status: str) -> str:
    return f'<span class="badge {html.escape(status)}">{STATUS_WORD[status]}</span>'


def _worst(findings: Sequence[dict], limit: int = MAX_WORST_FINDINGS) -> list[dict]:
    """Findings that block first, then the largest distance from the band (`score`)."""
    return sorted(
        findings,
        key=lambda f: severity(f.get("kind"), f.get("score"), f.get("known", ""), f.get("tolerance")),
    )[:limit]


def _findings_table(findings: Sequence[dict], chart_link: str = "") -> str:
    """Every finding, numbers to 4 significant digits; `chart_link` (HTML) ends each row."""
    if not findings:
        return "<p>No findings.</p>"
    link_cell = f"<td>{chart_link}</td>" if chart_link else ""
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(_number(v))}</td>"
            for v in (
                f.get("kind"),
                f.get("metric"),
                ", ".join(f"{k}={v}" for k, v in (f.get("where") or {}).items()),
                f.get("value"),
                f.get("reference"),
                f.get("tolerance"),
                f.get("message"),
            )
        )
        + link_cell
        + "</tr>"
        for f in findings
    )
    return (
        "<table><tr><th>kind</th><th>metric</th><th>where</th><th>value</th>"
        f"<th>reference</th><th>tolerance</th><th>message</th>{'<th></th>' if chart_link else ''}"
        f"</tr>{rows}</table>"
    )


def _case_html(out: Path, i: int, case: dict) -> str:
    """A case: its charts first, then its worst findings (each linking to the chart), then the
    full table folded."""
    esc = html.escape
    anchors = [f"case-{i}-chart-{j}" for j in range(len(case["charts"]))]
    charts = "".join(figure_html(out, rel, anchor) for rel, anchor in zip(case["charts"], anchors))
    link = f'<a href="#{anchors[0]}">chart</a>' if anchors else ""
    worst = "".join(
        f"<li>{esc(f.get('message', ''))}{f' ({link})' if link else ''}</li>"
        for f in _worst(case["findings"])
    )
    missing = "".join(
        f'<p class="error">chart not found: <code>{esc(p)}</code></p>' for p in case["missing_charts"]
    )
    worst_list = f"<h3>Worst findings</h3><ul>{worst}</ul>" if case["findings"] else "<p>No findings.</p>"
    table = (
        f"<details><summary>All {len(case['findings'])} findings</summary>"
        f"{_findings_table(case['findings'], link)}</details>"
        if case["findings"]
        else ""
    )
    known = (
        f"<p>Known violation, not failing the run: {esc(case['known_violation'])}</p>"
        if case["known_violation"]
        else ""
    )
    if case.get("quantized_by"):
        known += f'<p class="meta">Quantized by the model\'s own code: {esc(case["quantized_by"])}</p>'
    body = (
        f'<div class="case"><div class="charts">{charts}{missing}</div>'
        f'<aside class="worst">{worst_list}</aside></div>'
        if charts or missing
        else worst_list
    )
    return (
        f'<section id="case-{i}"><h2 class="{esc(case["status"])}">{_badge(case["status"])} '
        f"{esc(case['case'])}</h2>{known}{body}{table}</section>"
    )


def _html(summary: dict, out: Path) -> str:
    esc = html.escape
    # one wrapped line of links rather than a table: ten cases must not push the first failing
    # case off the first screen
    case_links = "".join(
        f'<span>{_badge(c["status"])} <a href="#case-{i}">{esc(c["case"])}</a> ({len(c["findings"])})</span>'
        for i, c in enumerate(summary["cases"])
    )
    sections = [_case_html(out, i, case) for i, case in enumerate(summary["cases"])]
    overview = "".join(figure_html(out, rel) for rel in summary["overview_charts"])
    overview_section = (
        f"<section><h2>Overview: attention norm across variants (figure A), "
        f"quantization error per layer (figure B), accumulation error against K</h2>"
        f"{overview}</section>"
        if overview
        else ""
    )
    sensitivity = summary.get("sensitivity") or {}
    detectable = "".join(
        f"<tr><td>{esc(case)}</td><td>{esc(metric)}</td><td>{esc(text)}</td></tr>"
        for case, changes in (sensitivity.get("detectable_change") or {}).items()
        for metric, text in changes.items()
    )
    sensitivity_section = (
        (
            "<section><h2>Sensitivity of the comparison</h2>"
            + "".join(f"<p>{esc(line)}</p>" for line in _sensitivity_lines(sensitivity))
            + (
                f"<details><summary>Smallest change detected, per case and metric</summary><table>"
                f"<tr><th>case</th><th>metric</th><th>smallest detected change</th></tr>{detectable}"
                f"</table></details>"
                if detectable
                else ""
            )
            + "</section>"
        )
        if sensitivity
        else ""
    )
    headline = esc(_headline(summary))
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{headline}</title><style>{CSS}</style></head><body>"
        f'<h1 class="{esc(summary["overall"])}">{_badge(summary["overall"])} {headline}</h1>'
        + "".join(f'<p class="context">{esc(line)}</p>' for line in summary.get("context", ()))
        + f'<p class="meta">Created {esc(summary["created"])} by precision-suite '
        f"{esc(summary['package_version'])}. Machine-readable: <code>summary.json</code>. "
        f'Cases with their number of findings:</p><nav class="cases">{case_links}</nav>'
        f"{''.join(sections)}{overview_section}{sensitivity_section}</body></html>\n"
    )


def write_text(path: Path, text: str) -> None:
    with atomic_file(path) as handle:
        handle.write(text.encode("utf-8"))
