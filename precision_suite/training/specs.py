"""What a run trains and measures (`RunSpec`) and which case it is (`case_id`): the fields, their
checks with the message that says how to fix them, and the identity baselines are filed under.
docs/runs.md lists the fields."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from precision_suite.training.attention import get_attention
from precision_suite.training.imports import is_import_string, load_object
from precision_suite.training.models import ModelConfig, block_linears, build_model, model_config
from precision_suite.training.probes import (
    SCHEME_EXAMPLES,
    Scheme,
    check_measurements,
    check_scheme_fits,
    get_scheme,
)
from precision_suite.training.recipe_registry import RECIPE_EXAMPLES, get_recipe
from precision_suite.training.recipes import Recipe
from precision_suite.training.recorder import instrument

DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MEASUREMENT = "fp8-block"  # always measured; extra_formats are added side by side
# used where RunSpec.batch_size / lr is None. Both batches are 512 tokens per step; the 12-block ViT
# does not learn in 50 steps at lr 1e-3 (loss stays at chance) but does at 3e-4.
TRAINING_DEFAULTS = {"vit": {"batch_size": 32, "lr": 3e-4}, "gpt": {"batch_size": 8, "lr": 1e-3}}
USER_MODEL_DEFAULTS = {"batch_size": 8, "lr": 1e-3}  # a user's model (model = "package.module:factory")
# what makes two runs of one case: the seed draws an ensemble member, threads and device the host
NOT_CASE_IDENTITY = ("seed", "threads", "device")
# how a case is judged, not what it trains: neither in its id nor compared with its baseline's spec
JUDGING_FIELDS = ("expect",)
# what a case is called, not what it trains: its id's readable part, outside the id's hash
NAMING_FIELDS = ("name",)
# fields added after case ids and baselines were first written: in a spec's JSON and its case id
# only when set, so the specs stored before they existed still read as the same case
ADDED_FIELDS = ("expect", "replace_own_quantization", "name", "modules")
# a case's name: it names files (baselines, charts) and is typed after --case
CASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}")


@dataclass(frozen=True)
class RunSpec:
    """What to train and measure. ``None`` model sizes mean the model's default (models.py).

    A user's model: ``model="mypkg.models:build"`` names a factory called as ``build(spec)`` that
    returns an ``nn.Module``, and ``batches="mypkg.data:batch"`` one called as
    ``batch(spec, generator)`` each step, returning (inputs, targets); the loss is the
    cross-entropy of ``model(inputs)`` (or its ``.logits``, as Hugging Face models return) against
    ``targets``, logits reshaped to one row per target.
    The size fields (depth, width, ...) are the factory's to read.
    """

    model: str = "gpt"  # "vit" | "gpt" | "package.module:factory"
    attention: str = "softmax"  # attention.get_attention name, e.g. "x^3/sqrt(N)", or package.module:phi
    recipe: str = "fp32"  # fp32, or a recipe_registry.get_recipe name: fp8-block, fp8-hybrid, nvfp4-training, <fmt>:<layout>
    extra_formats: tuple[str, ...] = ()  # schemes measured next to fp8-block, e.g. ("mxfp8", "nvfp4")
    steps: int = 50
    batch_size: int | None = None  # None: 32 images (vit) / 8 sequences (gpt)
    seed: int = 0
    device: str = "auto"  # auto: CUDA when available, else CPU
    sample_every: int = 10  # probes fire on steps 0, k, 2k, ... and on the last step
    lr: float | None = None  # AdamW learning rate; None: 3e-4 (vit) / 1e-3 (gpt)
    depth: int | None = None
    width: int | None = None
    heads: int | None = None
    seq_len: int | None = None  # GPT: sequence length; ViT: patches per image (4, 16 or 64)
    threads: int = 1  # torch CPU threads, pinned during the run
    batches: str | None = None  # a user model's batches: "package.module:function"
    # what the model's own code must quantize with: (module glob, recipe name) pairs, the first
    # glob that matches a module deciding; "fp32" expects no quantization (verdicts.observed)
    expect: tuple[tuple[str, str], ...] = ()
    # a `recipe` replaces linear layers that quantize on their own (a torchao Float8Linear) only when set
    replace_own_quantization: bool = False
    name: str | None = None  # the case id's readable part in place of <model>-<attention>-<recipe>
    # the modules measured: globs over fully qualified module names, as instrument(modules=...)
    # takes them; () measures every linear-like module
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # lists (from JSON or callers) become tuples so specs stay hashable and compare equal
        for name in ("extra_formats", "modules"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.expect, Mapping):  # a TOML table: glob = "recipe"
            object.__setattr__(self, "expect", tuple((str(k), v) for k, v in self.expect.items()))
        elif isinstance(self.expect, list):  # JSON: [[glob, recipe], ...]
            object.__setattr__(
                self, "expect", tuple(tuple(pair) if isinstance(pair, list) else pair for pair in self.expect)
            )

    # -- derived values -------------------------------------------------------------------------
    @property
    def user_model(self) -> bool:
        return is_import_string(self.model)

    def model_config(self) -> ModelConfig:
        return model_config(self.model, self.attention, self.depth, self.width, self.heads, self.seq_len)

    def resolved_batch_size(self) -> int:
        defaults = TRAINING_DEFAULTS.get(self.model, USER_MODEL_DEFAULTS)
        return defaults["batch_size"] if self.batch_size is None else self.batch_size

    def resolved_lr(self) -> float:
        return TRAINING_DEFAULTS.get(self.model, USER_MODEL_DEFAULTS)["lr"] if self.lr is None else self.lr

    def tokens_per_step(self) -> int:
        return self.resolved_batch_size() * self.model_config().tokens

    def training_recipe(self) -> Recipe | None:
        return None if self.recipe == "fp32" else get_recipe(self.recipe)

    def measured_schemes(self) -> list[Scheme]:
        return [get_scheme(name) for name in (DEFAULT_MEASUREMENT, *self.extra_formats)]

    def sampled_steps(self) -> list[int]:
        return sorted({*range(0, self.steps, self.sample_every), self.steps - 1})

    def relative_work(self) -> float:
        """A rough guess of how long the run trains, to start the longest runs first
        (execution.longest_first): the multiply-adds of its block GEMMs on every step, once more
        on every step when the recipe quantizes them, once more on every sampled step for each
        format the probes measure. Only the order of two specs' values means anything; a user's
        model, whose size the spec does not say, is +inf (started first)."""
        if self.user_model:
            return math.inf
        config = self.model_config()
        gemms = sum(inputs * outputs for _, inputs, outputs in block_linears(config)) * config.depth
        formats = len(self.measured_schemes())
        passes = float(self.steps) * (1 + (self.recipe != "fp32")) + len(self.sampled_steps()) * formats
        return passes * float(self.tokens_per_step()) * gemms

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> RunSpec:
        """Raise ValueError (naming the field and what is allowed) unless the spec can run."""
        self.check_case_fields()
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
        get_attention(self.attention)  # unknown names list the known ones
        recipe = self._checked_recipe()
        self._check_expect()
        if not isinstance(self.replace_own_quantization, bool):
            raise ValueError(
                f"replace_own_quantization must be true or false, got {self.replace_own_quantization!r}"
            )
        schemes = self._checked_measurements()
        if self.user_model:
            load_object(self.model, "model")
            if self.batches is None:
                raise ValueError(
                    f"batches: model {self.model!r} is a user's model, so name its batch "
                    'function too: batches = "package.module:function" (see RunSpec)'
                )
            load_object(self.batches, "batches")
            return self
        if self.model not in TRAINING_DEFAULTS:
            raise ValueError(
                f"unknown model {self.model!r}; choose one of {', '.join(TRAINING_DEFAULTS)} "
                "or name a factory of yours as package.module:function"
            )
        if self.batches is not None:
            raise ValueError(
                f"batches: the built-in {self.model!r} model trains on its own data; "
                'batches is for a user\'s model (model = "package.module:factory")'
            )
        config = self.model_config()
        tokens = self.tokens_per_step()
        for name, in_features, out_features in block_linears(config):
            if recipe is not None:
                recipe.check_fits(in_features, out_features, tokens, f"linear layer {name!r}")
            for scheme in schemes:
                check_scheme_fits(scheme, in_features, out_features, tokens, f"linear layer {name!r}")
        if (
            self.modules
        ):  # a glob that matches no layer, said before anything trains (a user's model: when built)
            with torch.random.fork_rng(devices=[]):
                instrument(build_model(config), modules=self.modules, attention=None, observe=False)
        return self

    def check_case_fields(self) -> None:
        """Raise ValueError (naming the field) unless the fields that name the case and say what
        it measures have their form: what `case_id` reads, checked before the rest of `validate`.
        Whether the `modules` globs match a layer is `validate`'s to say."""
        for name in ("model", "attention", "recipe"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.name is not None and not (isinstance(self.name, str) and CASE_NAME.fullmatch(self.name)):
            raise ValueError(
                f"name must be 1 to 80 letters, digits, '.', '_' or '-', starting with a letter or "
                f'digit (it names the case\'s files), e.g. name = "my-model-fp8"; got {self.name!r}'
            )
        if not (isinstance(self.modules, tuple) and all(isinstance(p, str) and p for p in self.modules)):
            raise ValueError(
                'modules must be a list of globs over module names, e.g. modules = ["blocks.*", '
                f'"head"]; got {self.modules!r}'
            )

    def _checked_recipe(self) -> Recipe | None:
        if not isinstance(self.recipe, str):
            raise ValueError(f"recipe must be a name (fp32, {RECIPE_EXAMPLES}), got {self.recipe!r}")
        return self.training_recipe()

    def _check_expect(self) -> None:
        example = 'expect = { "blocks.*" = "fp8-hybrid", head = "fp32" }'
        for pair in self.expect:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(v, str) for v in pair)):
                raise ValueError(
                    f"expect: each entry is a module glob and a recipe name, as in {example}; got {pair!r}"
                )
            if pair[1] != "fp32":
                try:
                    get_recipe(pair[1])
                except ValueError as error:
                    raise ValueError(f"expect: {pair[0]!r}: {error}") from None

    def _checked_measurements(self) -> list[Scheme]:
        if not isinstance(self.extra_formats, tuple) or not all(
            isinstance(n, str) for n in self.extra_formats
        ):
            raise ValueError(
                f"extra_formats must be a tuple of scheme names ({SCHEME_EXAMPLES}), got {self.extra_formats!r}"
            )
        try:
            return list(check_measurements(self.measured_schemes()))
        except ValueError as error:
            raise ValueError(f"extra_formats: {error}") from None

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self.fields(), sort_keys=True)

    def fields(self) -> dict[str, object]:
        """Every field, but an ADDED_FIELDS one at its default (the spec's JSON object)."""
        defaults = RunSpec.__dataclass_fields__
        return {
            name: value
            for name, value in dataclasses.asdict(self).items()
            if name not in ADDED_FIELDS or value != defaults[name].default
        }

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
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
    """'<model>-<attention>-<recipe>', filename-safe, e.g. 'gpt-x3-sqrtN-fp8-block', then a short
    hash of every other field that defines the case where one differs from the defaults (sizes,
    steps, extra formats, batches, modules...): two specs that are different cases never share an
    id, nor a baseline file. Seed, threads and device are not part of a case (NOT_CASE_IDENTITY). A
    user's model trained without a recipe of the suite's computes as its own code does (which the
    run observes: training/observation.py), so its recipe reads "own", not "fp32".

    A named case is '<name>-<hash>', the hash over every field that defines the case, model,
    attention and recipe included, and the name left out: two cases of one name that train
    different things get different ids, and a renamed case keeps its hash."""
    identity = {
        name: value
        for name, value in spec.fields().items()
        if name not in (*NOT_CASE_IDENTITY, *JUDGING_FIELDS, *NAMING_FIELDS)
    }
    if spec.name is not None:
        return f"{safe_name(spec.name)}-{_digest(identity)}"
    recipe = "own" if spec.user_model and spec.recipe == "fp32" else safe_name(spec.recipe)
    readable = f"{safe_name(spec.model)}-{safe_name(spec.attention)}-{recipe}"
    defaults = RunSpec().fields()
    others = {name: value for name, value in identity.items() if name not in ("model", "attention", "recipe")}
    if all(value == defaults.get(name) for name, value in others.items()):
        return readable
    return f"{readable}-{_digest(others)}"


def _digest(fields: Mapping[str, object]) -> str:
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)
