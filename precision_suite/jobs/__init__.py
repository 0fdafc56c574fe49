"""Orchestration that the command line and the pytest plugin share: selecting cases, executing
runs (serially, in a pool, on Dask), loading what a case is judged against, judging and
reporting, regenerating baselines, calibrating, reproducing figures, two commits compared and
bisected, the history store. May import every package below it.

This __init__ imports nothing, so that the command line can read the light modules (usage,
execution) while it parses its arguments without loading torch."""
