"""Tensor subclasses whose matrix products are scaled GEMMs, known by class name (their library
need not be installed): how to read one as a GEMM operand (its 8-bit data and scale), and, for
torchao's ``Float8TrainingTensor``, which GEMM a pair of operand roles is and which of its linear
config's GEMM configs says whether it accumulates fast. training/observation.py dispatches on them."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from precision_suite.training.dequantization import GemmOperand
from precision_suite.training.observed_operands import Scaling


def _torchao_operand(tensor: Tensor) -> GemmOperand:
    """torchao.float8's Float8TrainingTensor: `_data` = x * `_scale`, its role and GEMM configs."""
    role = str(getattr(tensor, "_gemm_input_role", "")).rsplit(".", 1)[-1].lower() or None
    return GemmOperand(tensor._data, Scaling("mul", tensor._scale), role)


# tensor subclasses whose GEMMs are scaled GEMMs, by class (matched by name: torchao need not be
# installed) -> how to read one as a GEMM operand
SUBCLASS_OPERANDS: dict[str, Callable[[Tensor], GemmOperand]] = {
    "torchao.float8.float8_training_tensor.Float8TrainingTensor": _torchao_operand,
}
# torchao's GemmInputRole of each operand: which GEMM a pair of roles is
TORCHAO_GEMMS = {
    frozenset({"input", "weight"}): "fprop",
    frozenset({"grad_output", "weight"}): "dgrad",
    frozenset({"grad_output", "input"}): "wgrad",
}
TORCHAO_SIDES = {
    "fprop": ("input", "weight"),
    "dgrad": ("grad_output", "weight"),
    "wgrad": ("grad_output", "input"),
}
TORCHAO_GEMM_CONFIG = {"fprop": "output", "dgrad": "grad_input", "wgrad": "grad_weight"}


def subclass_reader(tensor: object) -> Callable[[Tensor], GemmOperand] | None:
    """How to read `tensor` as a scaled GEMM's operand, if its class (or a base) is known."""
    for cls in type(tensor).__mro__:
        reader = SUBCLASS_OPERANDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if reader is not None:
            return reader
    return None
