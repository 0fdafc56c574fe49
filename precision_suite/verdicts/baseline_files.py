"""Golden baseline files: one netCDF file per case, read and written safely.

A baseline is a case's seed ensemble (verdicts.ensemble) of run datasets (schema in
docs/architecture.md) stored as `<baseline_dir>/<case>.nc`. Its attributes say what it is:
`schema_version`, `case`, `spec` (JSON), `fingerprint` (JSON) and `package_version`. Loading
checks all of them against what the caller expects, so a stale or foreign file fails loudly
instead of passing silently, with the command that recreates it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xarray as xr

from precision_suite.files import NETCDF_ENGINE, SCHEMA_VERSION, safe_filename, save_dataset
from precision_suite.verdicts.ensemble.series import EnsembleError, check_ensemble
from precision_suite.verdicts.findings import to_python

REQUIRED_ATTRS = ("schema_version", "case", "spec", "fingerprint", "package_version")
EXECUTION_FIELDS = (
    "device",
    "seed",
    "threads",
)  # spec fields that do not define the case (see spec_differences)


class BaselineError(Exception):
    """A baseline file that cannot be used: missing, corrupt, or made for another schema or spec."""


def baseline_path(baseline_dir: str | os.PathLike, case: str) -> Path:
    """`<baseline_dir>/<case>.nc`, the case id made file-name safe (`files.safe_filename`)."""
    return Path(baseline_dir) / f"{safe_filename(case)}.nc"


def save_baseline(ds: xr.Dataset, path: str | os.PathLike) -> Path:
    """Write `ds` as a baseline file atomically (unique temp file in the same folder + rename).

    Concurrent writers (pytest-xdist workers) never see or leave a half-written file.
    """
    missing = [name for name in REQUIRED_ATTRS if name not in ds.attrs]
    if missing:
        raise BaselineError(
            f"cannot save a baseline without attribute(s) {', '.join(missing)}; "
            "save datasets made by precision_suite.run"
        )
    return save_dataset(ds, path)


def update_baseline(ds: xr.Dataset, path: str | os.PathLike) -> bool:
    """Write `ds` as the baseline at `path` unless it already holds exactly these numbers (no
    churn in git); True when written. A missing, stale or corrupt file is replaced."""
    try:
        existing = load_baseline(
            path, expected_spec=ds.attrs["spec"], expected_schema_version=int(ds.attrs["schema_version"])
        )
    except BaselineError:
        existing = None
    if existing is not None and same_numbers(existing, ds):
        return False
    save_baseline(ds, path)
    return True


def default_regen_hint(case: str) -> str:
    """A command that recreates `case`: `baseline update --case` for a case of the built-in matrix;
    any other case is defined by a config file or a test, which must be named too."""
    if in_default_matrix(case):
        return f"precision-suite baseline update --case '{case}'"
    return (
        f"precision-suite baseline update --config <the file defining it> --case '{case}' "
        "(or, for a pytest case, pytest <its test> --precision-regen)"
    )


def in_default_matrix(case: str) -> bool:
    # lazy: the matrix loads torch (runs.py); the plugin's header and `compare` need no torch
    from precision_suite.training.matrix import default_matrix
    from precision_suite.training.runs import case_id

    return case in {case_id(spec) for spec in default_matrix()}


def load_baseline(
    path: str | os.PathLike,
    *,
    expected_spec: str | Mapping[str, Any] | None = None,
    expected_schema_version: int = SCHEMA_VERSION,
    regen_hint: str | None = None,
) -> xr.Dataset:
    """Read a baseline into memory, checking schema version and (if given) the spec it was run with.

    Raises BaselineError naming the file and saying how to create it again (`regen_hint`, by
    default the `precision-suite baseline update` command for the file's case).
    """
    path = Path(path)
    hint = regen_hint or default_regen_hint(path.stem)
    if not path.is_file():
        raise BaselineError(f"no baseline {path}; create it with: {hint}")
    try:
        with xr.open_dataset(path, engine=NETCDF_ENGINE) as stored:
            ds = stored.load()
    except Exception as err:  # h5py/xarray raise many types for a damaged file
        raise BaselineError(
            f"baseline {path} is corrupt or not a netCDF file "
            f"({type(err).__name__}: {err}); recreate it with: {hint}"
        ) from None
    hint = regen_hint or default_regen_hint(str(ds.attrs.get("case", path.stem)))
    missing = [name for name in REQUIRED_ATTRS if name not in ds.attrs]
    if missing:
        raise BaselineError(
            f"baseline {path} lacks attribute(s) {', '.join(missing)}; recreate it with: {hint}"
        )
    try:
        version = int(ds.attrs["schema_version"])
    except (TypeError, ValueError):
        version = None
    if version != expected_schema_version:
        raise BaselineError(
            f"baseline {path} has schema_version {to_python(ds.attrs['schema_version'])!r}, "
            f"this precision-suite reads {expected_schema_version}; "
            f"recreate it with: {hint}"
        )
    if expected_spec is not None:
        differences = spec_differences(
            _spec_dict(ds.attrs["spec"], f"baseline {path}"), _spec_dict(expected_spec, "the current spec")
        )
        if differences:
            raise BaselineError(
                f"baseline {path} was made for another spec ({'; '.join(differences)}); "
                f"if the change is intended, recreate it with: {hint}"
            )
    return ds


def load_ensemble(path: str | os.PathLike, **kwargs: Any) -> xr.Dataset:
    """`load_baseline`, then check that the file is a seed ensemble (BaselineError otherwise)."""
    ds = load_baseline(path, **kwargs)
    try:
        check_ensemble(ds, path)
    except EnsembleError as err:
        hint = kwargs.get("regen_hint") or default_regen_hint(str(ds.attrs.get("case", Path(path).stem)))
        raise BaselineError(f"{err}; recreate it with: {hint}") from None
    return ds


def spec_differences(baseline: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One 'field: baseline X, current Y' line per spec field that differs.

    Fields in EXECUTION_FIELDS say how a run of the case was made, not what the case is, and are
    not compared: a baseline is a seed ensemble judged for any seed, and device and thread count
    change only rounding, which the comparison is calibrated to absorb.
    """
    fields = sorted((set(baseline) | set(current)) - set(EXECUTION_FIELDS))
    return [
        f"{name}: baseline {baseline.get(name, '<absent>')!r}, current {current.get(name, '<absent>')!r}"
        for name in fields
        if baseline.get(name) != current.get(name)
    ]


def _spec_dict(spec: str | Mapping[str, Any], what: str) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        return dict(spec)
    try:
        value = json.loads(spec)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, dict):
        raise BaselineError(f"{what}: spec is not a JSON object: {spec!r}")
    return value


def same_numbers(a: xr.Dataset, b: xr.Dataset) -> bool:
    """True when both datasets hold exactly the same coordinates and data (attributes ignored)."""
    return a.equals(b)
