"""The commands of `precision-suite`, one function each, called by cli.py with its parsed flags."""

from __future__ import annotations

from precision_suite.jobs.checking import compare_results, report_results, run_cases  # noqa: F401
from precision_suite.jobs.figure_runs import reproduce_figure  # noqa: F401
from precision_suite.jobs.first_bad_commit import bisect_commits  # noqa: F401
from precision_suite.jobs.history_store import record_results, report_history  # noqa: F401
from precision_suite.jobs.regenerate import update_baselines  # noqa: F401
from precision_suite.jobs.selection import Selection  # noqa: F401
from precision_suite.jobs.two_commits import diff_commits  # noqa: F401
