"""A recipe as data, on both sides: the suite's recipe a run trained with (a `[recipes.NAME]`
table or a built-in recipe, `recipe_operand` and `recipe_accumulation`) and what the model's own
code quantized (training/observation.py), judged against the reference run and against what the
case expects.

- `check_recipes`: both recipes against the reference (a baseline's first member, or BASE's run
  in `diff`), without tolerance. Any change is a regression that names the module, the GEMM and
  the operand and what changed: a recipe is a decision, not a noisy number.
  - `check_trained_recipe`: per module, each GEMM operand's format and layout and each GEMM's
    accumulation in the suite's recipe; modules that changed alike are named in one finding. A
    reference that does not record it (a baseline written before the recipe was stored) is not
    compared.
  - `check_observed_recipe`: per module, the scaled GEMMs observed and their accumulation flags,
    and per module and operand the format, scaling block, scale kind and scale target, step by step.
- `check_expected`: against the recipe the case declares for its modules (`RunSpec.expect`: module
  globs and recipe names, the vocabulary of `[recipes.NAME]`); a module expected to quantize that
  quantizes nothing fails with that sentence, counting what it cast that no GEMM consumed.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import xarray as xr

from precision_suite.numerics.layouts import WHOLE_AXIS, layout_text
from precision_suite.training.recipe_registry import get_recipe
from precision_suite.training.recipes import GEMM_OPERANDS, HIGH_PRECISION, Operand
from precision_suite.verdicts.findings import Finding, to_python

NOT_OBSERVED = "none"  # how an empty observation (or no recipe of the suite's) reads in a message
_NAMED_MODULES = 3  # a change shared by more modules names this many of them, then counts the rest


def check_recipes(current: xr.Dataset, reference: xr.Dataset, regen_hint: str = "") -> list[Finding]:
    """Findings where the suite's recipe or the observed recipe of `current` differs from
    `reference`'s (module docstring)."""
    return [
        *check_trained_recipe(current, reference, regen_hint),
        *check_observed_recipe(current, reference, regen_hint),
    ]


def check_trained_recipe(current: xr.Dataset, reference: xr.Dataset, regen_hint: str = "") -> list[Finding]:
    """Findings where the suite's recipe `current` trained with differs from `reference`'s: one per
    GEMM operand (format:layout[:stochastic]) or GEMM (accumulation) and change, naming the modules
    it changed in. Nothing where `reference` does not record the recipe."""
    reference = reference.isel(seed=0) if "seed" in reference.dims else reference
    case = str(current.attrs.get("case", "?"))
    after = f"; if intended, regenerate the reference: {regen_hint}" if regen_hint else ""
    findings = []
    for name, along in (("recipe_operand", "operand"), ("recipe_accumulation", "gemm")):
        if name not in reference:
            continue  # not recorded
        changes: dict[tuple[str, Any, Any], list[str]] = {}
        for module, differences in _differences(current, reference, name, along, None, ""):
            for _, key, before, now in differences:
                changes.setdefault((key, before, now), []).append(module)
        for (key, before, now), modules in changes.items():
            gemm, _, side = key.partition(".")
            what = f"operand {side}" if side else "accumulation"
            findings.append(
                _finding(
                    case,
                    name,
                    {"module": modules[0], along: key},
                    np.nan,
                    np.nan,
                    f"{_modules_text(modules)} {gemm} {what}: {before or NOT_OBSERVED} -> "
                    f"{now or NOT_OBSERVED} in the suite's recipe the run trained with{after}",
                )
            )
    return findings


def check_observed_recipe(current: xr.Dataset, reference: xr.Dataset, regen_hint: str = "") -> list[Finding]:
    """Findings where the observed recipe of `current` differs from `reference`'s (module
    docstring); nothing when neither observed any quantization of the model's own."""
    if "observed_gemms" not in current and "observed_gemms" not in reference:
        return []
    case = str(current.attrs.get("case", "?"))
    reference = reference.isel(seed=0) if "seed" in reference.dims else reference
    steps = sorted(set(_steps(current)) & set(_steps(reference)))
    if not steps:
        return []
    after = f"; if intended, regenerate the reference: {regen_hint}" if regen_hint else ""
    findings = []
    changed_gemms: set[tuple[str, str, Any]] = set()
    for module, differences in _differences(current, reference, "observed_gemms", "gemm", steps, 0):
        step = differences[0][0]
        at_step = [(gemm, b, c) for s, gemm, b, c in differences if s == step]
        changed_gemms.update((module, gemm, s) for s, gemm, _, _ in differences)
        before, now = (
            sum(int(v) for v in _row(ds, "observed_gemms", module, step)) for ds in (reference, current)
        )
        detail = ", ".join(f"{gemm} {b} -> {c}" for gemm, b, c in at_step)
        findings.append(
            _finding(
                case,
                "observed_gemms",
                {"module": module, "step": step},
                now,
                before,
                f"{module}: scaled GEMMs observed {before} -> {now} at step {step} ({detail})"
                f"{_later(differences)}{after}",
            )
        )
    for module, differences in _differences(current, reference, "observed_accumulation", "gemm", steps, ""):
        step, gemm, before, now = differences[0]
        if (module, gemm, step) in changed_gemms:
            continue  # the GEMM itself came or went: said above
        findings.append(
            _finding(
                case,
                "observed_accumulation",
                {"module": module, "gemm": gemm, "step": step},
                np.nan,
                np.nan,
                f"{module} {gemm} accumulation: {before or NOT_OBSERVED} -> "
                f"{now or NOT_OBSERVED} at step {step}{_later(differences)}{after}",
            )
        )
    recipe_changes = [
        (m, d) for m, d in _differences(current, reference, "observed_format", "operand", steps, "")
    ]
    recipe_changes += [
        (m, d) for m, d in _differences(current, reference, "observed_block", "operand", steps, "")
    ]
    recipe_changes += [
        (m, d) for m, d in _differences(current, reference, "observed_scale", "operand", steps, "")
    ]
    if (
        "observed_target" in current and "observed_target" in reference
    ):  # a reference from before targets: none
        recipe_changes += [
            (m, d) for m, d in _differences(current, reference, "observed_target", "operand", steps, math.nan)
        ]
    reported: set[tuple[str, str]] = set()
    for module, differences in recipe_changes:
        for step, operand, _, _ in differences:
            if (module, operand) in reported or (module, operand.split(".")[0], step) in changed_gemms:
                continue
            reported.add((module, operand))
            before, now = (_operand_text(ds, module, operand, step) for ds in (reference, current))
            gemm, side = operand.split(".")
            findings.append(
                _finding(
                    case,
                    "observed_format",
                    {"module": module, "operand": operand, "step": step},
                    np.nan,
                    np.nan,
                    f"{module} {gemm} operand {side}: {before} -> {now} at step {step}{after}",
                )
            )
    return findings


def check_expected(current: xr.Dataset) -> list[Finding]:
    """Findings where the observed recipe differs from the one the case's spec expects."""
    expect = [tuple(pair) for pair in json.loads(current.attrs.get("spec", "{}")).get("expect", ())]
    if not expect:
        return []
    case = str(current.attrs.get("case", "?"))
    modules = [str(m) for m in current["module"].values] if "module" in current.coords else []
    findings = []
    for pattern, _ in expect:
        if not fnmatch.filter(modules, pattern):
            findings.append(
                Finding.error(
                    case,
                    "observed_format",
                    f"expect {pattern!r} matches no module of the run "
                    f"({', '.join(modules[:8]) or 'none'}{', ...' if len(modules) > 8 else ''})",
                )
            )
    for module in modules:
        pattern, recipe_name = next(
            ((p, r) for p, r in expect if fnmatch.fnmatchcase(module, p)), (None, None)
        )
        if pattern is None:
            continue
        rule = f"expect {pattern} = {recipe_name}"
        observed = {operand: _observed_texts(current, module, operand) for operand in GEMM_OPERANDS}
        quantized = any(text != HIGH_PRECISION for texts, _, _ in observed.values() for text in texts)
        if recipe_name != HIGH_PRECISION and not quantized:
            cast = (
                int(current["observed_unconsumed"].sel(module=module).sum())
                if "observed_unconsumed" in current
                else 0
            )
            what = (
                f"{cast:,} elements were cast to 8-bit floats in it, but no GEMM observed consumed them"
                if cast
                else "no cast to an 8-bit float and no scaled GEMM was observed in it"
            )
            findings.append(
                _expected(
                    case,
                    module,
                    None,
                    rule,
                    f"{module} is expected to quantize as {recipe_name} but quantizes nothing: {what}",
                )
            )
            continue
        recipe = None if recipe_name == HIGH_PRECISION else get_recipe(recipe_name)
        for operand, (texts, blocks, shapes) in observed.items():
            wanted = Operand(HIGH_PRECISION) if recipe is None else recipe.operand(operand)
            if not _matches(wanted, texts, blocks, shapes):
                gemm, side = operand.split(".")
                shown = "|".join(texts) or NOT_OBSERVED
                findings.append(
                    _expected(
                        case,
                        module,
                        operand,
                        rule,
                        f"{module} {gemm} operand {side}: expected {_wanted_text(wanted)} "
                        f"({recipe_name}), observed {shown}",
                    )
                )
    return findings


# --------------------------------------------------------------------------- helpers


def _steps(ds: xr.Dataset) -> list[Any]:
    return [to_python(s) for s in ds["step"].values] if "step" in ds.coords else []


def _empty(value: Any, empty: Any) -> bool:
    """Whether a cell is `empty` (NaN is empty where NaN is)."""
    if isinstance(empty, float) and math.isnan(empty):
        return isinstance(value, float) and math.isnan(value)
    return value == empty


def _table(
    ds: xr.Dataset, name: str, along: str, steps: Sequence[Any] | None, empty: Any
) -> dict[tuple, Any]:
    """(step, module, along-value) -> value of variable `name`; absent cells read as `empty`.
    `steps` None: a variable without a step dimension (its step reads None)."""
    if name not in ds:
        return {}
    if steps is None:
        da, steps = ds[name].expand_dims("step"), [None]
    else:
        da = ds[name].sel(step=list(steps))
    da = da.transpose("step", "module", along)
    table = {}
    for i, step in enumerate(steps):
        for j, module in enumerate(da["module"].values):
            for k, key in enumerate(da[along].values):
                value = to_python(da.values[i, j, k])
                if not _empty(value, empty):
                    table[step, str(module), str(key)] = value
    return table


def _differences(
    current: xr.Dataset, reference: xr.Dataset, name: str, along: str, steps: Sequence[Any] | None, empty: Any
) -> Iterator[tuple[str, list[tuple[Any, str, Any, Any]]]]:
    """Per module whose variable `name` differs: [(step, along-value, reference, current), ...],
    earliest first (`steps` None: no step dimension)."""
    now, before = _table(current, name, along, steps, empty), _table(reference, name, along, steps, empty)
    order = [None] if steps is None else list(steps)
    by_module: dict[str, list[tuple[Any, str, Any, Any]]] = {}
    for step, module, key in sorted(set(now) | set(before), key=lambda k: (order.index(k[0]), k[1], k[2])):
        b, c = before.get((step, module, key), empty), now.get((step, module, key), empty)
        if not (_empty(b, empty) and _empty(c, empty)) and b != c:
            by_module.setdefault(module, []).append((step, key, b, c))
    yield from by_module.items()


def _row(ds: xr.Dataset, name: str, module: str, step: Any) -> list[Any]:
    if name not in ds or module not in ds["module"].values:
        return []
    return [to_python(v) for v in ds[name].sel(step=step, module=module).values]


def _operand_text(ds: xr.Dataset, module: str, operand: str, step: Any) -> str:
    """ "e4m3:row (1x64, float32 pow2, target 1.0)": format, block, scale kind and scale target of
    one operand at one step ("fp32": taken unquantized)."""
    if "observed_format" not in ds or module not in ds["module"].values:
        return NOT_OBSERVED
    cell = {
        name: str(ds[name].sel(step=step, module=module, operand=operand).values)
        for name in ("observed_format", "observed_block", "observed_scale")
        if name in ds
    }
    if not cell.get("observed_format"):
        return NOT_OBSERVED
    if cell["observed_format"] == HIGH_PRECISION:
        return HIGH_PRECISION
    target = (
        float(ds["observed_target"].sel(step=step, module=module, operand=operand))
        if "observed_target" in ds
        else math.nan
    )
    shown = "" if math.isnan(target) else f", target {target:g}"
    return f"{cell['observed_format']} ({cell.get('observed_block', '?')}, {cell.get('observed_scale', '?')}{shown})"


def _modules_text(modules: Sequence[str]) -> str:
    """ "blocks.0.fc1" or "blocks.0.fc1, blocks.0.fc2, blocks.1.fc1 and 5 more modules"."""
    if len(modules) <= _NAMED_MODULES:
        return ", ".join(modules)
    return f"{', '.join(modules[:_NAMED_MODULES])} and {len(modules) - _NAMED_MODULES} more modules"


def _later(differences: Sequence[tuple]) -> str:
    steps = sorted({d[0] for d in differences})
    return (
        f" (and at {len(steps) - 1} later sampled step{'s' if len(steps) > 2 else ''})"
        if len(steps) > 1
        else ""
    )


def _observed_texts(ds: xr.Dataset, module: str, operand: str) -> tuple[list[str], list[str], list[str]]:
    """Every format text, block and operand shape one operand was observed with over the run."""
    if "observed_format" not in ds:
        return [], [], []
    texts, blocks, shapes = {}, {}, {}
    for name, into in (("observed_format", texts), ("observed_block", blocks), ("observed_shape", shapes)):
        if name in ds:
            for value in ds[name].sel(module=module, operand=operand).values:
                into.update(dict.fromkeys(part for part in str(value).split("|") if part))
    return list(texts), list(blocks), list(shapes)


def _matches(
    wanted: Operand, texts: Sequence[str], blocks: Sequence[str], shapes: Sequence[str] = ()
) -> bool:
    """Whether every observed quantization of an operand is the expected one: the same element
    format and the same scaling (a layout word row/column/tensor as observed, or a block shape
    as the block one scale covers, clipped to the operand where its shape is known: a 1x128 tile
    over a 64-wide operand is 1x64, a 128x128 block over a 128x128 one is its one scale); fp32
    expects nothing quantized."""
    if wanted.fmt == HIGH_PRECISION:
        return all(text == HIGH_PRECISION for text in texts)
    if not texts:
        return False
    if any(text.partition(":")[0] != wanted.fmt for text in texts):
        return False
    word = layout_text(wanted.layout)
    if word in ("tensor", *WHOLE_AXIS):  # as observed: one scale, or one per row or column
        return all(text.partition(":")[2] == word for text in texts)
    if len(shapes) == 1 and len(blocks) == 1:
        rows, cols = (int(n) for n in shapes[0].split("x"))
        block = (rows, cols) if blocks[0] == "tensor" else tuple(int(n) for n in blocks[0].split("x"))
        return block == (min(wanted.layout[0], rows), min(wanted.layout[1], cols))
    return bool(blocks) and all(block == word for block in blocks)


def _wanted_text(wanted: Operand) -> str:
    return "fp32 (not quantized)" if wanted.fmt == HIGH_PRECISION else wanted.text()


def _finding(
    case: str, metric: str, where: dict[str, Any], value: float, reference: float, message: str
) -> Finding:
    return Finding(
        case, "regression", metric, where, float(value), float(reference), np.nan, f"{case}: {message}"
    )


def _expected(case: str, module: str, operand: str | None, rule: str, message: str) -> Finding:
    where = {"module": module, **({"operand": operand} if operand else {})}
    return Finding(
        case, "threshold", "observed_format", where, np.nan, np.nan, np.nan, f"{case}: {message}", rule=rule
    )
