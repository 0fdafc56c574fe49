"""`precision-suite diff BASE [HEAD]`: the pull-request gate. The selection is trained with the
code of commit BASE (a temporary git worktree) and with HEAD's (default: the working tree) on this
host, same specs and seeds, so the two runs are bitwise identical unless the code changed the
numbers. Per case: where each metric first differs, and the verdict on the change, judged by the
engine and noise `run` judges with (verdicts/change.py): the case's baseline where it has one,
else BASE's rounding twins measured now; `--strict` fails any change. `bisect` reuses every step.

Each side trains in a fresh interpreter with the side's code first on PYTHONPATH (jobs/checkouts.py):
the user's code and the config's recipe tables come from the commit, and so does precision_suite
itself when the repository holds it (precision-suite's own repository); otherwise every side
measures with a copy of the running tool.

Cases whose runs first differ after step 0 are then measured cleanly (jobs/clean_measurement.py)."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import xarray as xr

from precision_suite.jobs import git
from precision_suite.jobs.checking import finish, judge_and_chart, judge_case, report_folder
from precision_suite.jobs.checkouts import (
    Checkout,
    Side,
    SideRuns,
    first_step_noise,
    side_tree,
    tool_snapshot,
    train_side,
)
from precision_suite.jobs.clean_measurement import Measurement, measure_cleanly, other_lines
from precision_suite.jobs.reference import OPTIONAL, SKIPPED, Reference, load_project, load_reference
from precision_suite.jobs.selection import Selection, selected_specs
from precision_suite.jobs.usage import DEFAULT_BASELINE_DIR, DEFAULT_RULES_FILE
from precision_suite.training.matrix import KNOWN_VIOLATIONS
from precision_suite.training.replays import replay_start
from precision_suite.training.runs import RunSpec, case_id
from precision_suite.verdicts import judge
from precision_suite.verdicts.baseline_files import default_regen_hint, same_numbers
from precision_suite.verdicts.change import first_point_findings, gate_text, set_aside_base, strict_finding
from precision_suite.verdicts.differences import Difference, first_differences, first_of
from precision_suite.verdicts.findings import CaseVerdict, Finding, verdict
from precision_suite.verdicts.observed import check_recipes
from precision_suite.verdicts.project_config import ProjectConfig


@dataclass(frozen=True)
class CaseDiff:
    """One case compared: its differences, earliest first (empty: bitwise identical), the verdict
    on the change (verdicts/change.py) and what judged it."""

    case: str
    differences: tuple[Difference, ...]
    verdict: CaseVerdict
    judged_by: str = ""

    def lines(self, metric: str | None = None) -> list[str]:
        """What `diff` prints for the case: a headline (about `metric` when given and changed),
        then every other changed metric, indented."""
        first = first_of(self.differences, metric) or first_of(self.differences)
        if first is None:
            return [f"numerics unchanged: {self.case} bitwise identical"]
        when = f" {first.when()}" if first.when() else ""
        return [
            f"numerics changed: {self.case}{when}: {first.describe()}",
            *other_lines(self.differences, first, "    "),
        ]


def load_diff_references(
    specs: Sequence[RunSpec], project: ProjectConfig, baseline_dir: str
) -> dict[str, Reference]:
    """case -> what HEAD's change is judged against: the project's rules, and the case's
    baseline and stored replay where they exist for this spec (a case without them is judged
    against BASE's rounding twins)."""
    return {
        case_id(spec): load_reference(
            case_id(spec),
            spec.to_json(),
            baseline_dir=baseline_dir,
            project=project,
            regen_hint=default_regen_hint(case_id(spec)),
            baseline=OPTIONAL,
            replay=SKIPPED if replay_start(spec) is None else OPTIONAL,
            strict=False,
        )
        for spec in specs
    }


def compare_sides(
    base: SideRuns,
    head: SideRuns,
    specs: Sequence[RunSpec],
    references: Mapping[str, Reference],
    report_dir: Path,
    charts: str,
    *,
    strict: bool = False,
    noise: Mapping[str, Mapping[str, float]] | None = None,
    measured: Mapping[str, Measurement] | None = None,
    names: tuple[str, str] = ("HEAD", "BASE"),
    metric: str | None = None,
) -> list[CaseDiff]:
    """Every case of `specs`: its differences and the verdict on HEAD's change (verdicts/change.py):
    against the case's baseline with what BASE's run shows set aside, or else against BASE's run
    within `noise` (its first point's rounding twins, case -> tolerance) and the clean
    replay of `measured`; with `strict`, any change fails. Only the findings of `metric` when given
    (`bisect --metric`)."""
    compared = []
    for spec in specs:
        case = case_id(spec)
        head_run, base_run = head.runs[case], base.runs[case]
        differences = case_differences(base_run, head_run)
        reference = references[case]
        if not differences:
            outcome, judged = verdict(case, []), "bitwise identical"
        elif reference.baseline is not None:
            outcome, judged = (
                _against_baseline(head, base, case, reference, report_dir, charts, names),
                "baseline",
            )
        else:
            clean = (measured or {}).get(case)
            outcome = _against_base(
                head_run,
                base_run,
                case,
                reference,
                (noise or {}).get(case, {}),
                clean,
                report_dir,
                charts,
                names,
            )
            judged = "BASE's rounding twins"
        if strict and differences and not judge.blocks(outcome):
            outcome = verdict(
                case, [strict_finding(case, differences[0].describe()), *outcome.findings], outcome.charts
            )
        if metric is not None:
            outcome = verdict(case, [f for f in outcome.findings if f.metric == metric], outcome.charts)
        compared.append(CaseDiff(case, differences, outcome, "strict" if strict else judged))
    return compared


def _against_baseline(
    head: SideRuns,
    base: SideRuns,
    case: str,
    reference: Reference,
    report_dir: Path,
    charts: str,
    names: tuple[str, str],
) -> CaseVerdict:
    """HEAD and BASE judged against the case's baseline as `run` judges; BASE's findings set aside."""
    head_outcome = judge_case(
        head.runs[case],
        reference,
        report_dir,
        charts,
        replay=head.replays.get(case),
        names=(names[0], "baseline"),
    )
    base_outcome = judge_and_chart(
        base.runs[case], reference, replay=base.replays.get(case), known=KNOWN_VIOLATIONS.get(case, ())
    )
    return verdict(case, set_aside_base(head_outcome.findings, base_outcome.findings), head_outcome.charts)


def _against_base(
    head_run: xr.Dataset,
    base_run: xr.Dataset,
    case: str,
    reference: Reference,
    noise: Mapping[str, float],
    clean: Measurement | None,
    report_dir: Path,
    charts: str,
    names: tuple[str, str],
) -> CaseVerdict:
    """HEAD against BASE's run: its first point within BASE's rounding twins, the clean replay within
    the replay's, the recipes (the suite's and the observed) unchanged; the rules and invariants as `run` checks them,
    what BASE's run shows set aside."""
    # nothing to regenerate: the case has no baseline
    against_base = dataclasses.replace(
        reference, baseline=None, regen_hint="", stored_replay=clean.stored() if clean else None
    )
    extra = [*first_point_findings(head_run, base_run, noise), *check_recipes(head_run, base_run)]
    if clean is not None and clean.problem:  # no noise to judge the change by: it cannot pass
        extra.append(
            Finding.error(
                case,
                "numerics",
                f"numerics changed from step {clean.start} and "
                f"cannot be judged beyond noise without a clean measurement ({clean.problem}); "
                "give the case a baseline, or judge with --strict",
            )
        )
    head_outcome = judge_case(
        head_run,
        against_base,
        report_dir,
        charts,
        extra_findings=extra,
        replay=clean.head if clean and clean.stored() is not None else None,
        drawn_against=base_run,
        names=names,
    )
    base_outcome = judge_and_chart(
        base_run,
        dataclasses.replace(reference, baseline=None, stored_replay=None),
        known=KNOWN_VIOLATIONS.get(case, ()),
    )
    return verdict(case, set_aside_base(head_outcome.findings, base_outcome.findings), head_outcome.charts)


def diff_commits(
    base_ref: str,
    head_ref: str | None,
    selection: Selection,
    *,
    strict: bool | None = None,
    metric: str | None = None,
    rules_file: str = DEFAULT_RULES_FILE,
    baseline_dir: str = DEFAULT_BASELINE_DIR,
    report_dir: str | None = None,
    charts: str = "failing",
    workers: int | None = None,
) -> int:
    """Train the selection with BASE's and HEAD's code, print where each case changed, judge the
    change (verdicts/change.py) and write the report; the exit status (0: unchanged, or changed
    within noise when not strict). `strict` None: the project's `diff_strict` (default false)."""
    root = git.repo_root()
    base = Side("BASE", git.resolve_commit(root, base_ref, "BASE"))
    head = Side("HEAD", None if head_ref is None else git.resolve_commit(root, head_ref, "HEAD"))
    specs = selected_specs(selection, validate=False)  # each side validates them with its own code
    project = load_project(rules_file)
    strict = project.diff_strict if strict is None else strict
    references = load_diff_references(specs, project, baseline_dir)
    config = Path(selection.config).resolve() if selection.config else None
    with (
        tempfile.TemporaryDirectory(prefix="precision-suite-diff-") as name,
        tool_snapshot() as tool,
        side_tree(base, root) as base_tree,
        side_tree(head, root) as head_tree,
    ):
        folder = Path(name)
        base_code, head_code = (
            Checkout(base, root, base_tree, tool, config),
            Checkout(head, root, head_tree, tool, config),
        )
        base_runs = train_side(base_code, specs, folder / "base", workers, baseline_dir)
        head_runs = train_side(head_code, specs, folder / "head", workers, baseline_dir)
        out = report_folder(report_dir)
        names = (_name(root, head), _name(root, base))
        compared, measured = judge_commits(
            base_code,
            head_code,
            specs,
            base_runs,
            head_runs,
            references,
            folder,
            out,
            charts,
            strict=strict,
            metric=metric,
            names=names,
        )
        sides = [base_code.describes(), head_code.describes()]
    print(f"{names[0]} against {names[1]}:")
    print("\n".join(f"  {line}" for line in sides))
    print(f"judged {gate_text(strict, *_judged(compared))}")
    for case in compared:
        print(
            "\n".join(
                case.lines(metric) + (measured[case.case].lines(metric) if case.case in measured else [])
            )
        )
    context = [f"{names[0]} against {names[1]}", *sides, f"judged {gate_text(strict, *_judged(compared))}"]
    return finish(
        [case.verdict for case in compared],
        head_runs.runs,
        out,
        charts,
        title=f"diff: {names[0]} against {names[1]}",
        context=context,
    )


def judge_commits(
    base_code: Checkout,
    head_code: Checkout,
    specs: Sequence[RunSpec],
    base_runs: SideRuns,
    head_runs: SideRuns,
    references: Mapping[str, Reference],
    folder: Path,
    report_dir: Path,
    charts: str,
    *,
    strict: bool,
    metric: str | None = None,
    names: tuple[str, str] = ("HEAD", "BASE"),
) -> tuple[list[CaseDiff], dict[str, Measurement]]:
    """The verdict on each case's change between two trained sides (`compare_sides`), after what
    it needs: the clean measurement of every case that changed after step 0, and for the changed
    cases without a baseline (unless `strict`) BASE's rounding twins of their first step and of
    their clean replay. Returns (the cases compared, their clean measurements)."""
    differences = {
        case_id(spec): case_differences(base_runs.runs[case_id(spec)], head_runs.runs[case_id(spec)])
        for spec in specs
    }
    twinned = (
        []
        if strict
        else [
            spec
            for spec in specs
            if differences[case_id(spec)] and references[case_id(spec)].baseline is None
        ]
    )
    noise = first_step_noise(base_code, twinned, base_runs.runs, folder / "base-twins")
    measured = measure_cleanly(
        base_code, head_code, specs, differences, folder, with_twins=[case_id(spec) for spec in twinned]
    )
    compared = compare_sides(
        base_runs,
        head_runs,
        specs,
        references,
        report_dir,
        charts,
        strict=strict,
        noise=noise,
        measured=measured,
        names=names,
        metric=metric,
    )
    return compared, measured


def case_differences(base: xr.Dataset, head: xr.Dataset) -> tuple[Difference, ...]:
    """Where two runs of one case first differ, earliest first (empty: bitwise identical)."""
    return () if same_numbers(base, head) else tuple(first_differences(base, head))


def _name(root: Path, side: Side) -> str:
    """ "HEAD 1a2b3c4 (its subject)", or "HEAD (working tree)"."""
    return f"{side.name} ({git.subject(root, side.sha)})" if side.sha else side.name


def _judged(compared: Sequence[CaseDiff]) -> tuple[list[str], list[str]]:
    """(cases judged against their baseline, cases judged against BASE's twins)."""
    return (
        [c.case for c in compared if c.judged_by == "baseline"],
        [c.case for c in compared if c.judged_by == "BASE's rounding twins"],
    )
