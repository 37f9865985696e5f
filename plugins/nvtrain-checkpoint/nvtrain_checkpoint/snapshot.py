"""Copy a captured training state off the live tensors, refusing what a safe load could not read.

A snapshot is taken on the training thread at the save point, so it holds exactly
one step's state however long the write takes afterwards. Every tensor is copied
to host memory (shared tensors stay shared); containers are copied; anything that
``torch.load(weights_only=True)`` would refuse is refused here, at save time, with
the path of the offending value.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["snapshot"]

#: Leaf types kept as they are (immutable, and readable by a weights-only load).
_LEAVES: frozenset[type] = frozenset(
    {int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size}
)


def snapshot(state: Any, label: str = "state") -> Any:
    """A deep copy of ``state`` whose tensors live in host memory and share nothing with the model.

    :raises TypeError: for a value no weights-only load can read back, naming where it sits.
    """
    memo: dict[int, torch.Tensor] = {}
    copied = _copy(state, label, memo)
    if any(t.device.type == "cuda" for t in memo.values()):
        torch.cuda.synchronize()
    return copied


def _copy(value: Any, path: str, memo: dict[int, torch.Tensor]) -> Any:
    kind = type(value)
    if kind in _LEAVES:
        return value
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, path, memo)
    if kind is dict or kind is OrderedDict:
        out = kind()
        for key, item in value.items():
            if type(key) not in _LEAVES:
                raise _refused(key, f"{path} (a key)")
            out[key] = _copy(item, f"{path}[{key!r}]", memo)
        return out
    if kind is list:
        return [_copy(item, f"{path}[{index}]", memo) for index, item in enumerate(value)]
    if kind is tuple:
        return tuple(_copy(item, f"{path}[{index}]", memo) for index, item in enumerate(value))
    if kind is set:
        return {_copy(item, f"{path} (a set member)", memo) for item in value}
    raise _refused(value, path)


def _copy_tensor(tensor: torch.Tensor, path: str, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    known = memo.get(id(tensor))
    if known is not None:
        return known
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise _refused(tensor, path)
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"checkpoint: {path} is a {tensor.layout} tensor; only dense (strided) tensors are saved")
    source = tensor.detach()
    if source.device.type == "cpu":
        copy = source.clone()
    else:
        copy = source.to("cpu", copy=True)
    memo[id(tensor)] = copy
    return copy


def _refused(value: Any, path: str) -> TypeError:
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    return TypeError(
        f"checkpoint: cannot save {path} of type {name}: checkpoints hold only tensors, numbers, strings, "
        "bytes, None, torch dtypes/devices/sizes and dicts, lists, tuples and sets of them, so that loading "
        "(torch.load(weights_only=True)) can never run code. Convert it in the owner's state_dict()."
    )
