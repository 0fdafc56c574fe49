"""What observing a fake-quantized model costs a sampled step at three widths: the hand-written
blockwise QDQ GPT of tests/user_qdq.py at width 128, 512 and 1024 (0.4M, 6.4M and 25.4M
parameters), one sampled step with the recorder's probes, with the observation and without, one
thread, median of 5 (docs/performance.md, "Observing the model's own quantization").

    python benchmarks/observation_widths.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import user_code  # noqa: E402
import user_qdq  # noqa: E402
from precision_suite.training.recorder import instrument  # noqa: E402
from precision_suite.training.specs import RunSpec  # noqa: E402

WIDTHS = (128, 512, 1024)


def sampled_step_seconds(model: torch.nn.Module, observe: bool) -> float:
    inputs, targets = user_code.batches(RunSpec(), torch.Generator().manual_seed(0))
    recorder = instrument(model, observe=observe)

    def step(index: int) -> None:
        with recorder.step(index):
            logits = model(inputs).reshape(targets.numel(), -1)
            F.cross_entropy(logits, targets.reshape(-1)).backward()

    step(0)  # warm-up
    samples = []
    for index in range(1, 6):
        start = time.perf_counter()
        step(index)
        samples.append(time.perf_counter() - start)
    recorder.remove()
    return statistics.median(samples)


def main() -> int:
    torch.set_num_threads(1)
    for width in WIDTHS:
        torch.manual_seed(0)
        model = user_qdq.build(RunSpec(width=width))
        params = sum(p.numel() for p in model.parameters())
        bare, observed = (sampled_step_seconds(model, observe) for observe in (False, True))
        print(
            f"width {width} ({params / 1e6:.1f}M parameters): sampled step {bare * 1e3:.0f} ms unobserved, "
            f"{observed * 1e3:.0f} ms observed: {observed / bare:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
