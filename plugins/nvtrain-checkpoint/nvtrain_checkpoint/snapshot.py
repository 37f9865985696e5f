"""Copy a captured training state off the live tensors, refusing what a safe load could not read.

A snapshot is taken on the training thread at the save point, so it holds exactly
one step's state however long the write takes afterwards. Every tensor is copied
to host memory (shared tensors stay shared, also tied weights that ``state_dict()`` hands
out as distinct tensor objects over one storage; a synchronous save, which writes before
training goes on, keeps host tensors that are all of their storage as they are);
containers are copied; anything that ``torch.load(weights_only=True)`` would refuse
is refused here, at save time, with the path of the offending value.
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


def snapshot(state: Any, label: str = "state", reuse: Any = None, *, copy_host: bool = True) -> Any:
    """A deep copy of ``state`` whose tensors live in host memory and share nothing with the model.

    ``reuse`` is an earlier snapshot nobody reads any more: its tensors are copied
    into where shape, dtype and strides still match, which avoids allocating (and
    page-faulting) host memory again. CUDA tensors go to pinned buffers with
    asynchronous copies and one synchronisation at the end.

    ``copy_host=False`` keeps tensors already in host memory as they are (still checked):
    for a synchronous save, which writes them before training can change them. A view of a
    larger storage is copied even then, so that the file holds only its own bytes, as a
    background save's does.

    :raises TypeError: for a value no weights-only load can read back, naming where it sits.
    """
    copier = Copier(copy_host)
    copied = copier.copy(state, reuse, label)
    for device in copier.devices:  # every asynchronous copy has landed
        torch.cuda.synchronize(device)
    return copied


class Copier:
    """One snapshot: the walk over the state with its checks, and its bookkeeping (copies by source tensor,
    so shared tensors stay shared; buffers taken; CUDA devices involved). :meth:`take` decides what stands
    for each tensor and :meth:`alias` what stands for another view of one already taken; the staging for
    the writer process overrides both."""

    def __init__(self, copy_host: bool = True) -> None:
        self.copy_host = copy_host
        self.memo: dict[int, torch.Tensor] = {}
        #: What was taken for each view (storage, offset, shape, strides, dtype): tied weights reach a
        #: state as distinct tensor objects (``state_dict()`` detaches each key anew) over one storage.
        self.views: dict[tuple[Any, ...], Any] = {}
        #: The storages (addresses) of the buffers this snapshot copied into: a buffer of the previous
        #: snapshot is reused only if its storage is not one of them (an alias views another's storage).
        self.taken: set[int] = set()
        self.devices: set[torch.device] = set()

    def copy(self, value: Any, previous: Any, path: str) -> Any:
        kind = type(value)
        if kind in _LEAVES:
            return value
        if isinstance(value, torch.Tensor):
            return self.copy_tensor(value, previous, path)
        if kind is dict or kind is OrderedDict:
            before = previous if type(previous) is kind else {}
            out = kind()
            for key, item in value.items():
                if type(key) not in _LEAVES:
                    raise _refused(key, f"{path} (a key)")
                out[key] = self.copy(item, before.get(key), f"{path}[{key!r}]")
            return out
        if kind is list or kind is tuple:
            if all(type(item) in _LEAVES for item in value):  # e.g. Python's RNG state: 625 ints
                return list(value) if kind is list else value
            same = type(previous) is kind and len(previous) == len(value)
            olds = previous if same else (None,) * len(value)
            items = [
                self.copy(item, old, f"{path}[{index}]")
                for index, (item, old) in enumerate(zip(value, olds, strict=False))
            ]
            return items if kind is list else tuple(items)
        if kind is set:
            return {self.copy(item, None, f"{path} (a set member)") for item in value}
        raise _refused(value, path)

    def copy_tensor(self, tensor: torch.Tensor, previous: Any, path: str) -> Any:
        known = self.memo.get(id(tensor))
        if known is not None:  # the same tensor twice (tied weights): one copy, still shared
            return known
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise _refused(tensor, path)
        if tensor.layout != torch.strided:
            raise TypeError(f"checkpoint: {path} is a {tensor.layout} tensor; only dense (strided) tensors are saved")
        key = _view_key(tensor)
        taken = self.views.get(key) if key is not None else None
        if taken is not None:  # another tensor object over the same bytes: shared in the copy as in the source
            copy = self.alias(taken)
        else:
            copy = self.take(tensor.detach(), previous)
            if key is not None:
                self.views[key] = copy
        self.memo[id(tensor)] = copy
        return copy

    def alias(self, taken: Any) -> Any:
        """A distinct tensor over what :meth:`take` gave for the same view: ``torch.save`` writes the bytes
        once and two tensor records, as it does for the source tensors in a synchronous save."""
        return taken.view_as(taken)

    def take(self, source: torch.Tensor, previous: Any) -> Any:
        """What stands for ``source`` (already checked) in the snapshot: its copy, or itself."""
        on_host = source.device.type == "cpu"
        if on_host and not self.copy_host and _covers_its_storage(source):
            return source
        if not on_host:
            self.devices.add(source.device)
        if self._fits(previous, source, on_host):
            copy = previous.copy_(source, non_blocking=not on_host)
        elif on_host:
            copy = source.clone()
        elif source.is_contiguous():
            copy = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            copy.copy_(source, non_blocking=True)
        else:
            copy = source.to("cpu", copy=True)
        self.taken.add(copy.untyped_storage().data_ptr())
        return copy

    def _fits(self, previous: Any, source: torch.Tensor, on_host: bool) -> bool:
        """Can ``previous`` (a buffer of an earlier snapshot) take ``source``'s values as they are?"""
        return (
            isinstance(previous, torch.Tensor)
            # two sources must never land in one buffer, nor in two views of one (tied weights untied since)
            and previous.untyped_storage().data_ptr() not in self.taken
            and previous.device.type == "cpu"
            and previous.dtype == source.dtype
            and previous.shape == source.shape
            and previous.stride() == source.stride()
            and (on_host or previous.is_pinned())
        )


def _view_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What identifies the bytes ``tensor`` views; None for an empty one (empty storages share address 0)."""
    if tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def _covers_its_storage(tensor: torch.Tensor) -> bool:
    """Is ``tensor`` all of its storage? ``torch.save`` writes a tensor's whole storage, so a view (a slice
    of a larger tensor) kept as it is would write more bytes than the compact copy a background save writes."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _refused(value: Any, path: str) -> TypeError:
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    return TypeError(
        f"checkpoint: cannot save {path} of type {name}: checkpoints hold only tensors, numbers, strings, "
        "bytes, None, torch dtypes/devices/sizes and dicts, lists, tuples and sets of them, so that loading "
        "(torch.load(weights_only=True)) can never run code. Convert it in the owner's state_dict()."
    )
