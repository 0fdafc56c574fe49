"""The prepared GPU check (benchmarks/gpu_check.py) runs end to end on a CPU-only machine: every
part recorded with a status, CUDA absent said, exit status 0, the Markdown summary written.
No time is asserted; --tiny keeps it near a minute on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
PARTS = ["environment", "quantization", "gemm", "accumulation", "speed", "quick_matrix", "user_cost"]


@pytest.mark.slow  # about a minute: a precision-suite run of one quick case and two small trainings
def test_tiny_gpu_check_on_cpu(tmp_path):
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--tiny", "--device", "cpu"]
    proc = subprocess.run(
        # the timeouts fit a device's lease; on a CPU host they would make the test a wall-time
        # assertion (an AMX Xeon's float8 GEMMs run oneDNN's reference kernel: user_cost timed out)
        [*command, "--timeout-scale", "10"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [p["part"] for p in report["parts"]] == PARTS
    statuses = {p["part"]: p["status"] for p in report["parts"]}
    assert statuses == {**dict.fromkeys(PARTS, "ok"), "gemm": "skipped"}, statuses
    assert report["cuda_available"] is False and report["device"] == "cpu" and report["all_ran"]
    assert "CUDA absent" in report["parts"][2]["reason"]
    quantization = report["parts"][1]["figures"]
    assert quantization["bit_exact"] and "CUDA absent" in quantization["note"]
    accumulation = report["parts"][3]["figures"]  # against mmaemu, a test dependency, where CUDA is absent
    assert (
        accumulation["bit_exact"]
        and accumulation["outputs_compared"] > 0
        and "mmaemu" in accumulation["reference"]
    )
    assert report["parts"][5]["figures"]["verdict"] == "pass"
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check (cpu, tiny)")
    cost = report["parts"][6]["figures"]  # a user's model through the suite's training, against its bare loop
    [timed] = cost["by_sample_every"].values()
    assert timed["bare_s"] > 0 and timed["run_s"] > 0 and timed["accumulation error_s"] > 0
