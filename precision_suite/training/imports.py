"""User code named by import strings, ``"package.module:attribute"`` (like entry points).

RunSpec fields (model, batches, attention), the TOML config and the command line name a user's
model factory, batch function or attention variant this way, so that `precision-suite run` can
train and check code that lives outside this package.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

IMPORT_STRING = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):(?P<attribute>[A-Za-z_][\w.]*)$")
EXAMPLE = "package.module:function"


def is_import_string(text: object) -> bool:
    return isinstance(text, str) and IMPORT_STRING.match(text) is not None


def load_object(text: str, what: str) -> Any:
    """The callable ``text`` names; ValueError naming ``what`` (a field or flag) and the fix."""
    match = IMPORT_STRING.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{what}: {text!r} is not an import string; write {EXAMPLE}")
    try:
        obj: Any = importlib.import_module(match["module"])
    except ImportError as error:
        raise ValueError(f"{what}: cannot import {match['module']!r} ({error}); is it installed or on "
                         "PYTHONPATH (run from the project root)?") from None
    for part in match["attribute"].split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: module {match['module']!r} has no attribute {match['attribute']!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what}: {text!r} is a {type(obj).__name__}, not a callable")
    return obj
