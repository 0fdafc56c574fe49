"""Test-suite helpers shared by the test files (the plugin itself is loaded via its entry point)."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Print each benchmark as a ratio to its group's reference, measured in the same run.

    A benchmark marks itself as the reference with `benchmark.extra_info["reference"] = True`.
    Ratios of medians are what docs and closing notes quote: absolute times vary by machine.
    """
    session = getattr(config, "_benchmarksession", None)
    benchmarks = [b for b in getattr(session, "benchmarks", []) if getattr(b, "stats", None)]
    if not benchmarks or getattr(session, "disabled", True):
        return
    groups: dict[str, list] = {}
    for bench in benchmarks:
        groups.setdefault(bench.group or "", []).append(bench)
    terminalreporter.section("benchmark ratios (median / reference median)")
    for group, members in sorted(groups.items()):
        reference = next((b for b in members if b.extra_info.get("reference")), None)
        if reference is None:
            continue
        for bench in members:
            ratio = bench.stats.median / reference.stats.median
            terminalreporter.write_line(f"{group:24s} {bench.name:60s} {ratio:6.2f}x")


def pytest_configure(config: pytest.Config) -> None:
    # CI gets derandomized hypothesis runs: a red CI is reproducible, not a coin flip.
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    settings.register_profile("dev", deadline=None)
    import os

    settings.load_profile("ci" if os.environ.get("CI") else "dev")
