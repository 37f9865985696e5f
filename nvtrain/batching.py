"""What a batch holds, read from shapes only (no device access): one owner for the loop and the loggers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_size"]


def batch_size(batch: Any) -> int:
    """Samples in a micro-batch: the first dimension of its first tensor.

    A tensor gives its first dimension (1 for a scalar); a mapping or a sequence gives
    its first value's size (0 for an empty mapping); anything else counts as one sample.
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_size(value)
        return 0
    if isinstance(batch, (tuple, list)) and batch:
        return batch_size(batch[0])
    return 1
