"""pytest plugin of precision-suite, registered through the `pytest11` entry point.

Any project that installs precision-suite gets:

- options `--precision-regen`, `--precision-baseline-dir`, `--precision-report-dir`,
  `--precision-device` and ini keys `precision_baseline_dir`, `precision_report_dir`,
  `precision_device`;
- markers `precision` (and `slow` unless the project declares it);
- fixtures `precision_run` (run a RunSpec once per session, hand back its dataset) and
  `precision_check` (baselines + threshold rules in one call; failing or drifting cases get a
  chart under the report directory, attached to the test report).

This module is imported in every pytest session of such a project, so it imports nothing heavy at
module level: xarray, torch and matplotlib are imported only when a fixture is used.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from precision_suite.verdicts.alarm_statement import read_measured, statement_lines

if TYPE_CHECKING:
    import xarray as xr

    from precision_suite.jobs.reference import Reference
    from precision_suite.training.matrix import KnownViolation
    from precision_suite.training.runs import RunSpec
    from precision_suite.verdicts.findings import CaseVerdict, Finding
    from precision_suite.verdicts.project_config import ProjectConfig
    from precision_suite.verdicts.rules import Rule

CHART_PROPERTY = "precision_chart"  # user_properties name -> JUnit XML <property>
CASE_PROPERTY = "precision_case"
STATUS_PROPERTY = "precision_status"
BASELINE_PROPERTY = "precision_baseline_written"
DEVICE_RE = re.compile(r"auto|cpu|cuda")  # the devices RunSpec accepts (runs.DEVICES)


@dataclass
class PrecisionSettings:
    """Options of one pytest session, paths resolved."""

    regen: bool
    baseline_dir: Path
    report_dir: Path
    device: str
    pyproject: Path
    seed: int | None = None
    _project: ProjectConfig | None = field(default=None, repr=False)

    def project(self) -> ProjectConfig:
        """[tool.precision_suite] of the rootdir's pyproject.toml, parsed once per session."""
        if self._project is None:
            # lazy: rules are read only by sessions with a pyproject.toml, and pull in xarray
            from precision_suite.verdicts.project_config import load_project_config

            self._project = load_project_config(self.pyproject)
        return self._project


SETTINGS_KEY = pytest.StashKey[PrecisionSettings]()


# --------------------------------------------------------------------------- options and markers


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("precision-suite", "precision-suite numerics regression checks")
    group.addoption(
        "--precision-regen",
        action="store_true",
        default=False,
        help="write the golden baselines of the precision checks that run (missing, "
        "stale or changed ones) instead of comparing with them",
    )
    group.addoption(
        "--precision-baseline-dir",
        default=None,
        metavar="DIR",
        help="folder of golden baselines (default: ini precision_baseline_dir)",
    )
    group.addoption(
        "--precision-report-dir",
        default=None,
        metavar="DIR",
        help="folder for charts of failing or drifting cases (default: ini precision_report_dir)",
    )
    group.addoption(
        "--precision-device",
        default=None,
        metavar="DEVICE",
        help="device for precision runs whose spec says 'auto': auto, cpu or cuda "
        "(default: ini precision_device)",
    )
    group.addoption(
        "--precision-seed",
        default=None,
        type=int,
        metavar="S",
        help="train every precision run with seed S (judged against the baselines' "
        "seed ensembles), e.g. to rotate seeds in CI",
    )
    parser.addini(
        "precision_baseline_dir", "golden baseline folder, relative to rootdir", default="baselines"
    )
    parser.addini("precision_report_dir", "precision chart folder, relative to rootdir", default="reports")
    parser.addini("precision_device", "device for precision runs (auto, cpu or cuda)", default="auto")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "precision: numerics regression check against golden baselines and threshold rules (precision-suite)",
    )
    if not any(line.split(":")[0].strip() == "slow" for line in config.getini("markers")):
        config.addinivalue_line("markers", "slow: long numerics runs; deselect with -m 'not slow'")
    config.stash[SETTINGS_KEY] = _settings(config)
    config.pluginmanager.register(PrecisionSummary(), PrecisionSummary.NAME)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say which [tool.precision_suite] configuration applies, or that none was found, and the
    false-alarm rate calibrate measured on the baselines."""
    settings = config.stash[SETTINGS_KEY]
    if not settings.pyproject.is_file():
        lines = [
            f"no {settings.pyproject} (rootdir {config.rootpath}): no project rules or "
            "tolerance overrides apply"
        ]
    else:
        try:
            project = settings.project()
            lines = [
                f"{len(project.rules)} rule(s), {len(project.tolerances)} tolerance override(s) "
                f"from {settings.pyproject}; baselines {settings.baseline_dir}"
            ]
        except (ValueError, RuntimeError) as err:
            lines = [f"{settings.pyproject}: {err}"]
    try:
        lines += statement_lines(read_measured(settings.baseline_dir))
    except ValueError as err:
        lines.append(str(err))
    return [f"precision-suite: {line}" for line in lines]


def pytest_unconfigure(config: pytest.Config) -> None:
    summary = config.pluginmanager.get_plugin(PrecisionSummary.NAME)
    if summary is not None:
        config.pluginmanager.unregister(summary)


def _settings(config: pytest.Config) -> PrecisionSettings:
    def folder(option: str, ini: str) -> Path:
        given = config.getoption(option)
        if given is not None:  # command-line paths are relative to where pytest was started
            return (config.invocation_params.dir / given).resolve()
        return (config.rootpath / config.getini(ini)).resolve()

    device = config.getoption("precision_device") or config.getini("precision_device")
    if not DEVICE_RE.fullmatch(device):
        raise pytest.UsageError(
            f"--precision-device / precision_device {device!r} is not a device; use auto, cpu or cuda"
        )
    seed = config.getoption("precision_seed")
    if seed is not None and seed < 0:
        raise pytest.UsageError(f"--precision-seed {seed}: use a non-negative integer")
    return PrecisionSettings(
        regen=config.getoption("precision_regen"),
        seed=seed,
        baseline_dir=folder("precision_baseline_dir", "precision_baseline_dir"),
        report_dir=folder("precision_report_dir", "precision_report_dir"),
        device=device,
        pyproject=config.rootpath / "pyproject.toml",
    )


# --------------------------------------------------------------------------- fixtures


class RunCache:
    """`cache(spec) -> Dataset`: runs each distinct spec once per session (per xdist worker).

    The datasets are shared between tests: treat them as read-only.
    """

    def __init__(self, device: str, seed: int | None = None) -> None:
        self.device, self.seed = device, seed
        self._datasets: dict[str, xr.Dataset] = {}

    def __call__(self, spec: Any) -> xr.Dataset:
        from precision_suite.training import runs  # lazy: torch loads with the first precision run

        spec = _as_spec(spec)
        if not isinstance(spec, runs.RunSpec):
            raise TypeError(
                f"precision_run needs a RunSpec (or a dict of its fields), got {type(spec).__name__}"
            )
        spec = self.with_device(spec)
        key = spec.to_json()
        if key not in self._datasets:
            self._datasets[key] = runs.run(spec)
        return self._datasets[key]

    def replay(self, spec: RunSpec, stored: xr.Dataset) -> xr.Dataset:
        """The replay of `spec`'s last steps from the state in `stored` (its seed), once per session."""
        from precision_suite.training import replays  # lazy, as above

        spec = replays.replay_spec(self.with_device(spec), stored)
        key = f"replay {spec.to_json()}"
        if key not in self._datasets:
            self._datasets[key] = replays.replay(spec, stored)
        return self._datasets[key]

    def with_device(self, spec: RunSpec) -> RunSpec:
        """The spec with the session's device (when the spec leaves it to 'auto') and seed."""
        if self.device != "auto" and spec.device == "auto":
            spec = dataclasses.replace(spec, device=self.device)
        return spec if self.seed is None else dataclasses.replace(spec, seed=self.seed)


@pytest.fixture(scope="session")
def precision_run(pytestconfig: pytest.Config) -> Iterator[RunCache]:
    """`precision_run(spec) -> xarray.Dataset`, each spec trained once per session; the user's
    code its specs name is imported from the rootdir (and the installed packages), as the
    command line imports it from the current directory."""
    from precision_suite.training.imports import project_importable  # lazy, as every import here

    settings = pytestconfig.stash[SETTINGS_KEY]
    with project_importable(pytestconfig.rootpath):
        yield RunCache(settings.device, settings.seed)


@pytest.fixture
def precision_check(request: pytest.FixtureRequest, precision_run: RunCache) -> Callable[..., CaseVerdict]:
    """`precision_check(spec_or_dataset, rules=None, tolerances=None, known_violation=None) -> CaseVerdict`.

    Runs the spec (cached) or takes the dataset, compares it with its golden baseline (or writes
    the baseline under --precision-regen), checks the project's rules and `rules`, charts a
    failing or drifting case, and fails the test on a regression, violated rule or error.
    `known_violation`: one or more `KnownViolation`s, each excusing the threshold findings it names.
    """
    settings = request.config.stash[SETTINGS_KEY]

    def check(
        spec_or_dataset: Any,
        rules: Iterable[Any] | None = None,
        tolerances: Mapping[str, Any] | None = None,
        known_violation: KnownViolation | Iterable[KnownViolation] | None = None,
    ) -> CaseVerdict:
        return _check_case(
            request.node, settings, precision_run, spec_or_dataset, rules, tolerances, known_violation
        )

    return check


# --------------------------------------------------------------------------- the check


def _check_case(
    node: pytest.Item,
    settings: PrecisionSettings,
    runner: RunCache,
    spec_or_dataset: Any,
    rules: Iterable[Any] | None,
    tolerances: Mapping[str, Any] | None,
    known_violation: KnownViolation | Iterable[KnownViolation] | None = None,
) -> CaseVerdict:
    # lazy: xarray, torch and matplotlib load with the first precision check, not with pytest
    from precision_suite.files import safe_filename
    from precision_suite.jobs.checking import judge_and_chart
    from precision_suite.jobs.reference import Reference
    from precision_suite.verdicts import judge
    from precision_suite.verdicts.baseline_files import default_regen_hint, in_default_matrix

    project, call_rules, known, ds = _prepare(
        node, settings, runner, spec_or_dataset, rules, tolerances, known_violation
    )
    case = str(ds.attrs["case"])
    hint = f"pytest '{node.nodeid}' --precision-regen"
    if in_default_matrix(case):
        hint += f"  (or: {default_regen_hint(case)})"
    spec = None if _is_dataset(spec_or_dataset) else _as_spec(spec_or_dataset)
    replay = None
    if settings.regen:
        reference = Reference(case, project.rules, regen_hint=hint)
        errors = _regenerate_unless_refused(
            node, settings, ds, None if spec is None else runner.with_device(spec), project, call_rules, known
        )
    else:
        reference, replay = _reference_and_replay(runner, settings, ds, spec, project, hint)
        errors = reference.errors()
    # charts and obtained files are named per test: two tests of one case never share one
    name = safe_filename(node.nodeid)
    outcome = judge_and_chart(
        ds,
        dataclasses.replace(reference, tolerances=(project.tolerances, tolerances or {})),
        case_rules=call_rules,
        known=known,
        replay=replay,
        extra_findings=errors,
        chart_path=settings.report_dir / "charts" / f"{name}.png",
        obtained_path=settings.report_dir / "obtained" / f"{name}.nc",
    )
    node.user_properties.append((CASE_PROPERTY, case))
    node.user_properties.append((STATUS_PROPERTY, outcome.status))
    for chart in outcome.charts:
        node.user_properties.append((CHART_PROPERTY, chart))
    if judge.blocks(outcome):
        pytest.fail(failure_message(outcome), pytrace=False)
    return outcome


def _prepare(
    node: pytest.Item,
    settings: PrecisionSettings,
    runner: RunCache,
    spec_or_dataset: Any,
    rules: Iterable[Any] | None,
    tolerances: Mapping[str, Any] | None,
    known_violation: KnownViolation | Iterable[KnownViolation] | None,
) -> tuple[ProjectConfig, tuple[Rule, ...], tuple[KnownViolation, ...], xr.Dataset]:
    """(the project's configuration, the call's rules, its known violations, the dataset to check);
    the test fails unchecked, with one line saying what is wrong, when one of them is unusable."""
    from precision_suite.verdicts import judge
    from precision_suite.verdicts.baseline_files import REQUIRED_ATTRS
    from precision_suite.verdicts.rules import parse_rules
    from precision_suite.verdicts.tolerances import resolve_tolerances

    problem = None  # pytest.fail is called outside the except blocks: no chained traceback
    try:
        project = settings.project()
        call_rules = parse_rules(rules)
        known = judge.known_violations(known_violation)
        resolve_tolerances(project.tolerances, tolerances)
    except (ValueError, RuntimeError) as err:
        problem = f"precision check configuration: {err}"
    if problem:
        _fail_unchecked(node, spec_or_dataset, problem)
    ds = spec_or_dataset
    if not _is_dataset(spec_or_dataset):
        try:
            ds = runner(spec_or_dataset)
        except (ValueError, TypeError) as err:  # a bad spec: say what is wrong, no deep traceback
            problem = f"precision run of {spec_or_dataset!r}: {err}"
    if problem:
        _fail_unchecked(node, spec_or_dataset, problem)
    missing = [name for name in REQUIRED_ATTRS if name not in ds.attrs]
    if missing:
        _fail_unchecked(
            node,
            spec_or_dataset,
            f"precision check: the dataset lacks attribute(s) {', '.join(missing)}; "
            "pass a RunSpec or a dataset made by precision_suite.run",
        )
    return project, call_rules, known, ds


def _reference_and_replay(
    runner: RunCache,
    settings: PrecisionSettings,
    ds: xr.Dataset,
    spec: RunSpec | None,
    project: ProjectConfig,
    hint: str,
) -> tuple[Reference, xr.Dataset | None]:
    """The case's Reference (what could not be loaded: its `errors`) and, for a spec whose case
    stores a replay (training.replays.replay_start), its replay from the stored state."""
    from precision_suite.jobs.reference import REQUIRED, SKIPPED, load_reference
    from precision_suite.training.replays import replay_start

    replays = spec is not None and replay_start(spec) is not None
    reference = load_reference(
        str(ds.attrs["case"]),
        ds.attrs["spec"],
        baseline_dir=settings.baseline_dir,
        project=project,
        regen_hint=hint,
        replay=REQUIRED if replays else SKIPPED,
        schema_version=int(ds.attrs["schema_version"]),
        strict=False,
    )
    if reference.stored_replay is None:
        return reference, None
    try:
        return reference, runner.replay(spec, reference.stored_replay)
    except ValueError as err:  # the stored state does not fit the spec's model
        return dataclasses.replace(reference, stored_replay=None, missing={"replay": str(err)}), None


def _regenerate_unless_refused(
    node: pytest.Item,
    settings: PrecisionSettings,
    ds: xr.Dataset,
    spec: RunSpec | None,
    project: ProjectConfig,
    call_rules: tuple[Rule, ...],
    known: tuple[KnownViolation, ...],
) -> list[Finding]:
    """Under --precision-regen: write the case's seed-ensemble baseline, unless the run breaks its
    rules (it is not golden) or no spec says how to train it; the refusal as an error finding."""
    from precision_suite.verdicts import judge
    from precision_suite.verdicts.baseline_files import baseline_path
    from precision_suite.verdicts.findings import Finding, verdict
    from precision_suite.verdicts.rules import check_rules

    case = str(ds.attrs["case"])
    before = check_rules(ds, project.rules, case) + check_rules(ds, call_rules, case, strict=True)
    if judge.blocks(verdict(case, judge.excuse(before, known))):
        return [
            Finding.error(
                case,
                "baseline",
                f"baseline {baseline_path(settings.baseline_dir, case)} "
                "not written: a run that breaks its rules is not golden",
            )
        ]
    if spec is None:
        return [
            Finding.error(
                case,
                "baseline",
                "--precision-regen needs a RunSpec (a baseline is a seed "
                "ensemble of the spec), not a dataset",
            )
        ]
    _regenerate(node, spec, settings.baseline_dir)
    return []


def _is_dataset(value: Any) -> bool:
    import xarray as xr  # lazy: only once a precision check runs

    return isinstance(value, xr.Dataset)


def _fail_unchecked(node: pytest.Item, spec_or_dataset: Any, problem: str) -> NoReturn:
    """Fail a check that could not be made; its JUnit XML properties still say so ("error")."""
    from precision_suite.training.runs import case_id  # lazy: torch, only for a failing check

    try:  # the case this check was for, as far as its spec tells
        case = (
            str(spec_or_dataset.attrs.get("case", "?"))
            if hasattr(spec_or_dataset, "attrs")
            else case_id(_as_spec(spec_or_dataset))
        )
    except (AttributeError, TypeError, ValueError):
        case = "?"
    node.user_properties.append((CASE_PROPERTY, case))
    node.user_properties.append((STATUS_PROPERTY, "error"))
    pytest.fail(problem, pytrace=False)


def _as_spec(spec: Any) -> RunSpec:
    """`spec`, or the RunSpec of a mapping of its fields ({"model": "vit", ...}: unknown keys are
    refused by name)."""
    from precision_suite.training.runs import RunSpec  # lazy: torch, only once a spec is checked

    return RunSpec.from_json(json.dumps(dict(spec))) if isinstance(spec, Mapping) else spec


def _regenerate(node: pytest.Item, spec: RunSpec, baseline_dir: Path) -> None:
    """Write the seed-ensemble baseline, unless it already holds these numbers (no git churn)."""
    from precision_suite.jobs.regenerate import regenerate  # lazy: torch, only under --precision-regen

    for path, written in regenerate([spec], baseline_dir):
        if written:
            node.user_properties.append((BASELINE_PROPERTY, str(path)))


def failure_message(outcome: CaseVerdict) -> str:
    lines = [
        f"precision check of {outcome.case}: {outcome.status.upper()} ({len(outcome.findings)} finding(s))"
    ]
    lines += [f"  [{f.kind}] {f.message}" for f in outcome.findings]
    lines += [f"  chart: {chart}" for chart in outcome.charts]
    return "\n".join(lines)


# --------------------------------------------------------------------------- terminal summary


class PrecisionSummary:
    """Collects cases, statuses, charts and written baselines from test reports (also those that
    pytest-xdist workers send to the controller) and lists them at the end of the session."""

    NAME = "precision_suite_summary"
    PROPERTIES = (CASE_PROPERTY, STATUS_PROPERTY, CHART_PROPERTY, BASELINE_PROPERTY)

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, list[str]]] = {}  # nodeid -> property -> values

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":  # later reports repeat the same user_properties
            return
        for name, value in report.user_properties:
            if name in self.PROPERTIES:
                self.tests.setdefault(report.nodeid, {}).setdefault(name, []).append(str(value))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        lines = []
        for nodeid, props in self.tests.items():
            for case, status in zip(props.get(CASE_PROPERTY, []), props.get(STATUS_PROPERTY, [])):
                if status != "pass":
                    lines.append(f"{status.upper():6} {case}  ({nodeid})")
            lines += [f"chart  {chart}" for chart in props.get(CHART_PROPERTY, [])]
            lines += [f"baseline written  {path}" for path in props.get(BASELINE_PROPERTY, [])]
        if lines:
            terminalreporter.write_sep("-", "precision-suite")
            for line in lines:
                terminalreporter.write_line(line)
