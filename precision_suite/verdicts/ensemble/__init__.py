"""Seed-ensemble baselines and the calibrated comparison of a run against them.

Short training is chaotic: after a few steps another CPU's rounding moves a run as far as another
seed does, so one reference trajectory cannot tell noise from change. A baseline therefore holds
K runs of its case that differ only in seed (dimension `seed`), and a run is judged two ways:

- **first point** (sampled step 0, training step 0) of a seed the ensemble holds: the seeded
  initialisation, deterministic up to rounding. It must match that member within the rounding
  noise measured when the baseline was made from its rounding twins: the same first step under
  every setting that changes only how kernels round (`jobs.twins`: ATen's unvectorized and
  narrower vector kernels, MKL's compatible path, 2 threads, eager), which is what another host
  changes too. Beyond it, a change in *either* direction fails: the computation itself changed,
  and the author regenerates on purpose. Counts (fractions times their elements) get a count
  model, since the elements that rounding moves sit on a quantization boundary, the more of them
  the more are counted: a count may move by `FIRST_STEP_SAFETY * k * sqrt(count + 1)` elements,
  `k` the largest such change the twins made in the case (at least `FIRST_STEP_FLIPS`). The sum
  of a count metric's changes over the case is held to the noise of that sum as well
  (`counts_moved_together`): rounding moves counts both ways, a wrong scale moves all one way.
- **trained points** (and every point of a seed outside the ensemble): against the ensemble's
  spread, per series (metric x layer x tensor x layout) in the metric's own space (`SPACES`).
  Each point's z is its distance from the K-seed mean in spreads; the variance of a point is the
  larger of its own K-seed variance and the pooled one: the seeds' variance beyond the count
  noise, averaged over every trained point of the same metric, tensor and layout (K is small:
  the pool has hundreds of degrees of freedom and keeps one quiet series from false-alarming),
  plus the floor (Poisson noise of the counted elements for fractions), so a change is as
  visible at 1e-5 as at 1e-2 once the same number of elements is counted.
  A series is judged by the **median of its trained points' z** (persistence). A seed's
  trajectory has excursions: a loss spike moves every layer at one step by tens of spreads
  (measured: docs/baselines.md, leave-one-seed-out), which no K-seed spread predicts; a change of
  the code moves the series at most of its steps. The median ignores fewer than half of the
  points, whatever they do, and shifts fully with a systematic change. Its band is Bonferroni-
  corrected over the case's series (`trained_threshold`), so the false-alarm rate of the whole
  case is at most `FALSE_ALARM_RATE` under the Gaussian model of each point, whatever the
  correlation between the points of one trajectory (measured, not assumed: docs/baselines.md).
  A new NaN/Inf where every seed measured a number fails at any point.
- **trained points, case level**: a change that moves every series of a metric a little, each
  within its band, moves the mean of their median z by as much while the series' own noise
  averages out (`case_mean_z`). Its band is a Student t quantile times the spread of that mean
  over runs that differ by seed alone, measured at regeneration (held-out seeds
  `MEAN_Z_HELD_OUT_SEEDS` and each member left out of the others; `trained_mean_z_spread`), not
  assumed: the series of one trajectory move together (a loss spike moves every layer).

Modules, in dependency order: `series` (an ensemble dataset, a metric's series of a run against
it in the comparison space, their spread and the findings about their points), `first_point`
(the deterministic point check and the rounding tolerance it is held to, measured from the
twins), `compare` (`compare_ensemble`: every check above on one run), `build` (the ensemble
baseline made from its runs) and `power` (the smallest change the comparison detects).
"""
