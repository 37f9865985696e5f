"""Give a DataLoader a distributed sampler, so each rank reads its own disjoint shard.

A DataLoader refuses a new sampler after construction, so the loader is rebuilt
with the same arguments and the new sampler.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler

__all__ = [
    "INFERRED_KEYWORDS",
    "distributed_loader",
    "has_distributed_sampler",
    "rebuild_loader",
    "samplers_of",
    "unsupported_reason",
]

#: Sampler keywords nvtrain infers (from the process group and the loader) when the sampler accepts them.
INFERRED_KEYWORDS = ("num_replicas", "rank", "shuffle", "seed", "drop_last")


def samplers_of(loader: Any) -> Iterator[Any]:
    """The loader's sampler, batch sampler and the batch sampler's sampler (each once)."""
    seen: set[int] = set()
    batch_sampler = getattr(loader, "batch_sampler", None)
    for candidate in (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        if candidate is not None and id(candidate) not in seen:
            seen.add(id(candidate))
            yield candidate


def has_distributed_sampler(loader: Any) -> bool:
    """Whether the loader already shards by rank (its sampler or batch sampler is distributed)."""
    return any(isinstance(s, DistributedSampler) for s in samplers_of(loader))


def unsupported_reason(loader: Any) -> str | None:
    """Why a sampler cannot be injected into ``loader`` (None when it can)."""
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset, which has no sampler"
    if loader.batch_sampler is not None and (
        loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler
    ):
        return f"it has a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    return None


def _accepted_keywords(factory: Callable[..., Any]) -> frozenset[str]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset(INFERRED_KEYWORDS)
    names = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return frozenset(name for name in INFERRED_KEYWORDS if name in names)


def distributed_loader(
    loader: DataLoader[Any],
    *,
    sampler_cls: Callable[..., Any],
    sampler_kwargs: dict[str, Any],
    rank: int,
    world_size: int,
) -> DataLoader[Any]:
    """``loader`` rebuilt with ``sampler_cls(dataset, **kwargs)``.

    ``num_replicas`` and ``rank`` come from the process group, ``shuffle`` from
    whether the loader's sampler is a RandomSampler, ``drop_last`` from the loader,
    ``seed`` is 0 (equal on every rank, as it must be); each only when the sampler
    accepts the keyword, and ``sampler_kwargs`` override them.
    """
    inferred = {
        "num_replicas": world_size,
        "rank": rank,
        "shuffle": isinstance(loader.sampler, RandomSampler),
        "seed": 0,
        "drop_last": loader.drop_last,
    }
    accepted = _accepted_keywords(sampler_cls)
    kwargs = {name: value for name, value in inferred.items() if name in accepted}
    kwargs.update(sampler_kwargs)
    sampler = sampler_cls(loader.dataset, **kwargs)
    return rebuild_loader(loader, sampler)


def rebuild_loader(loader: DataLoader[Any], sampler: Any) -> DataLoader[Any]:
    """A new loader of the same class with every DataLoader argument of ``loader`` and ``sampler``."""
    kwargs: dict[str, Any] = {
        "dataset": loader.dataset,
        "batch_size": loader.batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    cls = type(loader)
    try:
        return cls(**kwargs)
    except TypeError as err:
        if cls is DataLoader:
            raise
        raise TypeError(
            f"DDPHook: cannot rebuild the {cls.__qualname__} train loader with a distributed sampler, its "
            f"constructor does not take DataLoader's arguments ({err}); build it with "
            "sampler=DistributedSampler(dataset) yourself"
        ) from err
