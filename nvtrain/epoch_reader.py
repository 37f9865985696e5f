"""EpochReader: one epoch of a loader, read from a position, and what a checkpoint needs to come back.

The step scheduler decides which micro-batches form a step; this class owns where
the data stands. It opens an epoch's iterator (fresh at position 0, from a torchdata
StatefulDataLoader's own saved state, or through a :class:`~nvtrain.data_cursor.DataCursor`
under the epoch's saved random state, which starts at the first unconsumed sample),
counts the micro-batches taken, peeks one ahead for a loader without ``len()``, and
answers what a checkpoint must hold to resume here: the epoch's RNG state and, for a
StatefulDataLoader, its ``state_dict()`` after exactly the consumed micro-batches.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from nvtrain.data_cursor import (
    DataCursor,
    capture_rng,
    epoch_iterator,
    is_one_shot,
    is_stateful_dataloader,
    loader_generators,
    restore_rng,
)

__all__ = ["NO_ITEM", "EpochReader", "loader_generators", "loader_len", "loader_parts"]

#: What :meth:`EpochReader.take` returns once the epoch's iterator is exhausted.
NO_ITEM: Any = object()


def loader_len(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without one (or one that refuses, as an IterableDataset's)."""
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def loader_parts(loader: Any) -> list[Any]:
    """The loader and the objects behind it that may carry per-epoch state, each once."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [
        loader,
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(loader, "dataset", None),
        getattr(loader, "collate_fn", None),
    ]
    parts: list[Any] = []
    for part in candidates:
        if part is not None and all(part is not seen for seen in parts):
            parts.append(part)
    return parts


class EpochReader:
    """Reads the current epoch of ``loader`` for a step scheduler, from the position it is told.

    ``pulled`` counts the micro-batches taken from the live iterator (a peeked one not
    included); ``items`` is the epoch's length when the loader has one (None for a
    synchronized stream, which is read until some rank runs dry).
    """

    __slots__ = (
        "_loaded_state",
        "_state_before_lookahead",
        "epoch_rng",
        "items",
        "iterator",
        "loader",
        "pending",
        "pulled",
        "sized",
        "stateful",
    )

    def __init__(self, loader: Any, *, sized: bool = True) -> None:
        self.loader = loader
        #: A torchdata StatefulDataLoader: its own state_dict() is saved and restored.
        self.stateful = loader is not None and is_stateful_dataloader(loader)
        #: Whether the epoch's length comes from ``len(loader)`` (False: a synchronized stream).
        self.sized = sized
        #: The global and the loader's random states when the epoch's iterator was made (position 0).
        self.epoch_rng: dict[str, Any] | None = None
        self._loaded_state: dict[str, Any] | None = None  # a StatefulDataLoader state to resume from
        #: The epoch's live iterator (None until :meth:`open`), and a peeked micro-batch (or NO_ITEM).
        self.iterator: Iterator[Any] | None = None
        self.pending: Any = NO_ITEM
        self.pulled = 0
        self.items: int | None = None
        self._state_before_lookahead: tuple[int, dict[str, Any] | None] | None = None  # (pulled, loader state)

    # -- the epoch's iterator ------------------------------------------------------------------

    def open(self, position: int, epoch: int) -> Iterator[Any]:
        """The iterator of ``epoch`` that yields micro-batch ``position`` first (nothing before it is read)."""
        loader = self.loader
        generators = list(loader_generators(loader).values())
        if position == 0 and self.epoch_rng is None:
            self.epoch_rng = capture_rng(generators)
            iterator = epoch_iterator(loader, epoch)
        elif self._loaded_state is not None:  # a StatefulDataLoader continues from its own saved state
            iterator = self._resume_stateful(self._loaded_state, generators, position, epoch)
        else:
            now = capture_rng(generators)
            if self.epoch_rng is None:
                warnings.warn(
                    f"StepScheduler: resuming epoch {epoch + 1} at micro-batch {position} without the epoch's "
                    "RNG state; a shuffling loader will not replay the saved order",
                    RuntimeWarning,
                    stacklevel=4,
                )
            else:
                restore_rng(self.epoch_rng, generators)
            try:  # without reading the consumed micro-batches where the loader allows it
                # (position 0 with the epoch's states: a state captured inside its first window)
                iterator = DataCursor(loader).open(position, epoch, reopen=True)
            finally:
                restore_rng(now, generators)
        self.iterator, self.pending, self.pulled = iterator, NO_ITEM, position
        self.items = loader_len(loader) if self.sized else None
        return iterator

    def _resume_stateful(
        self, saved: dict[str, Any], generators: Sequence[torch.Generator], position: int, epoch: int
    ) -> Iterator[Any]:
        """``loader.load_state_dict(saved)``, then its iterator; the random state is left as it was.

        The new iterator's draws (its base seed, the sampler's first permutation) are replaced
        by the saved state; the global RNG and the loader's generators keep the save moment's
        state, which the checkpoint restored, so later draws (dropout) match the uninterrupted run.
        """
        loader = self.loader
        now = capture_rng(generators)
        try:
            loader.load_state_dict(saved["state"])
            iterator: Iterator[Any] = iter(loader)
        except Exception as err:
            err.add_note(
                f"while restoring the {type(loader).__qualname__} state saved after micro-batch {position} "
                f"of epoch {epoch + 1}"
            )
            raise
        finally:
            restore_rng(now, generators)
        self._loaded_state = None
        return iterator

    def take(self) -> Any:
        """The next micro-batch (a peeked one first), or :data:`NO_ITEM` at the epoch's end."""
        if self.pending is not NO_ITEM:
            item, self.pending = self.pending, NO_ITEM
            self.pulled += 1
            return item
        assert self.iterator is not None
        item = next(self.iterator, NO_ITEM)
        if item is not NO_ITEM:
            self.pulled += 1
        return item

    def peek_exhausted(self) -> bool:
        """Peek one micro-batch ahead (kept for :meth:`take`); True when the epoch has none left.

        For a StatefulDataLoader the loader's state is kept first: the state after the
        consumed micro-batches, before the loader counts the peeked one.
        """
        assert self.iterator is not None
        if self.stateful:
            self._state_before_lookahead = (self.pulled, copy.deepcopy(self._current_loader_state()))
        peeked = next(self.iterator, NO_ITEM)
        self.pending = peeked
        return peeked is NO_ITEM

    def yields_past_its_length(self) -> bool:
        """At a sized epoch's end, whether the live iterator yields one more micro-batch: the loader's ``len()``
        is below what it yields, and the rest of every epoch goes untrained. One ``next()`` per epoch, on
        an iterator the epoch is done with. Not asked of a one-shot iterator (the next epoch goes on from
        there) nor of a StatefulDataLoader (its saved state would count the extra read)."""
        iterator = self.iterator
        if iterator is None or self.items is None or self.pulled < self.items or self.stateful:
            return False
        if self.pending is not NO_ITEM:
            return True
        if is_one_shot(self.loader):
            return False
        generators = list(loader_generators(self.loader).values())
        streams = capture_rng(generators)
        try:  # a sampler draws even when it ends (a RandomSampler's last randperm): the next epoch must not see it
            return next(iterator, NO_ITEM) is not NO_ITEM
        finally:
            restore_rng(streams, generators)

    def untouched(self) -> bool:
        """Whether the live iterator has yielded just what this reader took: a DataLoader iterator counts
        what it yields, and one with persistent workers is reset by anybody's ``iter(loader)``."""
        iterator = self.iterator
        if iterator is None:
            return False
        yielded = getattr(iterator, "_num_yielded", None)
        return yielded is None or yielded == self.pulled + (self.pending is not NO_ITEM)

    def release(self, position: int) -> None:
        """Let go of the live iterator (its worker processes end now, not whenever the garbage collector
        finds this reader); the epoch is reopened at ``position`` (where the closed windows end) if read
        again. A one-shot iterator (the loader itself) is kept: it owns nothing, and could not be reopened."""
        if self.iterator is None or is_one_shot(self.loader):
            return
        if self.stateful:  # reopened from its own state at the position; None when read past it (mid-step)
            self._loaded_state = self.loader_entry(position, position)
        self.iterator, self.pending = None, NO_ITEM

    def drop(self) -> None:
        """Forget the live iterator (the epoch changes, or a state is loaded)."""
        self.iterator, self.pending, self.pulled, self.items = None, NO_ITEM, 0, None
        self._state_before_lookahead = None

    def new_epoch(self) -> None:
        """Start the next epoch from its first micro-batch: nothing of this one's resume state is kept."""
        self.epoch_rng = None
        self._loaded_state = None
        self.drop()

    # -- what a checkpoint holds --------------------------------------------------------------------

    def _current_loader_state(self) -> dict[str, Any] | None:
        """The loader's state at what this reader took, from the iterator that yielded it: the live one, or
        the loader's own behind a wrapper (the loader's ``state_dict()`` describes whichever iterator it
        made last, maybe somebody else's). None when that iterator was read or reset elsewhere: the
        position is then replayed."""
        expected = self.pulled + (self.pending is not NO_ITEM)
        for iterator in (self.iterator, getattr(self.loader, "_iterator", None)):
            state_of = getattr(iterator, "state_dict", None)
            if callable(state_of) and getattr(iterator, "_num_yielded", expected) == expected:
                state = state_of()
                if reiterates_unsaved_parts(state) and not _fixed_order(self.loader):
                    return None  # replayed under the epoch's RNG states instead, which gives the saved order
                return {"num_workers": self.loader.num_workers, "state": state}
        return None

    def loader_entry(self, position: int, closed_position: int) -> dict[str, Any] | None:
        """A StatefulDataLoader's state after exactly ``position`` micro-batches of the current epoch.

        The loader's ``state_dict()`` counts the batches it has yielded (its workers' prefetch
        is not counted). Those are the consumed ones unless the reader looked one ahead
        (a loader without ``len()``); for that case the state from before the look-ahead was
        kept. None at an epoch's start (a fresh iterator then starts the epoch, as in an
        uninterrupted run) and in the middle of a step. ``closed_position`` is where the
        scheduler's closed windows end (a loaded state still holds there until read from).
        """
        if not self.stateful or position == 0:
            return None
        if self.iterator is None:  # nothing read since the state was loaded: it still holds
            held = self._loaded_state
            return held if held is not None and position == closed_position else None
        if self.pulled == position and self.pending is NO_ITEM:
            return self._current_loader_state()
        before = self._state_before_lookahead
        if before is not None and before[0] == position:
            return before[1]
        return None

    def load(self, epoch_rng: Mapping[str, Any] | None, loader_entry: dict[str, Any] | None, position: int) -> None:
        """Resume at ``position`` with the epoch's RNG state and the loader's own state (as
        :meth:`check_loader_entry` returned it)."""
        self.epoch_rng = None if epoch_rng is None else {**epoch_rng, "generators": list(epoch_rng["generators"])}
        self._loaded_state = loader_entry if position > 0 else None
        self.drop()

    def check_loader_entry(self, entry: Any, owner: str) -> dict[str, Any] | None:
        """A saved StatefulDataLoader state (``state["loader"]``), checked against this reader's loader."""
        if entry is None:
            return None
        if not isinstance(entry, Mapping) or not isinstance(entry.get("state"), Mapping):
            got = f"a {type(entry).__name__}" if not isinstance(entry, Mapping) else f"keys {sorted(map(str, entry))}"
            raise ValueError(
                f"{owner}: state['loader'] must be None or a dict with the loader's 'state' dict and its "
                f"'num_workers' (got {got})"
            )
        workers = entry.get("num_workers")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"{owner}: state['loader']['num_workers'] must be an int >= 0 (got {workers!r})")
        if not self.stateful:
            return None  # another kind of loader now: the position and the epoch's RNG state resume it
        live = self.loader.num_workers
        if workers != live:
            raise ValueError(
                f"{owner}: the checkpoint's {type(self.loader).__qualname__} state was saved with "
                f"num_workers={workers}, but this loader has num_workers={live}; torchdata restores a loader's "
                f"state only into one with as many workers: build it with num_workers={workers} to resume"
            )
        if reiterates_unsaved_parts(entry["state"]) and not _fixed_order(self.loader):  # saved before: replayed
            return None
        return {"num_workers": workers, "state": dict(entry["state"])}


def reiterates_unsaved_parts(state: Mapping[str, Any]) -> bool:
    """Whether a StatefulDataLoader state resumes its position by iterating its sampler (or iterable data set)
    again and skipping what was yielded, because that part has no ``state_dict()`` of its own.

    Such a new iteration draws afresh: a sampler or data set that shuffles with the global RNG
    yields another order, and the rest of the epoch repeats some samples and skips others.
    nvtrain's own replay, under the epoch's saved RNG states, yields the saved order.
    """
    snapshot = state.get("_snapshot")
    if not isinstance(snapshot, Mapping) and "_sampler_iter_state" not in state:
        return False  # not a state of this torchdata's shape: torchdata itself says what is wrong with it
    main = snapshot.get("_main_snapshot", {}) if isinstance(snapshot, Mapping) else state
    workers = snapshot.get("_worker_snapshots", {}) if isinstance(snapshot, Mapping) else {"main": state}
    parts = [part for part in workers.values() if isinstance(part, Mapping)]
    fetchers = [part.get("fetcher_state") for part in parts]
    if any(isinstance(fetcher, Mapping) for fetcher in fetchers):  # an iterable data set
        return all(
            part.get("dataset_state") is None
            and not (isinstance(fetcher, Mapping) and fetcher.get("dataset_iter_state") is not None)
            for part, fetcher in zip(parts, fetchers, strict=True)
        )
    sampler = main.get("_sampler_iter_state")
    saved = isinstance(sampler, Mapping) and bool({"sampler_iter_state", "sampler_state"} & set(sampler))
    return main.get("_index_sampler_state") is None and not saved


def _fixed_order(loader: Any) -> bool:
    """Whether iterating the loader's sampler again yields the same order: torch's SequentialSampler, and its
    DistributedSampler (seeded by its seed and epoch, not the global RNG). torchdata's fast-forward then lands
    where the saved run was, without reading the samples before it."""
    sampler = getattr(loader, "sampler", None)
    return isinstance(sampler, (torch.utils.data.SequentialSampler, torch.utils.data.DistributedSampler))
