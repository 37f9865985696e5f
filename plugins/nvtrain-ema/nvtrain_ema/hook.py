"""EMAHook: an exponential moving average of one model, updated after real optimizer steps."""

from __future__ import annotations

import math
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import nvtrain
from nvtrain import TrainingStage
from nvtrain.distributed import unwrap_model
from nvtrain.validators import (
    float_in_range,
    int_at_least,
    non_empty_str,
    optional_non_empty_str,
    refused,
    satisfies,
    strict_bool,
    strict_int,
)

__all__ = ["EMAHook", "ShardedAverage", "unwrap_model"]

#: An update moves an averaged weight only when ``(1 - decay) * |weights - ema|`` exceeds half a unit in the last
#: place of ``ema``: up to ``eps / 2`` of it. Warn when that takes a difference above this share of the weight.
_STALL_SHARE = 0.01

_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP


def _finite_above_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


_positive_finite = satisfies("a finite number > 0", _finite_above_zero)
_optional_positive_finite = satisfies(
    "None or a finite number > 0 (2/3 for long runs, 3/4 for short ones)",
    lambda value: value is None or _finite_above_zero(value),
)


@attrs.define(eq=False)
class EMAHook(nvtrain.TrainingUpdateHook):
    """Keeps an exponential moving average of ``ctx.models[model_key]``.

    The average lives in a :class:`torch.optim.swa_utils.AveragedModel` (the copy,
    its ``n_averaged`` count and its state-dict layout). Each update is one
    multi-tensor ``torch._foreach_lerp_`` over the floating-point tensors (plus one
    ``torch._foreach_copy_`` for the tensors that are copied, not averaged), over
    tensor lists paired once when the copy is made, with no host-device sync. It is updated at
    AFTER_OPTIMIZER_STEP only when the optimizer really stepped (not on accumulating
    micro-batches, vetoed steps or fp16 inf/NaN skips), from ``start_step`` on, on
    completed-step counts divisible by ``update_every`` (``ctx.step_count %
    update_every == 0``: a global modulo, not counted from ``start_step``). The
    first update copies the weights; later ones compute
    ``ema = decay * ema + (1 - decay) * weights``, with ``decay_at(num_updates)`` in place
    of ``decay`` during a warmup (``warmup_power``).

    The copy is made at BEFORE_TRAINING (or at first use) from the unwrapped model,
    so a DDP wrapper is not copied. ``use_buffers=True`` averages buffers too;
    otherwise the copy's buffers follow the model's at every update. The average has
    the model's dtypes (a bfloat16 model: a bfloat16 average; the hook warns once when
    its updates would round away at this decay). A hook reused with another model (a
    new strategy) makes a copy of that one and carries its average over to it.

    A model sharded with FSDP (DTensor parameters) cannot be copied; its average is a
    :class:`ShardedAverage` instead: tensors shaped like this rank's shards, averaged
    with the same multi-tensor ops (local to each shard: no communication), and run
    by swapping them into the model's shards for a forward pass. ``averaged_weights()``
    gathers the full averaged weights for export.
    """

    plugin_name: ClassVar[str] = "ema"
    stages: ClassVar[frozenset[TrainingStage]] = frozenset({_AFTER_OPTIMIZER_STEP})
    vetoes = frozenset()

    #: Key of the source model in ``ctx.models``.
    model_key: str = attrs.field(default="main", validator=non_empty_str("model name"))
    #: EMA decay factor in [0.0, 1.0).
    decay: float = attrs.field(default=0.999, validator=float_in_range(0.0, 1.0, include_low=True))
    #: Update when the completed-step count is divisible by this (global modulo).
    update_every: int = attrs.field(default=1, validator=int_at_least(1))
    #: First completed step eligible for an update.
    start_step: int = attrs.field(default=0, validator=int_at_least(0))
    #: Average module buffers (e.g. BatchNorm running statistics) as well.
    use_buffers: bool = attrs.field(default=False, validator=strict_bool)
    priority: int = attrs.field(default=50, validator=strict_int)
    #: Warm the decay up as ``min(decay, 1 - (1 + n / warmup_gamma) ** -warmup_power)`` at the update after ``n``
    #: updates (the power-function warmup of timm and diffusers); None keeps ``decay`` from the first update.
    warmup_power: float | None = attrs.field(default=None, validator=_optional_positive_finite)
    #: The warmup's time scale, in updates (used only with ``warmup_power``).
    warmup_gamma: float = attrs.field(default=1.0, validator=_positive_finite)
    #: Names this average in checkpoints (``ema:<state_key>``; default ``ema:<model_key>``): two averages of one
    #: model, a fast and a slow one, each need their own.
    state_key: str | None = attrs.field(default=None, validator=optional_non_empty_str())
    #: EMA updates performed so far (an output, restored from checkpoints; read through num_updates).
    _num_updates: int = attrs.field(init=False, default=0, repr=False)

    _averaged: AveragedModel | ShardedAverage | None = attrs.field(init=False, default=None, repr=False)
    _models: Mapping[str, torch.nn.Module] | None = attrs.field(
        init=False, default=None, repr=False, on_setattr=attrs.setters.NO_OP
    )
    _pending: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _plan: _UpdatePlan | None = attrs.field(init=False, default=None, repr=False)
    #: The unwrapped model the copy and the plan were made from: another one (the hook reused in a new
    #: strategy) gets a new copy and plan, the average carried over.
    _source_model: torch.nn.Module | None = attrs.field(init=False, default=None, repr=False)
    _warned_precision: bool = attrs.field(init=False, default=False, repr=False)

    # -- the update ------------------------------------------------------------------------

    def __call__(
        self, ctx: nvtrain.TrainingContext, stage: TrainingStage, will_skip: bool
    ) -> tuple[bool, torch.Tensor | None]:
        if stage == _AFTER_OPTIMIZER_STEP and not will_skip:
            step = ctx.step_count
            if step >= self.start_step and step % self.update_every == 0:
                plan = self._plan
                if plan is None or self._models is not ctx.models:
                    self._models = ctx.models
                    self._ensure_averaged()
                    plan = self._plan
                    assert plan is not None
                plan.update(self.decay if self.warmup_power is None else self.decay_at(self._num_updates))
                # A count only this method raises: past the field's validation, which costs six calls.
                object.__setattr__(self, "_num_updates", self._num_updates + 1)
        return True, None

    # -- lifecycle ---------------------------------------------------------------------------

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Remember the models, so ``get_averaged_model()`` works before the first update; a ``model_key`` naming
        no model is refused here, at SETUP, where ``nvtrain validate`` sees it, not when training starts."""
        self._source(ctx.models)
        self._models = ctx.models

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Copy the (possibly wrapped) model now, not inside the first step."""
        self._models = ctx.models
        self._ensure_averaged()

    def get_averaged_model(self) -> AveragedModel | ShardedAverage:
        """The averaged copy (an AveragedModel: calling it runs the copied module), its count up to date.

        For a model sharded with FSDP, a :class:`ShardedAverage`: calling it runs the model
        with the averaged weights in its shards (every rank must call it, as for the model).
        """
        averaged = self._ensure_averaged()
        assert self._plan is not None
        self._plan.publish_count()
        return averaged

    def averaged_weights(self) -> dict[str, torch.Tensor]:
        """The averaged weights keyed like the plain model's ``state_dict()``, full tensors on the CPU.

        Loads into a plain model (for export or inference). For a sharded model this
        gathers every shard: a collective, to call on every rank.
        """
        averaged = self.get_averaged_model()
        if isinstance(averaged, ShardedAverage):
            return averaged.gathered_state_dict()
        return {name: value.detach().to("cpu", copy=True) for name, value in averaged.module.state_dict().items()}

    # -- checkpoint state ------------------------------------------------------------------

    def decay_at(self, updates: int) -> float:
        """The decay of the update that follows ``updates`` earlier ones: ``decay``, or during a warmup
        (``warmup_power``) the smaller ``1 - (1 + updates / warmup_gamma) ** -warmup_power``. (The first update
        copies the weights whatever the decay.)"""
        if self.warmup_power is None:
            return self.decay
        return min(self.decay, 1.0 - (1.0 + updates / self.warmup_gamma) ** -self.warmup_power)

    @property
    def num_updates(self) -> int:
        """Updates of the average so far (read only: ``load_state_dict`` restores it)."""
        return self._num_updates

    def state_dict(self) -> dict[str, Any]:
        """``num_updates`` and the AveragedModel's state (weights, buffers, ``n_averaged``)."""
        if self._averaged is not None:
            assert self._plan is not None
            self._plan.publish_count()
            averaged: dict[str, Any] | None = self._averaged.state_dict()
        else:
            averaged = self._pending
        return {"num_updates": self.num_updates, "averaged": averaged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``num_updates`` and the averaged weights (kept until the copy exists, if need be).

        A state with no average (``averaged`` None: saved before the copy was made) drops the copy:
        the next one is made from the model's weights then, as in a new hook.
        """
        if not isinstance(state, Mapping):
            raise refused(
                "EMAHook",
                "load_state_dict",
                state,
                "a mapping with 'num_updates' and 'averaged'",
                message=(
                    "EMAHook.load_state_dict: the state must be a mapping with 'num_updates' and 'averaged' "
                    f"(got {type(state).__name__})"
                ),
            )
        missing = {"num_updates", "averaged"} - set(state)
        if missing:
            raise ValueError(f"EMAHook.load_state_dict: the state lacks {sorted(missing)} (keys: {sorted(state)})")
        num_updates = state["num_updates"]
        if isinstance(num_updates, bool) or not isinstance(num_updates, int) or num_updates < 0:
            raise ValueError(f"EMAHook.load_state_dict: 'num_updates' must be an int >= 0 (got {num_updates!r})")
        averaged = state["averaged"]
        if averaged is not None and not isinstance(averaged, Mapping):
            raise refused(
                "EMAHook",
                "averaged",
                averaged,
                "None or an averaged model's state dict",
                message=(
                    f"EMAHook.load_state_dict: 'averaged' (model {self.model_key!r}) must be None or a mapping "
                    f"of the averaged model's state ('module.<name>' tensors and 'n_averaged'), "
                    f"got {type(averaged).__name__}"
                ),
            )
        if averaged is None:  # no average saved: forget this one, so the next copy is a fresh one
            self._averaged = self._plan = self._source_model = None
            self._pending = None
        elif self._averaged is not None:
            self._load_averaged(self._averaged, averaged)
        else:
            self._pending = dict(averaged)
        self._num_updates = num_updates

    # -- internals ----------------------------------------------------------------------------

    def _source(self, models: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
        try:
            model = models[self.model_key]
        except KeyError:
            raise ValueError(
                f"EMAHook.model_key: no model named {self.model_key!r} (models: {sorted(models)})"
            ) from None
        return unwrap_model(model)

    def _ensure_averaged(self) -> AveragedModel | ShardedAverage:
        if self._models is None:
            raise RuntimeError(
                "EMAHook.get_averaged_model(): there is no averaged model yet: the hook has not been set up "
                "(register it on a TrainingStrategy, then strategy.setup(), run(), train_batch() or validate())"
            )
        source = self._source(self._models)
        carried = False
        if self._averaged is not None:
            if source is self._source_model:
                return self._averaged
            # Another model (the hook reused in a new strategy, or load_checkpoint(hooks=[ema])): a new copy
            # and plan over it, the average (and its count) carried over, as a checkpoint's would be.
            assert self._plan is not None
            self._plan.publish_count()
            self._pending = dict(self._averaged.state_dict())
            self._averaged = self._plan = self._source_model = None
            carried = True
        for unit in _fsdp_units(source):  # gathered parameters (a forward without reshard) are no shards to copy
            unit.reshard()
        averaged: AveragedModel | ShardedAverage
        if _is_sharded(source):
            averaged = ShardedAverage(source, use_buffers=self.use_buffers)
        else:
            averaged = AveragedModel(
                source, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=self.use_buffers
            )
            modify = getattr(averaged.module, "modify_ema_methods", None)
            if callable(modify):
                modify()
        if self._pending is not None:
            try:
                self._load_averaged(averaged, self._pending)
            except ValueError as err:
                if not carried:
                    raise
                raise ValueError(
                    f"EMAHook: reused with another model {self.model_key!r} than the one it averaged, whose "
                    "average does not fit it; use a new EMAHook, or reset this one first with "
                    "ema.load_state_dict({'num_updates': 0, 'averaged': None})"
                ) from err
            self._pending = None
        if isinstance(averaged, ShardedAverage):
            self._plan = _UpdatePlan.pair_sharded(averaged, source)
        else:
            self._plan = _UpdatePlan.pair(averaged, source, use_buffers=self.use_buffers)
        self._averaged = averaged
        self._source_model = source
        self._warn_if_updates_round_away(self._plan.lerp_dst)
        return averaged

    def _warn_if_updates_round_away(self, averaged: list[torch.Tensor]) -> None:
        """Warn once when the average is kept in half precision at a decay whose updates round away."""
        if self._warned_precision:
            return
        for dtype in (torch.bfloat16, torch.float16):
            if any(t.dtype == dtype for t in averaged):
                share = torch.finfo(dtype).eps / 2 / (1.0 - self.decay)
                if share > _STALL_SHARE:
                    self._warned_precision = True
                    warnings.warn(
                        f"EMAHook (model {self.model_key!r}): the average is kept in {dtype} like the model, and "
                        f"with decay={self.decay} an update changes an averaged weight only where the weights "
                        f"differ from it by more than about {share:.2g} times its magnitude: smaller ones round away "
                        "and the average barely moves; keep the model's weights in float32 (mixed precision "
                        "autocast) or lower the decay (see docs/ema.md)",
                        UserWarning,
                        stacklevel=3,
                    )
                    return

    def _load_averaged(self, averaged: AveragedModel | ShardedAverage, state: Mapping[str, Any]) -> None:
        try:
            averaged.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(
                f"EMAHook.load_state_dict: the saved averaged weights do not fit model {self.model_key!r}: {err}"
            ) from err
        if self._plan is not None and self._plan.averaged is averaged:
            self._plan.n_averaged = int(averaged.n_averaged)  # a CPU tensor: no device sync


@attrs.define(eq=False)
class _UpdatePlan:
    """The averaged and source tensors, paired once, and the two multi-tensor ops of an update.

    ``AveragedModel.update_parameters`` would re-walk both modules every step and read
    its ``n_averaged`` count across devices (a host-device sync per update on CUDA);
    this keeps the count on the host and touches only the paired lists. The copy's
    ``n_averaged`` buffer is written only when someone can see it (its state dict, or
    the averaged model handed out), not by a kernel launch per update.
    """

    averaged: AveragedModel | ShardedAverage
    #: Floating-point tensors: averaged with ``lerp``.
    lerp_dst: list[torch.Tensor]
    lerp_src: list[torch.Tensor]
    #: Tensors copied from the model at every update: integer tensors, and the buffers without use_buffers.
    copy_dst: list[torch.Tensor]
    copy_src: list[torch.Tensor]
    #: Updates folded into the average so far (the first one copies the weights).
    n_averaged: int = 0
    #: Entered around each update; one instance, reused, instead of a new one per call.
    _no_grad: torch.no_grad = attrs.field(init=False, factory=torch.no_grad, repr=False)

    @classmethod
    def pair(cls, averaged: AveragedModel, source: torch.nn.Module, *, use_buffers: bool) -> _UpdatePlan:
        dst_params: list[torch.Tensor] = list(averaged.module.parameters())
        src_params: list[torch.Tensor] = list(source.parameters())
        dst_buffers, src_buffers = list(averaged.module.buffers()), list(source.buffers())
        if len(dst_params) != len(src_params) or len(dst_buffers) != len(src_buffers):
            raise RuntimeError(
                "EMAHook: the averaged copy does not have the model's parameters and buffers "
                "(did modify_ema_methods() change the module tree?)"
            )
        averaged_pairs = list(zip(dst_params, src_params, strict=False))
        copied_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if use_buffers:
            averaged_pairs += list(zip(dst_buffers, src_buffers, strict=False))
        else:
            copied_pairs += list(zip(dst_buffers, src_buffers, strict=False))
        return cls._of_pairs(averaged, averaged_pairs, copied_pairs)

    @classmethod
    def pair_sharded(cls, averaged: ShardedAverage, source: torch.nn.Module) -> _UpdatePlan:
        """The local shards of the average with the model's local shards (DTensors of the same placements,
        so each rank averages its own part: no communication, and no DTensor dispatch per update)."""
        pairs = [
            (_local(d), _local(s))
            for d, s in zip(
                [*averaged.averaged_parameters, *averaged.averaged_buffers],
                [*source.parameters(), *averaged.source_buffers()],
                strict=True,
            )
        ]
        return cls._of_pairs(averaged, pairs, [])

    @classmethod
    def _of_pairs(
        cls,
        averaged: AveragedModel | ShardedAverage,
        averaged_pairs: list[tuple[torch.Tensor, torch.Tensor]],
        copied_pairs: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> _UpdatePlan:
        """Floating-point pairs are averaged with ``lerp``; integer ones join ``copied_pairs``."""
        lerp = [(d, s) for d, s in averaged_pairs if d.is_floating_point() or d.is_complex()]
        copied = copied_pairs + [(d, s) for d, s in averaged_pairs if not (d.is_floating_point() or d.is_complex())]
        return cls(
            averaged=averaged,
            lerp_dst=[d for d, _ in lerp],
            lerp_src=[s for _, s in lerp],
            copy_dst=[d for d, _ in copied],
            copy_src=[s for _, s in copied],
            n_averaged=int(averaged.n_averaged),
        )

    def update(self, decay: float) -> None:
        with self._no_grad:
            if self.n_averaged == 0:
                torch._foreach_copy_(self.lerp_dst, self.lerp_src)
            elif self.lerp_dst:
                torch._foreach_lerp_(self.lerp_dst, self.lerp_src, 1.0 - decay)
            if self.copy_dst:
                torch._foreach_copy_(self.copy_dst, self.copy_src)
        self.n_averaged += 1

    def publish_count(self) -> None:
        """Write the host count into the copy's ``n_averaged`` buffer (in place, no host-device sync)."""
        self.averaged.n_averaged.fill_(self.n_averaged)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its storage: in-place ops on it change the DTensor); other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _fsdp_units(model: torch.nn.Module) -> list[Any]:
    """The modules of ``model`` that ``fully_shard`` made FSDP units (none for tensor parallelism alone)."""
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp_module is None:  # FSDP not even imported: nothing is sharded with it
        return []
    return [module for module in model.modules() if isinstance(module, fsdp_module)]


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2's ``fully_shard``, or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


class ShardedAverage(torch.nn.Module):
    """The average of a model whose parameters are DTensor shards (FSDP), kept sharded like them.

    FSDP modules cannot be deep-copied, so instead of a copy of the model this holds
    one tensor per parameter, shaped and placed like the model's shard on this rank
    (``use_buffers=True``: one per floating-point buffer too; buffers are replicated).
    Each rank averages only its own shards, so an update needs no communication.

    Calling it runs the model with the averaged weights in its shards: they are
    copied in (the model's own weights kept aside in a buffer of the same size),
    the model runs (gathering the shards as in training), and its weights are copied
    back, even when the forward raises. The model runs in this module's training
    mode. Every rank must call it, as for the model.

    ``state_dict()`` has the layout of an :class:`~torch.optim.swa_utils.AveragedModel`
    of the plain model (``module.<name>`` and ``n_averaged``), with DTensor values;
    ``load_state_dict()`` takes DTensors or full tensors (each rank keeps its shard).
    """

    def __init__(self, source: torch.nn.Module, *, use_buffers: bool = False) -> None:
        super().__init__()
        # The model is not a submodule: its weights are not part of the average's state.
        object.__setattr__(self, "source", source)
        self.use_buffers = use_buffers
        with torch.no_grad():
            self._param_names = [name for name, _ in source.named_parameters()]
            self.averaged_parameters: list[torch.Tensor] = [p.detach().clone() for p in source.parameters()]
            named_buffers = [(name, b) for name, b in source.named_buffers()] if use_buffers else []
            self._buffer_names = [name for name, _ in named_buffers]
            self.averaged_buffers: list[torch.Tensor] = [b.detach().clone() for _, b in named_buffers]
        first = next(iter(source.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=device))
        self._kept: list[torch.Tensor] | None = None
        self._fsdp_units = _fsdp_units(source)

    source: torch.nn.Module
    n_averaged: torch.Tensor

    def source_buffers(self) -> list[torch.Tensor]:
        """The model's buffers that are averaged (``use_buffers``), in the order of ``averaged_buffers``."""
        buffers = dict(self.source.named_buffers())
        return [buffers[name] for name in self._buffer_names]

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's and the average's local shards, paired."""
        live = [_local(t) for t in (*self.source.parameters(), *self.source_buffers())]
        return live, [_local(t) for t in (*self.averaged_parameters, *self.averaged_buffers)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Unsharded parameters (FSDP keeps them after a forward with reshard_after_forward=False, and after the
        # root's) hold gathered values the next forward would use as they are: drop them on both sides of the
        # swap, so this forward gathers the average and the next one gathers the model's own weights again.
        self._reshard()
        live, averaged = self._pairs()
        with torch.no_grad():
            if self._kept is None:
                self._kept = [t.detach().clone() for t in live]
            else:
                torch._foreach_copy_(self._kept, live)
            torch._foreach_copy_(live, averaged)
        was_training = self.source.training
        try:
            self.source.train(self.training)
            return self.source(*args, **kwargs)
        finally:
            self.source.train(was_training)
            self._reshard()
            with torch.no_grad():
                torch._foreach_copy_(live, self._kept)

    def _reshard(self) -> None:
        """Register every FSDP unit's shards again, freeing gathered parameters (local: no communication)."""
        for unit in self._fsdp_units:
            unit.reshard()

    def _named_entries(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from zip(self._param_names, self.averaged_parameters, strict=True)
        if self.use_buffers:
            yield from zip(self._buffer_names, self.averaged_buffers, strict=True)
        else:  # as in an AveragedModel's copy: the buffers follow the model's
            yield from self.source.named_buffers()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """``module.<name>`` for each averaged tensor (DTensor shards, live references) and ``n_averaged``."""
        state: dict[str, Any] = OrderedDict(("module." + name, value) for name, value in self._named_entries())
        state["n_averaged"] = self.n_averaged
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Copy a state of :meth:`state_dict`'s layout in; full tensors are cut to this rank's shard."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        expected = {"module." + name for name, _ in self._named_entries()} | {"n_averaged"}
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise RuntimeError(
                f"Error(s) in loading state_dict for ShardedAverage: missing keys {missing}, unexpected keys "
                f"{unexpected}"
            )
        for name, target in self._named_entries():
            value = state_dict["module." + name]
            if isinstance(target, DTensor) and not isinstance(value, DTensor):
                if tuple(value.shape) != tuple(target.shape):
                    raise RuntimeError(
                        f"Error(s) in loading state_dict for ShardedAverage: size mismatch for module.{name}: "
                        f"copying a param with shape {tuple(value.shape)}, the shape in current model is "
                        f"{tuple(target.shape)}"
                    )
                value = distribute_tensor(
                    value.to(target.device), target.device_mesh, target.placements, src_data_rank=None
                )
            target.copy_(value)
        self.n_averaged.copy_(state_dict["n_averaged"])
        return None

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights keyed like the plain model, gathered into full tensors on the CPU (a collective)."""
        from torch.distributed.tensor import DTensor

        gathered = {}
        for name, value in self._named_entries():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            gathered[name] = full.detach().to("cpu", copy=True)
        return gathered
