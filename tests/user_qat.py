"""A user's model trained with torchao's float8 quantization-aware training, named by import strings
in tests (``user_qat:build``, ``user_qat:batches``). Nothing from precision_suite.
``quantize_(model, QATConfig(Float8DynamicActivationFloat8WeightConfig(granularity=...), step="prepare"))``
turns each ``nn.Linear`` into a ``FakeQuantizedLinear`` whose ``Float8FakeQuantizer``s cast
activations and weights to E4M3 and back before an ordinary linear; its backward is
straight-through (the output gradient stays in float32). Read from the environment when the model
is built: ``USER_QAT_GRANULARITY`` (``rowwise``: one scale per row, or ``tensorwise``) and
``USER_QAT_HEAD`` (``fp8``, or ``hp``: the head is left out of the QAT conversion).
"""

from __future__ import annotations

import os

from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_
from torchao.quantization.qat import QATConfig

from user_code import TinyGPT, batches  # noqa: F401  (the same model and data as user_code's)

GRANULARITIES = {"rowwise": PerRow, "tensorwise": PerTensor}


def build(spec) -> TinyGPT:
    model = TinyGPT(depth=spec.depth or 2, width=spec.width or 128, seq_len=spec.seq_len or 32)
    granularity = GRANULARITIES[os.environ.get("USER_QAT_GRANULARITY", "rowwise")]()
    head_in_fp8 = os.environ.get("USER_QAT_HEAD", "fp8") == "fp8"
    quantize_(
        model,
        QATConfig(Float8DynamicActivationFloat8WeightConfig(granularity=granularity), step="prepare"),
        filter_fn=lambda module, name: (
            type(module).__name__ == "Linear" and (head_in_fp8 or name != "lm_head")
        ),
    )
    return model
