"""What a batch holds and how it reaches the device, read from its structure only: one owner for the
loop, the validation and the loggers."""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import attrs
import torch

__all__ = ["batch_size", "device_mover", "loader_batch_size", "tensor_mapper"]

#: Values a batch may carry that never hold a tensor.
_PLAIN = (str, bytes, int, float, complex, type(None))


def loader_batch_size(loader: Any) -> int | None:
    """Samples per micro-batch a loader says it yields: its ``batch_size``, else its ``batch_sampler``'s (a
    DataLoader given ``batch_sampler=`` has ``batch_size`` None); None when neither says."""
    for owner in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(owner, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return size
    return None


def batch_size(batch: Any) -> int:
    """Samples in a micro-batch: the first dimension of its first tensor (1 for a scalar).

    The first tensor is searched for through the whole batch, depth first and in order
    (a mapping's values, a sequence's items, a dataclass's or attrs instance's fields;
    a list of one kind of item without a tensor in its first is passed over whole),
    so the strings a default collate puts first (``(texts, targets)``) are passed over.
    A batch with no tensor at all counts the ``len()`` of its first list (default
    collate gathers a batch's strings in a list; a tuple groups fields), 0 for an empty
    mapping or sequence; anything else counts as one sample.
    """
    if isinstance(batch, torch.Tensor):
        return _first_dimension(batch)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):  # the common case, cheap
        return _first_dimension(batch[0])
    tensor = _first_tensor(batch)
    if tensor is not None:
        return _first_dimension(tensor)
    return _size_without_tensor(batch)


def _first_dimension(tensor: torch.Tensor) -> int:
    return int(tensor.shape[0]) if tensor.dim() else 1


def _children(value: Any) -> Iterable[Any]:
    """The values a batch's container holds, in order; none for a tensor, a plain value or an unknown object."""
    if isinstance(value, Mapping):
        return value.values()
    if isinstance(value, (tuple, list)):
        return value
    return (getattr(value, name) for name in _record_fields(value))


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value``, depth first; plain items (a list's strings) are skipped without a call each.

    A list whose first two items are of one type and the first holds no tensor is passed over whole: a
    collated list of one kind of item (a batch's strings, token-id lists, arrays) costs a few calls per
    batch, not one per sample or token. (A list of fields, ``[texts, targets]``, is searched item by item.)
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, _PLAIN):
            return None
        found = _first_tensor(first)
        if found is not None or (len(value) > 1 and type(value[1]) is type(first)):
            return found
    for item in _children(value):
        if isinstance(item, _PLAIN):
            continue
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _first_list(value: Any) -> list[Any] | None:
    """The first list in ``value``, depth first (``value`` itself if it is one)."""
    if isinstance(value, list):
        return value
    for item in _children(value):
        if isinstance(item, _PLAIN):
            continue
        found = _first_list(item)
        if found is not None:
            return found
    return None


def _size_without_tensor(batch: Any) -> int:
    """A tensor-free batch's size: its first list's length, 0 when it is an empty container, else 1."""
    found = _first_list(batch)
    if found is not None:
        return len(found)
    if isinstance(batch, (Mapping, tuple)) and not batch:
        return 0
    return 1


def device_mover(device: torch.device | None) -> Callable[[Any], Any]:
    """``move(batch)``: a copy of ``batch`` with every tensor on ``device`` (``non_blocking``), keeping its types.

    Tensors move; mappings keep their class (``OrderedDict``, ``defaultdict``, a
    ``UserDict`` such as a tokenizer's ``BatchEncoding``), named tuples their fields,
    lists and tuples their type; a dataclass or attrs instance is copied with its fields
    moved; any other object with a ``to()`` method (a graph batch, say) is moved by
    ``obj.to(device)``. Everything else is passed through as it is. ``device=None`` copies
    the containers and keeps the tensors where they are (the CPU's batches): a hook that
    edits the batch in place never edits what the loader holds, on any device.
    """
    if device is None:
        return tensor_mapper(None)
    return tensor_mapper(lambda tensor: tensor.to(device, non_blocking=True), move_objects=device)


def tensor_mapper(
    function: Callable[[torch.Tensor], Any] | None, *, move_objects: Any = None
) -> Callable[[Any], Any]:
    """``apply(value)``: a copy of ``value`` with ``function`` applied to every tensor in it (None: the tensors
    kept as they are, the containers copied), through the containers :func:`device_mover` knows (mappings,
    named tuples, lists and tuples, dataclass and attrs fields). ``move_objects``: a device other objects
    with a ``to()`` method are moved to (None: they are passed through)."""

    def apply(value: Any) -> Any:
        kind = type(value)
        if kind is torch.Tensor or isinstance(value, torch.Tensor):
            return value if function is None else function(value)
        if kind is tuple or kind is list:  # the common batch, first: no abstract-class checks for it
            return kind([apply(item) for item in value])
        if isinstance(value, Mapping):
            mapped = {key: apply(item) for key, item in value.items()}
            return mapped if kind is dict else _same_mapping(value, mapped)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple: rebuilt by position
            return kind(*(apply(item) for item in value))
        if isinstance(value, (tuple, list)):
            return kind(apply(item) for item in value)
        if isinstance(value, _PLAIN):  # labels, ids, flags: nothing to map, nothing to inspect
            return value
        fields = _record_fields(value)
        if fields:
            copied = copy.copy(value)
            for name in fields:  # frozen and slotted classes included: what the class's own __init__ would set
                object.__setattr__(copied, name, apply(getattr(value, name)))
            return copied
        to = getattr(value, "to", None)
        if move_objects is not None and callable(to) and not isinstance(value, type):
            return to(move_objects)
        return value

    return apply


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
