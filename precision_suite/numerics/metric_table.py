"""The one table of metrics: every recorded metric is declared here, once.

A declaration says what the metric is (CF-style `long_name`, `units`, `valid_range`, written
into the dataset's variable attributes), which direction is bad, and how the calibrated
comparison treats it (`Space`: the transform into the space where seeds spread evenly, its
inverse, whether the metric counts elements, and the smallest spreads). Datasets, the ensemble
comparison, the single-run tolerances, history records and charts all read it; definitions follow
../shared/SCIENCE.md. Like Transformer Engine's debug-stats table: adding a metric is one row here,
plus its computation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# spread of Anscombe's 2 sqrt(count + 3/8) for Poisson counts, at any level (Space.detection)
POISSON_SPREAD = 1.0


@dataclass(frozen=True)
class Space:
    """How a metric is compared against a seed ensemble: y = transform(value).

    kind: "log" (ln value: norms, losses), "log_count" (ln(count + 1/2): fractions of counted
      elements, Poisson-like noise 1/sqrt(count)), "log_one_minus" (ln(1 - value): the relative
      error energy of a cosine similarity), "db" (the value, already logarithmic).
    min_spread: the smallest spread in y (a deterministic series has none of its own).
    first_step_floor: the smallest first-point tolerance in y (rounding on other CPUs).
    """

    kind: str
    min_spread: float
    first_step_floor: float

    @property
    def is_count(self) -> bool:
        """Fractions of counted elements and counts: their noise is the count's, not the value's."""
        return self.kind == "log_count"

    @property
    def rises_with_value(self) -> bool:
        """Whether y rises as the value does: ln(1 - cos) falls as the cosine rises."""
        return self.kind != "log_one_minus"

    def transform(self, values: np.ndarray, numel: np.ndarray | None = None) -> np.ndarray:
        """Values in the comparison space (non-finite where the value is not comparable); a
        fraction's elements `numel` turn it into a count."""
        v = np.asarray(values, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.kind == "log":
                y = np.log(v)
            elif self.kind == "log_count":  # ln(count + 1/2): Poisson-like noise 1/sqrt(count) in y
                y = np.log(v * (1.0 if numel is None else numel) + 0.5)
            elif self.kind == "log_one_minus":  # 1 - cos: the relative error energy
                y = np.log(np.maximum(1.0 - v, 1e-15))
            else:
                y = v
        return np.where(np.isnan(v), np.nan, y)

    def inverse(self, y: np.ndarray, numel: np.ndarray | None = None) -> np.ndarray:
        """The values whose transform is `y`."""
        with np.errstate(over="ignore", invalid="ignore"):
            if self.kind == "log":
                return np.exp(y)
            if self.kind == "log_count":
                return (np.exp(y) - 0.5) / (1.0 if numel is None else numel)
            if self.kind == "log_one_minus":
                return 1.0 - np.exp(y)
            return y

    def floor_variance(self, mean_y: np.ndarray) -> np.ndarray:
        """The smallest variance of a point whose mean in the comparison space is `mean_y`:
        min_spread squared, plus the Poisson noise of the counted elements for counts."""
        floor = np.full_like(mean_y, self.min_spread**2)
        if self.is_count:
            with np.errstate(over="ignore", invalid="ignore"):
                floor = floor + np.exp(-mean_y)  # var ln(c + 1/2) ~ 1/(c + 1/2)
        return floor

    def detection(self, values: np.ndarray, numel: np.ndarray | None = None) -> np.ndarray:
        """Values where a history seeks steps: the comparison space, except counts, which take
        Anscombe's variance-stabilising 2 sqrt(count + 3/8). A count that steps from zero is the
        commonest regression (a block scale that flushes a tile), and ln(count + 1/2) makes the
        Poisson noise at zero look as large as a tenfold change; here Poisson noise has spread
        POISSON_SPREAD at every level."""
        v = np.asarray(values, dtype=np.float64)
        if not self.is_count:
            return self.transform(v)
        count = v * (1.0 if numel is None else np.asarray(numel, dtype=np.float64))
        with np.errstate(invalid="ignore"):
            return 2.0 * np.sqrt(np.maximum(count, 0.0) + 0.375)

    @property
    def detection_min_spread(self) -> float:
        """The smallest noise level of a series in the detection space."""
        return POISSON_SPREAD if self.is_count else self.min_spread


@dataclass(frozen=True)
class Metric:
    """One recorded metric. `bad` is the direction that is a regression ("up", "down"), None
    for metrics that are recorded but never compared (mse scales with the tensor and duplicates
    sqnr_db; batch accuracy moves in steps of 1/batch and duplicates loss). A metric with a `bad`
    direction and no `space` is an invariant the verdict checks on its own, never against a
    baseline (operand_mismatch must be zero)."""

    name: str
    long_name: str
    units: str  # CF units: "1" for a dimensionless quantity or fraction
    axis_label: str  # y-axis label of charts
    valid_range: tuple[float, float] | None
    bad: str | None
    space: Space | None
    description: str
    counted_by: str = "numel"  # the variable of the elements behind a fraction (log_count spaces)

    @property
    def is_count(self) -> bool:
        """Whether the metric counts elements (a fraction of them, or a count), by its space."""
        return self.space is not None and self.space.is_count

    @property
    def bad_sign(self) -> float:
        """+1 where a rise of y = space.transform(value) is a regression, -1 where a fall is."""
        sign = 1.0 if self.bad == "up" else -1.0
        return sign if self.space is None or self.space.rises_with_value else -sign

    def attrs(self) -> dict[str, object]:
        """CF-style attributes of the dataset variable holding this metric."""
        out: dict[str, object] = {
            "long_name": self.long_name,
            "units": self.units,
            "description": self.description,
        }
        if self.valid_range is not None:
            out["valid_min"], out["valid_max"] = self.valid_range
        return out


_FRACTION = (0.0, 1.0)

METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "attention_norm",
            "attention matrix Frobenius norm",
            "1",
            "Frobenius norm of φ(S), mean over heads",
            (0.0, float("inf")),
            "up",
            Space("log", 1e-3, 1e-3),
            "Frobenius norm of each head's N x N attention matrix phi(S), mean over heads and batch",
        ),
        Metric(
            "underflow",
            "underflow fraction",
            "1",
            "fraction of elements (non-zero → zero)",
            _FRACTION,
            "up",
            Space("log_count", 0.0, 0.0),
            "fraction of elements non-zero before and zero after quantization (Transformer Engine underflows%)",
        ),
        Metric(
            "zeros_after",
            "zero fraction after quantization",
            "1",
            "fraction of elements zero after",
            _FRACTION,
            "up",
            Space("log_count", 0.0, 0.0),
            "fraction of elements zero after quantization (the Ling 2.0 paper's count)",
        ),
        Metric(
            "overflow",
            "overflow fraction",
            "1",
            "fraction of elements saturated",
            _FRACTION,
            "up",
            Space("log_count", 0.0, 0.0),
            "fraction of elements saturated at the format maximum or non-finite after quantization",
        ),
        Metric(
            "distortion",
            "quantization distortion (cosine similarity)",
            "1",
            "cosine similarity",
            (-1.0, 1.0),
            "down",
            Space("log_one_minus", 1e-2, 1e-2),
            "cosine similarity of the tensor and its quantize-dequantize reconstruction",
        ),
        Metric(
            "sqnr_db",
            "signal to quantization noise ratio",
            "dB",
            "SQNR (dB)",
            None,
            "down",
            Space("db", 0.05, 0.05),
            "20 log10(||x|| / ||x - x_hat||), dB",
        ),
        Metric(
            "mse",
            "quantization mean squared error",
            "1",
            "mean squared error",
            (0.0, float("inf")),
            None,
            None,
            "mean squared error of the reconstruction",
        ),
        Metric(
            "nonfinite",
            "non-finite element count",
            "1",
            "NaN/Inf count",
            (0.0, float("inf")),
            "up",
            Space("log_count", 0.0, 0.0),
            "NaN/Inf elements seen by the probes",
        ),
        # an invariant, not compared with baselines: any nonzero count fails the case (verdicts.operand_invariant.check_operands)
        Metric(
            "operand_mismatch",
            "consumed operand elements unlike a fresh quantization",
            "1",
            "elements unlike a fresh quantization",
            (0.0, float("inf")),
            "up",
            None,
            "elements of a GEMM operand the recipe consumed that differ from a fresh quantization of the "
            "live tensor under the operand's declared format and layout (for stochastic rounding: that are "
            "neither grid neighbour of the live value); nonzero means a stale or wrongly quantized operand",
        ),
        # log: a change of accumulation multiplies the error (fast against promoted grows like K / 128)
        Metric(
            "accumulation_error",
            "GEMM accumulation relative error",
            "1",
            "‖C − R‖_F / ‖R‖_F",
            (0.0, float("inf")),
            "up",
            Space("log", 1e-2, 1e-2),
            "||C - R||_F / ||R||_F of a GEMM accumulated as an H100's FP8 tensor cores do (C) against the float64 "
            "product R of the same quantized operands, per GEMM (fprop, dgrad, wgrad) and accumulation: as it ran "
            "(its recipe's mode, or the model's own use_fast_accum), and what hopper-fast and hopper-promoted:128 "
            "would give",
        ),
        Metric(
            "loss",
            "training cross-entropy",
            "nats",
            "cross-entropy (nats)",
            (0.0, float("inf")),
            "up",
            Space("log", 1e-3, 1e-3),
            "training cross-entropy",
        ),
        Metric(
            "accuracy",
            "training top-1 accuracy",
            "1",
            "fraction correct",
            _FRACTION,
            None,
            None,
            "training top-1 accuracy (next byte for the GPT)",
        ),
    )
}

# metrics of one quantized tensor, in the order probes record them
QUANT_METRICS = ("underflow", "zeros_after", "overflow", "distortion", "sqnr_db", "mse")


def observed_name(metric: str) -> str:
    """The variable of `metric` measured on the model's own quantization (training/observation.py)."""
    return f"observed_{metric}"


# The same metrics of the quantization the model's own code did (its casts into 8-bit floats, as
# its scaled GEMMs consumed them), per operand: same definitions, spaces and bad directions.
METRICS.update(
    {
        observed_name(name): replace(
            METRICS[name],
            name=observed_name(name),
            long_name=f"observed {METRICS[name].long_name}",
            counted_by="observed_numel",
            description=f"{METRICS[name].description}; of the quantization the model's own code did, per GEMM operand",
        )
        for name in QUANT_METRICS
    }
)
# compared against a seed ensemble, each in its own space
COMPARED = {name: m for name, m in METRICS.items() if m.space is not None}
SPACES: dict[str, Space] = {name: m.space for name, m in COMPARED.items()}
