"""The power of the comparison: per metric, the smallest change of a case's series that it
detects, and the first-point tolerance, as readable text for reports (`detectable_change`)."""

from __future__ import annotations

import json
import math

import numpy as np
import xarray as xr

from precision_suite.numerics.metric_table import SPACES
from precision_suite.verdicts.ensemble.compare import mean_z_band
from precision_suite.verdicts.ensemble.first_point import FIRST_STEP_FLIPS, FIRST_STEP_SAFETY, count_allowance
from precision_suite.verdicts.ensemble.series import (
    all_series,
    describe_change,
    n_statistics,
    spread,
    trained_threshold,
)

DETECTABLE_MIN_COUNT = 10  # detectable_change reports count series from this many elements up


def detectable_change(current: xr.Dataset, ensemble: xr.Dataset) -> dict[str, str]:
    """Per metric, the median over series of the smallest shift of every trained point that
    the comparison flags, and the first-point tolerance, as readable text. For counts, only the
    series that count at least DETECTABLE_MIN_COUNT elements: below that, count noise alone
    hides any factor (a series of zeros has no change to detect)."""
    tol0 = json.loads(ensemble.attrs["first_step_tolerance"])
    count_noise = json.loads(ensemble.attrs["first_step_count_noise"])
    mean_z = json.loads(ensemble.attrs.get("trained_mean_z_spread", "{}"))
    case_series = all_series(current, ensemble)
    z = trained_threshold(n_statistics(case_series))
    out = {}
    for s in case_series:
        mean, sd = spread(s, 1)
        trained, counted = (sd[:, 1:], mean[:, 1:]) if sd.shape[1] > 1 else (sd, mean)
        space = SPACES[s.metric]
        where = ""
        if space.is_count:
            trained = np.where(counted >= math.log(DETECTABLE_MIN_COUNT + 0.5), trained, np.nan)
            where = f" (series counting >= {DETECTABLE_MIN_COUNT} elements)"
        if np.isfinite(trained).any():
            text = f"{describe_change(space, z * float(np.nanmedian(trained)), signed=False)}{where}"
        else:
            text = f"no series counts {DETECTABLE_MIN_COUNT} elements"
        if space.is_count:
            k = float(count_noise.get(s.metric, 0.0))
            first = (
                f"±max({FIRST_STEP_FLIPS:g}, {FIRST_STEP_SAFETY * k:.3g} x sqrt(count + 1)) elements "
                f"(1 element: ±{float(count_allowance(k, 1.0)):.3g}; 10^4: ±{float(count_allowance(k, 1e4)):.3g})"
            )
        else:
            first = describe_change(space, float(tol0.get(s.metric, 0.0)), signed=False)
        together = ""
        if s.metric in mean_z and mean_z[s.metric][0] > 0:
            band = mean_z_band(mean_z[s.metric][0], int(mean_z[s.metric][1]), len(mean_z))
            together = f", or every series by {band:.2f} spreads (case level)"
        out[s.metric] = f"trained points: {text} ({z:.1f} spreads){together}; first point: {first}"
    return out
