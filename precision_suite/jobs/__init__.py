"""Orchestration that the command line, the pytest plugin and `reproduce` share: selecting cases,
executing runs (serially, in a pool, on Dask), judging and reporting them, regenerating
baselines, calibrating, reproducing figures. May import every package below it.

This __init__ imports nothing, so that the command line can read the light modules (usage,
execution) while it parses its arguments without loading torch."""
