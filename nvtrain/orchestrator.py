"""The single owner of backward and the optimizer step, composing the update hooks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, final

import torch

from nvtrain.hook import TrainingUpdateHook, hook_label, validate_update_hook
from nvtrain.hookspecs import hookimpl
from nvtrain.stages import TrainingStage

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["TrainingUpdateOrchestrator"]

_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP


@final
class TrainingUpdateOrchestrator:
    """Runs update hooks in one ordered path and performs the calls they may not make.

    Hooks run in ascending ``priority``, construction order breaking ties. Every
    hook is called on its stages even after an earlier veto; later hooks then see
    ``will_skip=True``. The orchestrator zeroes gradients (``set_to_none=True``)
    unless BEFORE_BATCH was vetoed, chains the DO_BACKWARD loss transforms and
    calls ``backward()`` once, steps every optimizer unless DO_OPTIMIZER_STEP was
    vetoed, and steps an LR scheduler only when its optimizer really stepped.

    It is a plugin on the bus (the only implementation of the two DO slots);
    strategies build one automatically from the bare update hooks they receive.
    Pre-compose with ``hook_a + hook_b``.
    """

    plugin_name = "nvtrain.orchestrator"
    #: Among equal priorities the orchestrator is registered first.
    priority = 50

    def __init__(self, hooks: Iterable[TrainingUpdateHook] = ()) -> None:
        hooks = tuple(hooks)
        _check_composition(hooks)
        self.hooks: tuple[TrainingUpdateHook, ...] = hooks
        ordered = [h for _, h in sorted(enumerate(hooks), key=lambda item: (item[1].priority, item[0]))]
        self._by_stage = {
            stage: tuple(h for h in ordered if stage in frozenset(h.stages))
            for stage in (_BEFORE_BATCH, _DO_BACKWARD, _DO_OPTIMIZER_STEP, _AFTER_OPTIMIZER_STEP)
        }
        self._before_batch_hooks = self._by_stage[_BEFORE_BATCH]
        self._backward_hooks = self._by_stage[_DO_BACKWARD]
        self._step_hooks = self._by_stage[_DO_OPTIMIZER_STEP]
        self._after_step_hooks = self._by_stage[_AFTER_OPTIMIZER_STEP]
        # A stage no hook runs on is left off the bus (pluggy skips a non-routine attribute),
        # so the strategy's dispatch for it stays the no-op constant.
        if not self._before_batch_hooks:
            self.before_batch = None  # type: ignore[assignment,method-assign]
        if not self._after_step_hooks:
            self.after_optimizer_step = None  # type: ignore[assignment,method-assign]
        steppers = [h for h in ordered if callable(getattr(h, "step_optimizer", None))]
        self._stepper = steppers[0] if steppers else None
        self._optimizers: tuple[tuple[str, torch.optim.Optimizer, tuple[Any, ...]], ...] = ()

    # -- composition ---------------------------------------------------------

    def __add__(self, other: object) -> TrainingUpdateOrchestrator:
        if isinstance(other, TrainingUpdateOrchestrator):
            return TrainingUpdateOrchestrator([*self.hooks, *other.hooks])
        if isinstance(other, TrainingUpdateHook):
            return TrainingUpdateOrchestrator([*self.hooks, other])
        return NotImplemented

    def __iter__(self) -> Any:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def hooks_for(self, stage: TrainingStage) -> tuple[TrainingUpdateHook, ...]:
        """The hooks that run on ``stage``, in call order."""
        return self._by_stage.get(TrainingStage(stage), ())

    def bind(self, optimizers: dict[str, torch.optim.Optimizer], lr_schedulers: dict[str, Any]) -> None:
        """Fix the optimizers (and the schedulers paired with each) once they are built."""
        self._optimizers = tuple(
            (name, optimizer, _as_tuple(lr_schedulers.get(name))) for name, optimizer in optimizers.items()
        )

    # -- the four stages -------------------------------------------------------

    @hookimpl
    def before_batch(self, ctx: TrainingContext) -> bool | None:
        """Ask the hooks whether to zero gradients; ``False`` is a veto on the bus."""
        return False if _vetoed_by(self._before_batch_hooks, ctx, _BEFORE_BATCH) else None

    def zero_gradients(self) -> None:
        """Zero every optimizer's gradients (``set_to_none=True``)."""
        for _, optimizer, _ in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    @hookimpl
    def do_backward(self, ctx: TrainingContext) -> torch.Tensor:
        """Chain the loss transforms, then ``backward()`` exactly once."""
        original = ctx.loss
        if not isinstance(original, torch.Tensor):
            raise TypeError(
                f"stage DO_BACKWARD: ctx.loss must be a torch.Tensor before backward "
                f"(got {type(original).__name__}); check loss_fn"
            )
        if not self._backward_hooks:  # nothing transforms the loss: back-propagate it as it is
            original.backward()
            ctx.backward_loss = original
            return original
        loss = original
        try:
            for hook in self._backward_hooks:
                _, loss = hook(ctx, _DO_BACKWARD, False)
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(
                        f"update hook {hook_label(hook)} at stage DO_BACKWARD must return a "
                        f"torch.Tensor as loss, got {type(loss).__name__}: {loss!r}"
                    )
                ctx.loss = loss
            loss.backward()
        finally:
            ctx.loss = original
        ctx.backward_loss = loss
        return loss

    @hookimpl
    def do_optimizer_step(self, ctx: TrainingContext) -> bool:
        """Ask the hooks, then step optimizers and their schedulers unless vetoed."""
        stepped = False
        if not self._step_hooks or not _vetoed_by(self._step_hooks, ctx, _DO_OPTIMIZER_STEP):
            stepper = self._stepper
            for name, optimizer, schedulers in self._optimizers:
                if stepper is None:
                    optimizer.step()
                    this_stepped = True
                else:
                    this_stepped = stepper.step_optimizer(ctx, name, optimizer)  # type: ignore[attr-defined]
                    if this_stepped is not True and this_stepped is not False:
                        raise TypeError(
                            f"update hook {hook_label(stepper)}: step_optimizer() must return a bool "
                            f"(whether optimizer {name!r} stepped), got {this_stepped!r}"
                        )
                if this_stepped:
                    stepped = True
                    for scheduler in schedulers:
                        scheduler.step()
        ctx.step_skipped = not stepped
        return stepped

    @hookimpl
    def after_optimizer_step(self, ctx: TrainingContext) -> None:
        """Tell every hook whether the step happened."""
        will_skip = ctx.step_skipped
        for hook in self._after_step_hooks:
            hook(ctx, _AFTER_OPTIMIZER_STEP, will_skip)

    def __repr__(self) -> str:
        return f"TrainingUpdateOrchestrator({[hook_label(h) for h in self.hooks]})"


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def _vetoed_by(hooks: tuple[TrainingUpdateHook, ...], ctx: TrainingContext, stage: TrainingStage) -> bool:
    """Ask every hook in order, each told whether an earlier one vetoed; True when any returned False."""
    will_skip = False
    for hook in hooks:
        proceed, _ = hook(ctx, stage, will_skip)
        if proceed is not True:
            if proceed is not False:
                raise _bad_proceed(hook, stage, proceed)
            will_skip = True
    return will_skip


def _bad_proceed(hook: object, stage: TrainingStage, proceed: object) -> TypeError:
    return TypeError(
        f"update hook {hook_label(hook)} at stage {stage.name} must return proceed as a strict "
        f"bool (True or False), got {type(proceed).__name__}: {proceed!r}"
    )


def _check_composition(hooks: Sequence[object]) -> None:
    seen: dict[int, object] = {}
    exclusive: dict[str, object] = {}
    steppers: list[object] = []
    for hook in hooks:
        if isinstance(hook, TrainingUpdateOrchestrator):
            raise ValueError(
                "cannot nest a TrainingUpdateOrchestrator inside another: only one orchestrator "
                "may own DO_BACKWARD and DO_OPTIMIZER_STEP; compose hooks with '+' instead"
            )
        if not isinstance(hook, TrainingUpdateHook):
            raise TypeError(
                f"TrainingUpdateOrchestrator takes TrainingUpdateHook instances, got {hook_label(hook)}"
            )
        if id(hook) in seen:
            raise ValueError(f"update hook {hook_label(hook)} was given twice; each instance may be composed once")
        seen[id(hook)] = hook
        validate_update_hook(hook)
        key = getattr(hook, "exclusive_key", None)
        if key is not None:
            if key in exclusive:
                raise ValueError(
                    f"update hooks {hook_label(exclusive[key])} and {hook_label(hook)} share the exclusive "
                    f"key {key!r}: at most one such hook per strategy (e.g. one mixed-precision hook)"
                )
            exclusive[key] = hook
        if callable(getattr(hook, "step_optimizer", None)):
            steppers.append(hook)
    if len(steppers) > 1:
        names = ", ".join(hook_label(h) for h in steppers)
        raise ValueError(f"more than one update hook performs the optimizer step itself: {names}")
