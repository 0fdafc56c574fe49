"""The accumulation error's law in K: a table of the relative error of each mode against float64.

    python benchmarks/accumulation_law.py [--rows 64] [--seed 0] [--json FILE]

For K = 128, 256, ..., 8192 and each of two kinds of random E4M3 operands (per-tensor amax
scales): same-sign (|N(0, 1)| entries: every product adds, the sum grows like K) and mixed-sign
(N(0, 1): the sum grows like sqrt(K)), it prints ||C - R||_F / ||R||_F
(`numerics.accumulation_error.relative_error`) of a (rows x K) @ (K x rows) GEMM accumulated in float32,
hopper-fast and hopper-promoted (every 128), R the float64 product of the same quantized operands
(`numerics.accumulation_error.error_law`, which the report's overview chart draws too). Expected
(SCIENCE.md, DeepSeek-V3 section 3.3.2): hopper-fast grows with K, hopper-promoted stays flat,
float32 stays near 2^-24.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from precision_suite.numerics.accumulation import ACCUMULATION_MODES
from precision_suite.numerics.accumulation_error import error_law


def markdown(table: list[dict[str, object]], rows: int) -> str:
    lines = [
        f"Relative error ||C - R||_F / ||R||_F of a {rows} x K x {rows} E4M3 GEMM against float64",
        "",
        "| K | data | " + " | ".join(ACCUMULATION_MODES) + " |",
        "|---|---|" + "---|" * len(ACCUMULATION_MODES),
    ]
    lines += [
        f"| {row['K']} | {row['data']} | "
        + " | ".join(f"{row[mode]:.3e}" for mode in ACCUMULATION_MODES)
        + " |"
        for row in table
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="M = N of each GEMM (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    table = error_law(args.rows, args.seed)
    print(markdown(table, args.rows))
    if args.json:
        args.json.write_text(
            json.dumps({"rows": args.rows, "seed": args.seed, "table": table}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
