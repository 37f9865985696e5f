"""DDPHook: DistributedDataParallel, a distributed sampler and one all-reduce per optimizer step."""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

import nvtrain
from nvtrain.data_parallel import (
    LoaderSharding,
    ShardsTrainLoader,
    as_sampler_factory,
    as_sampler_kwargs,
    check_sampler_kwargs,
    optional_process_group,
    refuse_other_data_parallel,
    refuse_unknown_backend,
    refuse_unsynchronized_models,
    resolve_process_group,
)
from nvtrain.distributed import TorchrunEnv
from nvtrain.hook import accumulating_hook
from nvtrain.validators import (
    FieldTypeError,
    FieldValueError,
    a_bool,
    as_tuple,
    optional_bool,
    optional_non_empty_str,
    refused,
    satisfies,
)

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

_bucket_size = satisfies(
    "a finite number of MiB > 0",
    lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf,
    or_none=True,
)


def _as_model_keys(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    keys = (value,) if isinstance(value, str) else value
    expected = "a str, a sequence of distinct non-empty str, or None"
    if not isinstance(keys, Iterable) or isinstance(keys, Mapping):
        message = f"DDPHook.model_keys must be a str, a sequence of str or None (got {value!r})"
        raise refused("DDPHook", "model_keys", value, expected, message=message, error=FieldTypeError)
    keys = as_tuple(keys, "DDPHook", "model_keys", expected)
    if not keys or not all(isinstance(key, str) and key for key in keys):
        message = f"DDPHook.model_keys must name at least one model by a non-empty str (got {value!r})"
        raise refused("DDPHook", "model_keys", value, expected, message=message)
    if len(set(keys)) != len(keys):
        message = f"DDPHook.model_keys names a model twice (got {value!r})"
        raise refused("DDPHook", "model_keys", value, expected, message=message)
    return keys


def _as_sampler_cls(value: Any) -> Callable[..., Any]:
    return as_sampler_factory("DDPHook", value)


def _as_sampler_kwargs(value: Any) -> dict[str, Any]:
    return as_sampler_kwargs("DDPHook", value)


def _check_sampler_kwargs(instance: DDPHook, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
    check_sampler_kwargs("DDPHook", instance.sampler_cls, value)


# -- the hook --------------------------------------------------------------------------


@attrs.define(eq=False)
class DDPHook(ShardsTrainLoader):
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

    In a single process (no process group and ``WORLD_SIZE`` at most 1) the hook wraps
    nothing (its settings are still checked: ``static_graph`` with accumulation,
    ``model_keys`` that name no model or leave out a trained model, and a ``backend``
    torch.distributed does not know are refused), so one script runs, or is refused,
    under ``python`` and ``torchrun`` alike.
    """

    plugin_name: ClassVar[str] = "ddp"
    priority: ClassVar[int] = 50
    #: Wraps models for data parallelism: no other such hook (FSDP) may be registered beside it.
    data_parallel: ClassVar[bool] = True

    #: Models to wrap; None wraps every model that has an optimizer.
    model_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_as_model_keys)
    #: None: the distributed manager's setting when it has one, else False.
    find_unused_parameters: bool | None = attrs.field(default=None, validator=optional_bool)
    #: None: the distributed manager's setting when it has one, else False.
    broadcast_buffers: bool | None = attrs.field(default=None, validator=optional_bool)
    #: Refused with gradient accumulation: DDP's static graph cannot run a backward under no_sync().
    static_graph: bool = attrs.field(default=False, validator=a_bool)
    #: Explicit process group (a torch.distributed.ProcessGroup); None: the manager's, else the default group.
    process_group: Any = attrs.field(default=None, validator=optional_process_group)
    #: Backend when this hook initialises torch.distributed (None: NCCL on CUDA, gloo otherwise).
    backend: str | None = attrs.field(default=None, validator=optional_non_empty_str("backend name such as 'nccl' or 'gloo'"))
    auto_init: bool = attrs.field(default=True, validator=a_bool)
    #: Size of DDP's gradient buckets in MiB (None: torch's default, 25): larger buckets, fewer all-reduces.
    bucket_cap_mb: float | None = attrs.field(default=None, validator=_bucket_size)
    #: Gradients as views into DDP's buckets: no second copy of them (memory the size of the gradients).
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=a_bool)
    sampler_cls: Callable[..., Any] = attrs.field(default=DistributedSampler, converter=_as_sampler_cls)
    sampler_kwargs: dict[str, Any] = attrs.field(
        factory=dict, converter=_as_sampler_kwargs, validator=_check_sampler_kwargs
    )

    _ctx: nvtrain.TrainingContext | None = attrs.field(init=False, default=None, repr=False)
    _group: Any = attrs.field(init=False, default=None, repr=False)
    _active: bool = attrs.field(init=False, default=False, repr=False)
    _owns_group: bool = attrs.field(init=False, default=False, repr=False)
    _ddp_modules: tuple[DistributedDataParallel, ...] = attrs.field(init=False, default=(), repr=False)
    _wrapped: dict[str, tuple[torch.nn.Module, DistributedDataParallel]] = attrs.field(
        init=False, factory=dict, repr=False
    )
    _loaders: LoaderSharding = attrs.field(
        init=False, factory=lambda: LoaderSharding("DDPHook", "ddp_hook"), repr=False
    )
    _no_sync: contextlib.ExitStack | None = attrs.field(init=False, default=None, repr=False)

    # -- SETUP -------------------------------------------------------------------------

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Resolve the process group, wrap the models, inject the sampler."""
        self._ctx = ctx
        refuse_other_data_parallel(ctx, self)
        self._keys(ctx)  # a model_keys typo fails in one process too, as it would under torchrun
        refuse_unknown_backend("DDPHook", self.backend)
        refuse_unsynchronized_models(ctx, "DDPHook", self.model_keys)
        if ctx.strategy is not None:
            accumulation = accumulating_hook(ctx.strategy.registry.update_hooks(), strict=False)
            if accumulation is not None:
                self._refuse_static_graph_with(accumulation.accumulation_steps)
        manager = getattr(ctx.strategy, "distributed_manager", None)
        group, self._owns_group = resolve_process_group(
            "DDPHook",
            explicit=self.process_group,
            manager=manager,
            auto_init=self.auto_init,
            backend=self.backend,
            device=ctx.device,
        )
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
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }
        if self.bucket_cap_mb is not None:  # torch's own default otherwise, whatever it is in this release
            options["bucket_cap_mb"] = self.bucket_cap_mb
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
                raise FieldValueError(
                    f"DDPHook.model_keys: no model named {key!r} (models: {sorted(ctx.models)})",
                    owner="DDPHook",
                    field="model_keys",
                    value=self.model_keys,
                    expected=f"names among {sorted(ctx.models)}",
                )
        return self.model_keys

    def _wrap(self, key: str, model: torch.nn.Module, group: Any, options: dict[str, Any]) -> DistributedDataParallel:
        if _is_sharded(model):
            raise ValueError(
                f"DDPHook: model {key!r} is sharded with FSDP (torch.distributed.fsdp); DDP and FSDP do not "
                "combine. Train it with FSDPHook (plugin 'fsdp', nvtrain-fsdp) instead of DDPHook, or pass the "
                "plain model"
            )
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            if self.model_keys is None:
                raise ValueError(
                    f"DDPHook: model {key!r} has an optimizer but no trainable parameters (none requires grad); "
                    "give it no optimizer, or name the models to wrap in DDPHook.model_keys"
                )
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

    # shard(), _prepare_loader() and before_epoch come from ShardsTrainLoader.

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Refuse ``static_graph`` with the run's accumulation windows; warn about a late unsharded loader."""
        scheduler = ctx.scheduler
        if scheduler is not None:
            self._refuse_static_graph_with(scheduler.grad_acc_steps)
        ShardsTrainLoader.before_training(self, ctx)

    def _refuse_static_graph_with(self, window: int) -> None:
        if self.static_graph and window > 1:
            message = (
                f"DDPHook.static_graph=True does not combine with gradient accumulation (windows of {window} "
                "micro-batches): DDP's static graph cannot run a backward under no_sync(), which accumulation "
                "needs; set static_graph=False or accumulate over 1 micro-batch"
            )
            raise refused("DDPHook", "static_graph", True, "False with gradient accumulation", message=message)

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
        # A DDP wrapper sits in reference cycles (its autograd hooks), so dropping it frees nothing until the
        # next collection; its Reducer would then be the last owner of a gloo group destroyed by then (here, or
        # by the caller after the run), whose destructor can wait forever on its worker threads, or abort at
        # interpreter exit. Collect it while the group is alive.
        gc.collect()
        if self._owns_group:
            self._owns_group = False
            if dist.is_initialized():
                dist.destroy_process_group()


def _is_sharded(model: torch.nn.Module) -> bool:
    """Sharded by FSDP: wrapped by FSDP1, or fully_shard (FSDP2) applied (its parameters are DTensors)."""
    if type(model).__name__ == "FullyShardedDataParallel" or hasattr(model, "_fsdp_wrapped_module"):
        return True
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters())


def _check_gpu_per_process(key: str, index: int) -> None:
    env = TorchrunEnv.from_environ()
    if env.local_world_size > 1 and index != env.local_rank % torch.cuda.device_count():
        raise ValueError(
            f"DDPHook: model {key!r} is on cuda:{index} but LOCAL_RANK={env.local_rank}; every process needs "
            f"its own GPU. Pass TrainingStrategy(distributed_manager=nvtrain.DistributedManager.initialize()) "
            f"or device='cuda:{env.local_rank}'"
        )
