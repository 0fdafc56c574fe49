"""Short deterministic training runs recorded as xarray datasets (docs/architecture.md, schema 1);
what a run trains is its `RunSpec` (training/specs.py).

``run(RunSpec(...))`` trains a tiny ViT (digits) or GPT (Shakespeare bytes) and returns, per sampled
step and block, the attention-matrix norm (SCIENCE.md figure A) and the quantization error of every
linear layer's activation, gradient, gradient transpose and weight (figure B), plus loss and
accuracy per training step. See docs/runs.md for the fields and the dataset layout.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
import xarray as xr

from precision_suite.numerics.metric_table import METRICS
from precision_suite.numerics.quantization import compile_pays, compiling_if
from precision_suite.training.data import digits_batch, text_batch
from precision_suite.training.imports import load_object
from precision_suite.training.models import build_model
from precision_suite.training.quant_linear import own_quantization, recipe_layers, set_recipe
from precision_suite.training.recorder import Recorder, instrument
from precision_suite.training.specs import (  # RunSpec, case_id: also imported from here
    RunSpec,
    case_id,
    resolve_device,
)
from precision_suite.version import __version__

GRAD_CLIP_NORM = 1.0

ProgressFn = Callable[[int, int, float], None]
StepHook = Callable[["Trainer", int], None]


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


def run(spec: RunSpec, progress: ProgressFn | None = None, before_step: StepHook | None = None) -> xr.Dataset:
    """Train ``spec`` and return its measurements (schema: docs/architecture.md).

    ``progress(steps_done, total_steps, loss)`` is called after every step, ``before_step(trainer,
    step)`` before each (training.replays keeps a state there). The global torch RNG and the CPU
    thread count are restored afterwards.
    """
    with seeded(spec) as device:
        return _train(spec, device, progress, before_step)


@contextmanager
def seeded(spec: RunSpec) -> Iterator[torch.device]:
    """The context every training of ``spec`` runs in: spec validated, threads pinned, the global
    torch RNG seeded with its seed (the model init draws from it); both restored afterwards."""
    spec.validate()
    device = resolve_device(spec.device)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        # devices=None forks the RNG of every visible CUDA device
        with torch.random.fork_rng(devices=None if device.type == "cuda" else []):
            torch.manual_seed(spec.seed)
            yield device
    finally:
        torch.set_num_threads(saved_threads)


class Trainer:
    """One run's model, optimizer, data stream and recorder; ``step()`` trains one batch.

    Build it inside the seeded context of ``run`` (the model init draws from the global RNG).
    """

    def __init__(self, spec: RunSpec, device: torch.device):
        self.spec, self.device = spec, device
        self.config = None if spec.user_model else spec.model_config()
        model = load_object(spec.model, "model")(spec) if spec.user_model else build_model(self.config)
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model: {spec.model}(spec) returned a {type(model).__name__}, not an nn.Module")
        self.model = model.to(device)
        self.user_batches = load_object(spec.batches, "batches") if spec.user_model else None
        self.tokens_seen = 0
        recipe = spec.training_recipe()
        if recipe is not None and not spec.replace_own_quantization and (own := own_quantization(self.model)):
            raise ValueError(_replacement_error(spec.recipe, own))
        set_recipe(self.model, recipe, seed=spec.seed)
        # the layers whose forward the recipe replaced: an observed cast there is the model's own
        # quantization the recipe would silently replace (checked on the first sampled step)
        names = {id(module): name for name, module in self.model.named_modules()}
        self.replaced = (
            {names[id(layer)] for layer in recipe_layers(self.model)}
            if recipe is not None and not spec.replace_own_quantization
            else set()
        )
        self.recorder: Recorder = instrument(
            self.model, modules=spec.modules or None, schemes=spec.measured_schemes()
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.resolved_lr(), weight_decay=0.0)
        self.data_rng = torch.Generator().manual_seed(spec.seed)
        self.batch_size = spec.resolved_batch_size()
        # whether the quantizers compile: decided at the first step, from the spec (and for a
        # user's model the shape of its first batch), never from what the process compiled before
        self.compiles: bool | None = None

    def quantized_elements(self, tokens: int) -> int:
        """Elements the run's quantizers see, GEMMs fed `tokens` rows: the recipe's on every step,
        the probes' on every sampled step."""
        recipe = self.spec.training_recipe()
        per_step = 0
        if recipe is not None:
            for layer in recipe_layers(self.model):
                per_step += recipe.quantized_elements(layer.in_features, layer.out_features, tokens)
        return self.spec.steps * per_step + len(self.spec.sampled_steps()) * self.recorder.measured_elements(
            tokens
        )

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.user_batches is not None:
            inputs, targets = self.user_batches(self.spec, self.data_rng)
            self.tokens_seen += targets.numel()  # a user's model: one token per target
        elif self.config.kind == "vit":
            inputs, targets = digits_batch(self.batch_size, self.data_rng)
            self.tokens_seen += self.spec.tokens_per_step()
        else:
            inputs, targets = text_batch(self.batch_size, self.config.tokens, self.data_rng)
            self.tokens_seen += self.spec.tokens_per_step()
        return inputs.to(self.device), targets.to(self.device).reshape(-1)

    def step(self, index: int, sample: bool) -> tuple[float, float]:
        """Train on one batch (measured by the recorder if ``sample``); returns (loss, accuracy)."""
        inputs, targets = self._batch()
        if self.compiles is None:
            # a user's model: one GEMM row per target (a classifier's sequences have more rows: its
            # estimate is low, so a large one may stay eager; PRECISION_SUITE_COMPILE=1 compiles it)
            tokens = targets.numel() if self.user_batches is not None else self.spec.tokens_per_step()
            self.compiles = compile_pays(self.quantized_elements(tokens))
        with compiling_if(self.compiles), self.recorder.step(index, sample=sample) as sampled:
            logits, loss = self._forward(inputs, targets)
            loss.backward()
        if sampled and self.replaced:
            own = sorted(self.replaced & self.recorder.observed_modules())
            if own:
                raise ValueError(
                    _replacement_error(
                        self.spec.recipe, [f"{name} casts to 8-bit floats itself" for name in own]
                    )
                )
            self.replaced = set()  # checked once
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if sampled:
            release_freed_memory()
        return loss.item(), _accuracy(logits, targets)

    def evaluate(self) -> tuple[float, float]:
        """(loss, accuracy) of the next batch without training on it: what the next step's
        loss would be, the visible effect of the last update."""
        inputs, targets = self._batch()
        with torch.no_grad(), compiling_if(bool(self.compiles)):
            logits, loss = self._forward(inputs, targets)
        return loss.item(), _accuracy(logits, targets)

    def _forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits with one row per target, cross-entropy loss)."""
        logits = _logits(self.model(inputs)).reshape(targets.numel(), -1)
        return logits, F.cross_entropy(logits, targets)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


def release_freed_memory() -> None:
    """Hand the free pages of the C heap back to the system (glibc's malloc_trim; nothing
    elsewhere). glibc keeps what a sampled step's temporaries freed, scattered, so each sampled
    step's high-water mark added to the process's peak: a 17M-parameter Llama at sample_every 2
    peaked at 1.8 GB, 1.2 GB trimmed after each sampled step, bare training 0.8 GB (issue 39)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _replacement_error(recipe: str, own: list[str]) -> str:
    more = f" (and {len(own) - 1} more)" if len(own) > 1 else ""
    return (
        f"recipe {recipe!r} would replace the quantization the model's own code does: {own[0]}{more}; "
        "drop `recipe` to measure the model's own numerics, or set replace_own_quantization = true "
        "to train with the suite's recipe in their place"
    )


def _accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return (logits.argmax(dim=-1) == targets).double().mean().item()


def _logits(output: object) -> torch.Tensor:
    """A model's logits: its output, or the ``logits`` field of a Hugging Face style output."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"model returned a {type(output).__name__}; return logits (a tensor) or an object "
            "with a .logits tensor"
        )
    return logits


def _train(
    spec: RunSpec, device: torch.device, progress: ProgressFn | None, before_step: StepHook | None
) -> xr.Dataset:
    trainer = Trainer(spec, device)
    sampled = set(spec.sampled_steps())
    losses = np.empty(spec.steps)
    accuracies = np.empty(spec.steps)
    tokens = []
    for step in range(spec.steps):
        if before_step is not None:
            before_step(trainer, step)
        losses[step], accuracies[step] = trainer.step(step, sample=step in sampled)
        if step in sampled:
            tokens.append(trainer.tokens_seen)
        if progress is not None:
            progress(step + 1, spec.steps, float(losses[step]))
    return trained_dataset(trainer, np.arange(spec.steps), losses, accuracies, tokens)


def trained_dataset(
    trainer: Trainer,
    train_steps: np.ndarray,
    losses: np.ndarray,
    accuracies: np.ndarray,
    tokens: list[int],
    attrs: dict[str, object] | None = None,
) -> xr.Dataset:
    """The dataset of what ``trainer`` recorded: its sampled steps' measurements, with the loss and
    accuracy of ``train_steps`` and the tokens seen after each sampled step."""
    spec = trainer.spec
    attrs = {
        "spec": spec.to_json(),
        "fingerprint": json.dumps(fingerprint(trainer.device), sort_keys=True),
        "package_version": __version__,
        **(attrs or {}),
    }
    if trainer.config is not None:  # numbers that threshold rules refer to, e.g. "attention_norm <= sqrt(N)"
        attrs.update(N=trainer.config.tokens, d_head=trainer.config.width // trainer.config.heads)
    ds = trainer.recorder.dataset(case=case_id(spec), attrs=attrs)
    return ds.assign_coords(
        tokens=("step", np.array(tokens, dtype=np.int64), {"description": "tokens seen after the step"}),
        train_step=np.asarray(train_steps, dtype=np.int64),
    ).assign(
        loss=(("train_step",), losses, METRICS["loss"].attrs()),
        accuracy=(("train_step",), accuracies, METRICS["accuracy"].attrs()),
    )
