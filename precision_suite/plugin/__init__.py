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
from typing import TYPE_CHECKING, Any

import pytest

from precision_suite.verdicts.alarm_statement import read_measured, statement_lines

if TYPE_CHECKING:
    import xarray as xr

    from precision_suite.training.matrix import KnownViolation
    from precision_suite.training.runs import RunSpec
    from precision_suite.verdicts.findings import CaseVerdict
    from precision_suite.verdicts.project_config import ProjectConfig

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

        spec = as_spec(spec)
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
        from precision_suite.plugin.case_check import check_case  # lazy, as every import here

        return check_case(
            request.node, settings, precision_run, spec_or_dataset, rules, tolerances, known_violation
        )

    return check


def as_spec(spec: Any) -> RunSpec:
    """`spec`, or the RunSpec of a mapping of its fields ({"model": "vit", ...}: unknown keys are
    refused by name)."""
    from precision_suite.training.runs import RunSpec  # lazy: torch, only once a spec is checked

    return RunSpec.from_json(json.dumps(dict(spec))) if isinstance(spec, Mapping) else spec


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
