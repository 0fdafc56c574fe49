"""The built-in operand invariant of every run that records `operand_mismatch`: a GEMM operand
the recipe consumed equals a fresh quantization of its live tensor (docs/runs.md). The judging
engine checks it on every run and replay, whatever the baseline says and whatever violation is
known."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from precision_suite.verdicts.findings import Finding, to_python

if TYPE_CHECKING:  # xarray is only needed for annotations
    import xarray as xr


def check_operands(ds: xr.Dataset, case: str | None = None) -> list[Finding]:
    """The built-in invariant of every run that records `operand_mismatch`: a GEMM operand the
    recipe consumed equals a fresh quantization of its live tensor (docs/runs.md). Whatever the
    baseline says and whatever violation is known, a nonzero count is a "regression": one finding
    per module and operand, at its first offending step. Runs without the variable check nothing."""
    if "operand_mismatch" not in ds.data_vars:
        return []
    case = case if case is not None else str(ds.attrs.get("case", "?"))
    da = ds["operand_mismatch"].transpose("module", "operand", "step")
    numel = (
        ds["operand_numel"].transpose("module", "operand", "step").values
        if "operand_numel" in ds.data_vars
        else None
    )
    declared = (
        [str(v) for v in ds["operand_declared"].values]
        if "operand_declared" in ds.coords
        else [""] * da.sizes["operand"]
    )
    values, steps = da.values, [to_python(s) for s in da["step"].values]
    findings = []
    for m, o in zip(*np.nonzero((values != 0).any(axis=2))):
        first = int(np.flatnonzero(values[m, o])[0])
        module, operand = to_python(da["module"].values[m]), to_python(da["operand"].values[o])
        count = int(values[m, o, first])
        of = f" of {int(numel[m, o, first]):,}" if numel is not None else ""
        later = int(np.count_nonzero(values[m, o, first + 1 :]))
        also = f" (and at {later} later sampled step{'s' if later > 1 else ''})" if later else ""
        observed = (
            str(ds["observed_format"].sel(step=steps[first], module=module, operand=operand).values)
            if "observed_format" in ds.data_vars
            else ""
        )
        unlike = (
            (
                f"round-to-nearest of their high-precision source at the GEMM's own scale cannot give "
                f"(observed {observed}, the model's own quantization)"
            )
            if observed
            else _unlike(declared[o])
        )
        findings.append(
            Finding(
                case,
                "regression",
                "operand_mismatch",
                {"module": module, "operand": operand, "step": steps[first]},
                float(count),
                0.0,
                0.0,
                f"{case}: operand {operand} of {module} consumed {count:,}{of} elements that "
                f"{unlike} at step {steps[first]}{also}: a stale or wrongly quantized operand",
            )
        )
    return findings


def _unlike(declared: str) -> str:
    """What the consumed elements were compared with, from the operand's declared text."""
    if declared == "fp32":
        return "differ from the live tensor (declared fp32: used as it is)"
    parts = declared.split(":")
    if len(parts) == 3 and parts[2] == "stochastic":
        return (
            f"are neither grid neighbour of the live value under a fresh {parts[0]} {parts[1]} "
            "block scale (stochastic rounding)"
        )
    return f"differ from a fresh {' '.join(parts) or 'declared'} quantization of the live tensor"
