"""Print the own-stack gate table (client x change x gate: exit status, seconds, the finding's text)
as a Markdown table, from one run of tests/test_own_quantization.py's rows.

    python tests/own_stack_table.py [PYTEST ARGS...]     e.g. -n 2, or -k torchao

Each row's test appends its lines to the file named by OWN_STACK_TABLE; this runs them and prints it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HEADER = "| client | change | gate | exit | s | finding |\n|---|---|---|---|---|---|"


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "table.md"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:randomly",
                "-q",
                "-rxs",
                str(TESTS / "test_own_quantization.py"),
                "-k",
                "every_gate",
                *args,
            ],
            env={**os.environ, "OWN_STACK_TABLE": str(table)},
        )
        rows = table.read_text().splitlines() if table.exists() else []
    print(HEADER)
    print("\n".join(sorted(rows, key=lambda row: row.split(" | ")[:2])))  # a row's gates stay in order
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
