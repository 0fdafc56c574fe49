"""User code named by import strings, ``"package.module:attribute"`` (like entry points).

RunSpec fields (model, batches, attention), the TOML config and the command line name a user's
model factory, batch function or attention variant this way, so that `precision-suite run` can
train and check code that lives outside this package.

The user's code is imported from the project root (the command line's current directory, pytest's
rootdir: `project_importable`) and from the installed packages, in this process and in every
process a run starts.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

IMPORT_STRING = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<attribute>[A-Za-z_][\w.]*)$")
EXAMPLE = "package.module:function"
# the project roots made importable now, innermost last (what a failed import names)
_ROOTS: list[Path] = []


def is_import_string(text: object) -> bool:
    return isinstance(text, str) and IMPORT_STRING.match(text) is not None


@contextmanager
def project_importable(root: str | os.PathLike) -> Iterator[Path]:
    """`root` importable while the context lasts, as `python -m` makes the current directory:
    first on sys.path (this process; the spawned pool workers copy it) and on PYTHONPATH (the
    fresh interpreters of rounding twins and `diff`'s sides read it); both restored afterwards.
    A folder already on sys.path keeps its place."""
    folder = Path(root).resolve()
    entry = str(folder)
    inserted = entry not in {str(Path(p or ".").resolve()) for p in sys.path}
    if inserted:
        sys.path.insert(0, entry)
        importlib.invalidate_caches()
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys(p for p in (entry, *(saved or "").split(os.pathsep)) if p)
    )
    _ROOTS.append(folder)
    try:
        yield folder
    finally:
        _ROOTS.remove(folder)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        if inserted and entry in sys.path:
            sys.path.remove(entry)


def load_object(text: str, what: str) -> Any:
    """The callable ``text`` names; ValueError naming ``what`` (a field or flag) and the fix."""
    match = IMPORT_STRING.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{what}: {text!r} is not an import string; write {EXAMPLE}")
    module = match["module"]
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not _is_prefix(error.name, module):
            raise ValueError(
                f"{what}: importing {module!r} failed: {error}; install what it imports"
            ) from None
        raise ValueError(f"{what}: cannot import {module!r}: {_not_found(error.name)}") from None
    except ImportError as error:  # the user's module imports a name its dependency lacks
        raise ValueError(f"{what}: importing {module!r} failed: {error}") from None
    for part in match["attribute"].split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: module {module!r} has no attribute {match['attribute']!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what}: {text!r} is a {type(obj).__name__}, not a callable")
    return obj


def _is_prefix(name: str, module: str) -> bool:
    """Whether `name` is `module` or a package that holds it: what was asked for is missing, not
    something its code imports."""
    return module == name or module.startswith(name + ".")


def _not_found(missing: str) -> str:
    """What is missing and where it was looked for: a module of a package that imported, or a
    top-level name found neither under the project root nor among the installed packages."""
    package, _, leaf = missing.rpartition(".")
    if package:
        folders = ", ".join(getattr(sys.modules.get(package), "__path__", []))
        found = f" (in {folders})" if folders else ""
        return (
            f"package {package!r}{found} has no module {leaf!r}; check the name (a module is a {leaf}.py "
            f"file or a {leaf}/ folder with an __init__.py)"
        )
    where = (
        f"under {_ROOTS[-1]} (the project root: the current directory, under pytest its rootdir)"
        if _ROOTS
        else "on sys.path"
    )
    return (
        f"no module {missing!r} {where} nor among the installed packages; check the name (a {missing}.py "
        f"file or a {missing}/ folder with an __init__.py), or run from the folder that holds it, install "
        "it (pip install -e .) or add its folder to PYTHONPATH"
    )
