"""Judging the data: findings and verdicts, baseline files, the single-run and the seed-ensemble
comparisons, stored replays, threshold rules and the operand invariant, the one judge, history
records and their steps, the false-alarm statement. Imports numerics and training's dataset
schema; draws nothing."""
