"""Judging the data: baselines as files (read, write, compare), seed-ensemble statistics, threshold
rules, findings and verdicts, the judge, calibration statements. Imports numerics and training's
dataset schema; draws nothing."""
