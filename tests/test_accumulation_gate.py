"""A change of how a GEMM accumulates, planted in a user's [recipes.NAME] table, fails
`precision-suite run` against the case's baseline, the finding naming the GEMM.

The baseline is made by the same code `baseline update` runs (`regenerate`), from a smaller
ensemble so the test stays short: seeds 0 and 1 (the held-out seeds 4 and 5 beside them) and only
the rounding twin that runs in this process (2 threads), not those that need a fresh interpreter.
"""

from __future__ import annotations

from pathlib import Path

from precision_suite import cli
from precision_suite.jobs import regenerate
from precision_suite.jobs.selection import config_specs
from precision_suite.jobs.twins import RoundingTwin

# wgrad's K is the step's tokens, 8 x 32 = 256: two promotions of 128, or one chain
CASE = """[[case]]
model = "gpt"
recipe = "te-current"
steps = 3
sample_every = 1
depth = 1
width = 128
seq_len = 32
batch_size = 8

[recipes.te-current]
source = "Transformer Engine Float8CurrentScaling defaults"
fprop = {{ a = "e4m3:tensor", b = "e4m3:tensor", accumulate = "hopper-fast" }}
dgrad = {{ a = "e5m2:tensor", b = "e4m3:tensor", accumulate = "hopper-promoted" }}
wgrad = {{ a = "e5m2:tensor", b = "e4m3:tensor", accumulate = "{wgrad}" }}
"""


def test_wgrad_switched_from_promoted_to_fast_fails_the_run_naming_the_gemm(
    tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(regenerate, "rounding_twins", lambda: [RoundingTwin("2 threads", {"threads": 2})])
    Path("base.toml").write_text(CASE.format(wgrad="hopper-promoted:128"))
    regenerate.regenerate(config_specs(Path("base.toml")), "baselines", seeds=(0, 1))
    Path("planted.toml").write_text(CASE.format(wgrad="hopper-fast"))
    status = cli.main(
        [
            "run",
            "--config",
            "planted.toml",
            "--baseline-dir",
            "baselines",
            "--workers",
            "1",
            "--report-dir",
            "reports",
        ]
    )
    out = capsys.readouterr().out
    assert status == 1, out
    failing = [line for line in out.splitlines() if line.startswith("FAIL")]
    # the recipe's change is the headline (a recipe is data: tests/test_recipe_data.py), the error it makes follows
    assert (
        failing
        and "wgrad accumulation: hopper-promoted:128 -> hopper-fast in the suite's recipe" in failing[0]
    ), out
    summary = Path("reports", "summary.json").read_text()
    assert "accumulation_error changed (worse)" in summary and "gemm wgrad, accumulation as-run" in summary, (
        summary
    )
    assert "gemm fprop" not in out and "gemm dgrad" not in out  # what did not change is not named
