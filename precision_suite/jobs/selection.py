"""Which cases a command trains: the default matrix (or its quick subset) or a config file of
[[case]] tables, narrowed by --model/--attention/--recipe/--case, sharded by --shard, with the
device and seed overridden; every spec is validated before the first one trains."""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from precision_suite.files import read_toml
from precision_suite.jobs.usage import DEFAULT_BASELINE_DIR, UsageError
from precision_suite.training import matrix, recipe_registry
from precision_suite.training.attention import get_attention
from precision_suite.training.runs import RunSpec, case_id


@dataclass(frozen=True)
class Selection:
    """The selection flags of a command (None or empty: not given)."""

    model: Sequence[str] | None = None
    attention: Sequence[str] | None = None
    recipe: Sequence[str] | None = None
    case: Sequence[str] | None = None
    config: str | None = None
    quick: bool = False
    device: str | None = None
    seed: int | None = None
    shard: tuple[int, int] | None = None

    @classmethod
    def from_args(cls, args: Any) -> Selection:
        """The selection of parsed arguments (an argparse.Namespace); flags a command lacks are None."""
        return cls(
            **{f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls) if f.name != "quick"},
            quick=bool(getattr(args, "quick", False)),
        )

    def matches(self, case: str, spec: Mapping[str, Any]) -> bool:
        """Whether a stored case (its id and its spec's fields) passes --case, --model, --attention
        and --recipe: `history report` selects among a store's cases, not the matrix's."""
        wanted = {"model": self.model, "attention": self.attention, "recipe": self.recipe}
        return (not self.case or case in self.case) and all(
            not values or spec.get(field) in values for field, values in wanted.items()
        )


def selected_specs(selection: Selection, validate: bool = True) -> list[RunSpec]:
    """The RunSpecs of the selection, in matrix (or config file) order; UsageError for a flag that
    selects nothing, duplicate cases or an invalid spec. `validate=False` leaves `RunSpec.validate`
    (which imports a user's model) to whoever trains them: `diff` validates each side with that
    commit's code, in that side's interpreter."""
    specs = (
        config_specs(Path(selection.config)) if selection.config else matrix.default_matrix(selection.quick)
    )
    if selection.device:
        specs = [dataclasses.replace(spec, device=selection.device) for spec in specs]
    if selection.seed is not None:
        specs = [dataclasses.replace(spec, seed=selection.seed) for spec in specs]
    source = (
        f"config file {selection.config}"
        if selection.config
        else ("the quick matrix" if selection.quick else "the default matrix")
    )
    if selection.attention and not selection.config:
        specs += new_attention_specs(selection.attention, specs)
    filters = {"model": selection.model, "attention": selection.attention, "recipe": selection.recipe}
    for field, wanted in filters.items():
        if not wanted:
            continue
        available = sorted({str(getattr(spec, field)) for spec in specs})
        unknown = [w for w in wanted if w not in available]
        if unknown:
            raise UsageError(
                f"--{field} {', '.join(unknown)} is not in {source} (it has "
                f"{', '.join(available)}); for other cases write a --config file "
                "(see docs/cli.md)"
            )
        specs = [spec for spec in specs if str(getattr(spec, field)) in wanted]
    if selection.case:
        cases = {case_id(spec): spec for spec in specs}
        unknown = [c for c in selection.case if c not in cases]
        if unknown:
            raise UsageError(
                f"--case {', '.join(unknown)} is not in the selection from {source} "
                f"(it has {', '.join(sorted(cases)) or 'no cases'})"
            )
        specs = [cases[c] for c in selection.case]
    if not specs:
        raise UsageError(f"the selection from {source} is empty; widen --model/--attention/--recipe")
    if selection.shard is not None:
        index, count = selection.shard
        if count > len(specs):
            raise UsageError(
                f"--shard {index}/{count}: the selection has only {len(specs)} case(s); "
                f"use at most {len(specs)} shards"
            )
        specs = specs[index - 1 :: count]
    ids = [case_id(spec) for spec in specs]
    duplicates = sorted({case for case in ids if ids.count(case) > 1})
    if duplicates:
        raise UsageError(
            f"{source} has several specs for case {', '.join(duplicates)}; a case has one "
            "baseline file, so give each one once"
        )
    for spec in specs if validate else ():  # every spec is checked before the first one trains
        try:
            spec.validate()
        except ValueError as exc:
            raise UsageError(f"{case_id(spec)} from {source}: {exc}") from None
    return specs


def new_attention_specs(names: Sequence[str], specs: Sequence[RunSpec]) -> list[RunSpec]:
    """A figure-A case (the matrix's ViT recipe) for each --attention outside the matrix that names
    a variant: a polynomial such as x^2/4 or a user's function, package.module:function."""
    known = {spec.attention for spec in specs}
    added = []
    for name in dict.fromkeys(names):
        if name in known:
            continue
        try:
            get_attention(name)
        except ValueError:
            continue  # left to the filter's error, which lists what the matrix has
        added.append(RunSpec(model="vit", attention=name, recipe=matrix.VIT_RECIPE))
    return added


def config_specs(path: Path) -> list[RunSpec]:
    """RunSpecs from a TOML file of [[case]] tables whose keys are RunSpec fields, and the user
    recipes its [recipes.NAME] tables declare (made known to this process and the workers it
    spawns through recipe_registry.RECIPES_ENV)."""
    table = _read_toml(path)
    cases = table.get("case")
    if not isinstance(cases, list) or not cases:
        raise UsageError(
            f"{path}: no [[case]] tables; write one per run, e.g.\n"
            '[[case]]\nmodel = "vit"\nattention = "softmax"\nrecipe = "fp32"'
        )
    unknown_tables = sorted(set(table) - {"case", "recipes"})
    if unknown_tables:
        raise UsageError(
            f"{path}: unknown top-level key(s) {', '.join(unknown_tables)}; a config has "
            "[[case]] tables and optional [recipes.NAME] tables"
        )
    os.environ.update(config_recipes(path, table))
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    specs = []
    for number, case in enumerate(cases, 1):
        if not isinstance(case, dict):
            raise UsageError(f"{path}: case number {number} is not a table; write [[case]] tables")
        unknown = sorted(set(case) - fields)
        if unknown:
            raise UsageError(
                f"{path}: [[case]] number {number} has unknown field(s) "
                f"{', '.join(unknown)}; RunSpec fields are {', '.join(sorted(fields))}"
            )
        spec = RunSpec(**case)
        try:  # before anything else reads them: the case id is made of these fields
            spec.check_case_fields()
        except ValueError as exc:
            raise UsageError(f"{path}: [[case]] number {number}: {exc}") from None
        specs.append(spec)
    return specs


def config_recipes(path: Path, table: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The environment that makes the [recipes.NAME] tables of config `path` known to a process
    and its workers (recipe_registry.RECIPES_ENV; {} when it declares none)."""
    table = _read_toml(path) if table is None else table
    try:
        declared = recipe_registry.recipes_from_toml(table.get("recipes", {}), str(path))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return recipe_registry.recipes_environment(declared)


def _read_toml(path: Path) -> dict:
    try:
        return read_toml(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def regen_command(selection: Selection, baseline_dir: str, case: str) -> str:
    """The `baseline update` command that creates `case` with the same selection source."""
    words = ["precision-suite", "baseline", "update", "--case", case]
    if selection.quick:
        words.append("--quick")
    if selection.config:
        words += ["--config", selection.config]
    for name in dict.fromkeys(selection.attention or ()):  # a variant outside the matrix makes its case
        words += ["--attention", name]
    if selection.device:
        words += ["--device", selection.device]
    if baseline_dir != DEFAULT_BASELINE_DIR:
        words += ["--baseline-dir", baseline_dir]
    return shlex.join(words)
