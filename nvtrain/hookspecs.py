"""The contract between the training loop and its plugins: one hookspec per stage.

Read this module first: it is the loop as the plugins see it. Every stage of
:class:`~nvtrain.stages.TrainingStage` has one hookspec named after it
(``stage.name.lower()``: ``BEFORE_BATCH`` is ``before_batch(ctx)``), called with
the single keyword ``ctx`` (a :class:`~nvtrain.context.TrainingContext`). The
whole run, with the stage fired at each point::

    SETUP                                   wrap models, patch modules, swap the loader
    (optimizers and LR schedulers are built from the possibly wrapped models)
    BEFORE_TRAINING
    for epoch:
        BEFORE_EPOCH
        for window (one optimizer step) in the step scheduler:
            for micro-batch in window:
                BEFORE_BATCH                -> gradients zeroed unless vetoed
                BEFORE_FORWARD; forward; AFTER_FORWARD
                BEFORE_LOSS; loss; AFTER_LOSS
                BEFORE_BACKWARD
                DO_BACKWARD                 -> loss transforms chained, backward() once
                AFTER_BACKWARD
                BEFORE_OPTIMIZER_STEP
                DO_OPTIMIZER_STEP           -> optimizers + LR schedulers step unless vetoed
                AFTER_OPTIMIZER_STEP        (ctx.step_skipped: did the step happen?)
                AFTER_BATCH
            validation / checkpoint / preemption decisions for this step
        AFTER_EPOCH
    AFTER_TRAINING

    validate(): ... AFTER_VALIDATION       fires once the validation summary exists

This is the one drawing of the loop (docs/stages.md shows it, and a test keeps
the two equal). ``before_batch`` returning ``False`` vetoes gradient zeroing;
``do_backward`` and ``do_optimizer_step`` are ``firstresult`` slots that the
built-in update orchestrator owns.

Return values are ignored except where a spec says otherwise. The order of the
implementations of a stage is one rule, implemented in :mod:`nvtrain.bus`:
ascending priority (``@nvtrain.hookimpl(priority=N)`` for one implementation,
else the plugin's ``priority`` attribute, else 50), then pluggy's ``tryfirst`` /
plain / ``trylast``, then registration order. ``wrapper=True`` implementations
wrap the whole stage call, in the same order (the lowest priority outermost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, final, overload

import pluggy

if TYPE_CHECKING:
    import torch

    from nvtrain.context import TrainingContext

__all__ = ["PRIORITY_ATTRIBUTE", "PROJECT_NAME", "HookimplMarker", "hookimpl", "hookspec"]

#: The pluggy project name: hook markers and entry points use it.
PROJECT_NAME = "nvtrain"
#: Where ``@hookimpl(priority=N)`` stores N on the implementing function.
PRIORITY_ATTRIBUTE = PROJECT_NAME + "_priority"

_F = TypeVar("_F", bound=Callable[..., object])


@final
class HookimplMarker:
    """pluggy's implementation marker (same options), plus ``priority=N`` for one implementation.

    A plugin's ``priority`` attribute orders all its implementations; a plugin that
    must run early on one stage and late on another (a checkpoint plugin resumes
    first and saves last) gives those implementations their own priority.
    """

    __slots__ = ("_marker", "project_name")

    def __init__(self, project_name: str) -> None:
        self.project_name = project_name
        self._marker = pluggy.HookimplMarker(project_name)

    @overload
    def __call__(self, function: _F, *, priority: int | None = None, **options: Any) -> _F: ...

    @overload
    def __call__(
        self, function: None = None, *, priority: int | None = None, **options: Any
    ) -> Callable[[_F], _F]: ...

    def __call__(
        self, function: _F | None = None, *, priority: int | None = None, **options: Any
    ) -> _F | Callable[[_F], _F]:
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise TypeError(f"@nvtrain.hookimpl(priority=...) must be an int (got {priority!r})")
        mark = self._marker(**options)

        def apply(func: _F) -> _F:
            marked = mark(func)
            if priority is not None:
                setattr(func, PRIORITY_ATTRIBUTE, priority)
            return marked

        return apply(function) if function is not None else apply


#: Marks a method as a hookspec of the nvtrain project.
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a method as an implementation of an nvtrain stage (``priority=N`` orders this one implementation).
hookimpl = HookimplMarker(PROJECT_NAME)


@hookspec
def setup(ctx: TrainingContext) -> None:
    """Prepare models and data before any optimizer exists.

    Fires once per strategy, before optimizers and LR schedulers are built, after
    the models were moved to ``ctx.device``.

    :param ctx: ``ctx.models`` may be replaced (e.g. wrapped in DistributedDataParallel)
        and ``ctx.train_loader`` swapped (e.g. to inject a sampler). Optimizers built
        afterwards see the replaced models' parameters.

    Return value is ignored.
    """


@hookspec
def before_training(ctx: TrainingContext) -> None:
    """Start of a run.

    Fires once per ``run()``, before the first epoch, with models on device and
    ``ctx.optimizers`` / ``ctx.lr_schedulers`` built.

    :param ctx: counters hold the values the run starts from (non-zero after a resume).

    Return value is ignored.
    """


@hookspec
def before_epoch(ctx: TrainingContext) -> None:
    """Start of an epoch.

    Fires before the first micro-batch of each epoch.

    :param ctx: ``ctx.epoch`` is the epoch about to run; ``ctx.epoch_step_count`` is 0
        (or the resumed position inside the epoch).

    Return value is ignored.
    """


@hookspec
def before_batch(ctx: TrainingContext) -> bool | None:
    """Start of a micro-batch, before gradients are zeroed.

    Fires once per micro-batch.

    :param ctx: ``ctx.batch`` holds the micro-batch; ``ctx.window_size``,
        ``ctx.window_position`` and ``ctx.sync_gradients`` describe its place in the
        accumulation window.

    A return value of ``False`` vetoes gradient zeroing for this micro-batch (the
    gradients of the previous micro-batch are kept and accumulated into);
    ``None`` (no opinion) and ``True`` (proceed) do not. Any other value is refused
    with ``TypeError``.
    """


@hookspec
def before_forward(ctx: TrainingContext) -> None:
    """Before the model forward pass: the slot for input transforms.

    Fires once per micro-batch after gradient zeroing.

    :param ctx: ``ctx.batch`` may be replaced by a transformed batch.

    Return value is ignored.
    """


@hookspec
def after_forward(ctx: TrainingContext) -> None:
    """After the model forward pass.

    Fires once per micro-batch.

    :param ctx: ``ctx.outputs`` holds the model's predictions.

    Return value is ignored.
    """


@hookspec
def before_loss(ctx: TrainingContext) -> None:
    """Before the loss is computed.

    Fires once per micro-batch.

    :param ctx: ``ctx.outputs`` may be replaced before the loss function sees them.

    Return value is ignored.
    """


@hookspec
def after_loss(ctx: TrainingContext) -> None:
    """After the loss is computed.

    Fires once per micro-batch.

    :param ctx: ``ctx.loss`` holds the loss tensor (still on device: read it only when logging).

    Return value is ignored.
    """


@hookspec
def before_backward(ctx: TrainingContext) -> None:
    """Before the backward pass: the slot for observers of the pre-backward state.

    Fires once per micro-batch.

    :param ctx: ``ctx.loss`` is the loss about to be transformed and back-propagated.

    Return value is ignored.
    """


@hookspec(firstresult=True)
def do_backward(ctx: TrainingContext) -> torch.Tensor | None:
    """Replacement slot for the backward pass, owned by the update orchestrator.

    Fires once per micro-batch. Only one non-wrapper implementation may exist:
    the built-in :class:`~nvtrain.orchestrator.TrainingUpdateOrchestrator`, which
    chains the update hooks' loss transforms and calls ``backward()`` once.
    Observers use ``before_backward`` / ``after_backward``; a pluggy
    ``wrapper=True`` implementation may wrap this slot (e.g. to enter ``no_sync()``).

    :param ctx: ``ctx.loss`` is the loss from the loss function.

    Stops at the first non-``None`` result: the loss tensor that was back-propagated.
    """


@hookspec
def after_backward(ctx: TrainingContext) -> None:
    """After the backward pass: gradients are available.

    Fires once per micro-batch. Typical slot for gradient-norm logging.

    :param ctx: ``ctx.loss`` is the untransformed loss again; ``ctx.backward_loss``
        the tensor that was back-propagated.

    Return value is ignored.
    """


@hookspec
def before_optimizer_step(ctx: TrainingContext) -> None:
    """Immediately before the optimizer step decision.

    Fires once per micro-batch, also on micro-batches whose step will be vetoed.

    :param ctx: ``ctx.sync_gradients`` tells whether this micro-batch ends a window.

    Return value is ignored.
    """


@hookspec(firstresult=True)
def do_optimizer_step(ctx: TrainingContext) -> bool | None:
    """Replacement slot for the optimizer and LR-scheduler step, owned by the orchestrator.

    Fires once per micro-batch. Only one non-wrapper implementation may exist:
    the built-in orchestrator, which asks its update hooks, steps optimizers and
    the schedulers of optimizers that really stepped, and sets ``ctx.step_skipped``.
    Observers use ``before_optimizer_step`` / ``after_optimizer_step``.

    :param ctx: ``ctx.step_skipped`` is set by the implementation.

    Stops at the first non-``None`` result: ``True`` when a step happened.
    """


@hookspec
def after_optimizer_step(ctx: TrainingContext) -> None:
    """After the step path completes: the slot for EMA updates and post-step logging.

    Fires once per micro-batch. The step counters have already advanced when the
    step really happened.

    :param ctx: ``ctx.step_skipped`` is ``True`` when no optimizer step happened
        (vetoed, accumulating, or skipped by GradScaler for inf/NaN gradients).

    Return value is ignored.
    """


@hookspec
def after_batch(ctx: TrainingContext) -> None:
    """End of a micro-batch: generic cleanup.

    Fires once per micro-batch, after ``ctx.batch_count`` and ``ctx.epoch_step_count``
    advanced.

    :param ctx: everything the micro-batch produced is still there.

    Return value is ignored.
    """


@hookspec
def after_epoch(ctx: TrainingContext) -> None:
    """End of an epoch, after its last micro-batch and any end-of-epoch validation.

    :param ctx: ``ctx.epoch`` is the epoch that just ended.

    Return value is ignored.
    """


@hookspec
def after_training(ctx: TrainingContext) -> None:
    """End of a run, after the last epoch (also when the run stopped early for preemption).

    :param ctx: the final counters; ``ctx.preempted`` tells whether a signal stopped the run.

    Return value is ignored.
    """


@hookspec
def after_validation(ctx: TrainingContext) -> None:
    """After a validation pass produced its summary.

    Fires inside ``TrainingStrategy.validate()``, whether called by the loop's
    cadence or by the user.

    :param ctx: ``ctx.validation`` holds the summary (``loss``, ``num_samples`` and
        the configured metrics, as tensors).

    Return value is ignored.
    """


def spec_names() -> tuple[str, ...]:
    """The hookspec names, in stage order."""
    from nvtrain.stages import TrainingStage

    return tuple(stage.hook_name for stage in TrainingStage)


def _check_module_complete(namespace: dict[str, Any]) -> None:
    from nvtrain.stages import TrainingStage

    missing = [s.hook_name for s in TrainingStage if s.hook_name not in namespace]
    if missing:  # pragma: no cover - guards against editing mistakes
        raise RuntimeError(f"hookspecs missing for stages: {missing}")


_check_module_complete(globals())
