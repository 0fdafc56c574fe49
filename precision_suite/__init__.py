"""precision-suite: numerics regression suite for low-precision transformer training.

Public names are imported lazily so that the pytest plugin (loaded in every pytest session of a
project that installs us) does not pay for importing torch until a test actually needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

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
