"""Ending a run's data-loading worker processes when its strategy is dropped without ``close()``.

A strategy and its context refer to each other, so an unclosed strategy (and the loaders it
holds) is freed by the cyclic garbage collector, which finalizes objects in no useful order:
a ``DataLoader`` iterator's queues may be finalized before the iterator, whose shutdown then
waits 5 s per worker process for an answer that never comes. A ``weakref.finalize`` on the
strategy runs before that collection finalizes anything; it holds what the strategy's runs
read from (not the strategy), so it can end the workers while their queues still work.

What it holds is reachable from the finalizer until the strategy is closed: data that refers
back to the strategy (a dataset holding ``ctx``) keeps an unclosed strategy alive, so close
it (``with strategy:``); ``close()`` lets go of all of it.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["LiveData"]


@attrs.define(eq=False)
class LiveData:
    """The last run's step scheduler and loaders, for :meth:`release` when the strategy goes away."""

    scheduler: Any = None
    loaders: list[Any] = attrs.field(factory=list)

    def forget(self) -> None:
        """Hold nothing any more (the strategy was closed): what the finalizer holds must not keep data that
        refers back to the strategy (a dataset holding ``ctx``) alive, nor the strategy with it."""
        self.scheduler, self.loaders = None, []

    def release(self) -> None:
        """Let go of the live epoch iterator, and of the one iterator a loader with persistent workers
        keeps: dropped here, its worker processes end at once (a later ``iter()`` starts new ones)."""
        scheduler, loaders = self.scheduler, self.loaders
        self.scheduler, self.loaders = None, []
        if scheduler is not None:
            scheduler.release_data()
        for loader in loaders:
            if getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None) is not None:
                loader._iterator = None
