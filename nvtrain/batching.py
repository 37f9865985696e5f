"""What a batch holds and how it reaches the device, read from its structure only: one owner for the
loop, the validation and the loggers."""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import attrs
import torch

__all__ = ["batch_size", "device_mover"]

#: Values a batch may carry that never hold a tensor.
_PLAIN = (str, bytes, int, float, complex, type(None))


def batch_size(batch: Any) -> int:
    """Samples in a micro-batch: the first dimension of its first tensor.

    A tensor gives its first dimension (1 for a scalar); a mapping, a sequence, a
    dataclass or an attrs instance gives its first value's size (0 for an empty
    mapping); anything else counts as one sample.
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return batch_size(value)
        return 0
    if isinstance(batch, (tuple, list)) and batch:
        return batch_size(batch[0])
    fields = _record_fields(batch)
    if fields:
        return batch_size(getattr(batch, fields[0]))
    return 1


def device_mover(device: torch.device) -> Callable[[Any], Any]:
    """``move(batch)``: a copy of ``batch`` with every tensor on ``device`` (``non_blocking``), keeping its types.

    Tensors move; mappings keep their class (``OrderedDict``, ``defaultdict``, a
    ``UserDict`` such as a tokenizer's ``BatchEncoding``), named tuples their fields,
    lists and tuples their type; a dataclass or attrs instance is copied with its fields
    moved; any other object with a ``to()`` method (a graph batch, say) is moved by
    ``obj.to(device)``. Everything else is passed through as it is.
    """

    def move(batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(device, non_blocking=True)
        if isinstance(batch, Mapping):
            moved = {key: move(value) for key, value in batch.items()}
            return moved if type(batch) is dict else _same_mapping(batch, moved)
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple: rebuilt by position
            return type(batch)(*(move(value) for value in batch))
        if isinstance(batch, (tuple, list)):
            return type(batch)(move(value) for value in batch)
        if isinstance(batch, _PLAIN):  # labels, ids, flags: nothing to move, nothing to inspect
            return batch
        fields = _record_fields(batch)
        if fields:
            copied = copy.copy(batch)
            for name in fields:  # frozen and slotted classes included: what the class's own __init__ would set
                object.__setattr__(copied, name, move(getattr(batch, name)))
            return copied
        to = getattr(batch, "to", None)
        if callable(to) and not isinstance(batch, type):
            return to(device)
        return batch

    return move


def _same_mapping(original: Mapping[Any, Any], moved: dict[Any, Any]) -> Any:
    """``moved`` in ``original``'s mapping class, never changing ``original``.

    A dict subclass or a ``UserDict`` (a ``BatchEncoding``) is copied and updated, so a
    constructor taking other arguments (``defaultdict``'s factory) is no obstacle: their
    copies hold items of their own. Any other mapping class is built from the moved
    items, or, when its constructor will not take them (or it is read-only), a dict.
    """
    if isinstance(original, (dict, collections.UserDict)):
        copied = copy.copy(original)
        copied.update(moved)
        return copied
    if isinstance(original, MutableMapping):
        cls: Any = type(original)
        try:
            return cls(moved)
        except TypeError:
            return moved
    return moved


def _record_fields(batch: Any) -> tuple[str, ...]:
    """Field names of a dataclass or attrs instance (not of the class itself); empty for anything else."""
    if isinstance(batch, type):
        return ()
    if dataclasses.is_dataclass(batch):
        return tuple(field.name for field in dataclasses.fields(batch))
    if attrs.has(type(batch)):
        return tuple(field.name for field in attrs.fields(type(batch)))
    return ()
