"""Which seed figures `precision-suite reproduce` draws and where it writes them by default.

Names only, importing nothing: the command line lists the figures while it parses its arguments
(`--help`), before torch or matplotlib load; reports/paper_claims.py and jobs/figure_runs.py check names here.
"""

from __future__ import annotations

FIGURE_NAMES = ("figure-a", "figure-b")
DEFAULT_OUT = "reports/reproduce"


def check_figure(figure: str) -> None:
    """ValueError naming the figures, unless `figure` is one of them."""
    if figure not in FIGURE_NAMES:
        raise ValueError(f"unknown figure {figure!r}; choose one of {', '.join(FIGURE_NAMES)}")
