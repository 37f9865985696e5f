"""EMAHook: an exponential moving average of one model, updated after real optimizer steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import nvtrain
from nvtrain import TrainingStage
from nvtrain.distributed import unwrap_model
from nvtrain.validators import float_in_range, int_at_least, non_empty_str, strict_bool, strict_int

__all__ = ["EMAHook", "unwrap_model"]

_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP


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
    ``ema = decay * ema + (1 - decay) * weights``.

    The copy is made at BEFORE_TRAINING (or at first use) from the unwrapped model,
    so a DDP wrapper is not copied. ``use_buffers=True`` averages buffers too;
    otherwise the copy's buffers follow the model's at every update.
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
    #: EMA updates performed so far; restored from checkpoints.
    num_updates: int = attrs.field(default=0, validator=int_at_least(0))
    priority: int = attrs.field(default=50, validator=strict_int)

    _averaged: AveragedModel | None = attrs.field(init=False, default=None, repr=False)
    _models: Mapping[str, torch.nn.Module] | None = attrs.field(init=False, default=None, repr=False)
    _pending: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _plan: _UpdatePlan | None = attrs.field(init=False, default=None, repr=False)

    # -- the update ------------------------------------------------------------------------

    def __call__(
        self, ctx: nvtrain.TrainingContext, stage: TrainingStage, will_skip: bool
    ) -> tuple[bool, torch.Tensor | None]:
        if stage == _AFTER_OPTIMIZER_STEP and not will_skip:
            step = ctx.step_count
            if step >= self.start_step and step % self.update_every == 0:
                self._models = ctx.models
                self._ensure_averaged()
                assert self._plan is not None
                self._plan.update(self.decay)
                self.num_updates += 1
        return True, None

    # -- lifecycle ---------------------------------------------------------------------------

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Remember the models, so ``get_averaged_model()`` works before the first update."""
        self._models = ctx.models

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Copy the (possibly wrapped) model now, not inside the first step."""
        self._models = ctx.models
        self._ensure_averaged()

    def get_averaged_model(self) -> AveragedModel:
        """The averaged copy (an AveragedModel: calling it runs the copied module), its count up to date."""
        averaged = self._ensure_averaged()
        assert self._plan is not None
        self._plan.publish_count()
        return averaged

    # -- checkpoint state ------------------------------------------------------------------

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
        """Restore ``num_updates`` and the averaged weights (kept until the copy exists, if need be)."""
        missing = {"num_updates", "averaged"} - set(state)
        if missing:
            raise ValueError(f"EMAHook.load_state_dict: the state lacks {sorted(missing)} (keys: {sorted(state)})")
        num_updates = state["num_updates"]
        if isinstance(num_updates, bool) or not isinstance(num_updates, int) or num_updates < 0:
            raise ValueError(f"EMAHook.load_state_dict: 'num_updates' must be an int >= 0 (got {num_updates!r})")
        averaged = state["averaged"]
        if averaged is not None and self._averaged is not None:
            self._load_averaged(self._averaged, averaged)
        else:
            self._pending = None if averaged is None else dict(averaged)
        self.num_updates = num_updates

    # -- internals ----------------------------------------------------------------------------

    def _source(self, models: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
        try:
            model = models[self.model_key]
        except KeyError:
            raise ValueError(
                f"EMAHook.model_key: no model named {self.model_key!r} (models: {sorted(models)})"
            ) from None
        return unwrap_model(model)

    def _ensure_averaged(self) -> AveragedModel:
        if self._averaged is not None:
            return self._averaged
        if self._models is None:
            raise RuntimeError(
                "EMAHook.get_averaged_model(): there is no averaged model yet; register the hook on a "
                "TrainingStrategy and train (or validate) first"
            )
        source = self._source(self._models)
        averaged = AveragedModel(source, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=self.use_buffers)
        modify = getattr(averaged.module, "modify_ema_methods", None)
        if callable(modify):
            modify()
        if self._pending is not None:
            self._load_averaged(averaged, self._pending)
            self._pending = None
        self._plan = _UpdatePlan.pair(averaged, source, use_buffers=self.use_buffers)
        self._averaged = averaged
        return averaged

    def _load_averaged(self, averaged: AveragedModel, state: Mapping[str, Any]) -> None:
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

    averaged: AveragedModel
    #: Floating-point tensors: averaged with ``lerp``.
    lerp_dst: list[torch.Tensor]
    lerp_src: list[torch.Tensor]
    #: Tensors copied from the model at every update: integer tensors, and the buffers without use_buffers.
    copy_dst: list[torch.Tensor]
    copy_src: list[torch.Tensor]
    #: Updates folded into the average so far (the first one copies the weights).
    n_averaged: int = 0

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
        lerp = [(d, s) for d, s in averaged_pairs if d.is_floating_point() or d.is_complex()]
        copied_pairs += [(d, s) for d, s in averaged_pairs if not (d.is_floating_point() or d.is_complex())]
        return cls(
            averaged=averaged,
            lerp_dst=[d for d, _ in lerp],
            lerp_src=[s for _, s in lerp],
            copy_dst=[d for d, _ in copied_pairs],
            copy_src=[s for _, s in copied_pairs],
            n_averaged=int(averaged.n_averaged),
        )

    @torch.no_grad()
    def update(self, decay: float) -> None:
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
