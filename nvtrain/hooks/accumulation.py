"""Gradient accumulation: one optimizer step per window of micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from nvtrain.hook import TrainingUpdateHook
from nvtrain.stages import TrainingStage
from nvtrain.validators import int_at_least, strict_int

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["GradientAccumulationHook"]

_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP


@attrs.define(eq=False)
class GradientAccumulationHook(TrainingUpdateHook):
    """Accumulate gradients over ``steps`` micro-batches, then step once.

    On every micro-batch but the first of a window it vetoes gradient zeroing; on
    every one but the last it vetoes the optimizer step. At DO_BACKWARD it divides
    the loss by the real size of the window, so the accumulated gradient is the
    mean over the window, also for a trailing partial window (5 micro-batches with
    ``steps=2`` give windows of 2, 2 and 1; the last is stepped and divided by 1).

    Where the windows come from:

    - in ``run()`` the step scheduler builds windows of ``steps`` micro-batches
      (it reads this hook's ``steps``), shorter at the end of an epoch, and the
      strategy sets ``ctx.window_size`` / ``ctx.window_position`` /
      ``ctx.sync_gradients`` before each micro-batch (``ctx.windowed`` is True);
    - in standalone ``train_batch()`` calls (``ctx.windowed`` False) the hook
      counts micro-batches itself, in windows of ``steps``, and publishes the
      three fields before BEFORE_BATCH fires (the strategy calls
      :meth:`place_micro_batch`), so every BEFORE_BATCH implementation sees them.

    ``ctx.sync_gradients`` is True on the micro-batch that ends a window: a DDP
    hook reads it (from BEFORE_FORWARD on) to skip the gradient all-reduce on the
    others. The standalone counter is part of ``state_dict()`` so a resume
    continues the same window.
    """

    plugin_name: ClassVar[str] = "accumulate"
    stages: ClassVar[frozenset[TrainingStage]] = frozenset({_BEFORE_BATCH, _DO_BACKWARD, _DO_OPTIMIZER_STEP})
    exclusive_key: ClassVar[str | None] = "gradient_accumulation"
    vetoes = frozenset({_BEFORE_BATCH, _DO_OPTIMIZER_STEP})
    uses_gradients = False  # it decides from the window position alone

    #: Micro-batches per optimizer step (the window size K).
    steps: int = attrs.field(validator=int_at_least(1))
    priority: int = attrs.field(default=10, validator=strict_int)

    @property
    def accumulation_steps(self) -> int:
        """The window size the step scheduler builds for this hook (:class:`nvtrain.hook.AccumulatesGradients`)."""
        return self.steps

    # standalone counting: position of the next micro-batch in its window
    _position: int = attrs.field(init=False, default=0, repr=False)
    #: place_micro_batch() placed the current micro-batch: its BEFORE_BATCH call must not count it again.
    _placed: bool = attrs.field(init=False, default=False, repr=False, on_setattr=attrs.setters.NO_OP)
    #: The window position before the placement (to take back one that was never taken up).
    _placed_at: int = attrs.field(init=False, default=0, repr=False, on_setattr=attrs.setters.NO_OP)

    def __call__(self, ctx: TrainingContext, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage is _DO_BACKWARD:
            size = ctx.window_size
            loss: torch.Tensor = ctx.loss  # type: ignore[assignment]  # a tensor: the orchestrator checked
            return True, (loss if size == 1 else loss / size)
        if stage is _DO_OPTIMIZER_STEP:
            return ctx.window_position == ctx.window_size - 1, None
        if stage is _BEFORE_BATCH:
            if not ctx.windowed:
                if self._placed:
                    self._placed = False
                else:  # called without the strategy's placement (an orchestrator driven by hand)
                    self._count(ctx)
            elif self._position:
                self._position = 0  # the scheduler's windows replace a standalone window left open
            return ctx.window_position == 0, None
        return True, ctx.loss

    def place_micro_batch(self, ctx: TrainingContext) -> None:
        """Standalone ``train_batch()``: place the coming micro-batch in its window and publish it on ``ctx``,
        before any BEFORE_BATCH implementation reads the fields.

        A placement that the orchestrator's BEFORE_BATCH call never took up (an earlier BEFORE_BATCH
        implementation raised) is taken back first: that micro-batch never reached this hook.
        """
        if self._placed:
            self._position = self._placed_at
        self._placed_at = self._position
        self._count(ctx)
        self._placed = True

    def _count(self, ctx: TrainingContext) -> None:
        """Place this micro-batch in a window and publish it on ``ctx`` (standalone mode)."""
        position, size = self._position, self.steps
        ctx.window_size = size
        ctx.window_position = position
        last = position == size - 1
        ctx.sync_gradients = last
        self._position = 0 if last else position + 1

    # -- resume ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The standalone window counter (the step scheduler keeps its own when it drives windows)."""
        return {"steps": self.steps, "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = int(state["steps"])
        if steps != self.steps and int(state["position"]) != 0:  # at a window's start any size fits
            raise ValueError(
                f"GradientAccumulationHook.load_state_dict: the state was saved inside a window of steps={steps}, "
                f"this hook has steps={self.steps}"
            )
        position = int(state["position"])
        if not 0 <= position < steps:
            raise ValueError(
                f"GradientAccumulationHook.load_state_dict: position {position} is not in a window of {steps}"
            )
        self._position = position


class SchedulerAccumulationHook(GradientAccumulationHook):
    """The accumulation a step scheduler's ``global_batch_size`` implies, added by ``run()`` itself.

    Its windows are the scheduler's, whose position the checkpoint keeps, so it saves no
    state of its own: a resume on another number of ranks (which accumulates over
    another number of micro-batches, or not at all) finds nothing to reconcile.
    """

    saves_state: ClassVar[bool] = False
