"""Rounding twins: settings that change only how kernels round, never what they compute.

Another host runs the same code with other vector instructions, another BLAS code path or another
thread count, and its first training step differs from this host's by rounding alone. Any x86
host can produce those differences itself: ATen's unvectorized kernels (`ATEN_CPU_CAPABILITY=default`)
and every vector width below its own (with MKL held to it), MKL's reproducible path
(`MKL_CBWR=COMPATIBLE`), 2 threads, eager kernels instead of compiled ones. A baseline's first-point
tolerance is measured from these twins (`regenerate.ensemble_tasks`), and `calibrate` trains whole
runs under them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# ATen's x86 kernel levels, narrowest first (torch.backends.cpu.get_cpu_capability's names)
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


@dataclass(frozen=True)
class RoundingTwin:
    """A setting that changes only rounding: RunSpec fields to replace and environment variables."""

    name: str
    spec_changes: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


def rounding_twins(host_capability: str | None = None) -> list[RoundingTwin]:
    """The twins this host can run (`host_capability`: ATen's, default this process's)."""
    capability = host_capability or torch.backends.cpu.get_cpu_capability()
    twins = [
        RoundingTwin("2 threads", {"threads": 2}),
        RoundingTwin("eager", env={"PRECISION_SUITE_COMPILE": "0"}),
        RoundingTwin("ATen default kernels", env={"ATEN_CPU_CAPABILITY": "default"}),
    ]
    if capability in X86_CAPABILITIES:
        for narrower in X86_CAPABILITIES[1 : X86_CAPABILITIES.index(capability)]:
            twins.append(
                RoundingTwin(
                    f"{narrower} kernels",
                    env={"ATEN_CPU_CAPABILITY": narrower.lower(), "MKL_ENABLE_INSTRUCTIONS": narrower},
                )
            )
        twins.append(RoundingTwin("MKL compatible path", env={"MKL_CBWR": "COMPATIBLE"}))
    return twins
