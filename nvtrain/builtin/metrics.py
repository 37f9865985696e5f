"""Validation metrics a config can name by a short name (``metrics: [accuracy]``)."""

from __future__ import annotations

import torch

__all__ = ["BUILTIN_METRICS", "accuracy"]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of rows whose arg-max logit is the target class (a tensor: no host sync)."""
    return (outputs.argmax(dim=-1) == targets).to(torch.float32).mean()


#: Short metric names accepted in ``validation.metrics``, and their import paths.
BUILTIN_METRICS: dict[str, str] = {"accuracy": "nvtrain.builtin.metrics:accuracy"}
