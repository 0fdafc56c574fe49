"""precision-suite: numerics regression suite for low-precision transformer training.

Public names are imported lazily so that the pytest plugin (loaded in every pytest session of a
project that installs us) does not pay for importing torch until a test actually needs it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"


def use_project_cache() -> None:
    """Keep inductor's caches under $PRECISION_SUITE_CACHE_DIR (default ~/.cache/precision-suite),
    unless TORCHINDUCTOR_CACHE_DIR says where: compiled kernels then outlive /tmp and one process,
    so a fresh process loads its graphs instead of compiling them (tests/test_compile_cache.py)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        root = os.environ.get("PRECISION_SUITE_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "precision-suite")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")


# At import of the package, before any inductor code runs in this process: inductor's first
# lookup of its cache folder writes its /tmp default into TORCHINDUCTOR_CACHE_DIR, which then
# wins. Set at our first compile instead, the project cache was never used in a pytest session
# whose test modules imported torch._inductor first.
use_project_cache()

# public name -> defining module (one module per concept; see docs/architecture.md)
_EXPORTS = {
    "Format": "formats",
    "FORMATS": "formats",
    "get_format": "formats",
    "parse_layout": "layouts",
    "layout_label": "layouts",
    "Quantized": "quantization",
    "quantize": "quantization",
    "QuantStats": "metrics",
    "quant_stats": "metrics",
    "quant_error": "metrics",
    "register_attention": "attention",
    "get_attention": "attention",
    "instrument": "recorder",
    "register_linear": "recorder",
    "Recorder": "recorder",
    "module_view": "views",
    "RunSpec": "runs",
    "run": "runs",
    "case_id": "runs",
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
