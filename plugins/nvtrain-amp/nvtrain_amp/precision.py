"""The precision policies a MixedPrecisionHook accepts, and how ``"auto"`` resolves."""

from __future__ import annotations

from typing import Literal

import torch

from nvtrain.validators import refused, satisfies

__all__ = [
    "AUTO",
    "PRECISION_NAMES",
    "Precision",
    "as_precision",
    "is_precision",
    "parse_precision",
    "precision_name",
    "precision_validator",
    "resolve_auto",
]

#: Resolved when the device is known: bf16 on CUDA (fp16 where bf16 is unsupported), fp32 elsewhere.
AUTO: Literal["auto"] = "auto"

Precision = torch.dtype | Literal["auto"]

_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_SUPPORTED = frozenset(_BY_NAME.values())

#: What error messages list as accepted.
PRECISION_NAMES = (
    "torch.float32, torch.bfloat16, torch.float16, 'float32', 'bfloat16', 'float16', 'fp32', 'bf16', 'fp16' or 'auto'"
)


def as_precision(value: object) -> object:
    """A precision setting's name as its dtype (``"bf16"`` -> ``torch.bfloat16``); anything else unchanged.

    The converter of ``MixedPrecisionHook.precision``: what it leaves unchanged and
    :func:`is_precision` refuses, the field's validator refuses.
    """
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    return value


def is_precision(value: object) -> bool:
    """A supported dtype, or ``"auto"``."""
    return (isinstance(value, torch.dtype) and value in _SUPPORTED) or (isinstance(value, str) and value == AUTO)


#: ``MixedPrecisionHook.precision``'s validator: ``must be one of <PRECISION_NAMES>``.
precision_validator = satisfies(f"one of {PRECISION_NAMES}", is_precision)


def parse_precision(value: object) -> Precision:
    """Normalise a precision setting to a dtype (or ``"auto"``); refuse anything else.

    The refusal is the field's: a :class:`~nvtrain.validators.FieldValueError` (a
    ``ValueError``) naming ``MixedPrecisionHook.precision``.
    """
    precision = as_precision(value)
    if not is_precision(precision):
        raise refused("MixedPrecisionHook", "precision", value, f"one of {PRECISION_NAMES}")
    return precision  # type: ignore[return-value]


def precision_name(dtype: torch.dtype) -> str:
    """The canonical name: ``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def resolve_auto(device: torch.device) -> torch.dtype:
    """What ``precision="auto"`` means on ``device``.

    bf16 on CUDA (it needs no loss scaling), fp16 on CUDA devices without bf16
    support, fp32 elsewhere: CPU autocast rarely pays for itself.
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32
