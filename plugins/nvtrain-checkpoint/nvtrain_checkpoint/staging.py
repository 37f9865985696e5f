"""Stage a snapshot in shared memory, for the checkpoint writer process of ``async_save``.

A background write in a thread shares the training process's GIL: ``torch.save``
takes it back for every record it writes and the digest for every chunk it reads,
and a training loop that keeps the GIL busy (a launch-bound model) both slows the
write and is slowed by it. The writer process has its own. The training thread
copies the state's tensors into one shared-memory arena (an anonymous ``memfd``,
kept and reused from save to save, page-locked when tensors come from CUDA) and
sends the writer only the state's structure, each tensor replaced by a
:class:`Slot` and described by a :class:`TensorSpec`: where in the arena it lies.
The writer rebuilds every tensor over the arena with a storage of its own, so it
writes the very bytes a save in this process writes.
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import weakref
from collections import OrderedDict
from typing import Any, final

import attrs
import torch

from nvtrain_checkpoint.snapshot import Copier

__all__ = ["SharedArena", "Slot", "StagedState", "Stager", "TensorSpec", "rebuild", "shared_memory_supported"]

#: Byte alignment of every tensor in the arena (``torch.save`` aligns its records the same way).
ALIGN = 64
#: Arenas grow in steps of this many bytes, so a slightly larger state does not mean a new arena.
GRANULE = 2 << 20

_identities = itertools.count(1)


def shared_memory_supported() -> bool:
    """Can this platform share an anonymous memory file with a child process (Linux: ``memfd_create``)?"""
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


@attrs.frozen
class Slot:
    """Stands in the sent structure for the tensor ``specs[index]`` describes; an ``alias`` is another
    tensor object over the same bytes (tied weights), rebuilt as a view of the first."""

    index: int
    alias: bool = False


@attrs.frozen
class TensorSpec:
    """Where a staged tensor lies in the arena and how to view it: what the writer needs to rebuild it."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


@final
class SharedArena:
    """A block of anonymous shared memory (``memfd``) mapped here; the writer maps the same file."""

    __slots__ = ("__weakref__", "_release", "base", "buffer", "capacity", "fd", "identity", "pinned")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.identity = next(_identities)
        self.fd = os.memfd_create(f"nvtrain-checkpoint-{self.identity}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, capacity)
            self.buffer = mmap.mmap(self.fd, capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.base = torch.frombuffer(self.buffer, dtype=torch.uint8)
        self.pinned = False
        # An arena whose owner was never closed (a strategy used without ``with``) still gives its state-sized
        # block back when it is collected: the open file descriptor alone keeps the memory allocated.
        self._release = weakref.finalize(self, _close_arena, self.fd, None)

    def pin(self) -> None:
        """Page-lock the arena for CUDA, so device-to-host copies into it run asynchronously.

        :raises RuntimeError: when CUDA refuses (a locked-memory limit, for one), saying what to do.
        """
        if self.pinned:
            return
        portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
        code = int(torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), self.capacity, portable))
        if code != 0:
            raise RuntimeError(
                f"checkpoint: CUDA could not page-lock the {self.capacity} byte shared-memory block that stages "
                f"background saves for the writer process (cudaHostRegister error {code}); raise the locked-memory "
                "limit (ulimit -l) or set async_writer='thread'"
            )
        self.pinned = True
        self._release.detach()
        self._release = weakref.finalize(self, _close_arena, self.fd, self.base.data_ptr())

    def view(self, spec: TensorSpec) -> torch.Tensor:
        """The arena's bytes at ``spec`` seen as the tensor it describes (here: a copy destination)."""
        flat = self.base[spec.offset : spec.offset + spec.nbytes]
        return flat.view(spec.dtype).as_strided(spec.size, spec.stride)

    def release(self) -> None:
        """Unpin and close the file; the mapping goes when the last tensor over it does."""
        self._release()  # once: later calls, and the collection, do nothing
        self.pinned = False
        self.fd = -1


def _close_arena(fd: int, pinned_at: int | None) -> None:
    """Unpin (when page-locked at ``pinned_at``) and close an arena's file; runs before its mapping goes."""
    if pinned_at is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_at)
    os.close(fd)


@attrs.frozen
class StagedState:
    """One save's state as the writer receives it: the structure with slots, and the arena holding the tensors."""

    skeleton: Any
    specs: tuple[TensorSpec, ...]
    arena: SharedArena


class _Collector(Copier):
    """The snapshot's walk and checks; each distinct tensor becomes a :class:`Slot` instead of a copy."""

    def __init__(self) -> None:
        super().__init__(copy_host=True)
        self.sources: list[torch.Tensor] = []

    def take(self, source: torch.Tensor, previous: Any) -> Slot:
        self.sources.append(source)
        return Slot(len(self.sources) - 1)

    def alias(self, taken: Any) -> Slot:
        return Slot(taken.index, alias=True)


@final
class Stager:
    """Copies each save's tensors into the arena; keeps the arena and the layout from one save to the next.

    The caller makes sure the writer has finished with the previous save before
    staging the next one: the arena is overwritten in place.
    """

    __slots__ = ("_layout", "_specs", "_views", "arena")

    def __init__(self) -> None:
        self.arena: SharedArena | None = None
        self._layout: tuple[Any, ...] | None = None
        self._specs: tuple[TensorSpec, ...] = ()
        self._views: tuple[torch.Tensor | None, ...] = ()

    def stage(self, state: Any, label: str = "state") -> StagedState:
        """Check ``state`` as :func:`~nvtrain_checkpoint.snapshot.snapshot` does and copy its tensors to the arena.

        :raises TypeError: for a value no weights-only load can read back, naming where it sits.
        """
        collector = _Collector()
        skeleton = collector.copy(state, None, label)
        sources = collector.sources
        layout = tuple((source.dtype, source.shape, source.stride()) for source in sources)
        if layout != self._layout or self.arena is None:
            self._plan(sources)
            self._layout = layout
        assert self.arena is not None
        devices = {source.device for source in sources if source.device.type != "cpu"}
        if devices:
            self.arena.pin()
        for view, source in zip(self._views, sources, strict=True):
            if view is not None:
                view.copy_(source, non_blocking=source.device.type != "cpu")
        for device in devices:  # every copy has landed before the writer reads the arena
            torch.cuda.synchronize(device)
        return StagedState(skeleton, self._specs, self.arena)

    def _plan(self, sources: list[torch.Tensor]) -> None:
        specs: list[TensorSpec] = []
        offset = 0
        for source in sources:
            stride = torch.empty_like(source, device="meta").stride()  # the strides clone() would give
            nbytes = source.numel() * source.element_size()
            specs.append(TensorSpec(offset, nbytes, source.dtype, tuple(source.shape), tuple(stride)))
            offset += -(-nbytes // ALIGN) * ALIGN
        if self.arena is None or self.arena.capacity < offset:
            if self.arena is not None:
                self.arena.release()
            self.arena = SharedArena(max(GRANULE, -(-offset // GRANULE) * GRANULE))
        self._specs = tuple(specs)
        self._views = tuple(self.arena.view(spec) if spec.nbytes else None for spec in specs)

    def release(self) -> None:
        """Give the arena back (a later save makes a new one)."""
        self._views = ()
        self._layout = None
        if self.arena is not None:
            self.arena.release()
            self.arena = None


def rebuild(skeleton: Any, specs: tuple[TensorSpec, ...], buffer: Any) -> Any:
    """The state ``skeleton`` stands for, its tensors over ``buffer`` (the writer's mapping of the arena).

    Each tensor gets a storage of its own, exactly its bytes, so ``torch.save`` writes
    what it writes for a copy made in the training process.
    """
    tensors = [_over(buffer, spec) for spec in specs]
    return _fill(skeleton, tensors)


def _over(buffer: Any, spec: TensorSpec) -> torch.Tensor:
    if spec.nbytes == 0:
        return torch.empty_strided(spec.size, spec.stride, dtype=spec.dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset)
    return flat.view(spec.dtype).as_strided(spec.size, spec.stride)


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(value)
    if kind is Slot:
        tensor = tensors[value.index]
        return tensor.view_as(tensor) if value.alias else tensor
    if kind is dict or kind is OrderedDict:
        out = kind()
        for key, item in value.items():
            out[key] = _fill(item, tensors)
        return out
    if kind is list:
        return [_fill(item, tensors) for item in value]
    if kind is tuple:
        return tuple(_fill(item, tensors) for item in value)
    if kind is set:
        return {_fill(item, tensors) for item in value}
    return value
