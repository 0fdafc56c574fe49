"""What a case is judged against, loaded in one place for every entry point.

A `Reference` holds the project's threshold rules and tolerance overrides
([tool.precision_suite]), the case's seed-ensemble baseline, its stored replay and the command
that regenerates them. `run`, `calibrate`, `report`, `diff`, `history record` and the pytest plugin
load it with `load_reference`, each saying which parts it needs (REQUIRED, OPTIONAL, SKIPPED) and
whether a missing required part stops the command (`strict`: a one-line UsageError) or is reported
in the verdict (the plugin: `Reference.errors`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import SCHEMA_VERSION
from precision_suite.jobs.usage import DEFAULT_RULES_FILE, UsageError
from precision_suite.training.replays import replay_start
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts import baseline_files, stored_replays
from precision_suite.verdicts.findings import Finding
from precision_suite.verdicts.project_config import ProjectConfig, load_project_config
from precision_suite.verdicts.rules import Rule

REQUIRED, OPTIONAL, SKIPPED = "required", "optional", "skipped"
PARTS = ("baseline", "replay")  # a Reference's files, named as the error findings of their absence


@dataclass(frozen=True)
class Reference:
    """What one case is judged against.

    rules: checked where they match (the project's); tolerances: overrides of the single-run
    tolerance table, applied in order. baseline: the seed ensemble (for `compare` and `diff`, one
    saved run). stored_replay: what the case's replay is judged against. missing: why each part
    that was asked for is absent, by part ("baseline", "replay"); required: the parts asked for
    as REQUIRED.
    """

    case: str
    rules: tuple[Rule, ...] = ()
    tolerances: Sequence[Mapping[str, Any]] = ()
    baseline: xr.Dataset | None = None
    stored_replay: xr.Dataset | None = None
    regen_hint: str = ""
    missing: Mapping[str, str] = field(default_factory=dict)
    required: tuple[str, ...] = ()

    def errors(self) -> list[Finding]:
        """An error finding per required part that could not be loaded."""
        return [
            Finding.error(self.case, part, message)
            for part, message in self.missing.items()
            if part in self.required
        ]


def load_project(rules_file: str) -> ProjectConfig:
    """[tool.precision_suite] of `rules_file` (none if the default file is absent); UsageError
    naming the file or rule otherwise."""
    if not Path(rules_file).is_file() and rules_file != DEFAULT_RULES_FILE:
        raise UsageError(
            f"--rules {rules_file} does not exist; give the pyproject.toml that holds [tool.precision_suite]"
        )
    try:
        return load_project_config(rules_file)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"{exc}; fix the rule (grammar in docs/baselines.md)") from None


def load_reference(
    case: str,
    spec_json: str | None,
    *,
    baseline_dir: str | Path | None,
    project: ProjectConfig | None = None,
    regen_hint: str = "",
    baseline: str = REQUIRED,
    replay: str = SKIPPED,
    schema_version: int = SCHEMA_VERSION,
    strict: bool = True,
) -> Reference:
    """The Reference of `case`, whose runs are made from `spec_json`. `baseline` and `replay` say
    whether its ensemble and its stored replay are REQUIRED, OPTIONAL or SKIPPED; the stored replay
    is read only when the ensemble, if asked for, was. A part that cannot be read (missing, corrupt,
    made for another spec) is absent, its reason in `missing`; with `strict`, a REQUIRED one raises
    UsageError saying how to create it instead."""
    loaded: dict[str, xr.Dataset | None] = dict.fromkeys(PARTS)
    missing: dict[str, str] = {}
    needs = {"baseline": baseline, "replay": replay}
    for part in PARTS:
        if needs[part] == SKIPPED or (part == "replay" and "baseline" in missing):
            continue
        try:
            if part == "baseline":
                loaded[part] = baseline_files.load_ensemble(
                    baseline_files.baseline_path(baseline_dir, case),
                    expected_spec=spec_json,
                    expected_schema_version=schema_version,
                    regen_hint=regen_hint or None,
                )
            else:
                loaded[part] = stored_replays.load_replay(
                    baseline_dir, case, expected_spec=spec_json, regen_hint=regen_hint or None
                )
        except baseline_files.BaselineError as exc:
            if strict and needs[part] == REQUIRED:
                raise UsageError(str(exc)) from None
            missing[part] = str(exc)
    return Reference(
        case,
        rules=tuple(project.rules) if project else (),
        tolerances=(project.tolerances,) if project else (),
        baseline=loaded["baseline"],
        stored_replay=loaded["replay"],
        regen_hint=regen_hint,
        missing=missing,
        required=tuple(part for part in PARTS if needs[part] == REQUIRED),
    )


def load_references(
    specs: Sequence[RunSpec], project: ProjectConfig, baseline_dir: str, regen_hint: Callable[[str], str]
) -> dict[str, Reference]:
    """The Reference of every spec, by case id, for a command that trains them: each ensemble
    required, and each stored replay of a case that keeps one (training.replays.replay_start).
    Every file is read before the first minute of training; UsageError for a missing one."""
    return {
        case_id(spec): load_reference(
            case_id(spec),
            spec.to_json(),
            baseline_dir=baseline_dir,
            project=project,
            regen_hint=regen_hint(case_id(spec)),
            replay=SKIPPED if replay_start(spec) is None else REQUIRED,
        )
        for spec in specs
    }
