"""FSDPHook: shards the trained models with torch's fully_shard (FSDP2) at SETUP and shards the data."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
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
from nvtrain.strategy import on_meta_device
from nvtrain.validators import (
    FieldTypeError,
    FieldValueError,
    a_bool,
    as_tuple,
    non_empty_str,
    optional_int_at_least,
    optional_non_empty_str,
)
from nvtrain_fsdp.sharding import gathered_state_dict, shard_model, sharding_units

__all__ = ["FSDPHook"]

logger = logging.getLogger(__name__)

#: Spellings a config may use for the dtypes FSDP's mixed precision takes.
_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "torch.float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "torch.float16": torch.float16,
}
_EXPECTED_DTYPE = "None, 'bf16' or 'fp32' (or torch.bfloat16 / torch.float32)"


# -- field converters ---------------------------------------------------------------------


def _as_model_keys(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, Iterable) or isinstance(keys, Mapping):
        raise FieldTypeError(
            f"FSDPHook.model_keys must be a str, a sequence of str or None (got {value!r})",
            owner="FSDPHook", field="model_keys", value=value, expected="a str, a sequence of str or None",
        )
    keys = as_tuple(keys, "FSDPHook", "model_keys", "a str, a sequence of str or None")
    if not keys or not all(isinstance(key, str) and key for key in keys) or len(set(keys)) != len(keys):
        raise FieldValueError(
            f"FSDPHook.model_keys must name at least one model, each once, by a non-empty str (got {value!r})",
            owner="FSDPHook", field="model_keys", value=value, expected="distinct non-empty model names",
        )
    return keys


def _as_class_names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable) or isinstance(names, Mapping):
        raise FieldTypeError(
            f"FSDPHook.shard_classes must be a class name or a sequence of class names (got {value!r})",
            owner="FSDPHook", field="shard_classes", value=value, expected="a sequence of class names",
        )
    names = as_tuple(names, "FSDPHook", "shard_classes", "a class name or a sequence of class names")
    if not all(isinstance(name, str) and name.isidentifier() for name in names):
        raise FieldValueError(
            f"FSDPHook.shard_classes must hold module class names such as 'TransformerBlock' (got {value!r})",
            owner="FSDPHook", field="shard_classes", value=value, expected="module class names",
        )
    return tuple(dict.fromkeys(names))


def _as_dtype(field: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    dtype = _DTYPES.get(value.lower()) if isinstance(value, str) else value
    if dtype == torch.float16:
        raise FieldValueError(
            f"FSDPHook.{field} must be {_EXPECTED_DTYPE} (got {value!r}): float16 needs loss scaling, which "
            "MixedPrecisionHook(precision='fp16') gives with param_dtype=None (its scaler agrees across the "
            "shards); bfloat16 needs none",
            owner="FSDPHook", field=field, value=value, expected=_EXPECTED_DTYPE,
        )
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.bfloat16, torch.float32):
        raise FieldValueError(
            f"FSDPHook.{field} must be {_EXPECTED_DTYPE} (got {value!r})",
            owner="FSDPHook", field=field, value=value, expected=_EXPECTED_DTYPE,
        )
    return dtype


def _as_param_dtype(value: Any) -> torch.dtype | None:
    return _as_dtype("param_dtype", value)


def _as_reduce_dtype(value: Any) -> torch.dtype | None:
    return _as_dtype("reduce_dtype", value)


def _as_output_dtype(value: Any) -> torch.dtype | None:
    return _as_dtype("output_dtype", value)


def _as_sampler_cls(value: Any) -> Callable[..., Any]:
    return as_sampler_factory("FSDPHook", value)


def _as_sampler_kwargs(value: Any) -> dict[str, Any]:
    return as_sampler_kwargs("FSDPHook", value)


def _check_sampler_kwargs(instance: FSDPHook, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
    check_sampler_kwargs("FSDPHook", instance.sampler_cls, value)


# -- the hook --------------------------------------------------------------------------------


@attrs.define(eq=False)
class FSDPHook(ShardsTrainLoader):
    """Shards the trained models over the ranks with ``fully_shard`` (FSDP2) at SETUP, and shards the data.

    - SETUP (after every other setup implementation, so fine-tuning patches that change
      ``requires_grad`` come first): resolves the process group (``process_group``, else
      the strategy's ``distributed_manager``'s, else the default group; with ``auto_init``
      one is initialised from torchrun's environment), builds a one-dimensional
      ``DeviceMesh`` over it (two-dimensional, replicate x shard, with
      ``replicate_degree``: HSDP) and applies ``fully_shard`` to each unit of the model (the
      modules whose class is in ``shard_classes``, else each top-level child), then to
      the root. ``ctx.models[key]`` stays the same object, now with DTensor parameters,
      so the optimizers built next hold the shards. ``ctx.train_loader`` gets a
      distributed sampler.
    - BEFORE_EPOCH: ``sampler.set_epoch(ctx.epoch)``.
    - BEFORE_FORWARD: on a micro-batch that does not end an accumulation window
      (``ctx.sync_gradients`` False) the sharded models skip the gradient
      reduce-scatter (``set_requires_gradient_sync(False)``: the unsharded gradients
      accumulate locally); the micro-batch that ends the window reduce-scatters once.
    - ``close()`` turns gradient synchronisation back on and destroys the process group
      only if this hook created it. The models stay sharded (FSDP2 has no unshard-in-place);
      :meth:`gathered_state_dict` gives their full weights.

    Mixed precision: ``param_dtype`` / ``reduce_dtype`` form FSDP's ``MixedPrecisionPolicy``
    (parameters all-gathered and computed in ``param_dtype``, gradients reduce-scattered in
    ``reduce_dtype``, shards and optimizer state kept in float32; float16 is refused there,
    as it needs loss scaling). A ``param_dtype`` is refused together with the amp plugin's
    autocast (a second cast of the same forward). The amp plugin alone (``param_dtype=None``)
    works in bf16 and in fp16: its fp16 loss scaling uses torch's ``ShardedGradScaler``,
    whose inf/NaN check every rank shares.

    In a single process (no process group and ``WORLD_SIZE`` at most 1) the hook does
    nothing, so one script runs under ``python`` and ``torchrun`` alike.
    """

    plugin_name: ClassVar[str] = "fsdp"
    priority: ClassVar[int] = 50
    #: Wraps models for data parallelism: no other such hook (DDP) may be registered beside it.
    data_parallel: ClassVar[bool] = True
    #: Allocates and initialises models built on the meta device (the strategy leaves them to this hook).
    materializes_meta_models: ClassVar[bool] = True

    #: Models to shard; None shards every model that has an optimizer.
    model_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_as_model_keys)
    #: Class names of the submodules sharded as units of their own (transformer blocks); empty: each
    #: top-level child that has parameters (the members of a top-level ModuleList / ModuleDict in its
    #: place). The root is always sharded last.
    shard_classes: tuple[str, ...] = attrs.field(default=(), converter=_as_class_names)
    #: Free each unit's gathered parameters after its forward (all-gather again in backward): less memory,
    #: one more all-gather per unit and step (the root's own parameters too).
    reshard_after_forward: bool = attrs.field(default=True, validator=a_bool)
    #: Dtype the parameters are all-gathered and computed in (None: their own, float32).
    param_dtype: torch.dtype | None = attrs.field(default=None, converter=_as_param_dtype)
    #: Dtype the gradients are reduce-scattered in (None: ``param_dtype``, else float32).
    reduce_dtype: torch.dtype | None = attrs.field(default=None, converter=_as_reduce_dtype)
    #: Dtype of the root module's outputs (None: float32 when ``param_dtype`` is set, so the loss is computed
    #: in full precision as under autocast; else as the model returns them).
    output_dtype: torch.dtype | None = attrs.field(default=None, converter=_as_output_dtype)
    #: Keep the shards, their gradients and the optimizer step on the CPU (CUDA training only).
    cpu_offload: bool = attrs.field(default=False, validator=a_bool)
    #: Broadcast rank 0's parameters and buffers before sharding, so every rank shards the same model (DDP
    #: does the same at construction). False when every rank built identical weights already.
    sync_module_states: bool = attrs.field(default=True, validator=a_bool)
    #: A model built on the meta device (``torch.device("meta")``: no memory) is sharded first; then each rank
    #: allocates its shards on the strategy's device and calls this method on every submodule that has one
    #: (torch's layers have ``reset_parameters``; name a root ``init_weights`` that initialises everything).
    meta_init: str = attrs.field(default="reset_parameters", validator=non_empty_str("method name"))
    #: Hybrid sharding (HSDP): keep this many replicas of the model, each sharded over a group of consecutive
    #: ranks (``world_size / replicate_degree`` of them, e.g. one node): a 2-D mesh ``(replicate, shard)``.
    #: Reduce-scatters stay within a group; one all-reduce of the shards' gradients crosses the replicas.
    #: None or 1: shard over all ranks.
    replicate_degree: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    #: Explicit process group (a torch.distributed.ProcessGroup); None: the manager's, else the default group.
    process_group: Any = attrs.field(default=None, validator=optional_process_group)
    #: Backend when this hook initialises torch.distributed (None: NCCL on CUDA, gloo otherwise).
    backend: str | None = attrs.field(
        default=None, validator=optional_non_empty_str("backend name such as 'nccl' or 'gloo'")
    )
    auto_init: bool = attrs.field(default=True, validator=a_bool)
    sampler_cls: Callable[..., Any] = attrs.field(default=DistributedSampler, converter=_as_sampler_cls)
    sampler_kwargs: dict[str, Any] = attrs.field(
        factory=dict, converter=_as_sampler_kwargs, validator=_check_sampler_kwargs
    )

    _ctx: nvtrain.TrainingContext | None = attrs.field(init=False, default=None, repr=False)
    _group: Any = attrs.field(init=False, default=None, repr=False)
    _mesh: DeviceMesh | None = attrs.field(init=False, default=None, repr=False)
    _active: bool = attrs.field(init=False, default=False, repr=False)
    _owns_group: bool = attrs.field(init=False, default=False, repr=False)
    _sharded: dict[str, FSDPModule] = attrs.field(init=False, factory=dict, repr=False)
    _units: dict[str, list[str]] = attrs.field(init=False, factory=dict, repr=False)
    #: The gradient-sync flag last set on the sharded models (set only when it changes).
    _syncing: bool = attrs.field(init=False, default=True, repr=False)
    _loaders: LoaderSharding = attrs.field(
        init=False, factory=lambda: LoaderSharding("FSDPHook", "fsdp_hook"), repr=False
    )

    # -- SETUP -------------------------------------------------------------------------------

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Refuse what does not combine, resolve the group, shard the models, inject the sampler."""
        self._ctx = ctx
        refuse_other_data_parallel(ctx, self)
        refuse_unsynchronized_models(ctx, "FSDPHook", self.model_keys)
        self._refuse_autocast(ctx)
        refuse_unknown_backend("FSDPHook", self.backend)  # a typo fails in one process too, as under torchrun
        manager = getattr(ctx.strategy, "distributed_manager", None)
        group, self._owns_group = resolve_process_group(
            "FSDPHook",
            explicit=self.process_group,
            manager=manager,
            auto_init=self.auto_init,
            backend=self.backend,
            device=ctx.device,
        )
        if self.cpu_offload and ctx.device.type != "cuda":  # refused alike under python and torchrun
            raise FieldValueError(
                f"FSDPHook.cpu_offload=True needs a CUDA device: it keeps the shards and the optimizer step on the "
                f"CPU and computes on the GPU, but this strategy trains on {str(ctx.device)!r}; set "
                "cpu_offload=False (on the CPU the shards are in host memory already)",
                owner="FSDPHook", field="cpu_offload", value=True, expected="False on a CPU device",
            )
        if group is None:
            dtypes = [name for name in ("param_dtype", "reduce_dtype", "output_dtype") if getattr(self, name) is not None]
            ignored = dtypes + (["cpu_offload"] if self.cpu_offload else [])
            ignored += ["replicate_degree"] if (self.replicate_degree or 1) > 1 else []
            logger.info("FSDPHook: single process (no process group, WORLD_SIZE <= 1); models are not sharded")
            if ignored:
                logger.warning(
                    "FSDPHook: single process, so the models are not sharded and %s %s no effect%s",
                    ", ".join(ignored),
                    "has" if len(ignored) == 1 else "have",
                    " (MixedPrecisionHook gives bf16 in one process)" if dtypes else "",
                )
            for key in self._keys(ctx):  # one script for python and torchrun: a meta model is still built here
                model = ctx.models[key]
                sharding_units(model, self.shard_classes, key=key)  # what torchrun would refuse, refused here too
                if on_meta_device(model):
                    self._materialise(key, model, self._meta_initialisers(key, model), ctx.device)
            return
        self._group, self._active = group, True
        world_size = dist.get_world_size(group)
        if ctx.world_size == 1 and world_size > 1:
            ctx.rank, ctx.world_size = dist.get_rank(group), world_size
        self._mesh = self._device_mesh(group, ctx.device.type)
        for key in self._keys(ctx):
            model = ctx.models[key]
            if isinstance(model, FSDPModule):
                self._sharded[key] = model  # sharded by the caller: used as it is
                continue
            self._shard(key, model)
        self._prepare_loader(ctx)

    def _device_mesh(self, group: Any, device_type: str) -> DeviceMesh:
        """One dimension over ``group``; with ``replicate_degree``, ``(replicate, shard)`` over its ranks."""
        degree = self.replicate_degree or 1
        if degree == 1:
            return DeviceMesh.from_group(group, device_type=device_type, mesh_dim_names=("dp",))
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) % degree:
            raise FieldValueError(
                f"FSDPHook.replicate_degree={degree} must divide the number of ranks ({len(ranks)}): each replica "
                f"is sharded over {len(ranks)} / replicate_degree ranks",
                owner="FSDPHook", field="replicate_degree", value=degree, expected=f"a divisor of {len(ranks)}",
            )
        if len(ranks) != dist.get_world_size():
            # DeviceMesh builds the replicate and shard groups with collectives over every process of the job.
            raise FieldValueError(
                f"FSDPHook.replicate_degree={degree} needs every rank of the job (world size "
                f"{dist.get_world_size()}), but the hook trains over a process group of {len(ranks)} ranks; drop "
                "process_group= or replicate_degree",
                owner="FSDPHook", field="replicate_degree", value=degree, expected="None with a process subgroup",
            )
        layout = torch.tensor(ranks, dtype=torch.int).view(degree, len(ranks) // degree)
        return DeviceMesh(device_type, layout, mesh_dim_names=("replicate", "shard"))

    def _refuse_autocast(self, ctx: nvtrain.TrainingContext) -> None:
        """The amp plugin's autocast with FSDP's param_dtype casts twice (its fp16 alone is fine: under FSDP it
        scales with a ShardedGradScaler whose inf check all ranks share)."""
        strategy = ctx.strategy
        if strategy is None:
            return
        from nvtrain.state import strategy_hooks

        for hook in strategy_hooks(strategy):  # type: ignore[arg-type]
            if getattr(hook, "exclusive_key", None) != "mixed_precision" or isinstance(hook, type):
                continue
            dtype = getattr(hook, "dtype", None)
            name = type(hook).__name__
            if dtype in (torch.bfloat16, torch.float16) and self.param_dtype is not None:
                precision = "bf16" if dtype == torch.bfloat16 else "fp16"
                raise ValueError(
                    f"FSDPHook.param_dtype={self.param_dtype} and {name}(precision={precision}) both cast the "
                    "forward pass: FSDP all-gathers the parameters in param_dtype and autocast casts every op "
                    f"again. Use one: FSDPHook(param_dtype='bf16') without {name} (recommended under FSDP: half "
                    f"the all-gather traffic and gathered-parameter memory, no loss scaling), or {name} with "
                    "FSDPHook(param_dtype=None)"
                )

    def _keys(self, ctx: nvtrain.TrainingContext) -> tuple[str, ...]:
        if self.model_keys is None:
            strategy = ctx.strategy
            return tuple(strategy.optimizers) if strategy is not None else tuple(ctx.models)
        for key in self.model_keys:
            if key not in ctx.models:
                raise FieldValueError(
                    f"FSDPHook.model_keys: no model named {key!r} (models: {sorted(ctx.models)})",
                    owner="FSDPHook", field="model_keys", value=self.model_keys, expected=f"names among {sorted(ctx.models)}",
                )
        return self.model_keys

    def _mp_policy(self) -> MixedPrecisionPolicy:
        output = self.output_dtype
        if output is None and self.param_dtype is not None:
            output = torch.float32
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, output_dtype=output)

    def _shard(self, key: str, model: torch.nn.Module) -> None:
        if isinstance(model, (DistributedDataParallel, torch.nn.DataParallel)):
            raise ValueError(
                f"FSDPHook: model {key!r} is wrapped in {type(model).__name__}; FSDP shards the plain module. "
                "Pass the model itself (and no DDPHook)"
            )
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"FSDPHook: model {key!r} has no trainable parameters; leave it out of model_keys")
        assert self._mesh is not None
        meta = on_meta_device(model)
        devices = {p.device for p in model.parameters()}
        mesh_type = self._mesh.device_type
        if not meta and any(device.type != mesh_type for device in devices):
            raise ValueError(
                f"FSDPHook: model {key!r} has parameters on {sorted(str(d) for d in devices)} but the strategy trains "
                f"on {mesh_type}; move the model to the strategy's device (TrainingStrategy does so before SETUP)"
            )
        # a meta model is refused before sharding when its initialisers would leave a tensor unset
        initialisers = self._meta_initialisers(key, model) if meta else []
        if not meta and self.sync_module_states:  # a meta model has nothing to broadcast: ranks initialise alike
            _broadcast_from_first_rank(model, self._group)
        self._units[key] = shard_model(
            model,
            self._mesh,
            shard_classes=self.shard_classes,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self._mp_policy(),
            offload_policy=CPUOffloadPolicy() if self.cpu_offload else None,
            key=key,
        )
        assert isinstance(model, FSDPModule)
        if meta:  # offloaded shards live in host memory
            assert self._ctx is not None
            self._materialise(key, model, initialisers, torch.device("cpu") if self.cpu_offload else self._ctx.device)
        self._sharded[key] = model

    def _meta_initialisers(self, key: str, model: torch.nn.Module) -> list[Callable[[], Any]]:
        """The ``meta_init`` methods of ``model``'s modules, checked to reach every tensor before anything is
        allocated: a parameter or buffer whose module and ancestors all lack the method would train from
        uninitialised memory (``torch.nn.MultiheadAttention`` has no ``reset_parameters``, for one)."""
        name = self.meta_init
        initialisers: list[Callable[[], Any]] = []
        uncovered: list[str] = []

        def walk(prefix: str, module: torch.nn.Module, covered: bool) -> None:
            method = getattr(module, name, None)
            if callable(method):
                initialisers.append(method)
                covered = True
            if not covered:
                own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                uncovered.extend(f"{prefix}{tensor_name}" for tensor_name, _ in own)
            for child_name, child in module.named_children():
                walk(f"{prefix}{child_name}.", child, covered)

        walk("", model, False)
        if uncovered:
            shown = ", ".join(uncovered[:6]) + (f" and {len(uncovered) - 6} more" if len(uncovered) > 6 else "")
            raise FieldValueError(
                f"FSDPHook.meta_init={name!r}: model {key!r} was built on the meta device, and {shown} would stay "
                f"uninitialised memory once allocated: neither their modules nor any parent has a method {name!r}. "
                "Name a method that initialises them (e.g. a root init_weights) or build the model on a real device",
                owner="FSDPHook", field="meta_init", value=name, expected="a method that reaches every tensor",
            )
        return initialisers

    def _materialise(
        self, key: str, model: torch.nn.Module, initialisers: list[Callable[[], Any]], device: torch.device
    ) -> None:
        """Allocate a meta model's (sharded) tensors on ``device`` and run its ``meta_init`` ``initialisers``
        (bound methods found before sharding; ``fully_shard`` keeps the module objects)."""
        model.to_empty(device=device)
        with torch.no_grad(), self._init_rng(key):
            for initialise in initialisers:
                initialise()

    def _init_rng(self, key: str) -> contextlib.AbstractContextManager[Any]:
        """Random initialisation of the shards. On CUDA, DTensor's RNG makes each shard the matching part of the
        full tensor's draw. CPU meshes lack it: there every shard index draws from a stream of its own (seeded from
        the first rank's seed, the model's key and how many models this process materialised before it), so
        shards differ, two models differ as two built eagerly one after the other do, and HSDP replicas of one
        shard agree; training's stream is kept."""
        mesh = self._mesh
        if mesh is None or mesh.device_type != "cpu":
            return contextlib.nullcontext()
        base = torch.tensor([torch.initial_seed() % 2**62])
        dist.broadcast(base, src=_first_rank(self._group), group=self._group)
        shard_index = mesh.get_local_rank(mesh.mesh_dim_names[-1] if mesh.mesh_dim_names else -1)
        model = zlib.crc32(key.encode())  # not hash(): a str's hash differs from process to process
        return _seeded(hash((int(base), model, next(_MATERIALISED), shard_index)) % 2**62)

    # -- data --------------------------------------------------------------------------------

    # before_training, shard(), _prepare_loader() and before_epoch come from ShardsTrainLoader.

    # -- one reduce-scatter per optimizer step -----------------------------------------------

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        """Reduce-scatter gradients only in the backward of a window's last micro-batch."""
        sync = ctx.sync_gradients
        if sync is not self._syncing and self._sharded:
            self._set_gradient_sync(sync)

    def _set_gradient_sync(self, sync: bool) -> None:
        for model in self._sharded.values():
            model.set_requires_gradient_sync(sync)
        self._syncing = sync

    # -- inspection and lifetime -------------------------------------------------------------

    @property
    def sharded_models(self) -> dict[str, FSDPModule]:
        """The models this hook sharded (or found sharded), by name."""
        return dict(self._sharded)

    @property
    def units(self) -> dict[str, list[str]]:
        """By model, the names of the submodules sharded as units, root (``""``) last."""
        return {key: list(names) for key, names in self._units.items()}

    @property
    def mesh(self) -> DeviceMesh | None:
        """The device mesh the models are sharded over (None in a single process)."""
        return self._mesh

    def gathered_state_dict(self, key: str = "main") -> dict[str, torch.Tensor]:
        """The full weights of model ``key`` on the CPU, keyed like the plain model (a collective: call it on
        every rank). In a single process, the model's own state dict, copied to the CPU."""
        models = self._ctx.models if self._ctx is not None else self._sharded
        model = models.get(key)
        if model is None:
            raise KeyError(f"FSDPHook.gathered_state_dict: no model {key!r} (models: {sorted(models)})")
        return gathered_state_dict(model)  # type: ignore[arg-type]

    def close(self) -> None:
        """Turn gradient synchronisation back on; destroy the process group only if this hook created it."""
        if not self._syncing:
            self._set_gradient_sync(True)
        self._active = False
        self._group = None
        _release_mesh_caches()
        if self._owns_group:
            self._owns_group = False
            if dist.is_initialized():
                gc.collect()  # sharded modules and their FSDP state form cycles that hold the group (see DDPHook.close)
                dist.destroy_process_group()


def _release_mesh_caches() -> None:
    """Empty DTensor's caches of sharding and redistribution plans, which keep every mesh they saw alive.

    A cached plan holds its DTensor specs or its mesh, and a mesh holds its process groups: without
    this, a group outlives ``destroy_process_group()`` and the sharded model, and its gloo threads
    are torn down at interpreter exit, which aborts a finished rank now and then. The caches refill
    on the next DTensor operation, at the cost of planning each operator once more.
    """
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute, debug
    except ImportError:  # pragma: no cover - torch.distributed without DTensor
        return
    # torch has no public way to empty them; each is skipped where a torch release renames it
    lru_caches = (
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    )
    clears = (
        getattr(debug, "_clear_sharding_prop_cache", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        *(getattr(cache, "cache_clear", None) for cache in lru_caches),
    )
    for clear in clears:
        if clear is not None:
            clear()


def _first_rank(group: Any) -> int:
    return dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0


#: Models this process has materialised from the meta device (every rank materialises the same, in order).
_MATERIALISED = itertools.count()


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Draw from ``seed`` (DTensor random ops then use this process's stream, which is what they warn about)."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        torch.manual_seed(seed)
        yield


@torch.no_grad()
def _broadcast_from_first_rank(model: torch.nn.Module, group: Any) -> None:
    """Every rank takes the parameters and buffers of the group's first rank (once, at SETUP)."""
    source = _first_rank(group)
    tensors = [t for t in (*model.parameters(), *model.buffers())]
    for tensor in dict.fromkeys(tensors):  # tied weights once
        dist.broadcast(tensor.data, src=source, group=group)
