"""DataCursor: open an epoch of a loader at a micro-batch position without reading what came before.

A resumed run continues an epoch in the middle. Replaying the epoch from its
start (``next()`` ``position`` times) fetches and collates every consumed sample
again; on a real data set that is minutes or hours per restart. For a
``torch.utils.data.DataLoader`` over a map-style dataset with a standard sampler
the cursor instead draws the epoch's sample order from the sampler (indices
only, no dataset access) and builds a one-epoch loader over the same dataset,
collate function and worker settings whose batch sampler yields only the
unconsumed index batches, so neither the main process nor the workers touch
the skipped part. Any other iterable is fast-forwarded as before, with one log
line saying so.

torchdata's ``StatefulDataLoader`` keeps its own position: the step scheduler
saves its ``state_dict()`` and restores it with ``load_state_dict()`` instead of
opening a cursor (:func:`is_stateful_dataloader` recognises one without
importing torchdata, which stays optional). The cursor replays such a loader
only when the checkpoint holds no state of it.

The caller sets the random state the epoch started from before :meth:`DataCursor.open`
and puts the current one back afterwards (``StepScheduler`` does both); the
cursor makes exactly the draws a fresh ``iter(loader)`` followed by a full pass
over its sampler would make, so the permutation is the one the interrupted run
used.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from nvtrain.host_rng import apply_host_rng, capture_host_rng

__all__ = [
    "DataCursor",
    "capture_rng",
    "check_rng_fits",
    "epoch_iterator",
    "is_one_shot",
    "is_stateful_dataloader",
    "loader_generators",
    "restore_rng",
]

logger = logging.getLogger(__name__)

_NO_ITEM: Any = object()

#: torchdata's loader that saves and restores its own position: (module prefix, class name). Recognised by
#: name, so nvtrain never imports torchdata (an optional dependency).
_STATEFUL_LOADER = ("torchdata.stateful_dataloader", "StatefulDataLoader")

#: Samplers whose iteration only yields indices: drawing an epoch's order from them reads no data.
_STANDARD_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)


class _RemainingBatches:
    """The rest of an epoch's index batches, pulled lazily from the sampler as the loader asks for them.

    A ``RandomSampler`` with a generator of its own draws lazily: its trailing
    ``randperm`` happens only when the loader asks past the epoch's last index.
    The cursor iterates a copy of the sampler on a replica of that generator and,
    whenever a pull made the replica draw, sets the real generator to the replica's
    state: the real one then advances when, and as far as, the uninterrupted run's did.
    """

    def __init__(self, iterator: Iterator[Any], replica: torch.Generator | None, real: torch.Generator | None) -> None:
        self._iterator = iterator
        self._replica, self._real = replica, real
        self._seen = replica.get_state() if replica is not None else None

    def _sync(self) -> None:
        if self._replica is None or self._real is None:
            return
        state = self._replica.get_state()
        if self._seen is None or not torch.equal(state, self._seen):
            self._seen = state
            self._real.set_state(state)

    def __iter__(self) -> Iterator[Any]:
        while True:
            batch = next(self._iterator, _NO_ITEM)
            self._sync()
            if batch is _NO_ITEM:
                return
            yield batch


class DataCursor:
    """Opens ``loader``'s current epoch at a micro-batch position (see the module docstring).

    :attr:`skips_without_reading` says which way :meth:`open` goes, and
    :attr:`reason` why not when it replays.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.reason = _replay_reason(loader)

    @property
    def skips_without_reading(self) -> bool:
        """True when :meth:`open` starts at the position without fetching the batches before it."""
        return self.reason is None

    def open(self, position: int, epoch: int = 0, *, reopen: bool = False) -> Iterator[Any]:
        """An iterator over the epoch's micro-batches from ``position`` on.

        ``reopen``: the epoch was started before (a state captured inside its first window), so
        even at position 0 its order is drawn now, under the random states the caller restored,
        as for any later position. Raises ValueError when the epoch has fewer than ``position``
        micro-batches.
        """
        if position == 0 and not reopen:
            return epoch_iterator(self.loader, epoch)
        if self.reason is None:
            return self._open_by_index(position, epoch)
        return self._replay(position, epoch)

    def _open_by_index(self, position: int, epoch: int) -> Iterator[Any]:
        loader: DataLoader[Any] = self.loader
        # iter(loader) draws the workers' base seed first (from loader.generator, else the global
        # generator), then the sampler draws the permutation at its first pull: make the same draws in
        # the same order. The new loader draws its base seed from a private copy of that state.
        source = loader.generator
        seed_generator = torch.Generator()
        seed_generator.set_state(source.get_state() if source is not None else torch.get_rng_state())
        draw_base_seed(loader)
        index_sampler, replica, real = _shadow_index_sampler(loader)
        iterator = iter(index_sampler)
        for skipped in range(position):  # indices only: no dataset access
            if next(iterator, _NO_ITEM) is _NO_ITEM:
                raise ValueError(
                    f"StepScheduler: cannot resume epoch {epoch + 1} at micro-batch {position}: the dataloader "
                    f"yields only {skipped} this epoch"
                )
        if position == 0:
            iterator = _drawn_now(iterator)
        remaining = _RemainingBatches(iterator, replica, real)
        settings: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "generator": seed_generator,
            "prefetch_factor": loader.prefetch_factor,
            "pin_memory_device": loader.pin_memory_device,
        }
        if hasattr(loader, "in_order"):
            settings["in_order"] = loader.in_order
        if loader.batch_sampler is not None:
            rest = DataLoader(loader.dataset, batch_sampler=remaining, **settings)
        else:  # batch_size=None: one index per micro-batch, no auto-collation
            rest = DataLoader(loader.dataset, batch_size=None, sampler=remaining, **settings)
        return _started_later(rest)

    def _replay(self, position: int, epoch: int) -> Iterator[Any]:
        if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
            advice = (
                "A checkpoint nvtrain writes at a step boundary holds the loader's state"
                if is_stateful_dataloader(self.loader)
                else "To resume without reading them, use a torch DataLoader over a map-style dataset with a "
                "standard sampler (SequentialSampler, RandomSampler, DistributedSampler, optionally under a "
                "BatchSampler) and persistent_workers=False, or torchdata's StatefulDataLoader"
            )
            logger.warning(
                "resuming epoch %d: replaying %d micro-batch(es) to reach the saved position, because %s; every "
                "skipped sample is read again. %s",
                epoch + 1,
                position,
                self.reason,
                advice,
            )
        iterator = epoch_iterator(self.loader, epoch)
        for skipped in range(position):
            if next(iterator, _NO_ITEM) is _NO_ITEM:
                raise ValueError(
                    f"StepScheduler: cannot resume epoch {epoch + 1} at micro-batch {position}: the dataloader yields "
                    f"only {skipped} this epoch"
                )
        return _drawn_now(iterator) if position == 0 else iterator


def loader_generators(loader: Any) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` objects a new iterator of ``loader`` may draw from, by attribute path, each once.

    The one place that knows where a loader keeps its generators: the checkpoint's RNG
    state keys them by these paths, and the epoch's RNG state lists them in this order.
    """
    found: dict[str, torch.Generator] = {}
    if loader is None:
        return found
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = {
        "loader.generator": getattr(loader, "generator", None),
        "loader.sampler.generator": getattr(getattr(loader, "sampler", None), "generator", None),
        "loader.batch_sampler.generator": getattr(batch_sampler, "generator", None),
        "loader.batch_sampler.sampler.generator": getattr(getattr(batch_sampler, "sampler", None), "generator", None),
    }
    for path, generator in candidates.items():
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found.values()):
            found[path] = generator
    return found


def capture_rng(generators: Sequence[torch.Generator]) -> dict[str, Any]:
    """The global random states (torch's, Python's, NumPy's) and ``generators``' states, for :func:`restore_rng`.

    A sampler or data set may draw from any of the global streams, so an epoch's order
    and what replaying its first micro-batches moves depend on all three.
    """
    return {"torch": torch.get_rng_state(), **capture_host_rng(), "generators": [g.get_state() for g in generators]}


def check_rng_fits(state: Mapping[str, Any], generators: Sequence[Any]) -> None:
    """A saved epoch RNG state holds one state per generator of the loader (sampler's and loader's), or a
    ValueError says what differs: it is refused before a resume loads anything, not at the epoch's first window."""
    saved = list(state.get("generators", []))
    if len(saved) != len(generators):
        raise ValueError(
            f"StepScheduler: the saved epoch RNG holds {len(saved)} sampler/loader generator state(s) but the "
            f"dataloader has {len(generators)} generator(s); build the loader the same way as the saved run"
        )


def restore_rng(state: Mapping[str, Any], generators: Sequence[torch.Generator]) -> None:
    """Put back what :func:`capture_rng` took (the generators listed in the same order)."""
    check_rng_fits(state, generators)
    saved = list(state.get("generators", []))
    torch.set_rng_state(state["torch"])
    apply_host_rng(state)  # an epoch state saved before these were kept has neither: left as they are
    for generator, generator_state in zip(generators, saved, strict=True):
        generator.set_state(generator_state)


def draw_base_seed(loader: DataLoader[Any]) -> None:
    """The draw a new DataLoader iterator makes first: its workers' base seed, from ``loader.generator``
    (else the global generator), before the sampler draws the epoch's order."""
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


def is_one_shot(loader: Any) -> bool:
    """Whether ``loader`` is an iterator (a generator, say): ``iter()`` gives itself, read once, never again."""
    return isinstance(loader, Iterator)


def epoch_iterator(loader: Any, epoch: int) -> Iterator[Any]:
    """``iter(loader)`` for ``epoch``, making the random draws an uninterrupted run makes there.

    A loader with persistent workers keeps one iterator for its lifetime: the first
    ``iter()`` creates it and draws the workers' base seed before the sampler draws the
    epoch's order; later epochs reset it and draw only the order. A resumed or continued
    run must draw what the uninterrupted one drew at this epoch, whichever iterator it
    holds: an epoch after the first that finds no live iterator (a resume in a new
    process) creates one off the record (its draws undone) and resets it; the first epoch
    found with a live iterator (a second ``run()`` continuing it) draws the base seed first.
    Any other loader gets a plain ``iter(loader)``.
    """
    if not (getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0):
        return iter(loader)
    live = getattr(loader, "_iterator", None) is not None
    if epoch > 0 and not live:
        generators = list(loader_generators(loader).values())
        before = capture_rng(generators)
        iter(loader)  # starts the workers; the draws it makes are undone
        restore_rng(before, generators)
    elif epoch == 0 and live:
        draw_base_seed(loader)  # as the first iter() did
    return iter(loader)


def _drawn_now(iterator: Iterator[Any]) -> Iterator[Any]:
    """``iterator`` with its first item pulled already: a sampler draws its order at the first pull, which
    must happen under the random states the caller set (skipping to a later position pulls anyway)."""
    first = next(iterator, _NO_ITEM)
    return iter(()) if first is _NO_ITEM else itertools.chain((first,), iterator)


def _started_later(loader: DataLoader[Any]) -> Iterator[Any]:
    """Iterate ``loader``, creating its iterator (and workers, and their prefetch) only at the first ``next()``.

    The caller puts the random state of the save moment back between :meth:`DataCursor.open`
    and the first ``next()``; whatever the new iterator pulls from the sampler comes after that.
    """
    yield from loader


def _shadow_index_sampler(loader: DataLoader[Any]) -> tuple[Any, torch.Generator | None, torch.Generator | None]:
    """The loader's index sampler, drawing from a replica when its RandomSampler has a generator of its own.

    Returns ``(index_sampler, replica, real)``; without such a generator both are None and
    the loader's own index sampler is iterated (its draws, if any, are made at the first pull).
    """
    batch_sampler: Any = loader.batch_sampler
    sampler: Any = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    real = getattr(sampler, "generator", None) if type(sampler) is RandomSampler else None
    if real is None:
        return loader._index_sampler, None, None
    replica = torch.Generator()
    replica.set_state(real.get_state())
    shadow = copy.copy(sampler)
    shadow.generator = replica
    if batch_sampler is None:
        return shadow, replica, real
    shadow_batches = copy.copy(batch_sampler)
    shadow_batches.sampler = shadow
    return shadow_batches, replica, real


def is_torchdata_class(obj: Any, name: str) -> bool:
    """Whether ``obj`` is exactly torchdata's stateful-loader class ``name`` (its own RandomSampler or
    BatchSampler, say), decided from names so that torchdata stays optional."""
    prefix = _STATEFUL_LOADER[0]
    module = type(obj).__module__ or ""
    return type(obj).__name__ == name and (module == prefix or module.startswith(prefix + "."))


def is_stateful_dataloader(loader: Any) -> bool:
    """Whether ``loader`` is a torchdata ``StatefulDataLoader`` (or a subclass) that can save its position.

    Decided from the class hierarchy's names, without importing torchdata: True when a
    class named ``StatefulDataLoader`` from the ``torchdata.stateful_dataloader`` package is
    among the loader's bases and the loader has callable ``state_dict`` and ``load_state_dict``.
    """
    module_prefix, name = _STATEFUL_LOADER
    for cls in type(loader).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if cls.__name__ == name and (module == module_prefix or module.startswith(module_prefix + ".")):
            return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    return False


def _replay_reason(loader: Any) -> str | None:
    """Why ``loader`` cannot be opened at a position without reading the skipped part (None: it can)."""
    if is_stateful_dataloader(loader):
        return (
            f"the loader is a {type(loader).__qualname__} and the checkpoint holds no state of it for this position "
            "(written by an nvtrain without StatefulDataLoader support, or in the middle of a step)"
        )
    if type(loader) is not DataLoader:
        return f"the loader is a {type(loader).__qualname__}, not a torch.utils.data.DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset (a stream cannot start at an offset)"
    if loader.persistent_workers and loader.num_workers > 0:
        return "it keeps persistent workers (one iterator for the loader's lifetime)"
    sampler = loader.sampler
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None:
        if type(batch_sampler) is not BatchSampler:
            return f"its batch sampler is a {type(batch_sampler).__qualname__}, not a torch BatchSampler"
        sampler = batch_sampler.sampler
    if type(sampler) not in _STANDARD_SAMPLERS:
        return f"its sampler is a {type(sampler).__qualname__}, not a standard one"
    return None
