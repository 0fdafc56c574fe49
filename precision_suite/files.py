"""Atomic file writes and the netCDF reader/writer every module shares.

Readers (a browser, a CI job, another pytest-xdist worker) never see a half-written file: each
write goes to a uniquely named temp file beside its target and is renamed onto it only once
complete. Unique names (not mkstemp) keep the usual file permissions and are safe under xdist.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:  # xarray is imported where datasets are read or written: verdicts.rules stays light
    import xarray as xr

SCHEMA_VERSION = 3  # run-dataset schema (docs/architecture.md); bump on any layout change
NETCDF_ENGINE = "h5netcdf"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path beside `path` to write to; renamed onto `path` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces `path` when the block succeeds."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        yield handle


def write_json(value: object, path: str | os.PathLike) -> Path:
    """`value` as indented JSON at `path`, atomically."""
    import json

    with atomic_file(path) as handle:
        handle.write((json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    return Path(path)


def safe_filename(name: str) -> str:
    """A file-name-safe form of a case id (or any name); a hash keeps ids that differ only in
    symbols apart. Case ids (runs.case_id) are already safe and pass through unchanged."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "case"
    if safe == name:
        return safe
    return f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def read_toml(path: str | os.PathLike) -> dict:
    """Parse a TOML file; ValueError names the file and what is wrong with it."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # tomli is a dependency on Python 3.10
        import tomli as tomllib
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; check the path") from None
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"{path} is not valid TOML: {err}; fix the file") from None


def save_dataset(ds: xr.Dataset, path: str | os.PathLike, compress: bool = True) -> Path:
    """Write `ds` as netCDF4 atomically; gzip keeps baselines at tens of kB."""
    encoding = (
        {name: {"compression": "gzip", "compression_opts": 4} for name in ds.data_vars} if compress else None
    )
    with atomic_path(path) as tmp:
        ds.to_netcdf(tmp, engine=NETCDF_ENGINE, encoding=encoding)  # type: ignore[call-overload]
    return Path(path)


def load_dataset(path: str | os.PathLike, engine: str = NETCDF_ENGINE) -> xr.Dataset:
    """Read a dataset written by `save_dataset` (or, with `engine="scipy"`, a netCDF classic file:
    jobs/history_store.py's records) fully into memory (the file is closed after)."""
    import xarray as xr

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file {str(path)!r}")
    return xr.load_dataset(path, engine=engine)
