"""Saved results (`run --save-results DIR`): their files, loading, pairing BASE with NEW by case
id, and `--fail METRIC:TOL` overrides, for `compare` and `report`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import xarray as xr

from precision_suite.files import load_dataset, safe_filename
from precision_suite.jobs.usage import UsageError
from precision_suite.verdicts.baseline_files import spec_differences
from precision_suite.verdicts.rule_check import run_spec
from precision_suite.verdicts.stored_replays import REPLAY_FOLDER
from precision_suite.verdicts.tolerances import DEFAULT_TOLERANCES, resolve_tolerances


def result_path(folder: str, case: str) -> Path:
    """`folder/<case>.nc`, the case id made file-name safe."""
    return Path(folder) / f"{safe_filename(case)}.nc"


def replay_folder(folder: str) -> Path:
    """`folder/replays/`: the replays of the runs saved in `folder` (`load_results` reads a
    folder's own .nc files only, so they do not count as cases)."""
    return Path(folder) / REPLAY_FOLDER


def replay_result_path(folder: str, case: str) -> Path:
    return replay_folder(folder) / f"{safe_filename(case)}.nc"


def load_results(location: str, what: str) -> dict[str, xr.Dataset]:
    """case -> dataset for a .nc file or every .nc file in a folder."""
    path = Path(location)
    if path.is_dir():
        result_files = sorted(path.glob("*.nc"))
        if not result_files:
            raise UsageError(
                f"{what} {path} holds no .nc files; save results with "
                "`precision-suite run --save-results DIR`"
            )
    elif path.is_file():
        result_files = [path]
    else:
        raise UsageError(f"{what} {path} does not exist; give a .nc result file or a folder of them")
    results: dict[str, xr.Dataset] = {}
    for file in result_files:
        try:
            ds = load_dataset(file)
        except Exception as exc:  # h5py/xarray raise many types for a damaged file
            raise UsageError(
                f"{what} {file} is not a readable result file ({type(exc).__name__}: "
                f"{exc}); write results with `precision-suite run --save-results DIR`"
            ) from None
        case = ds.attrs.get("case")
        if not case:
            raise UsageError(
                f"{what} {file} has no `case` attribute; it was not written by "
                "precision-suite (use `run --save-results`)"
            )
        if case in results:
            raise UsageError(f"{what} {path} holds case {case!r} twice; keep one file per case")
        results[case] = ds
    return results


def merge_shards(locations: Sequence[str]) -> dict[str, xr.Dataset]:
    """case -> dataset from several result folders (one per CI shard); a case in two is an error."""
    results: dict[str, xr.Dataset] = {}
    origin: dict[str, str] = {}
    for location in locations:
        for case, ds in load_results(location, "RESULTS").items():
            if case in results:
                raise UsageError(
                    f"RESULTS {origin[case]} and {location} both hold case {case!r}; "
                    "each case belongs to one shard: give each folder once"
                )
            results[case], origin[case] = ds, location
    return results


def pair_results(
    base: Mapping[str, xr.Dataset], new: Mapping[str, xr.Dataset], base_location: str, new_location: str
) -> dict[str, tuple[xr.Dataset, xr.Dataset]]:
    """case -> (base, new); any case or spec that does not match is a usage error."""
    if len(base) == 1 and len(new) == 1 and Path(base_location).is_file() and Path(new_location).is_file():
        (base_case, base_ds), (new_case, new_ds) = next(iter(base.items())), next(iter(new.items()))
        pairs = {new_case: (base_ds, new_ds)}
        if base_case != new_case:
            _raise_spec_mismatch(
                new_case, base_ds, new_ds, f"BASE is case {base_case!r}, NEW is case {new_case!r}"
            )
    else:
        only_base, only_new = sorted(set(base) - set(new)), sorted(set(new) - set(base))
        if only_base or only_new:
            parts = ([f"only in BASE: {', '.join(only_base)}"] if only_base else []) + (
                [f"only in NEW: {', '.join(only_new)}"] if only_new else []
            )
            raise UsageError(
                f"BASE and NEW hold different cases ({'; '.join(parts)}); compare "
                "results of the same cases, or pass two single .nc files"
            )
        pairs = {case: (base[case], new[case]) for case in sorted(new)}
    for case, (base_ds, new_ds) in pairs.items():
        if base_ds.attrs.get("spec") != new_ds.attrs.get("spec"):
            _raise_spec_mismatch(case, base_ds, new_ds, "")
    return pairs


def _raise_spec_mismatch(case: str, base_ds: xr.Dataset, new_ds: xr.Dataset, context: str) -> None:
    def spec(ds: xr.Dataset) -> dict:  # an unreadable spec is compared as its raw text
        return run_spec(ds) or {"spec": ds.attrs.get("spec")}

    differences = spec_differences(spec(base_ds), spec(new_ds)) or ["spec attributes differ"]
    prefix = f"{context}; " if context else f"case {case}: "
    raise UsageError(
        f"{prefix}BASE and NEW were made from different specs "
        f"({'; '.join(differences)}, with BASE as the baseline and NEW as current); "
        "compare results of the same spec"
    )


def parse_fail_rules(rules: Sequence[str]) -> dict[str, float]:
    """`--fail metric:tolerance` flags as tolerance overrides {metric: tolerance}."""
    overrides: dict[str, float] = {}
    for rule in rules:
        metric, sep, number = rule.partition(":")
        try:
            tolerance = float(number)
        except ValueError:
            tolerance = float("nan")
        if not sep or not metric or not (tolerance >= 0 and tolerance != float("inf")):
            raise UsageError(
                f"--fail {rule!r}: write METRIC:TOLERANCE with a finite tolerance "
                ">= 0, e.g. --fail underflow:1e-3"
            )
        overrides[metric.strip()] = tolerance
    try:
        resolve_tolerances(overrides)
    except ValueError as exc:
        raise UsageError(
            f"--fail: {exc}; metrics with a tolerance: {', '.join(DEFAULT_TOLERANCES)}"
        ) from None
    return overrides
