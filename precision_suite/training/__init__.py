"""Training runs that produce the data: attention variants, shipped data, models, recipes, probes,
the recorder and its dataset views, RunSpec and run, the default case matrix. Imports numerics
(and the leaf modules files and version) only."""
