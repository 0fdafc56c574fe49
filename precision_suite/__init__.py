"""precision-suite: numerics regression suite for low-precision transformer training.

Public names are imported lazily so that the pytest plugin (loaded in every pytest session of a
project that installs us) does not pay for importing torch until a test actually needs it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from precision_suite.numerics import kernel_cache
from precision_suite.version import __version__

# The folder use_project_cache chose. A process started from this one inherits both variables;
# if its settings differ (a rounding twin's ATEN_CPU_CAPABILITY), it must choose its own folder.
KEYED_BY_US = "PRECISION_SUITE_KEYED_INDUCTOR_DIR"


def use_project_cache() -> None:
    """Keep inductor's caches under $PRECISION_SUITE_CACHE_DIR (default ~/.cache/precision-suite),
    in `inductor/<hash>`, a folder per compile environment (numerics.kernel_cache): compiled kernels
    then outlive /tmp and one process, so a fresh process loads its graphs instead of compiling
    them, and never one compiled for another CPU capability or compiler (tests/test_compile_cache.py).
    A TORCHINDUCTOR_CACHE_DIR set by the user wins, as is: the user then owns its key."""
    inherited = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inherited is not None and inherited != os.environ.get(KEYED_BY_US):
        return
    root = os.environ.get("PRECISION_SUITE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "precision-suite"
    )
    try:
        folder = kernel_cache.keyed_cache_dir(
            os.path.join(root, "inductor"), kernel_cache.compile_environment()
        )
    except OSError:  # an unwritable cache: inductor keeps its per-process default
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[KEYED_BY_US] = str(folder)


# At import of the package, before any inductor code runs in this process: inductor's first
# lookup of its cache folder writes its /tmp default into TORCHINDUCTOR_CACHE_DIR, which then
# wins. Set at our first compile instead, the project cache was never used in a pytest session
# whose test modules imported torch._inductor first.
use_project_cache()

# public name -> defining module, by package (one module per concept; see docs/architecture.md)
_EXPORTS = {
    "Format": "numerics.formats",
    "FORMATS": "numerics.formats",
    "get_format": "numerics.formats",
    "parse_layout": "numerics.layouts",
    "layout_label": "numerics.layouts",
    "Quantized": "numerics.quantization",
    "quantize": "numerics.quantization",
    "QuantStats": "numerics.metrics",
    "quant_stats": "numerics.metrics",
    "quant_error": "numerics.metrics",
    "register_attention": "training.attention",
    "get_attention": "training.attention",
    "instrument": "training.recorder",
    "register_linear": "training.linear_modules",
    "Recorder": "training.recorder",
    "module_view": "training.views",
    "RunSpec": "training.runs",
    "run": "training.runs",
    "case_id": "training.runs",
    "KnownViolation": "training.matrix",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'precision_suite' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"precision_suite.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
