"""Python's and NumPy's global random states, in a form a checkpoint holds (tensors and plain values).

A data set or sampler that draws from ``random`` or ``numpy.random`` moves these
streams; a resume that replays an epoch's first micro-batches must put them where
the uninterrupted run had them, as it does torch's.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["apply_host_rng", "capture_host_rng"]


def capture_host_rng() -> dict[str, Any]:
    """``{"python": ..., "numpy": ...}`` (no ``"numpy"`` without NumPy installed)."""
    state: dict[str, Any] = {"python": random.getstate()}
    numpy = _numpy()
    if numpy is not None:
        np_state = numpy.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype("int64")),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    return state


def apply_host_rng(state: Mapping[str, Any]) -> None:
    """Set back what :func:`capture_host_rng` took; an entry the state lacks (an older checkpoint) is left alone."""
    python_state = state.get("python")
    if python_state is not None:
        version, internal, gauss = python_state
        random.setstate((version, tuple(internal), gauss))
    numpy_state = state.get("numpy")
    numpy = _numpy()
    if numpy_state is not None and numpy is not None:
        numpy.random.set_state(
            {
                "bit_generator": numpy_state["bit_generator"],
                "state": {"key": numpy_state["key"].numpy().astype("uint32"), "pos": numpy_state["pos"]},
                "has_gauss": numpy_state["has_gauss"],
                "gauss": numpy_state["gauss"],
            }
        )


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
