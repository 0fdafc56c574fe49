"""`history record` and `history report`: the numerics of every recorded commit, per host and case.

The store is a folder of plain files that a CI cache or artifact carries:

    STORE/precision-suite-history.json        {"history_schema_version": 1}
    STORE/<host>/<case>/<full commit SHA>.nc   one record (verdicts.history_records.summarize), netCDF classic

netCDF, one small file per record, rather than one Zarr store with a growing `commit` dimension:
netCDF is already how runs and baselines are kept, so no new dependency; and a record is
written as a whole file, atomically (files.atomic_file: a temp file renamed onto its place), so
two jobs recording at once never write into one file: each record lands whole, the store is never
half-written, and the same commit, host and case recorded again replaces its file (the later write
wins) instead of appending a duplicate. Appending to one Zarr array from two processes needs a lock
the CI cache cannot give. The report concatenates the records of a case along `commit` (xarray),
so the history is one dataset per host and case when it is read.

Records are netCDF classic files written and read by scipy (already a dependency), not the
HDF5-based netCDF4 of runs and baselines: a record is a few small arrays, and HDF5's per-variable
overhead makes reading one an order of magnitude slower, most of a long report's time; the
uncompressed classic files are smaller too (docs/performance.md).

`<host>` is a short hash of the runs' fingerprint (vector ISA, device, threads, torch, Python, the
platform's system, machine and C library) without the kernel's release, which runner images update
under the same numbers: a history is a series of one host's bitwise-reproducible runs, and another
host's runs form another series.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from precision_suite.files import SCHEMA_VERSION, atomic_file, load_dataset, safe_filename, write_json
from precision_suite.jobs import git, results
from precision_suite.jobs.checking import report_folder
from precision_suite.jobs.reference import OPTIONAL, load_reference
from precision_suite.jobs.selection import Selection
from precision_suite.jobs.usage import DEFAULT_BASELINE_DIR, EXIT_OK, UsageError
from precision_suite.reports.history_report import write_history_report
from precision_suite.verdicts.history_records import HISTORY_SCHEMA_VERSION, summarize
from precision_suite.verdicts.history_steps import CaseHistory, case_history
from precision_suite.version import __version__

STORE_MARKER = "precision-suite-history.json"
RECORD_ENGINE = "scipy"  # netCDF classic (module docstring)
_MACHINE = re.compile(r"-(x86_64|amd64|aarch64|arm64|armv7l|ppc64le|s390x|i686|riscv64)(?=-|$)")


def host_of(ds: xr.Dataset) -> tuple[str, dict[str, Any]]:
    """(the store's folder name for the host a run was made on, its fingerprint as recorded). The
    name hashes the fingerprint with the platform string cut to its system, machine and C library:
    the kernel's release changes with runner image updates under the same numbers."""
    fingerprint = json.loads(ds.attrs.get("fingerprint") or "{}")
    kept = dict(fingerprint)
    if "platform" in kept:
        text = str(kept["platform"])
        machine = _MACHINE.search(text)
        kept["platform"] = " ".join(
            [text.split("-")[0], machine.group(1) if machine else "", text.partition("-with-")[2]]
        )
    return hashlib.sha1(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:12], fingerprint


def host_label(fingerprint: dict[str, Any]) -> str:
    """'cpu AVX512, torch 2.13.0+cpu, 1 thread(s)'"""
    return (
        f"{fingerprint.get('device', '?')} {fingerprint.get('cpu_capability', '')}".rstrip()
        + f", torch {fingerprint.get('torch', '?')}, {fingerprint.get('threads', '?')} thread(s)"
    )


def store_schema(store: Path, *, create: bool) -> Path:
    """`store`, checked to be a history store this version reads (created when `create`)."""
    marker = store / STORE_MARKER
    if store.exists() and not store.is_dir():
        raise UsageError(f"--store {store} is a file; give a folder for the history store")
    if marker.is_file():
        try:
            version = json.loads(marker.read_text(encoding="utf-8")).get("history_schema_version")
        except (OSError, ValueError, AttributeError) as exc:
            raise UsageError(
                f"--store {store}: {marker} is not readable JSON ({exc}); restore it or "
                "record into a new --store folder"
            ) from None
        if version != HISTORY_SCHEMA_VERSION:
            raise UsageError(
                f"--store {store} holds history schema {version!r}, this precision-suite "
                f"{__version__} reads {HISTORY_SCHEMA_VERSION}; record into a new --store "
                f"folder (or read this one with the precision-suite version that wrote it)"
            )
        return store
    # hidden temp files are another recorder creating this store at the same time (files.atomic_path)
    if store.is_dir() and any(not entry.name.startswith(".") for entry in store.iterdir()):
        raise UsageError(
            f"--store {store} is not a history store (no {STORE_MARKER}) and is not empty; "
            "give an empty or new folder"
        )
    if not create:
        raise UsageError(
            f"--store {store} holds no history yet; record runs into it first with "
            "`precision-suite history record RESULTS --store DIR`"
        )
    write_json({"history_schema_version": HISTORY_SCHEMA_VERSION}, marker)
    return store


def series_name(case: str, seed: int) -> str:
    """A history's name: the case, and the seed when a run was trained with another than 0 (a
    case id leaves the seed out, and another seed's run is another series, not a step)."""
    return case if seed == 0 else f"{case} seed {seed}"


def record_path(store: Path, host: str, case: str, sha: str, seed: int = 0) -> Path:
    return store / host / safe_filename(series_name(case, seed)) / f"{sha}.nc"


def encode_record(record: xr.Dataset) -> bytes:
    """A record's file, in memory: every record of a command is encoded before the first is
    written. Element counts become float64 (netCDF classic has no 64-bit integers)."""
    if "numel" in record.data_vars:
        record = record.assign(numel=record["numel"].astype(np.float64))
    return bytes(record.to_netcdf(engine=RECORD_ENGINE))


def write_record(encoded: bytes, path: Path) -> None:
    """One record, atomically: a concurrent writer of the same path wins or loses whole."""
    with atomic_file(path) as handle:
        handle.write(encoded)


def record_results(
    locations: Sequence[str],
    store_dir: str,
    *,
    commit: str = "HEAD",
    branch: str | None = None,
    baseline_dir: str = DEFAULT_BASELINE_DIR,
) -> int:
    """Record saved results (`run --save-results` folders; replays in their `replays/`) as commit
    `commit` of the repository holding the working directory. Every input is read, checked and
    every record encoded before the first file is written."""
    root = git.repo_root()
    sha = git.resolve_commit(root, commit, "--commit")
    if git.is_shallow(root):
        raise UsageError(
            f"{root} is a shallow clone: a commit's place in the history (its first-parent "
            "depth) cannot be counted; fetch the history (`git fetch --unshallow`, or "
            "actions/checkout with fetch-depth: 0)"
        )
    # the checked-out branch names HEAD only; another commit is recorded on no branch unless given
    info = {
        **git.commit_info(root, sha),
        "branch": branch if branch is not None else (git.branch(root) if commit == "HEAD" else ""),
    }
    runs = results.merge_shards(locations)
    replayed = {
        case: ds
        for location in locations
        if results.replay_folder(location).is_dir()
        for case, ds in results.load_results(str(results.replay_folder(location)), "RESULTS replays").items()
    }
    for case, ds in runs.items():
        if ds.attrs.get("schema_version") != SCHEMA_VERSION:
            raise UsageError(
                f"RESULTS: case {case} was saved with run-dataset schema "
                f"{ds.attrs.get('schema_version')}, this precision-suite reads {SCHEMA_VERSION} "
                f"(its numbers may be measured otherwise); record results of this version: "
                f"`precision-suite run --save-results DIR` at commit {sha[:12]}"
            )
    if commit == "HEAD" and git.is_dirty(root):
        print(
            f"precision-suite: warning: the working tree has uncommitted changes; the results are "
            f"recorded as commit {sha[:12]}",
            file=sys.stderr,
        )
    records = []
    for case, ds in runs.items():
        # a case without a baseline (a user's model with none) records no noise level
        reference = load_reference(
            case, ds.attrs.get("spec"), baseline_dir=baseline_dir, baseline=OPTIONAL, replay=OPTIONAL
        )
        missing = reference.missing.get("baseline", "").split(";")[0]
        host, fingerprint = host_of(ds)
        seed = int(json.loads(ds.attrs.get("spec") or "{}").get("seed") or 0)
        record = summarize(
            ds, ensemble=reference.baseline, replay=replayed.get(case), stored_replay=reference.stored_replay
        )
        record = record.assign_attrs(
            case=case,
            seed=seed,
            spec=ds.attrs.get("spec", ""),
            host=host,
            fingerprint=json.dumps(fingerprint, sort_keys=True),
            recorded=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            package_version=__version__,
            **info,
        )
        note = (
            f"; {missing}, so no noise level: its series are drawn, not searched for steps" if missing else ""
        )
        records.append(
            (
                record_path(Path(store_dir), host, case, info["commit"], seed),
                encode_record(record),
                f"{case} (host {host}: {host_label(fingerprint)}){note}",
            )
        )
    store = store_schema(Path(store_dir), create=True)
    print(f"commit {sha[:12]} {info['subject']!r}{' on ' + info['branch'] if info['branch'] else ''}")
    for path, encoded, label in records:
        replaced = path.exists()
        write_record(encoded, path)
        print(f"  {'replaced' if replaced else 'recorded'} {label}")
    print(f"{len(records)} record(s) in {store}")
    return EXIT_OK


RECORD_ATTRS = ("case", "host", "fingerprint", "commit", "commit_time", "commit_depth", "subject", "branch")


def load_histories(
    store: Path, keep: Selection, since: str | None, branch: str | None = None
) -> list[CaseHistory]:
    """Every host and case of the store that `keep` selects, its records along `commit` in the
    order of the first-parent history (`git.commit_info`'s depth; commit time between equal
    depths), from the commit `since` names on, of `branch` only when given."""
    files = sorted(store.glob("*/*/*.nc"))
    if not files:
        raise UsageError(
            f"--store {store} holds no records; add some with "
            "`precision-suite history record RESULTS --store DIR`"
        )
    since_depth = None
    if since is not None:
        root = git.repo_root()
        since_depth = git.commit_info(root, git.resolve_commit(root, since, "--since"))["commit_depth"]
    grouped: dict[tuple[str, str], list[xr.Dataset]] = {}
    for file in files:
        record = _read_record(store, file)
        spec = json.loads(record.attrs.get("spec") or "{}")
        if not keep.matches(record.attrs["case"], spec) or (
            branch is not None and record.attrs["branch"] != branch
        ):
            continue
        if since_depth is not None and int(record.attrs["commit_depth"]) < since_depth:
            continue
        key = series_name(record.attrs["case"], int(record.attrs.get("seed", 0)))
        grouped.setdefault((record.attrs["host"], key), []).append(record)
    if not grouped:
        limits = [f"--since {since}"] * (since is not None) + [f"--branch {branch}"] * (branch is not None)
        raise UsageError(
            f"--store {store} holds no records of the selected cases"
            f"{' with ' + ' and '.join(limits) if limits else ''}; widen the selection"
        )
    return [_case_history(name, records) for (_, name), records in sorted(grouped.items())]


def _read_record(store: Path, file: Path) -> xr.Dataset:
    """A record of the store; UsageError (one line) for one that is unreadable, of another
    schema, or lacks what the report orders and names commits by."""
    try:
        record = load_dataset(file, engine=RECORD_ENGINE)
    except Exception as exc:  # scipy/xarray raise many types for a damaged file
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise UsageError(
            f"--store {store}: record {file} is unreadable ({type(exc).__name__}: {reason}); "
            "delete it and record that commit again"
        ) from None
    if record.attrs.get("history_schema_version") != HISTORY_SCHEMA_VERSION:
        raise UsageError(
            f"--store {store}: record {file} has history schema "
            f"{record.attrs.get('history_schema_version')!r}, this version reads "
            f"{HISTORY_SCHEMA_VERSION}; delete it or record into a new store"
        )
    missing = [name for name in RECORD_ATTRS if name not in record.attrs]
    if missing:
        raise UsageError(
            f"--store {store}: record {file} lacks {', '.join(missing)} (not written by "
            "`precision-suite history record`); delete it and record that commit again"
        )
    return record


def _case_history(name: str, records: list[xr.Dataset]) -> CaseHistory:
    records.sort(
        key=lambda r: (
            int(r.attrs["commit_depth"]),
            _dt.datetime.fromisoformat(r.attrs["commit_time"]),
            r.attrs["commit"],
        )
    )
    commits = [{key: r.attrs[key] for key in ("commit", "commit_time", "subject", "branch")} for r in records]
    data = xr.concat(
        records, dim="commit", join="outer", coords="minimal", compat="override", combine_attrs="drop"
    )
    last = records[-1].attrs
    return case_history(
        name,
        last["host"],
        host_label(json.loads(last["fingerprint"])),
        commits,
        data.assign_coords(commit=[c["commit"] for c in commits]),
    )


def report_history(
    store_dir: str,
    keep: Selection,
    *,
    since: str | None,
    branch: str | None = None,
    report_dir: str | None,
    charts: str,
) -> int:
    """Per host and case: the headline series over commits, their steps, the report folder."""
    store = store_schema(Path(store_dir), create=False)
    cases = load_histories(store, keep, since, branch)
    out = report_folder(report_dir)  # only once the store has been read: nothing written on bad input
    write_history_report(cases, out, charts=charts)
    for case in cases:
        print(
            f"{case.case} (host {case.host}: {case.host_label}): {len(case.commits)} commit(s), "
            f"{len(case.steps)} step(s)"
        )
        for step in case.steps[:10]:
            commit = case.commits[step.index]
            print(f"  step at {commit['commit'][:12]} {commit['subject']!r}: {step.describe()}")
        if len(case.steps) > 10:
            print(f"  ... and {len(case.steps) - 10} more (summary.json)")
    print(f"report: {out / 'index.html'}")
    return EXIT_OK
