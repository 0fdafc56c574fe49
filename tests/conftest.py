"""Test-suite helpers shared by the test files (the plugin itself is loaded via its entry point)."""

from __future__ import annotations

import os
from unittest import mock

import pytest


@pytest.fixture(autouse=True)
def own_environment():
    """Every test starts from the session's environment: a command run in-process sets variables
    for the workers it spawns (a config's user recipes), which leaked into whichever test the
    random order ran next in the same worker."""
    with mock.patch.dict(os.environ):
        yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Print each benchmark as a ratio to its group's reference, measured in the same run, and
    whether it meets its goal.

    A benchmark marks itself as the reference with `benchmark.extra_info["reference"] = True`,
    names itself with `extra_info["subject"]` and states a goal (at most this many references)
    with `extra_info["goal"]`. Ratios of medians are what docs and closing notes quote: absolute
    times vary by machine.
    """
    session = getattr(config, "_benchmarksession", None)
    benchmarks = [b for b in getattr(session, "benchmarks", []) if getattr(b, "stats", None)]
    if not benchmarks or getattr(session, "disabled", True):
        return
    groups: dict[str, list] = {}
    for bench in benchmarks:
        groups.setdefault(bench.group or "", []).append(bench)
    terminalreporter.section("benchmark ratios (median / reference median, one run)")
    header = ("subject", "reference", "ratio", "goal", "met")
    rows = []
    for members in groups.values():
        reference = next((b for b in members if b.extra_info.get("reference")), None)
        if reference is None:
            continue
        ref_name = f"{_subject(reference)} ({reference.stats.median * 1e3:.1f} ms)"
        for bench in members:
            if bench is reference:
                continue
            ratio = bench.stats.median / reference.stats.median
            goal = bench.extra_info.get("goal")
            rows.append(
                (
                    _subject(bench),
                    ref_name,
                    f"{ratio:.2f}x",
                    f"<= {goal:g}x" if goal else "",
                    "" if goal is None else "yes" if ratio <= goal else "no",
                )
            )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        terminalreporter.write_line("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _subject(bench) -> str:
    return bench.extra_info.get("subject", bench.name)


def pytest_configure(config: pytest.Config) -> None:
    # CI gets derandomized hypothesis runs: a red CI is reproducible, not a coin flip.
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("dev", deadline=None)
    import os

    settings.load_profile("ci" if os.environ.get("CI") else "dev")
