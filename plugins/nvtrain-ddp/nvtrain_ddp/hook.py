"""DDPHook: DistributedDataParallel, a distributed sampler and one all-reduce per optimizer step."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

import nvtrain
from nvtrain.distributed import TorchrunEnv, default_backend
from nvtrain.validators import a_bool, optional_bool, optional_non_empty_str
from nvtrain_ddp.sampler import distributed_loader, has_distributed_sampler, samplers_of, unsupported_reason

__all__ = ["DDPHook"]

logger = logging.getLogger(__name__)

# torch 2.13 renamed DistributedDataParallel(broadcast_buffers=...) to forward_sync_buffers (buffers are then
# always synced once at construction); older releases only know the old name.
_BUFFER_SYNC_ARGUMENT = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


# -- field converters and validators ------------------------------------------------------


def _as_model_keys(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, Iterable) or isinstance(keys, Mapping):
        raise TypeError(f"DDPHook.model_keys must be a str, a sequence of str or None (got {value!r})")
    keys = tuple(keys)
    if not keys or not all(isinstance(key, str) and key for key in keys):
        raise ValueError(f"DDPHook.model_keys must name at least one model by a non-empty str (got {value!r})")
    if len(set(keys)) != len(keys):
        raise ValueError(f"DDPHook.model_keys names a model twice (got {value!r})")
    return keys


def _as_callable(value: Any) -> Callable[..., Any]:
    """A callable, or a dotted path to one (``"pkg.module.Name"`` or ``"pkg.module:Name"``), for configs."""
    if isinstance(value, str):
        module_name, sep, attr = value.rpartition(":") if ":" in value else value.rpartition(".")
        if not sep or not module_name or not attr:
            raise ValueError(
                f"DDPHook.sampler_cls: {value!r} is not a dotted path such as 'torch.utils.data.DistributedSampler'"
            )
        try:
            value = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"DDPHook.sampler_cls: cannot import {value!r} ({err})") from err
    if not callable(value):
        raise TypeError(f"DDPHook.sampler_cls must be a sampler class or factory (got {value!r})")
    return value  # type: ignore[no-any-return]


def _as_sampler_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"DDPHook.sampler_kwargs must be a mapping of keyword -> value (got {value!r})")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"DDPHook.sampler_kwargs keys must be keyword names (got {key!r})")
    if "dataset" in value:
        raise ValueError("DDPHook.sampler_kwargs must not hold 'dataset': the loader's dataset is passed first")
    return dict(value)


# -- the hook --------------------------------------------------------------------------


@attrs.define(eq=False)
class DDPHook:
    """Wraps the trained models in DistributedDataParallel at SETUP and shards the data.

    - SETUP (after every other setup implementation, so fine-tuning patches that
      change ``requires_grad`` come first): resolves the process group (``process_group``,
      else the strategy's ``distributed_manager``'s, else the default group; with
      ``auto_init`` it initialises one from torchrun's environment when
      ``WORLD_SIZE > 1``), wraps ``ctx.models[key]`` so the optimizers built next hold
      the wrapped parameters, and gives ``ctx.train_loader`` a distributed sampler.
    - BEFORE_EPOCH: ``sampler.set_epoch(ctx.epoch)``, so every epoch shuffles anew.
    - Micro-batches that do not end an accumulation window (``ctx.sync_gradients`` is
      False) run forward and backward under ``no_sync()``: one gradient all-reduce per
      optimizer step. DDP decides at forward time whether the coming backward
      all-reduces, so the context is entered at BEFORE_FORWARD and left at AFTER_BACKWARD.
    - ``close()`` puts the unwrapped models back into ``ctx.models`` and destroys the
      process group only if this hook created it. The injected loader stays in place.

    In a single process (no process group and ``WORLD_SIZE`` at most 1) the hook does
    nothing, so one script runs under ``python`` and ``torchrun`` alike.
    """

    plugin_name: ClassVar[str] = "ddp"
    priority: ClassVar[int] = 50

    #: Models to wrap; None wraps every model that has an optimizer.
    model_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_as_model_keys)
    #: None: the distributed manager's setting when it has one, else False.
    find_unused_parameters: bool | None = attrs.field(default=None, validator=optional_bool)
    #: None: the distributed manager's setting when it has one, else False.
    broadcast_buffers: bool | None = attrs.field(default=None, validator=optional_bool)
    static_graph: bool = attrs.field(default=False, validator=a_bool)
    #: Explicit process group; None: the manager's, else the default group.
    process_group: Any = None
    #: Backend when this hook initialises torch.distributed (None: NCCL on CUDA, gloo otherwise).
    backend: str | None = attrs.field(default=None, validator=optional_non_empty_str("backend name such as 'nccl' or 'gloo'"))
    auto_init: bool = attrs.field(default=True, validator=a_bool)
    sampler_cls: Callable[..., Any] = attrs.field(default=DistributedSampler, converter=_as_callable)
    sampler_kwargs: dict[str, Any] = attrs.field(factory=dict, converter=_as_sampler_kwargs)

    _ctx: nvtrain.TrainingContext | None = attrs.field(init=False, default=None, repr=False)
    _group: Any = attrs.field(init=False, default=None, repr=False)
    _active: bool = attrs.field(init=False, default=False, repr=False)
    _owns_group: bool = attrs.field(init=False, default=False, repr=False)
    _ddp_modules: tuple[DistributedDataParallel, ...] = attrs.field(init=False, default=(), repr=False)
    _wrapped: dict[str, tuple[torch.nn.Module, DistributedDataParallel]] = attrs.field(
        init=False, factory=dict, repr=False
    )
    _prepared_loader: Any = attrs.field(init=False, default=None, repr=False)
    _warned_loader: bool = attrs.field(init=False, default=False, repr=False)
    _no_sync: contextlib.ExitStack | None = attrs.field(init=False, default=None, repr=False)

    # -- SETUP -------------------------------------------------------------------------

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Resolve the process group, wrap the models, inject the sampler."""
        self._ctx = ctx
        manager = getattr(ctx.strategy, "distributed_manager", None)
        group = self._resolve_group(ctx, manager)
        if group is None:
            logger.info("DDPHook: single process (no process group, WORLD_SIZE <= 1); models are not wrapped")
            return
        self._group, self._active = group, True
        world_size = dist.get_world_size(group)
        if ctx.world_size == 1 and world_size > 1:
            ctx.rank, ctx.world_size = dist.get_rank(group), world_size
        options: dict[str, Any] = {
            "find_unused_parameters": self._setting("find_unused_parameters", manager),
            _BUFFER_SYNC_ARGUMENT: self._setting("broadcast_buffers", manager),
            "static_graph": self.static_graph,
        }
        ddp_modules = []
        for key in self._keys(ctx):
            model = ctx.models[key]
            if isinstance(model, DistributedDataParallel):
                ddp_modules.append(model)
                continue
            wrapped = self._wrap(key, model, group, options)
            self._wrapped[key] = (model, wrapped)
            ctx.models[key] = wrapped
            ddp_modules.append(wrapped)
        self._ddp_modules = tuple(ddp_modules)
        self._prepare_loader(ctx)

    def _resolve_group(self, ctx: nvtrain.TrainingContext, manager: Any) -> Any:
        if self.process_group is not None:
            if not dist.is_initialized():
                raise RuntimeError("DDPHook.process_group was given but torch.distributed is not initialised")
            return self.process_group
        group = getattr(manager, "process_group", None)
        if group is not None:
            return group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        env = TorchrunEnv.from_environ()
        if env.world_size <= 1:
            return None
        if not self.auto_init:
            raise RuntimeError(
                f"DDPHook: WORLD_SIZE={env.world_size} but torch.distributed is not initialised and "
                "auto_init=False; call nvtrain.DistributedManager.initialize() and pass the manager as "
                "TrainingStrategy(distributed_manager=...), or set DDPHook(auto_init=True)"
            )
        backend = self.backend or default_backend(ctx.device)
        dist.init_process_group(backend=backend, init_method="env://", rank=env.rank, world_size=env.world_size)
        self._owns_group = True
        return dist.group.WORLD

    def _setting(self, name: str, manager: Any) -> bool:
        value = getattr(self, name)
        if value is None:
            value = getattr(manager, name, None)
        return value if isinstance(value, bool) else False

    def _keys(self, ctx: nvtrain.TrainingContext) -> tuple[str, ...]:
        if self.model_keys is None:
            strategy = ctx.strategy
            return tuple(strategy.optimizers) if strategy is not None else tuple(ctx.models)
        for key in self.model_keys:
            if key not in ctx.models:
                raise ValueError(f"DDPHook.model_keys: no model named {key!r} (models: {sorted(ctx.models)})")
        return self.model_keys

    def _wrap(self, key: str, model: torch.nn.Module, group: Any, options: dict[str, Any]) -> DistributedDataParallel:
        if type(model).__name__ == "FullyShardedDataParallel" or hasattr(model, "_fsdp_wrapped_module"):
            raise ValueError(
                f"DDPHook: model {key!r} is sharded with FSDP; DDP and FSDP do not combine (FSDP is not "
                "supported by nvtrain-ddp)"
            )
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"DDPHook: model {key!r} has no trainable parameters; leave it out of model_keys")
        device = trainable[0].device
        device_ids: list[int] | None = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            _check_gpu_per_process(key, index)
            device_ids = [index]
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            output_device=device_ids[0] if device_ids else None,
            process_group=group,
            **options,
        )

    # -- data ------------------------------------------------------------------------------

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Warn when ``run()`` got a loader after SETUP that does not shard (it can no longer be swapped)."""
        loader = ctx.train_loader
        if not self._active or loader is None or loader is self._prepared_loader:
            return
        self._prepared_loader = loader
        if not has_distributed_sampler(loader) and unsupported_reason(loader) is None:
            warnings.warn(
                "DDPHook: run() got a train loader without a distributed sampler after the strategy was set up "
                "(SETUP shards only the loader it sees), so every rank reads all of it. Shard it yourself: "
                "strategy.run(ddp_hook.shard(loader)), or run again on strategy.ctx.train_loader",
                stacklevel=2,
            )

    def shard(self, loader: Any) -> Any:
        """``loader`` with this hook's distributed sampler (unchanged in a single process or when it shards).

        SETUP does this for the loader of the first ``run()``; use it for loaders given later.
        """
        if not self._active or has_distributed_sampler(loader):
            return loader
        reason = unsupported_reason(loader)
        if reason is not None:
            if not self._warned_loader:
                self._warned_loader = True
                warnings.warn(
                    f"DDPHook: no distributed sampler was injected into the train loader because {reason}; "
                    "each rank must read its own shard (ctx.rank of ctx.world_size)",
                    stacklevel=3,
                )
            return loader
        return distributed_loader(
            loader,
            sampler_cls=self.sampler_cls,
            sampler_kwargs=self.sampler_kwargs,
            rank=dist.get_rank(self._group),
            world_size=dist.get_world_size(self._group),
        )

    def _prepare_loader(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.train_loader is not None:
            ctx.train_loader = self.shard(ctx.train_loader)
        self._prepared_loader = ctx.train_loader

    @nvtrain.hookimpl
    def before_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        """``set_epoch(ctx.epoch)`` on every sampler of the loader that has it (idempotent)."""
        for sampler in samplers_of(ctx.train_loader):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(ctx.epoch)

    # -- one all-reduce per optimizer step -------------------------------------------------

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_FIRST)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        # A micro-batch that raised between forward and backward must not leave no_sync on.
        if self._no_sync is not None:
            self._leave_no_sync()

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        """Enter ``no_sync()`` on a micro-batch that does not end its window."""
        if ctx.sync_gradients or not self._ddp_modules or self._no_sync is not None:
            return
        stack = contextlib.ExitStack()
        for module in self._ddp_modules:
            stack.enter_context(module.no_sync())
        self._no_sync = stack

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_FIRST)
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        if self._no_sync is not None:
            self._leave_no_sync()

    def _leave_no_sync(self) -> None:
        stack, self._no_sync = self._no_sync, None
        if stack is not None:
            stack.close()

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def wrapped_models(self) -> dict[str, DistributedDataParallel]:
        """The models this hook wrapped, by name."""
        return {key: wrapped for key, (_, wrapped) in self._wrapped.items()}

    def close(self) -> None:
        """Unwrap the models in ``ctx.models``; destroy the process group only if this hook created it."""
        self._leave_no_sync()
        ctx = self._ctx
        if ctx is not None:
            for key, (original, wrapped) in self._wrapped.items():
                if ctx.models.get(key) is wrapped:
                    ctx.models[key] = original
        self._wrapped.clear()
        self._ddp_modules = ()
        self._active = False
        self._group = None
        if self._owns_group:
            self._owns_group = False
            if dist.is_initialized():
                dist.destroy_process_group()


def _check_gpu_per_process(key: str, index: int) -> None:
    env = TorchrunEnv.from_environ()
    if env.local_world_size > 1 and index != env.local_rank % torch.cuda.device_count():
        raise ValueError(
            f"DDPHook: model {key!r} is on cuda:{index} but LOCAL_RANK={env.local_rank}; every process needs "
            f"its own GPU. Pass TrainingStrategy(distributed_manager=nvtrain.DistributedManager.initialize()) "
            f"or device='cuda:{env.local_rank}'"
        )
