"""How far the accumulation error measured on a run's output subset (accumulation_error.output_subset)
lands from the whole output's, on a user model's real GEMMs (issue 39).

    python benchmarks/accumulation_subset.py [--size 20M]

One sampled training step of the HF Llama of benchmarks/user_models.py (torchao float8,
tensorwise): each scaled GEMM the observation sees is measured twice, on the subset (as a run
does) and whole. Printed: the estimate's relative deviation from the whole output's relative
error per GEMM and per (layer, GEMM, mode) pooled as a layer's verdict pools them, and the
deviation of log(hopper-fast / hopper-promoted), a change of accumulation as a verdict sees it.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from user_cost import BATCH, SIZES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=list(SIZES), default="20M")
    args = parser.parse_args()
    from precision_suite.numerics import accumulation_error
    from precision_suite.training import gemm_errors, recorder
    from precision_suite.training.runs import RunSpec, Trainer, seeded

    calls, where = [], {}
    sampled_sums, observed_gemm = accumulation_error.error_sums_by_mode, gemm_errors.observed_gemm_errors

    def both(a, b, scale_a, scale_b, modes, **kwargs):
        sub = sampled_sums(a, b, scale_a, scale_b, modes, **kwargs)
        whole = sampled_sums(a, b, scale_a, scale_b, modes, **{**kwargs, "sampled": False})
        calls.append(
            (
                where["now"],
                [None if s is None else s.numpy() for s in whole],
                [None if s is None else s.numpy() for s in sub],
            )
        )
        return sub

    def observed(into, call):
        where["now"] = (call.module, call.gemm)
        return observed_gemm(into, call)

    gemm_errors.error_sums_by_mode, recorder.observed_gemm_errors = both, observed
    spec = RunSpec(
        model="user_models:llama_fp8",
        batches="user_models:llama_batch",
        steps=1,
        sample_every=1,
        device="cpu",
        batch_size=BATCH,
        width=SIZES[args.size],
    )
    with seeded(spec) as device:
        Trainer(spec, device).step(0, sample=True)

    def error(sums):
        return np.sqrt(sums[0] / sums[1])

    per_gemm = [
        error(s) / error(w) - 1 for _, whole, sub in calls for w, s in zip(whole, sub) if w is not None
    ]
    pooled = collections.defaultdict(lambda: [0.0, 0.0])
    for (module, gemm), whole, sub in calls:
        layer = re.search(r"layers\.(\d+)", module)
        for mode, (w, s) in enumerate(zip(whole, sub)):
            if w is not None:
                cell = pooled[layer.group(1) if layer else module, gemm, mode]
                cell[0], cell[1] = cell[0] + w, cell[1] + s
    per_layer = [error(s) / error(w) - 1 for w, s in pooled.values()]
    change = [
        (
            0.5 * np.log((s[1][0] / s[1][1]) / (s[2][0] / s[2][1])),
            0.5 * np.log((w[1][0] / w[1][1]) / (w[2][0] / w[2][1])),
        )
        for _, w, s in calls
        if w[1] is not None and w[2] is not None
    ]
    for name, values in (("per GEMM", per_gemm), ("per layer, GEMM and mode", per_layer)):
        values = np.asarray(values)
        print(
            f"{name} ({len(values)}): estimate / whole - 1: rms {np.sqrt(np.mean(values**2)):.4f}, "
            f"largest {np.abs(values).max():.4f}"
        )
    change = np.asarray(change)
    print(
        f"log(fast / promoted) ({len(change)} GEMMs): whole {change[:, 1].mean():.3f} on average; estimate - whole: "
        f"rms {np.sqrt(np.mean((change[:, 0] - change[:, 1]) ** 2)):.4f}, "
        f"largest {np.abs(change[:, 0] - change[:, 1]).max():.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
