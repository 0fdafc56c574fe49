"""A project's configuration: the [tool.precision_suite] table of its pyproject.toml, with the
threshold rules checked on every case (verdicts.rules) and the tolerance overrides of the
single-run comparison (verdicts.tolerances)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from precision_suite.files import read_toml
from precision_suite.verdicts.rules import Rule, parse_rules
from precision_suite.verdicts.tolerances import tolerances_from_config

CONFIG_KEYS = ("rules", "tolerances", "diff_strict")


@dataclass(frozen=True, slots=True)
class ProjectConfig:
    """[tool.precision_suite] of a project: rules checked on every case, tolerance overrides, and
    whether `diff` fails any change of the numbers (`diff_strict`) instead of changes beyond noise."""

    rules: tuple[Rule, ...] = ()
    tolerances: Mapping[str, Any] = field(default_factory=dict)
    diff_strict: bool = False


def read_project_table(pyproject: str | Path) -> dict[str, Any]:
    """The [tool.precision_suite] table of a pyproject.toml ({} when the file or table is absent)."""
    path = Path(pyproject)
    if not path.is_file():
        return {}
    data = read_toml(path)
    table = data.get("tool", {}).get("precision_suite", {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [tool.precision_suite] must be a table")
    return table


def load_project_config(pyproject: str | Path) -> ProjectConfig:
    """Parse and validate [tool.precision_suite]; errors name the file, key and rule."""
    table = read_project_table(pyproject)
    unknown = sorted(set(table) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"{pyproject}: [tool.precision_suite] has unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(CONFIG_KEYS)}"
        )
    rules = table.get("rules", [])
    if not isinstance(rules, list):
        raise ValueError(f"{pyproject}: [tool.precision_suite] rules must be a list of strings or tables")
    strict = table.get("diff_strict", False)
    if not isinstance(strict, bool):
        raise ValueError(
            f"{pyproject}: [tool.precision_suite] diff_strict must be true or false, got {strict!r}"
        )
    try:
        return ProjectConfig(
            rules=parse_rules(rules), tolerances=tolerances_from_config(table), diff_strict=strict
        )
    except ValueError as err:
        raise ValueError(f"{pyproject}: [tool.precision_suite] {err}") from None
