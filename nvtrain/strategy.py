"""TrainingStrategy: the training loop, read top to bottom as its sequence of stages."""

from __future__ import annotations

import gc
import itertools
import signal
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from nvtrain.batching import batch_size, device_mover, loader_batch_size
from nvtrain.bus import HookBus
from nvtrain.context import TrainingContext
from nvtrain.data_cursor import is_one_shot
from nvtrain.hook import (
    AccumulatesGradients,
    SavesCheckpoints,
    TrainingUpdateHook,
    accumulating_hook,
    hook_label,
)
from nvtrain.host_rng import apply_host_rng, capture_host_rng
from nvtrain.lr_schedule import LRSchedule, ScheduledLR, plan_schedules
from nvtrain.orchestrator import TrainingUpdateOrchestrator
from nvtrain.preemption import collective_device
from nvtrain.registry import HookRegistry
from nvtrain.run_release import LiveData
from nvtrain.stages import TrainingStage
from nvtrain.step_scheduler import StepScheduler, StepSchedulerConfig
from nvtrain.validation import (
    SUMMARY_KEYS,
    ValidationConfig,
    ValidationLoop,
    averages_to_validate,
    cadence_never_fires,
    check_batches,
    validation_autocast,
    validation_models,
)
from nvtrain.validators import optional_int_at_least

__all__ = ["IMPLIED_STEP_SCHEDULER", "RunResult", "TrainingStrategy"]

#: validate() calls inside validate() (an AFTER_VALIDATION hook validating again) before it is refused.
_MAX_NESTED_VALIDATIONS = 16

S = TrainingStage
# Stage members bound once: an enum attribute lookup per stage would cost on every micro-batch.
_SETUP, _BEFORE_TRAINING, _BEFORE_EPOCH = S.SETUP, S.BEFORE_TRAINING, S.BEFORE_EPOCH
_BEFORE_BATCH, _BEFORE_FORWARD, _AFTER_FORWARD = S.BEFORE_BATCH, S.BEFORE_FORWARD, S.AFTER_FORWARD
_BEFORE_LOSS, _AFTER_LOSS, _BEFORE_BACKWARD = S.BEFORE_LOSS, S.AFTER_LOSS, S.BEFORE_BACKWARD
_DO_BACKWARD, _AFTER_BACKWARD = S.DO_BACKWARD, S.AFTER_BACKWARD
_BEFORE_OPTIMIZER_STEP, _DO_OPTIMIZER_STEP = S.BEFORE_OPTIMIZER_STEP, S.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP, _AFTER_BATCH, _AFTER_EPOCH = S.AFTER_OPTIMIZER_STEP, S.AFTER_BATCH, S.AFTER_EPOCH
_AFTER_TRAINING, _AFTER_VALIDATION = S.AFTER_TRAINING, S.AFTER_VALIDATION
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@attrs.frozen
class RunResult:
    """What ``run()`` reports: final counters, whether a preemption signal ended it, last validation.

    ``validation`` is the latest validation's summary, of this run or from before it (a
    ``validate()`` call; a run that did not validate keeps the earlier one): ``validated_at_step``
    says at which ``step_count``, so whose weights it judged. Both None when nothing validated yet.
    """

    step_count: int
    global_step_count: int
    batch_count: int
    epoch: int
    preempted: bool
    validation: dict[str, Any] | None
    #: Why the run ended early: a hook's ``ctx.request_stop(reason)``, or the preemption signal
    #: (``"preempted by SIGTERM"``); None when it ran to its end.
    stop_reason: str | None = None
    #: ``step_count`` when ``validation`` was taken (the final weights' when it equals ``step_count``).
    validated_at_step: int | None = None


# -- field converters and validators ------------------------------------------------


def _as_models(value: Any) -> dict[str, torch.nn.Module]:
    if isinstance(value, torch.nn.Module):
        return {"main": value}
    if isinstance(value, Mapping):
        for name, model in value.items():
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"TrainingStrategy.models[{name!r}] must be a torch.nn.Module (got {type(model).__name__})"
                )
        if not value:
            raise ValueError("TrainingStrategy.models is empty: give a module or a name -> module mapping")
        return dict(value)
    raise TypeError(
        f"TrainingStrategy.models must be a torch.nn.Module or a mapping of name -> module "
        f"(got {type(value).__name__})"
    )


def _as_factories(field_name: str) -> Callable[[Any], dict[str, Callable[..., Any]]]:
    def convert(value: Any) -> dict[str, Callable[..., Any]]:
        if value is None:
            return {}
        if callable(value) and not isinstance(value, Mapping):
            return {"main": value}
        if not isinstance(value, Mapping):
            raise TypeError(
                f"TrainingStrategy.{field_name} must be a factory or a mapping of name -> factory "
                f"(got {type(value).__name__})"
            )
        for name, factory in value.items():
            if not callable(factory):
                raise TypeError(
                    f"TrainingStrategy.{field_name}[{name!r}] must be callable, e.g. "
                    f"functools.partial(torch.optim.AdamW, lr=1e-3) (got {factory!r})"
                )
        return dict(value)

    return convert


def _as_optimizers(value: Any) -> dict[str, OptimizerFactory]:
    """Optimizer factories by model name; a bare one means ``"main"``."""
    return _as_factories("optimizers")(value)


def _as_hooks(value: Iterable[object]) -> tuple[object, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"TrainingStrategy.hooks must be a list of hooks (got {value!r}); pass [] for none")
    if isinstance(value, Mapping):  # iterating it would register its keys
        raise TypeError(
            f"TrainingStrategy.hooks must be a list of hooks (got a {type(value).__name__} keyed "
            f"{sorted(map(str, value))}); pass list(hooks.values())"
        )
    return tuple(value)


def _as_schedules(value: Any) -> dict[str, LRSchedule]:
    """Factories (or LRSchedules) by optimizer name; a bare one means ``"main"``."""
    if isinstance(value, LRSchedule):
        value = {"main": value}
    factories = _as_factories("lr_schedulers")(value)
    return {name: f if isinstance(f, LRSchedule) else LRSchedule(f) for name, f in factories.items()}


def _as_device(value: Any) -> torch.device | None:
    if value is None:
        return None  # resolved in __attrs_post_init__: the distributed manager's device, else cuda/cpu
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"TrainingStrategy.device: {value!r} is not a torch device ({err})") from None
    if device.type == "cuda":  # without touching CUDA: its context is made when the run starts
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count or (device.index is not None and device.index >= count):
            raise ValueError(
                f"TrainingStrategy.device: {str(device)!r} asks for CUDA, but {count} CUDA device(s) are visible "
                "to this process" + ("" if count else " (torch.cuda.is_available() is False); use device='cpu'")
            )
    return device


#: What a strategy without ``step_scheduler`` runs with: no explicit cadences (checkpoints at epoch ends, the
#: last step and preemption; no validation on checkpoint steps), SIGTERM and SIGINT as preemption signals.
IMPLIED_STEP_SCHEDULER = StepSchedulerConfig(ckpt_every_steps=None, validate_on_checkpoint=False)


def _default_device(manager: Any) -> torch.device:
    """The distributed manager's device (``cuda:LOCAL_RANK``) when it has one, else cuda or cpu."""
    device = getattr(manager, "device", None)
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def indexed_device(device: torch.device) -> torch.device:
    """``device`` with the index its tensors report: ``cuda`` becomes the current CUDA device (``cuda:0``).

    Made when SETUP starts, not when the strategy is built: asking for the current device makes the device's
    context, which only a run on it should. The CPU (and the meta device) has no index.
    """
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.empty(0, device=device).device


def _check_names(field: str, names: Iterable[str], kind: str, known: Mapping[str, Any]) -> None:
    """Every key of ``field`` names one of ``known`` (a ``kind``: model, optimizer)."""
    for name in names:
        if name not in known:
            raise ValueError(
                f"TrainingStrategy.{field}[{name!r}]: no {kind} named {name!r} ({kind}s: {sorted(known)})"
            )


# -- the strategy -----------------------------------------------------------------------


@attrs.define
class _EpochEnd:
    """A completed epoch's end work, in order; each flag is cleared once its part is done."""

    epoch: int
    #: Where the epoch ended: a run() that starts anywhere else does not finish this end.
    step_count: int
    epoch_step_count: int
    #: The validation's summary is still to be computed (the metric-driven LR schedulers step with it).
    evaluate: bool
    #: The per-epoch LR schedulers are still to step.
    step_schedules: bool
    #: AFTER_VALIDATION is still to fire with the computed summary.
    announce: bool = False


@attrs.define(eq=False)
class TrainingStrategy:
    """Trains ``models`` with ``optimizers``; features arrive as hooks on the bus.

    ``optimizers`` maps a model name to a factory of its trainable parameters (a bare
    factory means ``"main"``); they are built after SETUP so wrapped models are used.
    ``lr_schedulers`` maps the same names to factories of the optimizer, each stepped after
    every real optimizer step, or an :class:`~nvtrain.LRSchedule` saying otherwise (per
    epoch, or by a validation metric; a ReduceLROnPlateau is metric-driven). With batches
    of ``(inputs, targets)`` the forward is ``model(inputs)`` and the loss
    ``loss_fn(outputs, targets)``; any other batch needs ``forward_fn(ctx) -> outputs``
    (the loss then sees ``loss_fn(outputs, batch)``).

    ``device`` defaults to the distributed manager's, else CUDA where available. A device
    without an index (``cuda``) becomes the current one (``cuda:0``) when SETUP starts, in
    ``device`` and ``ctx.device``, so it compares equal to its tensors' ``.device``.

    Use it as a context manager so hooks holding resources are closed, also after
    an exception.
    """

    models: dict[str, torch.nn.Module] = attrs.field(converter=_as_models)
    optimizers: dict[str, OptimizerFactory] = attrs.field(converter=_as_optimizers)
    loss_fn: Callable[[Any, Any], torch.Tensor] = attrs.field()
    lr_schedulers: dict[str, LRSchedule] = attrs.field(factory=dict, converter=_as_schedules)
    forward_fn: Callable[[TrainingContext], Any] | None = attrs.field(default=None)
    hooks: Sequence[object] = attrs.field(factory=tuple, converter=_as_hooks)
    device: torch.device = attrs.field(default=None, converter=_as_device)
    num_epochs: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    max_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    validation: ValidationConfig | None = attrs.field(default=None)
    distributed_manager: Any = None
    #: Windows, cadences and preemption of ``run()`` (None: one micro-batch per step, SIGTERM and SIGINT preempt).
    step_scheduler: StepSchedulerConfig | None = attrs.field(default=None, kw_only=True)

    ctx: TrainingContext = attrs.field(init=False)
    #: Every hook of this strategy: the bus, the orchestrator, the registration order.
    registry: HookRegistry = attrs.field(init=False)
    _is_set_up: bool = attrs.field(init=False, default=False)
    #: A state restored before setup waits to be applied (by setup(); a failed attempt is retried).
    _restore_pending: bool = attrs.field(init=False, default=False)
    _setup_loader: Any = attrs.field(init=False, default=None)
    _move_batch: Callable[[Any], Any] = attrs.field(init=False)
    _schedules: tuple[ScheduledLR, ...] = attrs.field(init=False, default=())
    #: What the last run read from, released when this strategy is collected unclosed (see run_release).
    _live_data: LiveData = attrs.field(init=False, factory=LiveData)
    #: What is left of a completed epoch's end work (validation, per-epoch LR step, AFTER_EPOCH); still set
    #: when that work raised, so that the next run() finishes it before the next epoch starts.
    _unfinished_epoch_end: _EpochEnd | None = attrs.field(init=False, default=None)
    #: Held by run() and train_batch(): one of them at a time (a hook calling one, another thread) is refused.
    _busy: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    _busy_with: str = attrs.field(init=False, default="", repr=False)
    _busy_thread: int = attrs.field(init=False, default=0, repr=False)
    _validation_depth: int = attrs.field(init=False, default=0, repr=False)

    @loss_fn.validator
    def _check_loss_fn(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not callable(value):
            raise TypeError(f"TrainingStrategy.loss_fn must be callable (got {value!r})")

    @forward_fn.validator
    def _check_forward_fn(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            if "main" not in self.models:  # the default forward runs models["main"]
                raise ValueError(
                    f"TrainingStrategy.models has no 'main' model (got {sorted(self.models)}) and no forward_fn: the "
                    "default forward is models['main'](inputs); name one model 'main' or pass forward_fn(ctx) -> outputs"
                )
        elif not callable(value):
            raise TypeError(f"TrainingStrategy.forward_fn must be callable fn(ctx) -> outputs or None (got {value!r})")

    @optimizers.validator
    def _check_optimizers(self, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
        if not value:
            raise ValueError("TrainingStrategy.optimizers: at least one optimizer factory is required")
        _check_names("optimizers", value, "model", self.models)

    @lr_schedulers.validator
    def _check_schedulers(self, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
        _check_names("lr_schedulers", value, "optimizer", self.optimizers)

    @step_scheduler.validator
    def _check_step_scheduler(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not isinstance(value, StepSchedulerConfig):
            raise TypeError(
                f"TrainingStrategy.step_scheduler must be a StepSchedulerConfig (got {type(value).__name__})"
            )

    @validation.validator
    def _check_validation(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not isinstance(value, ValidationConfig):
            raise TypeError(f"TrainingStrategy.validation must be a ValidationConfig (got {type(value).__name__})")

    def __attrs_post_init__(self) -> None:
        if self.device is None:
            self.device = _default_device(self.distributed_manager)
        rank, world_size = _rank_and_world_size(self.distributed_manager)
        self.ctx = TrainingContext(
            strategy=self, models=dict(self.models), device=self.device, rank=rank, world_size=world_size
        )
        # on the CPU the containers are copied and the tensors kept: the batch a hook edits is never the loader's
        self._move_batch = device_mover(None if self.device.type == "cpu" else self.device)
        self.registry = HookRegistry(self.hooks)
        if self.validation is not None:
            self._live_data.loaders = [self.validation.data]
        weakref.finalize(self, self._live_data.release)

    # -- registration -------------------------------------------------------------------

    def register_hook(self, hook: object, stage: TrainingStage | Iterable[TrainingStage] | None = None) -> None:
        """Add a hook after construction (before the run it should see)."""
        self.registry.register(hook, stage)

    @property
    def bus(self) -> HookBus:
        return self.registry.bus

    @property
    def orchestrator(self) -> TrainingUpdateOrchestrator:
        return self.registry.orchestrator

    def update_hooks(self) -> tuple[TrainingUpdateHook, ...]:
        return self.registry.update_hooks()

    @property
    def is_set_up(self) -> bool:
        """Has SETUP run (models moved and wrapped, optimizers and LR schedulers built)?"""
        return self._is_set_up

    # -- the run ----------------------------------------------------------------------------

    def run(self, train_loader: Iterable[Any]) -> RunResult:
        """Train over ``train_loader`` until the epochs or ``max_steps`` end, or a preemption signal.

        A :class:`~nvtrain.StepScheduler` (built from ``step_scheduler``, else from
        ``num_epochs`` / ``max_steps``) groups micro-batches into optimizer steps and
        decides the cadences. It is ``ctx.scheduler`` from BEFORE_TRAINING on, where a
        hook may load a saved position; the loop starts from the scheduler's state.
        Preemption signals are caught from BEFORE_TRAINING through AFTER_TRAINING (the
        previous handlers come back afterwards, also on error); a preempted run ends
        after a checkpoint step and returns ``RunResult(preempted=True)``.
        """
        if train_loader is None:
            raise ValueError("TrainingStrategy.run(train_loader): a loader or iterable of batches is required")
        check_batches(train_loader, "TrainingStrategy.run", "train_loader")
        self._enter("run()")
        try:
            return self._run(train_loader)
        finally:
            self._leave()

    def _enter(self, call: str) -> None:
        """Take the strategy for ``call``: a run() or train_batch() already in progress (this one called from a
        hook, or from another thread) would move the weights and counters under it, so it is refused."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"TrainingStrategy.{call}: {self._busy_with} is in progress on this strategy (is it called from a "
                f"hook during it, or from another thread?); one run() or train_batch() at a time"
            )
        self._busy_with, self._busy_thread = call, threading.get_ident()

    def _refuse_from_another_thread(self, call: str, why: str) -> None:
        """``call`` from a thread other than the one running run() or train_batch() would act under its step."""
        if self._busy.locked() and self._busy_thread != threading.get_ident():
            raise RuntimeError(
                f"TrainingStrategy.{call} from another thread during {self._busy_with}: {why}; call it from a hook, "
                "or once the run returned"
            )

    def _leave(self) -> None:
        self._busy_with = ""
        self._busy.release()

    def _warn_open_standalone_window(self) -> None:
        """train_batch() calls that left an accumulation window open: run() starts windows of its own, and the
        gradients accumulated there are zeroed at its first micro-batch."""
        ctx = self.ctx
        if ctx.window_size > 1 and ctx.window_position < ctx.window_size - 1:
            warnings.warn(
                f"TrainingStrategy.run(): train_batch() left an accumulation window open (micro-batch "
                f"{ctx.window_position + 1} of {ctx.window_size}, no optimizer step yet); run() starts its own "
                "windows, so the gradients accumulated there are dropped. Call train_batch() until the window's "
                "last micro-batch first to keep them",
                RuntimeWarning,
                stacklevel=4,
            )

    def refuse_mid_run(self, what: str, why: str) -> None:
        """Refuse ``what`` while a run() or train_batch() is in progress, except at BEFORE_TRAINING, where a resume
        loads a state; ``why`` says what it would do there. :func:`nvtrain.state.load_state` calls it, so loading
        a state is refused whichever way it comes (``load_state_dict``, ``restore``, a hook's ``load_into``)."""
        ctx = self.ctx
        if self._busy.locked() and not (ctx.windowed and ctx.stage is _BEFORE_TRAINING):
            raise RuntimeError(
                f"{what} during {self._busy_with} (at {ctx.stage.name if ctx.stage else 'no stage'}): {why}; "
                "do it at BEFORE_TRAINING, or between runs"
            )

    def _run(self, train_loader: Iterable[Any]) -> RunResult:
        self._warn_open_standalone_window()
        self.registry.begin_run(self.ctx)  # refuses slots without an owner (the orchestrator unregistered by hand)
        ctx, bus = self.ctx, self.registry.bus
        self._set_up(train_loader)
        if self._saves_checkpoints():  # two hooks sharing a state key: refused now, not at the first save
            from nvtrain.state import checkpointable_hooks, strategy_hooks

            checkpointable_hooks(strategy_hooks(self))
        if self.validation is not None:  # which averages use_ema evaluates: refused now, not at the first validation
            averages_to_validate(self.registry.hooks(), self.validation)
        scheduler = self._build_scheduler(ctx.train_loader)
        self._check_metric_schedules(scheduler)
        self._warn_cadence_beyond_the_run(scheduler)
        ctx.scheduler = scheduler
        self._live_data.scheduler = scheduler
        self._live_data.loaders = [ctx.train_loader, self.validation.data if self.validation is not None else None]
        ctx.preempted = False
        ctx.stop_reason = None
        ctx.windowed = True
        manual_gc = scheduler.gc_every_steps is not None and gc.isenabled()
        if manual_gc:  # collect on the step cadence only, as NeMo does: no gc pause inside a step
            gc.disable()
        try:
            with scheduler:
                ctx.stage = _BEFORE_TRAINING
                try:
                    bus.before_training(ctx)
                finally:  # a resume there loaded a position: a retry after a later hook raised starts from it
                    self._follow_scheduler(scheduler)
                if scheduler.training_done and not scheduler.validation_owed and self._unfinished_epoch_end is None:
                    warnings.warn(_nothing_to_train(scheduler), RuntimeWarning, stacklevel=3)
                self._finish_interrupted_epoch_end(scheduler)
                if scheduler.validation_owed:
                    self._validate_owed(scheduler)
                for epoch in scheduler.epochs:
                    self._run_epoch(scheduler, epoch)
                ctx.preempted = _cut_by_preemption(scheduler)
                ctx.stop_reason = _stop_reason(scheduler)
                ctx.stage = _AFTER_TRAINING
                bus.after_training(ctx)
        except BaseException as err:  # free when nothing raises: the update hooks leave the failed batch
            self.registry.orchestrator.abort_batch(err)
            self.registry.abort_run(err)  # per-run resources (a profiler) go now, not when the strategy closes
            raise
        finally:
            ctx.windowed = False
            # a run that failed inside a window leaves no window open: the scheduler replays it on resume
            ctx.window_size, ctx.window_position, ctx.sync_gradients = 1, 0, True
            ctx.release_step_graph()
            if manual_gc:
                gc.enable()
        return RunResult(
            step_count=ctx.step_count,
            global_step_count=ctx.global_step_count,
            batch_count=ctx.batch_count,
            epoch=ctx.epoch,
            preempted=ctx.preempted,
            validation=ctx.validation,
            stop_reason=ctx.stop_reason,
            validated_at_step=ctx.validation_step,
        )

    def _run_epoch(self, scheduler: StepScheduler, epoch: int) -> None:
        """One epoch (or the rest of it after a resume): windows, step validation, epoch-end work."""
        ctx, bus = self.ctx, self.registry.bus
        ctx.epoch = epoch
        ctx.epoch_step_count = scheduler.position
        ctx.stage = _BEFORE_EPOCH
        bus.before_epoch(ctx)
        validated_at: int | None = None
        has_validation_data = self._has_validation_data()
        collect_garbage = scheduler.gc_every_steps is not None
        train_micro_batch = self._train_micro_batch
        try:
            for window in scheduler:
                size = len(window)
                if size == 1:  # no accumulation: the common case, without the inner loop
                    ctx.window_size, ctx.window_position, ctx.sync_gradients = 1, 0, True
                    train_micro_batch(window[0], scheduler)
                else:
                    for position, batch in enumerate(window):
                        ctx.window_size, ctx.window_position = size, position
                        ctx.sync_gradients = position == size - 1
                        train_micro_batch(batch, scheduler if position == size - 1 else None)
                if collect_garbage and scheduler.is_gc_step:
                    gc.collect()
                if has_validation_data and scheduler.is_val_step:
                    self._validate_in_run()
                    validated_at = ctx.step_count
                    if not scheduler.is_last_step:  # a signal or stop request during validation ends the run here
                        scheduler.poll_preemption()
                        ctx.preempted = scheduler.sigterm_received
        except BaseException:
            self._leave_a_failed_window(scheduler, epoch, validated_at)
            raise
        self._end_epoch(scheduler, self._epoch_end(scheduler, epoch, validated_at))

    def _leave_a_failed_window(self, scheduler: StepScheduler, epoch: int, validated_at: int | None) -> None:
        """A failure inside the epoch's loop: what a later ``run()`` needs to go on as the straight run did.

        A window left open is replayed whole, so its micro-batches counted so far are taken back
        (``batch_count`` counted them twice). A failure after the step that ended the epoch (at its
        AFTER_OPTIMIZER_STEP, AFTER_BATCH or step validation) leaves that epoch's end work owed: the
        next ``run()`` does it first, as after a failure during the end work itself; so does a failure after
        the run's own last step inside an epoch (``max_steps``), when the next run has nothing more to train.
        """
        ctx = self.ctx
        completed = scheduler.state_dict()["epoch"] > epoch  # the epoch's last window closed before the failure
        closed = ctx.epoch_step_count == scheduler.position
        if completed or (closed and scheduler.reaches_the_end):  # or the run's own last step (max_steps) did
            end = self._epoch_end(scheduler, epoch, validated_at, completed=completed)
            if validated_at != ctx.step_count and ctx.validation_step == ctx.step_count:
                # that step's validation was computed (a metric-driven LR scheduler stepped with it) and its
                # AFTER_VALIDATION raised: that stage runs again, the summary is not computed twice
                end.evaluate, end.announce = False, True
            self._unfinished_epoch_end = end
            return
        counted_again = ctx.epoch_step_count - scheduler.position
        if counted_again > 0:
            ctx.batch_count -= counted_again
            ctx.epoch_step_count -= counted_again

    def _epoch_end(
        self, scheduler: StepScheduler, epoch: int, validated_at: int | None, *, completed: bool | None = None
    ) -> _EpochEnd:
        """What the end of ``epoch`` (or of the run inside it) does: its validation, per-epoch LR step, AFTER_EPOCH;
        a completed epoch's end is kept as owed until done (a run() after a failure there finishes it).
        ``completed``: whether the epoch's data was used up (default: the scheduler moved past it)."""
        ctx = self.ctx
        # The epoch's end validates; so does a run's last step inside an epoch (max_steps): the run's
        # result describes its final weights. Not a stop request's step inside an epoch. A preemption at
        # a completed epoch's end saves first (the grace period is for saving) and owes the validation to
        # the resumed run; at the run's last step there is nothing to resume, so it validates now.
        epoch_completed = scheduler.epoch > epoch if completed is None else completed
        # a stop request at the run's own last step (max_steps) cuts nothing short
        stopped_early = scheduler.stop_reason is not None and not epoch_completed and not scheduler.reaches_the_end
        validates = False
        if not stopped_early and validated_at != ctx.step_count and self._epoch_end_validates(scheduler):
            if not scheduler.sigterm_received or scheduler.is_last_step:
                validates = True
            elif epoch_completed:
                scheduler.validation_owed = True
        end = _EpochEnd(
            epoch=epoch,
            step_count=ctx.step_count,
            epoch_step_count=ctx.epoch_step_count,
            evaluate=validates,
            step_schedules=epoch_completed,
        )
        if epoch_completed:  # kept until done: a run() after a failure here finishes it
            self._unfinished_epoch_end = end
        return end

    def _end_epoch(self, scheduler: StepScheduler, end: _EpochEnd) -> None:
        """The epoch's end work, each part once: what a failure left is what the next ``run()`` does."""
        ctx, bus = self.ctx, self.registry.bus
        if end.evaluate:
            self._evaluate_on_forked_streams()
            end.evaluate, end.announce = False, True
        if end.announce:
            self._after_validation()
            end.announce = False
            ctx.validation_follows = False
        if end.step_schedules:
            self._step_schedules("epoch")
            end.step_schedules = False
        ctx.stage = _AFTER_EPOCH
        bus.after_epoch(ctx)
        self._unfinished_epoch_end = None
        ctx.epoch = scheduler.epoch  # advanced only when the epoch's data was used up

    def _finish_interrupted_epoch_end(self, scheduler: StepScheduler) -> None:
        """The last run() raised during a completed epoch's end work, and this one goes on from the next epoch:
        first do what that end had left (its validation, AFTER_VALIDATION, its per-epoch LR step, AFTER_EPOCH
        and so the checkpoint saved there), each part once, as the run that never failed did. The stage that
        raised fires again whole. A run that starts elsewhere (a checkpoint loaded since) drops it."""
        end, ctx = self._unfinished_epoch_end, self.ctx
        if end is None:
            return
        after_the_epoch = scheduler.epoch == end.epoch + 1 and scheduler.position == 0
        # the run's last step inside an epoch: finished only when this run has nothing more to train (a raised
        # max_steps trains on, and that step is no longer the run's last)
        at_the_run_end = (scheduler.epoch, scheduler.position) == (end.epoch, end.epoch_step_count)
        if not (after_the_epoch or (at_the_run_end and scheduler.training_done)) or ctx.step_count != end.step_count:
            self._unfinished_epoch_end = None
            return
        ctx.epoch, ctx.epoch_step_count = end.epoch, end.epoch_step_count
        self._end_epoch(scheduler, end)
        scheduler.poll_preemption()  # as between epochs: a signal during that work ends the run here
        ctx.preempted = scheduler.sigterm_received

    def _build_scheduler(self, loader: Any) -> StepScheduler:
        """The run's scheduler: its configuration, the run bounds, accumulation and where to start."""
        ctx = self.ctx
        config = self.step_scheduler if self.step_scheduler is not None else IMPLIED_STEP_SCHEDULER
        num_epochs, max_steps = self._run_bounds()
        local_batch_size = _local_batch_size(loader)
        dp_size = ctx.world_size
        accumulation = self._accumulation_hook()
        if config.global_batch_size is not None:
            global_batch_size = config.global_batch_size
        else:
            steps = 1 if accumulation is None else accumulation.accumulation_steps
            global_batch_size = steps * local_batch_size * dp_size
        val_every = [config.val_every_steps, self.validation.every_n_steps if self.validation is not None else None]
        # A run with no plugin that saves checkpoints has no checkpoint steps to validate on.
        validate_on_checkpoint = config.validate_on_checkpoint and self._saves_checkpoints()
        progressed = ctx.step_count > 0 or ctx.epoch > 0 or isinstance(ctx.scheduler, StepScheduler)
        previous = ctx.scheduler
        # the epoch the last run's scheduler stands at: past a finished epoch even when a failure came before
        # AFTER_EPOCH moved ctx.epoch
        stopped_epoch = previous.state_dict()["epoch"] if isinstance(previous, StepScheduler) else ctx.epoch
        scheduler = config.create(
            global_batch_size=global_batch_size,
            local_batch_size=local_batch_size,
            dp_size=dp_size,
            dataloader=loader,
            val_every_steps=[every for every in val_every if every is not None],
            validate_on_checkpoint=validate_on_checkpoint,
            start_step=ctx.step_count if progressed else config.start_step,
            start_epoch=stopped_epoch if progressed else config.start_epoch,
            num_epochs=num_epochs,
            max_steps=max_steps,
            process_group=self._scheduler_group(),
            synchronized_stream=bool(getattr(loader, "synchronized_stream", False)),
        )
        scheduler.finish_step_required = True  # the loop closes every window itself, after DO_OPTIMIZER_STEP
        self._ensure_accumulation(scheduler, accumulation)
        # Where the last run stopped: on its live iterator when the loader is the same; a DataLoader made again
        # over the same data set object reopens the epoch there, as a resume does, with the epoch's saved random
        # state. Other data (another data set object, a new list or generator) starts at the epoch's first
        # micro-batch. Steps taken by train_batch() since count on.
        if not isinstance(previous, StepScheduler):
            return scheduler
        if previous.dataloader is not loader and not _over_the_same_data_set(previous.dataloader, loader):
            stopped = previous.state_dict()
            if stopped["position"] and not is_one_shot(loader):
                warnings.warn(
                    f"TrainingStrategy.run(): the last run stopped at micro-batch {stopped['position']} of epoch "
                    f"{stopped['epoch'] + 1}; this run's loader is not over the same data set object, so the epoch "
                    "starts from its first micro-batch (to continue it, pass the same loader, or a DataLoader over "
                    "the same data set object)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return scheduler
        try:
            scheduler.continue_from(previous, step=ctx.step_count)
        except ValueError as err:
            stopped = previous.state_dict()
            if stopped["position"]:  # at an epoch's start nothing is lost: the epoch starts whole anyway
                warnings.warn(
                    f"TrainingStrategy.run(): the last run stopped at micro-batch {stopped['position']} of epoch "
                    f"{stopped['epoch'] + 1}, which this run's batch configuration cannot continue ({err}); the "
                    "epoch starts again from its first micro-batch",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return scheduler

    def _scheduler_group(self) -> Any:
        """The manager's group for the scheduler's agreements; None (torch's name for it) for the default group.

        The scheduler stays on ``ctx.scheduler`` after the run: holding the default group object
        there would keep a destroyed group alive for as long as the strategy lives.
        """
        group = getattr(self.distributed_manager, "process_group", None)
        if group is not None and dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
            return None
        return group

    def _saves_checkpoints(self) -> bool:
        """Whether a registered hook writes checkpoints; the registry's hooks, so a seed-style one counts too."""
        return any(isinstance(hook, SavesCheckpoints) and not isinstance(hook, type) for hook in self.registry.hooks())

    def _run_bounds(self) -> tuple[int | None, int | None]:
        config = self.step_scheduler
        bounds = []
        for name in ("num_epochs", "max_steps"):
            mine = getattr(self, name)
            theirs = getattr(config, name) if config is not None else None
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(
                    f"TrainingStrategy.{name}={mine} and TrainingStrategy.step_scheduler.{name}={theirs} "
                    "disagree; set it in one place"
                )
            bounds.append(theirs if theirs is not None else mine)
        return bounds[0], bounds[1]

    def _accumulation_hook(self) -> AccumulatesGradients | None:
        return accumulating_hook(self.registry.update_hooks())

    def _ensure_accumulation(self, scheduler: StepScheduler, hook: AccumulatesGradients | None) -> None:
        """Windows of several micro-batches need the accumulation hook: check it, or register one."""
        steps = scheduler.grad_acc_steps
        if hook is not None:
            hook_steps = hook.accumulation_steps
            if hook_steps != steps:
                raise ValueError(
                    f"TrainingStrategy: step_scheduler.global_batch_size={scheduler.global_batch_size} with "
                    f"local_batch_size={scheduler.local_batch_size} and dp_size={scheduler.dp_size} means "
                    f"grad_acc_steps={steps}, but {hook_label(hook)} accumulates over {hook_steps}; "
                    "drop one of them or make them agree"
                )
        elif steps > 1:
            from nvtrain.hooks.accumulation import SchedulerAccumulationHook

            self.register_hook(SchedulerAccumulationHook(steps=steps))

    def _follow_scheduler(self, scheduler: StepScheduler) -> None:
        """After BEFORE_TRAINING (where a resume may load a position) the counters follow the scheduler."""
        ctx = self.ctx
        if ctx.step_count != scheduler.step:
            ctx.global_step_count += (scheduler.step - ctx.step_count) * ctx.world_size
            ctx.step_count = scheduler.step
        ctx.epoch = scheduler.epoch

    def train_batch(self, batch: Any) -> torch.Tensor | None:
        """Run one micro-batch through every batch stage outside ``run()``; returns its loss (detached).

        Like ``run()``, it leaves ``ctx.outputs`` and ``ctx.loss`` detached from the micro-batch's
        autograd graph (:meth:`TrainingContext.release_step_graph`).
        """
        self._enter("train_batch()")
        try:
            return self._train_one_batch(batch)
        finally:
            self._leave()

    def _train_one_batch(self, batch: Any) -> torch.Tensor | None:
        self.setup()
        ctx = self.ctx
        placer = self.registry.orchestrator.window_placer
        if placer is None:
            ctx.window_size, ctx.window_position, ctx.sync_gradients = 1, 0, True
        else:
            placer(ctx)
        try:
            self._train_micro_batch(batch)
        except BaseException as err:  # free when nothing raises: the update hooks leave the failed batch
            self.registry.orchestrator.abort_batch(err)
            raise
        finally:
            ctx.release_step_graph()
        return ctx.loss

    def _train_micro_batch(self, batch: Any, boundary: StepScheduler | None = None) -> None:
        """All batch stages for one micro-batch; ``boundary`` closes the scheduler's step after DO_OPTIMIZER_STEP."""
        ctx, registry = self.ctx, self.registry
        bus = registry.bus
        # the last micro-batch's batch, outputs and losses go before this one is moved and run forward: kept,
        # they would sit on the device through the next forward (a language model's logits: gigabytes of peak)
        ctx.batch = ctx.outputs = ctx.loss = ctx.backward_loss = None
        ctx.batch = self._move_batch(batch)
        ctx.stage = _BEFORE_BATCH
        registry.orchestrator.settle_zeroing(bus.before_batch(ctx), registry.before_batch_voters)
        ctx.stage = _BEFORE_FORWARD
        bus.before_forward(ctx)
        ctx.outputs = self._forward(ctx)
        ctx.stage = _AFTER_FORWARD
        bus.after_forward(ctx)
        ctx.stage = _BEFORE_LOSS
        bus.before_loss(ctx)
        ctx.loss = self._loss(ctx)
        ctx.stage = _AFTER_LOSS
        bus.after_loss(ctx)
        ctx.stage = _BEFORE_BACKWARD
        bus.before_backward(ctx)
        ctx.stage = _DO_BACKWARD
        bus.do_backward(ctx)
        ctx.stage = _AFTER_BACKWARD
        bus.after_backward(ctx)
        ctx.stage = _BEFORE_OPTIMIZER_STEP
        bus.before_optimizer_step(ctx)
        ctx.stage = _DO_OPTIMIZER_STEP
        try:
            bus.do_optimizer_step(ctx)
        except BaseException:
            self._keep_a_taken_step(boundary)
            raise
        ctx.batch_count += 1
        ctx.epoch_step_count += 1
        if not ctx.step_skipped:
            ctx.step_count += 1
            ctx.global_step_count += ctx.world_size
        if boundary is not None:  # the step boundary: predicates now describe this step; preemption polled once
            ctx.preempted = boundary.finish_step(stepped=not ctx.step_skipped)
            ctx.validation_follows = self.validation is not None and self._validation_follows(boundary)
        ctx.stage = _AFTER_OPTIMIZER_STEP
        bus.after_optimizer_step(ctx)
        ctx.stage = _AFTER_BATCH
        bus.after_batch(ctx)

    def _keep_a_taken_step(self, boundary: StepScheduler | None) -> None:
        """DO_OPTIMIZER_STEP raised after the optimizers stepped (a wrapper, after its ``yield``): that step
        happened, so it is counted and its window closed; a later ``run()`` must not take it again."""
        ctx = self.ctx
        if self.registry.orchestrator.stepped_at_batch != ctx.batch_count:
            return  # it raised before any optimizer stepped: the window is replayed whole
        ctx.step_skipped = False
        ctx.batch_count += 1
        ctx.epoch_step_count += 1
        ctx.step_count += 1
        ctx.global_step_count += ctx.world_size
        if boundary is not None:
            boundary.close_failed_step()

    def _forward(self, ctx: TrainingContext) -> Any:
        forward_fn = self.forward_fn
        if forward_fn is not None:
            return forward_fn(ctx)
        batch = ctx.batch
        if type(batch) is tuple and len(batch) == 2:  # the common case first, then anything pair-like
            return ctx.models["main"](batch[0])
        inputs, _ = _split_pair(batch)
        return ctx.models["main"](inputs)

    def _loss(self, ctx: TrainingContext) -> torch.Tensor:
        batch = ctx.batch
        targets = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
        return self.loss_fn(ctx.outputs, targets)

    # -- setup ----------------------------------------------------------------------------------

    def setup(self, train_loader: Iterable[Any] | None = None) -> None:
        """Run SETUP once: move the models, let plugins wrap them, build optimizers and LR schedulers.

        ``run()``, ``train_batch()``, ``validate()`` and ``load_checkpoint()`` call it; call it
        yourself to inspect wrapped models or built optimizers before training. Later calls
        only take a new ``train_loader``. A state restored before (``load_state_dict``,
        ``restore``) is applied once the optimizers exist, its data position at the next ``run()``.
        """
        if train_loader is not None:
            check_batches(train_loader, "TrainingStrategy.setup", "train_loader")
        if train_loader is not None and self._busy.locked():
            raise RuntimeError(
                f"TrainingStrategy.setup(train_loader) during {self._busy_with}: the run reads the loader it was "
                "given; pass the new one to the next run()"
            )
        self._set_up(train_loader)
        if self._restore_pending:
            from nvtrain.state import apply_held_state

            apply_held_state(self)  # raises, and stays pending, when the state does not fit
            self._restore_pending = False

    def _set_up(self, train_loader: Iterable[Any] | None) -> None:
        """SETUP itself; ``run()`` calls it directly, so a held state is applied whole at BEFORE_TRAINING."""
        ctx = self.ctx
        if self._is_set_up:
            # The loader SETUP saw may have been replaced by a plugin (a DDP sampler): keep the
            # replacement when the same loader comes back; a new loader is used as given.
            if train_loader is not None and (train_loader is not self._setup_loader or ctx.train_loader is None):
                ctx.train_loader = train_loader
            return
        device = indexed_device(self.device)
        if device != self.device:  # ``cuda`` given: hooks compare their tensors' ``cuda:0`` with ctx.device
            self.device = ctx.device = device
            self._move_batch = device_mover(device)
        on_meta = [name for name, model in ctx.models.items() if on_meta_device(model)]
        self._refuse_unmaterialised(on_meta)
        for name, model in ctx.models.items():
            if name not in on_meta:  # a plugin materialises those (FSDP shards them first): nothing to move
                ctx.models[name] = model.to(self.device)
        ctx.train_loader = train_loader
        ctx.stage = _SETUP
        self.registry.bus.setup(ctx)
        self._setup_loader = train_loader
        self._refuse_still_on_meta([name for name in on_meta if on_meta_device(ctx.models[name])])
        for name, factory in self.optimizers.items():
            params = [p for p in ctx.models[name].parameters() if p.requires_grad]
            if not params:
                raise ValueError(f"TrainingStrategy.optimizers[{name!r}]: model {name!r} has no trainable parameters")
            ctx.optimizers[name] = _checked_optimizer(name, factory(params), ctx.models[name])
        for name, schedule in self.lr_schedulers.items():
            ctx.lr_schedulers[name] = _checked_lr_scheduler(name, schedule.factory(ctx.optimizers[name]), ctx.optimizers[name])
        self._schedules = plan_schedules(self.lr_schedulers, ctx.lr_schedulers)
        self.registry.bind(ctx.optimizers, self._per_step_schedulers())
        self._is_set_up = True

    def _materialisers(self) -> list[str]:
        return [hook_label(h) for h in self.registry.hooks() if getattr(h, "materializes_meta_models", False)]

    def _refuse_unmaterialised(self, on_meta: Sequence[str]) -> None:
        """Before SETUP: models built on the meta device hold no weights, so a hook must materialise them."""
        if on_meta and not self._materialisers():
            raise ValueError(
                f"TrainingStrategy: model {', '.join(map(repr, on_meta))} has parameters on the meta device (built "
                "under torch.device('meta')), and no registered hook materialises meta models; register FSDPHook, "
                "which shards such a model and then allocates and initialises each rank's shards, or build the "
                "model on a real device"
            )

    def _refuse_still_on_meta(self, on_meta: Sequence[str]) -> None:
        """After SETUP: a meta model the materialising hook left alone (not among its model keys)."""
        if on_meta:
            raise ValueError(
                f"TrainingStrategy: model {', '.join(map(repr, on_meta))} still has parameters on the meta device "
                f"after SETUP; {', '.join(self._materialisers())} did not materialise it (is it among the hook's "
                "model_keys?)"
            )

    # -- validation -----------------------------------------------------------------------------

    def validate(self, loader: Iterable[Any] | None = None) -> dict[str, Any]:
        """Evaluate over ``loader`` (default: ``validation.data``) and fire AFTER_VALIDATION.

        Called from a hook (a baseline validation at BEFORE_TRAINING), it leaves ``ctx.stage``
        as it found it, so the stage's later hooks (a resume) see the stage they run in.
        """
        self._refuse_from_another_thread("validate()", "it would switch the models to eval mode under the training step")
        ctx = self.ctx
        stage = ctx.stage
        if self._validation_depth >= _MAX_NESTED_VALIDATIONS:
            raise RuntimeError(
                f"TrainingStrategy.validate() nested {self._validation_depth} deep: an AFTER_VALIDATION hook calls "
                "validate() after every validation, and each fires AFTER_VALIDATION again; call it under a condition"
            )
        self._validation_depth += 1
        try:
            summary = self._evaluate_on_forked_streams(loader)
            self._after_validation()
        finally:
            ctx.stage = stage
            self._validation_depth -= 1
        return summary

    def _evaluate(self, loader: Iterable[Any] | None) -> dict[str, Any]:
        """The validation summary, on ``ctx.validation``; a metric-driven LR scheduler steps with it in ``run()``."""
        config = self.validation or ValidationConfig()
        loader = loader if loader is not None else config.data
        if loader is None:
            raise ValueError("validate(): no loader given and TrainingStrategy.validation.data is not set")
        check_batches(loader, "TrainingStrategy.validate", "loader")
        self.setup()
        ctx = self.ctx
        hooks = self.registry.hooks()
        models = validation_models(ctx.models, hooks, config)
        loop = ValidationLoop(
            forward=self._validation_forward,
            loss_fn=self.loss_fn,
            autocast=validation_autocast(hooks, config),
            metrics=config.metrics,
        )
        summary = loop.run(models, (self._move_batch(b) for b in loader))
        ctx.validation, ctx.validation_step = summary, ctx.step_count
        if ctx.windowed:  # inside run(): a ReduceLROnPlateau steps with this validation's metric
            self._step_schedules("metric")
        return summary

    def _after_validation(self) -> None:
        ctx = self.ctx
        ctx.stage = _AFTER_VALIDATION
        self.registry.bus.after_validation(ctx)

    def _validation_forward(self, models: Mapping[str, torch.nn.Module], batch: Any) -> tuple[Any, Any, int]:
        targets = batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
        if self.forward_fn is None:
            inputs, _ = _split_pair(batch)
            outputs = models["main"](inputs)
        else:
            ctx = self.ctx
            saved_batch, saved_models = ctx.batch, ctx.models
            ctx.batch, ctx.models = batch, dict(models)
            try:
                outputs = self.forward_fn(ctx)
            finally:
                ctx.batch, ctx.models = saved_batch, saved_models
        return outputs, targets, batch_size(batch)

    def validation_keys(self) -> frozenset[str]:
        """The keys of the summary this strategy's validation produces (``ctx.validation``): ``loss``,
        ``num_samples`` and the configured metrics' names."""
        metrics = self.validation.metrics if self.validation is not None else {}
        return SUMMARY_KEYS | frozenset(metrics)

    def why_run_never_validates(self, scheduler: StepScheduler | None = None) -> str | None:
        """Why ``run()`` as configured never validates on its own (None when it does): no validation data, or no
        cadence (read from ``scheduler``, by default the run's). A hook may still call ``validate()`` itself."""
        scheduler = scheduler if scheduler is not None else self.ctx.scheduler
        if not self._has_validation_data():
            return "TrainingStrategy.validation has no data"
        if self.validation is not None and scheduler is not None and (
            self.validation.epoch_interval is None and not scheduler.val_every_steps and not scheduler.validate_on_checkpoint
        ):
            return "no validation cadence is set (ValidationConfig every_n_steps and every_n_epochs are None)"
        return None

    def _check_metric_schedules(self, scheduler: StepScheduler) -> None:
        """A metric-driven LR scheduler (a ReduceLROnPlateau) steps with a key of the validation summary, before
        any hook sees it: a key the summary never has is refused now, not at the first validation. A run that
        never validates keeps its learning rate, unless a hook calls ``validate()`` itself: say so."""
        metric_driven = [plan for plan in self._schedules if plan.metric is not None]
        if not metric_driven:
            return
        keys = self.validation_keys()
        for plan in metric_driven:
            if plan.metric not in keys:
                raise ValueError(
                    f"TrainingStrategy.lr_schedulers[{plan.name!r}]: LRSchedule(monitor={plan.metric!r}) steps with "
                    f"a key the validation summary does not have (its keys: {', '.join(sorted(keys))}); set monitor "
                    "to one of them, or add the metric to ValidationConfig.metrics"
                )
        why = self.why_run_never_validates(scheduler)
        if why is None:
            return
        plan = metric_driven[0]
        warnings.warn(
            f"TrainingStrategy.lr_schedulers[{plan.name!r}]: {type(plan.scheduler).__name__} steps after each "
            f"validation with metric {plan.metric!r}, but the run is not set to validate: {why}; it keeps its "
            "learning rate unless a hook calls validate() during the run (give the run validation data and a "
            "cadence, or use a step or epoch schedule)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _warn_cadence_beyond_the_run(self, scheduler: StepScheduler) -> None:
        """A validation cadence longer than the run (``every_n_epochs=5`` in a 3-epoch run) never validates: the
        run ends with no validation result, and early stopping and a plateau scheduler never act; say so."""
        config = self.validation
        if config is None or config.data is None or scheduler.validate_on_checkpoint:
            return
        steps, epochs, epoch_len = scheduler.total_steps, scheduler.num_epochs, scheduler.epoch_len
        if steps is not None and epoch_len:  # max_steps may end the run epochs before num_epochs does
            epochs = min(epochs, -(-steps // epoch_len)) if epochs is not None else -(-steps // epoch_len)
        why = cadence_never_fires(scheduler.val_every_steps, config.epoch_interval, steps, epochs)
        if why is not None:
            warnings.warn(
                f"TrainingStrategy.validation: the run never validates ({why}); shorten the cadence "
                "(ValidationConfig every_n_steps / every_n_epochs) or lengthen the run",
                RuntimeWarning,
                stacklevel=4,
            )

    def _has_validation_data(self) -> bool:
        return self.validation is not None and self.validation.data is not None

    def _validation_follows(self, scheduler: StepScheduler) -> bool:
        """Whether ``run()`` validates right after the step just closed (the decisions ``_run_epoch`` makes)."""
        config = self.validation
        if config is None or config.data is None:
            return False
        if scheduler.is_val_step:  # a step cadence: also on a preempted step
            return True
        if scheduler.sigterm_received and not scheduler.is_last_step:
            return False  # a preemption saves first; an epoch-end validation is owed to the resumed run
        # the epoch's end, or the run's inside it at max_steps (a stop request's step inside it does not validate)
        ends_run = scheduler.is_last_step and (scheduler.stop_reason is None or scheduler.reaches_the_end)
        ends_epoch = scheduler.is_last_batch or ends_run
        return bool(ends_epoch and self._epoch_validates())

    def _per_step_schedulers(self) -> dict[str, list[Any]]:
        """The schedulers the orchestrator steps after each real optimizer step, by optimizer."""
        per_step: dict[str, list[Any]] = {}
        for plan in self._schedules:
            if plan.interval == "step" and plan.metric is None:
                per_step.setdefault(plan.name, []).append(plan.scheduler)
        return per_step

    def _step_schedules(self, interval: str) -> None:
        """Step the epoch-interval schedulers (interval ``"epoch"``) or the metric-driven ones (``"metric"``)."""
        for plan in self._schedules:
            if interval == "epoch" and plan.interval == "epoch" and plan.metric is None:
                plan.scheduler.step()
            elif interval == "metric" and plan.metric is not None:
                summary = self.ctx.validation or {}
                if plan.metric not in summary:
                    raise KeyError(
                        f"TrainingStrategy.lr_schedulers[{plan.name!r}]: {type(plan.scheduler).__name__} steps with "
                        f"validation metric {plan.metric!r}, which the validation summary lacks "
                        f"(it has {sorted(summary)}); set LRSchedule(monitor=...) to one of them"
                    )
                plan.scheduler.step(self.mean_over_ranks(summary[plan.metric]))

    def mean_over_ranks(self, value: Any) -> float:
        """``value`` (a number or one-element tensor) averaged over the data-parallel ranks: one all-reduce,
        which every rank must make at the same point; in one process, ``float(value)``.

        For decisions a validation drives (a metric-driven LR scheduler, early stopping): each
        rank validates on its own data (or with its own BatchNorm statistics), and ranks deciding
        apart would step their replicas or FSDP shards at different learning rates, or keep
        states a rank-0 checkpoint cannot hold for all.
        """
        if self.ctx.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return float(value)
        group = self._scheduler_group()
        device = collective_device(group, self.device)
        total = torch.tensor(float(value), dtype=torch.float64, device=device)
        dist.all_reduce(total, group=group)
        return float(total) / dist.get_world_size(group)

    def _validate_in_run(self) -> None:
        """Validate without touching the training RNG streams, so a resumed run draws what a straight one does.

        AFTER_VALIDATION fires once those streams are back: a checkpoint saved there holds
        the training RNG state, not the one the validation loader's iterator advanced.
        """
        self._evaluate_on_forked_streams()
        self._after_validation()
        self.ctx.validation_follows = False

    def _evaluate_on_forked_streams(self, loader: Iterable[Any] | None = None) -> dict[str, Any]:
        """The validation summary (see :meth:`_evaluate`), computed on forked RNG streams, restored also when it
        raises: whether and where a validation runs never changes the training's data order, augmentations or
        dropout masks (a validation loader draws its base seed from the global generator). SETUP, when this is
        the strategy's first call, runs before the fork: what it draws stays drawn, as when run() sets up."""
        self.setup()
        device = self.device
        devices = []
        if device.type == "cuda":
            devices = [device.index if device.index is not None else torch.cuda.current_device()]
        host = capture_host_rng()  # a validation set that augments with numpy or random must not move them either
        try:
            with torch.random.fork_rng(devices=devices):
                return self._evaluate(loader)
        finally:  # also when the validation raised: a later run() trains on the streams it left
            apply_host_rng(host)

    def _epoch_end_validates(self, scheduler: StepScheduler) -> bool:
        """Whether the end of ``ctx.epoch`` validates: on the epoch cadence, or as a checkpoint step (the
        scheduler's ``validate_on_checkpoint`` with a checkpoint at every epoch's end)."""
        on_checkpoint = scheduler.validate_on_checkpoint and scheduler.save_checkpoint_every_epoch
        return self._epoch_validates() or (on_checkpoint and self._has_validation_data())

    def _epoch_validates(self) -> bool:
        """Whether the epoch cadence validates at the end of ``ctx.epoch`` (given validation data)."""
        config = self.validation
        if config is None or config.data is None:
            return False
        interval = config.epoch_interval
        return bool(interval and (self.ctx.epoch + 1) % interval == 0)

    def _validate_owed(self, scheduler: StepScheduler) -> None:
        """The end-of-epoch validation a preemption left to this (resumed) run, before anything trains: it
        validates the weights the epoch ended with, so early stopping and a plateau scheduler decide as
        in the run that never stopped (a stop it requests ends this run before its first step)."""
        scheduler.validation_owed = False
        if not self._has_validation_data():
            return
        ctx = self.ctx
        epoch, ctx.epoch = ctx.epoch, scheduler.epoch - 1  # it belongs to the epoch that ended
        try:
            self._validate_in_run()
        finally:
            ctx.epoch = epoch
        scheduler.poll_preemption()
        ctx.preempted = scheduler.sigterm_received

    # -- state and resume (nvtrain/state.py does the work) -----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a bitwise resume needs (weights, optimizers, counters, data position, RNG, hook
        states), as live references like ``nn.Module.state_dict()``."""
        from nvtrain.state import capture_state

        self._refuse_from_another_thread("state_dict()", "the state would mix the step in progress with the last")
        return capture_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: now once set up, else when it is (``setup()``, the first
        ``train_batch()`` or ``validate()``, or the next run's BEFORE_TRAINING)."""
        from nvtrain.state import load_state

        load_state(self, state, "TrainingStrategy.load_state_dict(state)")
        self._restore_pending = not self._is_set_up
        self._unfinished_epoch_end = None  # the loaded state's position replaces the one that work belonged to

    def restore(self, path: Any) -> None:
        """Restore the checkpoint at ``path``: once set up, through a registered hook's ``load_into`` (a
        sharded checkpoint reshards to this job's ranks there), else read by the installed
        nvtrain-checkpoint distribution."""
        from nvtrain.state import restore_checkpoint

        restore_checkpoint(self, path)
        self._restore_pending = not self._is_set_up
        self._unfinished_epoch_end = None

    @classmethod
    def load_checkpoint(
        cls, path: Any, hooks: Iterable[object] | None = None, *, trust: Iterable[str] = (), **overrides: Any
    ) -> TrainingStrategy:
        """A strategy restored from the checkpoint at ``path`` now: counters, models, optimizers, LR
        schedulers and hook states are readable on return; the data position applies at the next ``run()``.

        With the constructor's arguments (``models``, ``optimizers``, ``loss_fn``, ...) the
        strategy is built from them and ``hooks``. With none, a checkpoint written by
        ``nvtrain train`` is enough: models, optimizer, LR schedulers, loss and hooks are
        rebuilt from the run config saved in its manifest (``hooks`` are added to the
        config's; ``overrides`` replace constructor arguments), and the config's training
        loader is ``ctx.train_loader``. The config's import paths must lie in ``torch``,
        ``nvtrain``, an installed nvtrain plugin or a package named in ``trust``; any other
        is refused before anything is imported.
        """
        from nvtrain.errors import ResumeError
        from nvtrain.state import find_manifest_reader

        extra = tuple(hooks or ())
        required = ("models", "optimizers", "loss_fn")
        loader = None
        if any(name in overrides for name in required):
            missing = [name for name in required if name not in overrides]
            if missing:
                raise TypeError(
                    f"TrainingStrategy.load_checkpoint: given {[n for n in required if n in overrides]} but not "
                    f"{missing}; pass all of {list(required)}, or none to rebuild them from the checkpoint's run config"
                )
            strategy = cls(hooks=extra, **overrides)
        else:
            manifest = find_manifest_reader(extra)(path)
            run_config = manifest.get("run_config")
            if not isinstance(run_config, Mapping):
                raise ResumeError(
                    f"TrainingStrategy.load_checkpoint({str(path)!r}): missing the arguments models, optimizers and "
                    "loss_fn. The checkpoint was written from Python, not by `nvtrain train`: its manifest holds no "
                    "run_config, so nothing says how to build the models, optimizers and loss it restores. Pass "
                    "them (and lr_schedulers=, hooks=[...] as when it was saved): "
                    "load_checkpoint(path, hooks=[...], models=..., optimizers=..., loss_fn=...)"
                )
            from nvtrain.app import build_from_checkpoint

            built = build_from_checkpoint(
                run_config,
                f"checkpoint {str(path)!r}",
                trust=(trust,) if isinstance(trust, str) else tuple(trust),
                strategy_cls=cls,
                overrides=overrides,
                extra_hooks=extra,
            )
            strategy, loader = built.strategy, built.train_loader
        strategy.setup(loader)
        strategy.restore(path)
        return strategy

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every hook that holds resources (reverse registration order); re-raise the first failure.

        The last run's epoch iterator is let go too: a multi-worker loader's worker processes
        end now rather than whenever the garbage collector finds this strategy. A later
        ``run()`` reopens the epoch where the last one stopped.
        """
        try:
            self._release_run()
        finally:
            self.registry.close()

    def __enter__(self) -> TrainingStrategy:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self._release_run()
        finally:  # the hooks are closed whatever letting go of the run raised
            self.registry.close(exc)

    def _release_run(self) -> None:
        self._live_data.forget()
        self.ctx.release_step_graph()
        if isinstance(self.ctx.scheduler, StepScheduler):
            self.ctx.scheduler.release_data()


# -- helpers ------------------------------------------------------------------------------------


def _cut_by_preemption(scheduler: StepScheduler) -> bool:
    """The run ended because of a preemption signal and a resume would go on. Not when a stop request was
    agreed as well (the run is complete: a requeue would train past the stop) nor at the run's last step."""
    return scheduler.sigterm_received and scheduler.stop_reason is None and not scheduler.is_last_step


def _stop_reason(scheduler: StepScheduler) -> str | None:
    """Why the run stopped early: a stop request, else the preemption signal; None when it ran out (also when a
    stop was requested at its last step, or at the validation after it: that cut nothing short)."""
    if scheduler.stop_reason is not None:
        return None if scheduler.training_done else scheduler.stop_reason
    if _cut_by_preemption(scheduler):
        signum = scheduler.received_signal
        return f"preempted by {signal.Signals(signum).name}" if signum is not None else "preempted (another rank)"
    return None


def _local_batch_size(loader: Any) -> int:
    """Samples per micro-batch: what the loader says (:func:`~nvtrain.batching.loader_batch_size`), else 1."""
    return loader_batch_size(loader) or 1


def on_meta_device(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (its parameters or buffers hold no storage)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _split_pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    got = type(batch).__name__
    if isinstance(batch, (tuple, list)):
        got = f"a {got} of {len(batch)} item{'' if len(batch) == 1 else 's'}"
    raise TypeError(
        f"the default forward expects batches of (inputs, targets), got {got}; "
        "pass TrainingStrategy(forward_fn=...) for other batch shapes"
    )


def _over_the_same_data_set(previous: Any, loader: Any) -> bool:
    """Whether two loaders read one data set object (a DataLoader made again over it): only then does the
    last run's position and sample order mean the same samples in the new one."""
    dataset = getattr(previous, "dataset", None)
    return dataset is not None and dataset is getattr(loader, "dataset", None)


def _nothing_to_train(scheduler: StepScheduler) -> str:
    """What says a run() has nothing to train, naming the bound that ends it (the run stops at whichever of
    ``max_steps`` and ``num_epochs`` comes first: raising the other changes nothing)."""
    where = f"TrainingStrategy.run(): nothing to train, the run is already at step {scheduler.step}"
    if scheduler.max_steps is not None and scheduler.step >= scheduler.max_steps:
        return f"{where}, where max_steps={scheduler.max_steps} ends it; raise max_steps to train on"
    if scheduler.epoch_limit is not None and scheduler.epoch >= scheduler.epoch_limit:
        return (
            f"{where} (epoch {scheduler.epoch}), where num_epochs={scheduler.epoch_limit} ends it; raise num_epochs "
            "to train on (the run stops at whichever of max_steps and num_epochs comes first)"
        )
    return f"{where}: its data stream ended"


def _rank_and_world_size(manager: Any) -> tuple[int, int]:
    if manager is not None:
        try:
            return int(manager.rank), int(manager.world_size)
        except (AttributeError, TypeError, ValueError):
            raise TypeError(
                "TrainingStrategy.distributed_manager must be a DistributedManager, or an object with int rank and "
                f"world_size (got {type(manager).__name__})"
            ) from None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _checked_optimizer(name: str, optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``optimizers[name]``'s result, refused when it would train nothing of the model: a factory closing
    over another model (or one rebuilt since) steps parameters the run never uses."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"TrainingStrategy.optimizers[{name!r}] must build a torch.optim.Optimizer (got {type(optimizer).__name__})"
        )
    mine = {id(p) for p in model.parameters()}
    if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            f"TrainingStrategy.optimizers[{name!r}] built a {type(optimizer).__name__} over none of model {name!r}'s "
            "parameters, so the run would not train it; build the optimizer over the parameters the factory is "
            "given (they are the model's as SETUP left it, e.g. sharded or moved)"
        )
    return optimizer


def _checked_lr_scheduler(name: str, scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``lr_schedulers[name]``'s result, refused when stepping it would not set this optimizer's rate."""
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"TrainingStrategy.lr_schedulers[{name!r}] must build a learning-rate scheduler with a step() method "
            f"(got {type(scheduler).__name__})"
        )
    bound = getattr(scheduler, "optimizer", optimizer)
    if bound is not optimizer:
        raise ValueError(
            f"TrainingStrategy.lr_schedulers[{name!r}] built a {type(scheduler).__name__} bound to another optimizer "
            f"than optimizers[{name!r}]'s, so the run's learning rate would never change; build it over the "
            "optimizer the factory is given"
        )
    return scheduler

