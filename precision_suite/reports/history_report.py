"""The history report: per host and case, the headline series over commits and their steps, in the
folder layout of the run reports (reports.py): a self-contained `index.html`, `summary.md` for a CI
job summary, `summary.json` for machines, `charts/<case>-<host>-history.png`."""

from __future__ import annotations

import datetime as _dt
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from precision_suite.files import safe_filename
from precision_suite.reports.history_chart import plot_history
from precision_suite.reports.reports import (
    CSS,
    MAX_MARKDOWN_BYTES,
    figure_html,
    jsonable,
    markdown_cell,
    write_text,
)
from precision_suite.verdicts.ensemble.series import FALSE_ALARM_RATE
from precision_suite.verdicts.history_steps import CaseHistory, Step
from precision_suite.version import __version__

HISTORY_SUMMARY_SCHEMA_VERSION = 1


def chart_name(case: CaseHistory) -> str:
    return f"charts/{safe_filename(case.case)}-{case.host}-history.png"


def write_history_report(cases: Sequence[CaseHistory], out: Path, *, charts: str = "all") -> dict[str, Any]:
    """Write the report folder; the summary (as summary.json holds it). `charts`: "all" draws every
    case, "failing" the cases with a step, "none" no chart."""
    drawn = {}
    for case in cases:
        if charts == "all" or (charts == "failing" and case.steps):
            plot_history(case, out / chart_name(case))
            drawn[case.case, case.host] = chart_name(case)
    summary = {
        "schema_version": HISTORY_SUMMARY_SCHEMA_VERSION,
        "package_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "steps": sum(len(c.steps) for c in cases),
        "false_step_rate": FALSE_ALARM_RATE,  # per case, by design (verdicts/history_steps.py)
        "cases": [
            {
                "case": c.case,
                "host": c.host,
                "host_label": c.host_label,
                "commits": c.commits,
                "series": len(c.series),
                "searched": sum(s.noise > 0 for s in c.series),
                "steps": [_step_json(step, c) for step in c.steps],
                "chart": drawn.get((c.case, c.host)),
            }
            for c in sorted(cases, key=lambda c: (not c.steps, c.case, c.host))
        ],
    }
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "summary.json", json.dumps(jsonable(summary), indent=2) + "\n")
    write_text(out / "summary.md", _markdown(summary, out))
    write_text(out / "index.html", _html(summary, out))
    return summary


def _step_json(step: Step, case: CaseHistory) -> dict[str, Any]:
    commit = case.commits[step.index]
    return {
        "series": step.series,
        "kind": step.kind,
        "metric": step.metric,
        "where": step.where,
        "commit": commit["commit"],
        "subject": commit["subject"],
        "commit_time": commit["commit_time"],
        "before": step.before,
        "after": step.after,
        "size_in_noise": step.size,
        "text": step.describe(),
    }


def _headline(summary: dict) -> str:
    stepped = sum(bool(c["steps"]) for c in summary["cases"])
    return (
        f"precision-suite history: {summary['steps']} step(s) in {stepped} of {len(summary['cases'])} case(s)"
    )


def _span(case: dict) -> str:
    commits = case["commits"]
    return f"{len(commits)} commits, {commits[0]['commit'][:7]} to {commits[-1]['commit'][:7]}"


def _markdown(summary: dict, out: Path) -> str:
    lines = [
        f"## {_headline(summary)}",
        "",
        "| case | host | commits | steps | largest step |",
        "|---|---|---|---|---|",
    ]
    for case in summary["cases"]:
        largest = case["steps"][0] if case["steps"] else None
        text = f"`{largest['commit'][:7]}` {largest['subject']}: {largest['text']}" if largest else ""
        lines.append(
            f"| `{markdown_cell(case['case'])}` | {markdown_cell(case['host_label'])} | {_span(case)} | "
            f"{len(case['steps'])} | {markdown_cell(text)} |"
        )
    for case in summary["cases"]:
        if not case["steps"]:
            continue
        lines += ["", f"### `{case['case']}` ({case['host_label']})", ""]
        lines += [f"- `{s['commit'][:12]}` {markdown_cell(s['subject'])}: {s['text']}" for s in case["steps"]]
        if case["chart"]:
            lines.append(f"- chart: `{out / case['chart']}`")
    text = "\n".join(lines + ["", f"Full report: `{out / 'index.html'}`", ""])
    if len(text.encode("utf-8")) > MAX_MARKDOWN_BYTES:  # GitHub's job-summary limit
        text = text.encode("utf-8")[: MAX_MARKDOWN_BYTES - 200].decode("utf-8", errors="ignore")
        text = text[: text.rfind("\n")] + "\n\n(cut to fit a CI job summary: every step is in summary.json)\n"
    return text


def _html(summary: dict, out: Path) -> str:
    esc = html.escape
    links = "".join(
        f'<span><a href="#case-{i}">{esc(c["case"])}</a> ({len(c["steps"])})</span>'
        for i, c in enumerate(summary["cases"])
    )
    sections = []
    for i, case in enumerate(summary["cases"]):
        rows = "".join(
            f"<tr><td><code>{esc(s['commit'][:12])}</code></td><td>{esc(s['subject'])}</td><td>{esc(s['series'])}</td>"
            f"<td>{s['before']:.4g}</td><td>{s['after']:.4g}</td><td>{s['size_in_noise']:+.1f}</td></tr>"
            for s in case["steps"]
        )
        table = (
            "<table><tr><th>commit</th><th>subject</th><th>series</th><th>before</th><th>after</th>"
            f"<th>size (noise units)</th></tr>{rows}</table>"
            if rows
            else "<p>No step.</p>"
        )
        chart = figure_html(out, case["chart"]) if case["chart"] else ""
        status = "fail" if case["steps"] else "pass"
        sections.append(
            f'<section id="case-{i}"><h2 class="{status}">{esc(case["case"])}</h2>'
            f'<p class="meta">{esc(case["host_label"])} (host {esc(case["host"])}); {esc(_span(case))}; '
            f"{case['searched']} of {case['series']} series searched for steps (the others have no noise "
            f"level: no baseline); by design a case shows a false step with probability at most "
            f"{summary['false_step_rate']:g}</p>"
            f"{table}{chart}</section>"
        )
    headline = esc(_headline(summary))
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{headline}</title>'
        f"<style>{CSS}</style></head><body><h1>{headline}</h1>"
        f'<p class="meta">Created {esc(summary["created"])} by precision-suite {esc(summary["package_version"])}. '
        f"Machine-readable: <code>summary.json</code>. Cases with their number of steps:</p>"
        f'<nav class="cases">{links}</nav>{"".join(sections)}</body></html>\n'
    )
