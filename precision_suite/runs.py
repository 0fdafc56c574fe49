"""Short deterministic training runs recorded as xarray datasets (docs/architecture.md, schema 1).

``run(RunSpec(...))`` trains a tiny ViT (digits) or GPT (Shakespeare bytes) and returns, per sampled
step and block, the attention-matrix norm (SCIENCE.md figure A) and the quantization error of every
linear layer's activation, gradient, gradient transpose and weight (figure B), plus loss and
accuracy per training step. See docs/runs.md for the fields and the dataset layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from precision_suite import __version__
from precision_suite.files import SCHEMA_VERSION
from precision_suite.attention import get_attention
from precision_suite.data import digits_batch, text_batch
from precision_suite.models import ModelConfig, block_linears, build_model, model_config
from precision_suite.metric_table import METRICS, QUANT_METRICS
from precision_suite.probes import (
    SCHEME_EXAMPLES,
    TENSOR_ROLES,
    LayerRecord,
    Probes,
    Scheme,
    check_scheme_fits,
    get_scheme,
    set_recipe,
)

DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MEASUREMENT = "fp8-block"  # always measured; extra_formats are added side by side
# examples of training recipes; any quantization scheme name (probes.get_scheme) also works
RECIPES = ("fp32", "bf16", "fp8-block", "mxfp8", "nvfp4")
# used where RunSpec.batch_size / lr is None. Both batches are 512 tokens per step; the 12-block ViT
# does not learn in 50 steps at lr 1e-3 (loss stays at chance) but does at 3e-4.
TRAINING_DEFAULTS = {"vit": {"batch_size": 32, "lr": 3e-4}, "gpt": {"batch_size": 8, "lr": 1e-3}}
GRAD_CLIP_NORM = 1.0

ProgressFn = Callable[[int, int, float], None]


@dataclass(frozen=True)
class RunSpec:
    """What to train and measure. ``None`` model sizes mean the model's default (models.py)."""

    model: str = "gpt"  # "vit" | "gpt"
    attention: str = "softmax"  # attention.get_attention name, e.g. "x^3/sqrt(N)"
    recipe: str = "fp32"  # emulated training format: fp32, bf16, fp8-block, mxfp8, nvfp4, <fmt>:<layout>
    extra_formats: tuple[str, ...] = ()  # schemes measured next to fp8-block, e.g. ("mxfp8", "nvfp4")
    steps: int = 50
    batch_size: Optional[int] = None  # None: 32 images (vit) / 8 sequences (gpt)
    seed: int = 0
    device: str = "auto"  # auto: CUDA when available, else CPU
    sample_every: int = 10  # probes fire on steps 0, k, 2k, ... and on the last step
    lr: Optional[float] = None  # AdamW learning rate; None: 3e-4 (vit) / 1e-3 (gpt)
    depth: Optional[int] = None
    width: Optional[int] = None
    heads: Optional[int] = None
    seq_len: Optional[int] = None  # GPT: sequence length; ViT: patches per image (4, 16 or 64)
    threads: int = 1  # torch CPU threads, pinned during the run

    def __post_init__(self) -> None:
        # lists (from JSON or callers) become tuples so specs stay hashable and compare equal
        if isinstance(self.extra_formats, list):
            object.__setattr__(self, "extra_formats", tuple(self.extra_formats))

    # -- derived values -------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        return model_config(self.model, self.attention, self.depth, self.width, self.heads, self.seq_len)

    def resolved_batch_size(self) -> int:
        return TRAINING_DEFAULTS[self.model]["batch_size"] if self.batch_size is None else self.batch_size

    def resolved_lr(self) -> float:
        return TRAINING_DEFAULTS[self.model]["lr"] if self.lr is None else self.lr

    def tokens_per_step(self) -> int:
        return self.resolved_batch_size() * self.model_config().tokens

    def recipe_scheme(self) -> Scheme | None:
        if self.recipe == "fp32":
            return None
        return get_scheme("bf16:tensor" if self.recipe == "bf16" else self.recipe)

    def measured_schemes(self) -> list[Scheme]:
        return [get_scheme(name) for name in (DEFAULT_MEASUREMENT, *self.extra_formats)]

    def sampled_steps(self) -> list[int]:
        return sorted({*range(0, self.steps, self.sample_every), self.steps - 1})

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> "RunSpec":
        """Raise ValueError (naming the field and what is allowed) unless the spec can run."""
        for name in ("steps", "sample_every", "threads"):
            _check_positive_int(name, getattr(self, name))
        for name in ("batch_size", "depth", "width", "heads", "seq_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.lr is not None and (
            not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) or self.lr <= 0
        ):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        resolve_device(self.device)  # 'cuda' without a CUDA device fails here, before any training
        if self.model not in TRAINING_DEFAULTS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(TRAINING_DEFAULTS)}")
        get_attention(self.attention)  # unknown names list the known ones
        config = self.model_config()
        recipe = self._checked_recipe()
        schemes = self._checked_measurements()
        tokens = self.tokens_per_step()
        for name, in_features, out_features in block_linears(config):
            for scheme in ([recipe] if recipe else []) + schemes:
                check_scheme_fits(scheme, in_features, out_features, tokens, f"linear layer {name!r}")
        return self

    def _checked_recipe(self) -> Scheme | None:
        try:
            return self.recipe_scheme()
        except (ValueError, TypeError) as error:  # TypeError: an unhashable value such as a list
            raise ValueError(
                f"unknown recipe {self.recipe!r}: use one of {', '.join(RECIPES)} or <format>:<layout> ({error})"
            ) from None

    def _checked_measurements(self) -> list[Scheme]:
        if not isinstance(self.extra_formats, tuple) or not all(isinstance(n, str) for n in self.extra_formats):
            raise ValueError(f"extra_formats must be a tuple of scheme names ({SCHEME_EXAMPLES}), got {self.extra_formats!r}")
        schemes = self.measured_schemes()
        seen: dict[tuple[str, str], str] = {}
        for scheme in schemes:
            for key in scheme.role_labels().items():
                if key in seen:
                    raise ValueError(
                        f"extra_formats: {scheme.name!r} measures the {key[0]} under layout {key[1]!r}, "
                        f"which {seen[key]!r} already measures; drop it"
                    )
                seen[key] = scheme.name
        return schemes

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"RunSpec JSON is not valid JSON: {error}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"RunSpec JSON must be an object, got {type(fields).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - allowed)
        if unknown:
            raise ValueError(f"unknown RunSpec field(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
        return cls(**fields)


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def safe_name(name: str) -> str:
    """A filename-safe form of an attention or recipe name: 'x^3/sqrt(N)' -> 'x3-sqrtN'.

    '^', '(' and ')' are dropped, '/' and ':' become '-', anything else outside [A-Za-z0-9._-]
    becomes '_'.
    """
    name = re.sub(r"[\^()]", "", name).replace("/", "-").replace(":", "-")
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def case_id(spec: RunSpec) -> str:
    """'<model>-<attention>-<recipe>', filename-safe, e.g. 'gpt-x3-sqrtN-fp8-block'."""
    return f"{spec.model}-{safe_name(spec.attention)}-{safe_name(spec.recipe)}"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)


def fingerprint(device: torch.device) -> dict[str, object]:
    """What makes numbers reproducible: same fingerprint and spec -> identical dataset."""
    return {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def run(spec: RunSpec, progress: ProgressFn | None = None) -> xr.Dataset:
    """Train ``spec`` and return its measurements (schema: docs/architecture.md).

    ``progress(steps_done, total_steps, loss)`` is called after every step. The global torch RNG
    and the CPU thread count are restored afterwards.
    """
    spec.validate()
    device = resolve_device(spec.device)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        # devices=None forks the RNG of every visible CUDA device
        with torch.random.fork_rng(devices=None if device.type == "cuda" else []):
            torch.manual_seed(spec.seed)
            return _train(spec, device, progress)
    finally:
        torch.set_num_threads(saved_threads)


class Trainer:
    """One run's model, optimizer, data stream and probes; ``step()`` trains one batch.

    Build it inside the seeded context of ``run`` (the model init draws from the global RNG).
    """

    def __init__(self, spec: RunSpec, device: torch.device):
        self.spec, self.device = spec, device
        self.config = spec.model_config()
        self.model = build_model(self.config).to(device)
        set_recipe(self.model, spec.recipe_scheme())
        self.probes = Probes(self.model, spec.measured_schemes())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.resolved_lr(), weight_decay=0.0)
        self.data_rng = torch.Generator().manual_seed(spec.seed)
        self.batch_size = spec.resolved_batch_size()

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.kind == "vit":
            inputs, targets = digits_batch(self.batch_size, self.data_rng)
        else:
            inputs, targets = text_batch(self.batch_size, self.config.tokens, self.data_rng)
        return inputs.to(self.device), targets.to(self.device).reshape(-1)

    def step(self, sample: bool) -> tuple[float, float, list[LayerRecord] | None]:
        """Train on one batch; returns (loss, accuracy, per-block records if ``sample``)."""
        inputs, targets = self._batch()
        with self.probes.sample() if sample else nullcontext():
            logits = self.model(inputs).reshape(targets.numel(), -1)
            loss = F.cross_entropy(logits, targets)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        accuracy = (logits.argmax(dim=-1) == targets).double().mean().item()
        return loss.item(), accuracy, self.probes.records() if sample else None


def _train(spec: RunSpec, device: torch.device, progress: ProgressFn | None) -> xr.Dataset:
    trainer = Trainer(spec, device)
    sampled = set(spec.sampled_steps())
    losses = np.empty(spec.steps)
    accuracies = np.empty(spec.steps)
    records: list[list[LayerRecord]] = []
    for step in range(spec.steps):
        losses[step], accuracies[step], step_records = trainer.step(sample=step in sampled)
        if step_records is not None:
            records.append(step_records)
        if progress is not None:
            progress(step + 1, spec.steps, float(losses[step]))
    return _dataset(spec, trainer.config, device, records, losses, accuracies)


def _dataset(
    spec: RunSpec,
    config: ModelConfig,
    device: torch.device,
    records: list[list[LayerRecord]],
    losses: np.ndarray,
    accuracies: np.ndarray,
) -> xr.Dataset:
    steps = np.array(spec.sampled_steps(), dtype=np.int64)
    labels = list(dict.fromkeys(label for s in spec.measured_schemes() for label in s.role_labels().values()))
    shape = (len(steps), config.depth, len(TENSOR_ROLES), len(labels))
    quant = {name: np.full(shape, np.nan) for name in QUANT_METRICS}
    nonfinite = np.zeros(shape[:3], dtype=np.int64)
    numel = np.zeros(shape[1:3], dtype=np.int64)  # elements behind each fraction (count floors)
    attention_norm = np.empty(shape[:2])
    for i, step_records in enumerate(records):
        for layer, record in enumerate(step_records):
            attention_norm[i, layer] = record.attention_norm
            for (role, label), metrics in record.metrics.items():
                index = (i, layer, TENSOR_ROLES.index(role), labels.index(label))
                for name in QUANT_METRICS:
                    quant[name][index] = metrics[name]
                numel[layer, TENSOR_ROLES.index(role)] = metrics["numel"]
            for role, count in record.nonfinite.items():
                nonfinite[i, layer, TENSOR_ROLES.index(role)] = count
    where = ("step", "layer", "tensor", "layout")
    data_vars = {
        "attention_norm": (("step", "layer"), attention_norm, METRICS["attention_norm"].attrs()),
        **{name: (where, values, METRICS[name].attrs()) for name, values in quant.items()},
        "nonfinite": (("step", "layer", "tensor"), nonfinite, METRICS["nonfinite"].attrs()),
        "numel": (("layer", "tensor"), numel, {"long_name": "elements counted", "units": "1",
                                               "description": "elements pooled into each layer's fractions per step"}),
        "loss": (("train_step",), losses, METRICS["loss"].attrs()),
        "accuracy": (("train_step",), accuracies, METRICS["accuracy"].attrs()),
    }
    coords = {
        "step": steps,
        "tokens": ("step", (steps + 1) * spec.tokens_per_step(), {"description": "tokens seen after the step"}),
        "layer": np.arange(config.depth, dtype=np.int64),
        "tensor": np.array(TENSOR_ROLES, dtype=object),
        "layout": np.array(labels, dtype=object),
        "train_step": np.arange(spec.steps, dtype=np.int64),
    }
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "case": case_id(spec),
        "spec": spec.to_json(),
        "fingerprint": json.dumps(fingerprint(device), sort_keys=True),
        "package_version": __version__,
        # numbers that threshold rules refer to, e.g. "attention_norm <= sqrt(N)"
        "N": config.tokens,
        "d_head": config.width // config.heads,
    }
    return xr.Dataset(data_vars, coords=coords, attrs=attrs)
