"""What the data-parallel plugins (``nvtrain-ddp``, ``nvtrain-fsdp``) share.

- The process group they train over (:func:`resolve_process_group`): the hook's own,
  else the strategy's ``distributed_manager``'s, else the default group, else (with
  ``auto_init``) one initialised from torchrun's environment.
- A distributed sampler for the training loader (:class:`LoaderSharding`): a
  ``DataLoader`` refuses a new sampler after construction, so it is rebuilt with
  the same arguments and the new sampler; ``set_epoch`` every epoch.
- The rule that one strategy has one data-parallel hook
  (:func:`refuse_other_data_parallel`): DDP replicates a model, FSDP shards it, and
  a model cannot be both.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from nvtrain.data_cursor import is_torchdata_class
from nvtrain.distributed import TorchrunEnv, default_backend, dtensor_type, malformed_backend, unknown_backend
from nvtrain.hookspecs import hookimpl
from nvtrain.validators import FieldTypeError, FieldValueError, refused, satisfies

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = [
    "INFERRED_KEYWORDS",
    "LoaderSharding",
    "ShardsTrainLoader",
    "as_sampler_factory",
    "as_sampler_kwargs",
    "check_sampler_kwargs",
    "distributed_loader",
    "has_distributed_sampler",
    "is_process_group",
    "loader_seed",
    "optional_process_group",
    "rebuild_loader",
    "refuse_other_data_parallel",
    "refuse_unknown_backend",
    "refuse_unsynchronized_models",
    "resolve_process_group",
    "samplers_of",
    "set_sampler_epoch",
    "unsupported_reason",
]

#: Sampler keywords nvtrain infers (from the process group and the loader) when the sampler accepts them.
INFERRED_KEYWORDS = ("num_replicas", "rank", "shuffle", "seed", "drop_last")


# -- the process group ---------------------------------------------------------------------------


def resolve_process_group(
    owner: str,
    *,
    explicit: Any,
    manager: Any,
    auto_init: bool,
    backend: str | None,
    device: torch.device,
) -> tuple[Any, bool]:
    """``(group, created)``: the group ``owner`` trains over, or ``(None, False)`` in a single process.

    ``explicit`` (the hook's ``process_group``), else the manager's ``process_group``, else
    the default group when ``torch.distributed`` is initialised; otherwise, with
    ``WORLD_SIZE > 1`` in the environment and ``auto_init``, a default group initialised
    here from torchrun's variables (``created`` is then True: the caller destroys it).
    """
    if explicit is not None:
        if not dist.is_initialized():
            raise RuntimeError(f"{owner}.process_group was given but torch.distributed is not initialised")
        return explicit, False
    group = getattr(manager, "process_group", None)
    if group is not None:
        return group, False
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, False
    env = TorchrunEnv.from_environ()
    if env.world_size <= 1:
        return None, False
    if not auto_init:
        raise RuntimeError(
            f"{owner}: WORLD_SIZE={env.world_size} but torch.distributed is not initialised and "
            "auto_init=False; call nvtrain.DistributedManager.initialize() and pass the manager as "
            f"TrainingStrategy(distributed_manager=...), or set {owner}(auto_init=True)"
        )
    dist.init_process_group(
        backend=backend or default_backend(device), init_method="env://", rank=env.rank, world_size=env.world_size
    )
    return dist.group.WORLD, True


def refuse_unknown_backend(owner: str, backend: str | None) -> None:
    """Refuse ``owner.backend`` when torch.distributed knows no such backend, in one process too: torch only warns
    about an unknown name and fails when it initialises the group, so a typo (``"glo"``) would surface first on
    the cluster.

    Called at SETUP, not when the hook is built: a package that registers a backend of its own may be
    imported after the hook is built. ``"cpu:gloo,cuda:nccl"`` pairs name one backend per device type.
    """
    if backend is None:
        return
    unknown, known = unknown_backend(backend)
    malformed = malformed_backend(backend)
    if malformed is not None:
        expected = f"one of {known}, or 'device:backend' pairs such as 'cpu:gloo,cuda:nccl'"
        message = f"{owner}.backend={backend!r} is not a backend torch.distributed reads: {malformed} (expected {expected})"
        raise refused(owner, "backend", backend, expected, message=message)
    if unknown is not None:
        close = difflib.get_close_matches(unknown, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        expected = f"one of {known}, or 'device:backend' pairs such as 'cpu:gloo,cuda:nccl'"
        message = (
            f"{owner}.backend={backend!r} names no torch.distributed backend {unknown!r}{hint} (expected {expected})"
        )
        raise refused(owner, "backend", backend, expected, message=message)


def refuse_other_data_parallel(ctx: TrainingContext, owner: object) -> None:
    """Raise when the strategy has another data-parallel hook besides ``owner`` (a DDP and an FSDP hook).

    Data-parallel hooks mark themselves with a true ``data_parallel`` class attribute.
    """
    strategy = ctx.strategy
    if strategy is None:
        return
    from nvtrain.state import strategy_hooks

    others = [
        hook
        for hook in strategy_hooks(strategy)  # type: ignore[arg-type]
        if hook is not owner and not isinstance(hook, type) and getattr(hook, "data_parallel", False) is True
    ]
    if others:
        names = sorted({type(owner).__name__, *(type(hook).__name__ for hook in others)})
        raise ValueError(
            f"{' and '.join(names)} are both registered on this strategy, and each wraps the models for data "
            "parallelism: they do not combine (a model is either replicated, by DDP, or sharded, by FSDP). "
            "Keep one: FSDPHook shards parameters, gradients and optimizer state over the ranks; DDPHook "
            "keeps a full replica on every rank"
        )


def refuse_unsynchronized_models(ctx: TrainingContext, owner: str, keys: Sequence[str] | None) -> None:
    """Raise when ``owner.model_keys`` leaves out a model that an optimizer trains.

    Its gradients would not be averaged over the ranks, so each rank would train a copy
    of its own, silently drifting apart (and rank 0's copy is what a checkpoint keeps).
    Checked in one process too, so the script fails before it reaches torchrun.
    """
    strategy = ctx.strategy
    if keys is None or strategy is None or any(key not in ctx.models for key in keys):
        return  # an unknown name is the hook's own error to report
    left_out = [
        key
        for key in strategy.optimizers
        if key not in keys
        and key in ctx.models
        and not _wrapped_for_data_parallel(ctx.models[key])
        and any(p.requires_grad for p in ctx.models[key].parameters())
    ]
    if left_out:
        raise FieldValueError(
            f"{owner}.model_keys={tuple(keys)!r} leaves out {left_out}, which an optimizer trains: on several "
            "ranks its gradients would not be averaged, so every rank would train a copy of its own. Add it to "
            "model_keys, or leave model_keys unset to wrap every model that has an optimizer",
            owner=owner,
            field="model_keys",
            value=tuple(keys),
            expected=f"every model with an optimizer ({sorted(strategy.optimizers)})",
        )


def _wrapped_for_data_parallel(model: torch.nn.Module) -> bool:
    """Already replicated or sharded by the caller (DDP, FSDP, DTensor parameters): synchronised on its own."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return True
    dtensor = dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


# -- settings ------------------------------------------------------------------------------------


def is_process_group(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.ProcessGroup`` (False where torch.distributed is unavailable)."""
    group_cls = getattr(dist, "ProcessGroup", None)
    return group_cls is not None and isinstance(value, group_cls)


#: Validator of ``<owner>.process_group``: None or a ``torch.distributed.ProcessGroup`` (a config cannot give one).
optional_process_group = satisfies(
    "a torch.distributed.ProcessGroup (from torch.distributed.new_group(); a config can only leave it out)",
    is_process_group,
    or_none=True,
    error=FieldTypeError,
)


def as_sampler_factory(owner: str, value: Any) -> Callable[..., Any]:
    """``<owner>.sampler_cls`` converted: a callable, or a dotted path to one (``"pkg.module.Name"`` or
    ``"pkg.module:Name"``, for configs)."""
    given, expected = value, "a sampler class or factory, or a dotted path to one"
    if isinstance(value, str):
        module_name, sep, attr = value.rpartition(":") if ":" in value else value.rpartition(".")
        if not sep or not module_name or not attr:
            example = "'torch.utils.data.DistributedSampler'"
            message = f"{owner}.sampler_cls: {value!r} is not a dotted path such as {example}"
            raise refused(owner, "sampler_cls", given, expected, message=message)
        try:
            value = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            message = f"{owner}.sampler_cls: cannot import {value!r} ({err})"
            raise refused(owner, "sampler_cls", given, expected, message=message) from err
    if not callable(value):
        message = f"{owner}.sampler_cls must be a sampler class or factory (got {value!r})"
        raise refused(owner, "sampler_cls", given, expected, message=message, error=FieldTypeError)
    return value  # type: ignore[no-any-return]


def as_sampler_kwargs(owner: str, value: Any) -> dict[str, Any]:
    """``<owner>.sampler_kwargs`` converted: keyword names to values, without ``dataset``."""
    if value is None:
        return {}
    expected = "a mapping of keyword -> value, without 'dataset'"
    if not isinstance(value, Mapping):
        message = f"{owner}.sampler_kwargs must be a mapping of keyword -> value (got {value!r})"
        raise refused(owner, "sampler_kwargs", value, expected, message=message, error=FieldTypeError)
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            message = f"{owner}.sampler_kwargs keys must be keyword names (got {key!r})"
            raise refused(owner, "sampler_kwargs", value, expected, message=message)
    if "dataset" in value:
        message = f"{owner}.sampler_kwargs must not hold 'dataset': the loader's dataset is passed first"
        raise refused(owner, "sampler_kwargs", value, expected, message=message)
    return dict(value)


def check_sampler_kwargs(owner: str, sampler_cls: Callable[..., Any], sampler_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``<owner>.sampler_kwargs`` keys that ``sampler_cls`` does not take (any, when it takes ``**kwargs``
    or has no signature to read)."""
    try:
        parameters = list(inspect.signature(sampler_cls).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in parameters if p.kind in keywords and p.name != "dataset"]
    unknown = [key for key in sampler_kwargs if key not in names]
    if unknown:
        name = getattr(sampler_cls, "__qualname__", repr(sampler_cls))
        expected = f"keywords of {name}: {', '.join(names) or 'none'}"
        message = (
            f"{owner}.sampler_kwargs: {name} takes no keyword {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(names) or 'none besides the dataset'})"
        )
        raise refused(owner, "sampler_kwargs", dict(sampler_kwargs), expected, message=message)


# -- the training loader -------------------------------------------------------------------------


class LoaderSharding:
    """One hook's sharding of training loaders: injection, its warnings, and ``set_epoch``.

    ``owner`` names the hook in messages; ``variable`` is how the docs call an instance
    (``ddp_hook``), for the advice to shard a late loader by hand.
    """

    __slots__ = ("owner", "prepared", "variable", "warned")

    def __init__(self, owner: str, variable: str) -> None:
        self.owner = owner
        self.variable = variable
        #: The loader the hook last saw at SETUP or BEFORE_TRAINING.
        self.prepared: Any = None
        #: Whether the warning about a loader that cannot take a sampler was given.
        self.warned = False

    def shard(
        self,
        loader: Any,
        *,
        sampler_cls: Callable[..., Any],
        sampler_kwargs: dict[str, Any],
        rank: int,
        world_size: int,
    ) -> Any:
        """``loader`` with a distributed sampler; unchanged when it has one or cannot take one (one warning)."""
        if has_distributed_sampler(loader):
            return loader
        # a sampler factory the user chose replaces any sampler; the default keeps one it would not reproduce
        reason = unsupported_reason(loader, keep_custom_sampler=sampler_cls is DistributedSampler)
        if reason is not None:
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"{self.owner}: no distributed sampler was injected into the train loader because {reason}; "
                    "each rank must read its own shard (ctx.rank of ctx.world_size)",
                    stacklevel=4,
                )
            return loader
        return distributed_loader(
            loader,
            sampler_cls=sampler_cls,
            sampler_kwargs=sampler_kwargs,
            rank=rank,
            world_size=world_size,
            owner=self.owner,
        )

    def check_late_loader(self, loader: Any) -> None:
        """Warn when ``run()`` got a loader after SETUP that does not shard (it can no longer be swapped)."""
        if loader is None or loader is self.prepared:
            return
        self.prepared = loader
        if not has_distributed_sampler(loader) and unsupported_reason(loader) is None:
            warnings.warn(
                f"{self.owner}: run() got a train loader without a distributed sampler after the strategy was set "
                "up (SETUP shards only the loader it sees), so every rank reads all of it. Shard it yourself: "
                f"strategy.run({self.variable}.shard(loader)), or run again on strategy.ctx.train_loader",
                stacklevel=3,
            )


class ShardsTrainLoader:
    """The data side both data-parallel hooks share: shard the training loader, ``set_epoch`` each epoch.

    A hook mixing this in keeps ``_active`` (a process group of several ranks is in use),
    ``_group``, ``_loaders`` (its :class:`LoaderSharding`), ``sampler_cls`` and
    ``sampler_kwargs``, and calls :meth:`_prepare_loader` at SETUP.
    """

    __slots__ = ()

    _active: bool
    _group: Any
    _loaders: LoaderSharding
    sampler_cls: Callable[..., Any]
    sampler_kwargs: dict[str, Any]

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        """Warn when ``run()`` got a loader after SETUP that does not shard (it can no longer be swapped)."""
        if self._active:
            self._loaders.check_late_loader(ctx.train_loader)

    def shard(self, loader: Any) -> Any:
        """``loader`` with this hook's distributed sampler (unchanged in a single process or when it shards).

        SETUP does this for the loader of the first ``run()``; use it for loaders given later.
        """
        if not self._active:
            return loader
        return self._loaders.shard(
            loader,
            sampler_cls=self.sampler_cls,
            sampler_kwargs=self.sampler_kwargs,
            rank=dist.get_rank(self._group),
            world_size=dist.get_world_size(self._group),
        )

    def _prepare_loader(self, ctx: TrainingContext) -> None:
        if ctx.train_loader is not None:
            ctx.train_loader = self.shard(ctx.train_loader)
        self._loaders.prepared = ctx.train_loader

    @hookimpl
    def before_epoch(self, ctx: TrainingContext) -> None:
        """``set_epoch(ctx.epoch)`` on every sampler of the loader that has it (idempotent)."""
        set_sampler_epoch(ctx.train_loader, ctx.epoch)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on every sampler of ``loader`` that has it (idempotent)."""
    for sampler in samplers_of(loader):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


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


def unsupported_reason(loader: Any, *, keep_custom_sampler: bool = True) -> str | None:
    """Why a sampler cannot be injected into ``loader`` (None when it can).

    ``keep_custom_sampler``: a sampler other than a plain sequential or random one (a subset, weights,
    draws with replacement) is kept, since a DistributedSampler over the whole dataset would drop what
    it selects; False when the user gave a sampler factory of their own to replace it with.
    """
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "its dataset is an IterableDataset, which has no sampler"
    batch_sampler = loader.batch_sampler
    plain = type(batch_sampler) is BatchSampler or is_torchdata_class(batch_sampler, "BatchSampler")
    if batch_sampler is not None and (loader.batch_size is None or not plain):
        return f"it has a custom batch_sampler ({type(batch_sampler).__name__})"
    sampler = loader.sampler
    if keep_custom_sampler and not (_plain_random(sampler) or _in_order(sampler)):
        # a DistributedSampler over the whole dataset would drop what it selects (a subset) or weights
        return f"it has a custom sampler ({type(sampler).__name__}), which a DistributedSampler would not keep"
    return None


def _plain_random(sampler: Any) -> bool:
    """A random permutation of the whole dataset (``shuffle=True``), not draws with replacement or a count."""
    if not _shuffles(sampler):
        return False
    replacement = getattr(sampler, "replacement", False)
    num_samples = getattr(sampler, "_num_samples", None)  # None: len(data_source), as shuffle=True builds it
    return not replacement and num_samples is None


def _in_order(sampler: Any) -> bool:
    """A sampler that reads the dataset in order: torch's SequentialSampler, or torchdata's."""
    return isinstance(sampler, SequentialSampler) or is_torchdata_class(sampler, "SequentialSampler")


def _shuffles(sampler: Any) -> bool:
    """A random sampler: torch's RandomSampler, or torchdata's (a StatefulDataLoader built with shuffle=True)."""
    return isinstance(sampler, RandomSampler) or is_torchdata_class(sampler, "RandomSampler")


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
    owner: str = "nvtrain",
) -> DataLoader[Any]:
    """``loader`` rebuilt with ``sampler_cls(dataset, **kwargs)``.

    ``num_replicas`` and ``rank`` come from the process group, ``shuffle`` from
    whether the loader's sampler is a random one (torch's RandomSampler, or torchdata's in a
    StatefulDataLoader built with ``shuffle=True``), ``drop_last`` from the loader,
    ``seed`` from :func:`loader_seed`; each only when the sampler accepts the keyword,
    and ``sampler_kwargs`` override them. A sampler that refuses its arguments raises a
    TypeError or ValueError naming ``<owner>.sampler_kwargs`` (``<owner>.sampler_cls``
    when there are none).
    """
    inferred = {
        "num_replicas": world_size,
        "rank": rank,
        "shuffle": _shuffles(loader.sampler),
        "seed": agreed_seed(loader_seed(loader), world_size),
        "drop_last": loader.drop_last,
    }
    accepted = _accepted_keywords(sampler_cls)
    kwargs = {name: value for name, value in inferred.items() if name in accepted}
    kwargs.update(sampler_kwargs)
    try:
        sampler = sampler_cls(loader.dataset, **kwargs)
    except (TypeError, ValueError) as err:
        name = getattr(sampler_cls, "__qualname__", repr(sampler_cls))
        field = "sampler_kwargs" if sampler_kwargs else "sampler_cls"
        error = TypeError if isinstance(err, TypeError) else ValueError
        raise error(f"{owner}.{field}: {name}(dataset, **{kwargs!r}) failed: {err}") from err
    return rebuild_loader(loader, sampler, owner=owner)


def agreed_seed(seed: int, world_size: int) -> int:
    """Rank 0's ``seed`` on every rank (one broadcast at SETUP): the ranks' shards of a distributed sampler
    are disjoint only when every rank shuffles the same permutation, and a loader generator seeded per
    process (``generator.seed()``) gives each rank its own."""
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return seed
    agreed = [seed]
    dist.broadcast_object_list(agreed, src=0)
    return int(agreed[0])


def loader_seed(loader: Any) -> int:
    """The seed a distributed sampler for ``loader`` shuffles with: the ``initial_seed()`` of the loader's
    ``generator`` (equal on every rank when it is seeded from a config), else 0."""
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        return int(generator.initial_seed())
    return 0


def rebuild_loader(loader: DataLoader[Any], sampler: Any, *, owner: str = "nvtrain") -> DataLoader[Any]:
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
    if hasattr(loader, "snapshot_every_n_steps"):  # torchdata's StatefulDataLoader
        kwargs["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    cls = type(loader)
    try:
        return cls(**kwargs)
    except TypeError as err:
        if cls is DataLoader:
            raise
        raise TypeError(
            f"{owner}: cannot rebuild the {cls.__qualname__} train loader with a distributed sampler, its "
            f"constructor does not take DataLoader's arguments ({err}); build it with "
            "sampler=DistributedSampler(dataset) yourself"
        ) from err
