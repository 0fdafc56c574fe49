"""Bad usage and the command line's defaults, shared by the command line and the jobs it calls.

A leaf importing nothing: the command line reads it while it parses its arguments (`--help`
answers before torch loads), and every job raises UsageError for what the user must fix.
"""

from __future__ import annotations

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2
DEFAULT_BASELINE_DIR = "baselines"
DEFAULT_REPORT_ROOT = "reports"
DEFAULT_RULES_FILE = "pyproject.toml"


class UsageError(Exception):
    """Bad usage or configuration: reported as one line, exit status 2."""
