"""The accumulation error's law in K: a table of the relative error of each mode against float64.

    python benchmarks/accumulation_law.py [--rows 64] [--seed 0] [--json FILE]

For K = 128, 256, ..., 8192 and each of two kinds of random E4M3 operands (per-tensor amax
scales, as the suite quantizes): same-sign (|N(0, 1)| entries: every product adds, the sum grows
like K) and mixed-sign (N(0, 1): the sum grows like sqrt(K)), it prints
||C - R||_F / ||R||_F (`numerics.accumulation.relative_error`) of a (rows x K) @ (K x rows) GEMM
accumulated in float32, hopper-fast and hopper-promoted (every 128), R the float64 product of the
same quantized operands. Expected (SCIENCE.md, DeepSeek-V3 section 3.3.2): hopper-fast grows with
K, hopper-promoted stays flat, float32 stays near 2^-24.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from precision_suite.numerics.accumulation import ACCUMULATION_MODES, accumulation_error_sums, relative_error
from precision_suite.numerics.quantization import quantize

KS = [2**i for i in range(7, 14)]
KINDS = ("same-sign", "mixed-sign")


def fp8_elements(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 elements, per-tensor scale) of x, quantized as the suite does."""
    q = quantize(x, "e4m3", "tensor")
    return (q.dequantized / q.scales).to(torch.float8_e4m3fn), q.scales.reshape(1, 1)


def measure(rows: int, seed: int) -> list[dict[str, object]]:
    table = []
    for k in KS:
        gen = torch.Generator().manual_seed(seed + k)
        x, w = torch.randn(rows, k, generator=gen), torch.randn(k, rows, generator=gen)
        for kind in KINDS:
            a, scale_a = fp8_elements(x.abs() if kind == "same-sign" else x)
            b, scale_b = fp8_elements(w.abs() if kind == "same-sign" else w)
            row: dict[str, object] = {"K": k, "data": kind}
            for mode in ACCUMULATION_MODES:
                row[mode] = relative_error(accumulation_error_sums(a, b, scale_a, scale_b, mode))
            table.append(row)
    return table


def markdown(table: list[dict[str, object]], rows: int) -> str:
    lines = [f"Relative error ||C - R||_F / ||R||_F of a {rows} x K x {rows} E4M3 GEMM against float64", "",
             "| K | data | " + " | ".join(ACCUMULATION_MODES) + " |", "|---|---|" + "---|" * len(ACCUMULATION_MODES)]
    lines += [f"| {row['K']} | {row['data']} | " + " | ".join(f"{row[mode]:.3e}" for mode in ACCUMULATION_MODES) + " |"
              for row in table]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="M = N of each GEMM (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    table = measure(args.rows, args.seed)
    print(markdown(table, args.rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "seed": args.seed, "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
