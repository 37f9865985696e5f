"""Property: when ``TrainingStrategy.run()`` validates and when its step is a checkpoint step, as documented.

``expected()`` below is written from the text of docs/step-scheduler.md ("When training stops", "Cadences",
"Preemption"), docs/run-control.md ("Stopping a run from a hook") and docs/cli.md ("When a run validates"),
not from the code. The test draws a loader length, an accumulation window (through
``StepSchedulerConfig(global_batch_size=...)`` or a ``GradientAccumulationHook``), the run bounds, the
scheduler's and ``ValidationConfig``'s cadences, whether a checkpoint-writing hook is registered, and an event
(none, a stop request, a preemption signal agreed at a step's boundary, or a signal sent after it), runs a tiny
model and compares:

- the ``ctx.step_count`` of every AFTER_VALIDATION, in order;
- the steps whose AFTER_BATCH sees ``scheduler.is_ckpt_step``;
- ``scheduler.validation_owed`` (and the same key of ``scheduler.state_dict()``);
- the step the run ended at, ``RunResult.preempted``, and ``scheduler.validate_on_checkpoint``.
"""

from __future__ import annotations

import functools
import math
import os
import signal
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import nvtrain
from nvtrain.hooks import GradientAccumulationHook
from nvtrain.step_scheduler import StepSchedulerConfig
from nvtrain.validation import ValidationConfig

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")

#: The preemption signal of these runs (SIGTERM and SIGINT belong to the test runner).
PREEMPTION_SIGNAL = "SIGUSR1"

#: Events: a stop request at AFTER_OPTIMIZER_STEP of step ``at``; a signal sent during step ``at`` (at the
#: BEFORE_BATCH of its first micro-batch), so that step's boundary agrees it; a signal sent at
#: AFTER_OPTIMIZER_STEP of step ``at``, after that step's boundary polled.
EVENTS = ("none", "stop", "preempt_during", "preempt_after")


@dataclass(frozen=True)
class Case:
    batches: int  # micro-batches per epoch (len of the loader)
    window: int  # micro-batches per optimizer step
    via_hook: bool  # the window from GradientAccumulationHook(steps=window), else from global_batch_size
    num_epochs: int | None
    max_steps: int | None
    ckpt_every_steps: int | None
    save_checkpoint_every_epoch: bool
    validate_on_checkpoint: bool
    val_every_steps: int | None
    every_n_epochs: int | None
    every_n_steps: int | None
    saver: bool  # a hook that writes checkpoints (has ``last_saved``) is registered
    event: str
    at: int  # the event's step (1-based ``step_count``); unused for "none"

    @property
    def epoch_len(self) -> int:
        return math.ceil(self.batches / self.window)

    @property
    def total_steps(self) -> int:
        """The run's length without an event ("When training stops": the first bound reached)."""
        num_epochs = self.num_epochs
        if num_epochs is None and self.max_steps is None:
            num_epochs = 1  # None, None: one epoch
        bounds = [b for b in (self.max_steps, None if num_epochs is None else num_epochs * self.epoch_len) if b]
        return min(bounds)


@dataclass(frozen=True)
class Outcome:
    validated: list[int]  # step_count at each AFTER_VALIDATION, in order
    ckpt_steps: list[int]  # steps whose AFTER_BATCH saw is_ckpt_step
    owed: bool  # scheduler.validation_owed after the run
    last_step: int  # the step the run ended at
    preempted: bool  # RunResult.preempted


def expected(case: Case) -> Outcome:
    """The documented decisions, step by step."""
    epoch_len, total = case.epoch_len, case.total_steps
    max_steps = case.max_steps
    # cli.md / step-scheduler.md: validate_on_checkpoint applies only when a registered plugin writes checkpoints.
    on_checkpoint = case.validate_on_checkpoint and case.saver

    def fires(every: int | None, step: int) -> bool:  # "scheduler.step % every == 0"
        return every is not None and step % every == 0

    def epoch_cadence(epoch_number: int) -> bool:  # every_n_epochs counts completed epochs (from 1)
        return case.every_n_epochs is not None and epoch_number % case.every_n_epochs == 0

    def step_validates(step: int, *, last: bool, agreed: bool) -> bool:
        """``is_val_step`` at ``step``."""
        # The step cadences (val_every_steps, ValidationConfig.every_n_steps), and with validate_on_checkpoint
        # "a ckpt_every_steps step always".
        if fires(case.val_every_steps, step) or fires(case.every_n_steps, step):
            return True
        if not on_checkpoint:
            return False
        if fires(case.ckpt_every_steps, step):
            return True
        epoch_end = step % epoch_len == 0
        # "an epoch's end, and the run's last step when it ends the run's epochs, its max_steps or an epoch
        # (a stop request at an epoch's last step), unless a preemption was agreed there."
        checkpoint = (case.save_checkpoint_every_epoch and epoch_end) or (last and (epoch_end or step == max_steps))
        if not checkpoint:
            return False
        # "unless a preemption agreed there cuts the run short (at the run's own last step it does not: that
        # step validates)"
        return not agreed or step == total

    event, at = case.event, case.at
    agreed_at: int | None = at if event == "preempt_during" else None
    late_at: int | None = None  # a signal agreed after the step's own work (validation or epoch end)
    if event == "preempt_after" and at < total:
        # "the boundary is right after DO_OPTIMIZER_STEP", so a signal sent at AFTER_OPTIMIZER_STEP missed
        # step `at`'s poll. The next polls: "right after the validation" (a signal during validation is polled
        # right after it; the handler only records the signal), "before the next epoch" (after epoch-end work),
        # else the next step boundary. (At the run's last step: "A signal that arrives after the last step's
        # boundary is not acted on (the run is complete)".)
        validated_step = step_validates(at, last=False, agreed=False)
        if validated_step or at % epoch_len == 0:
            late_at = at
        else:
            agreed_at = at + 1

    validated: list[int] = []
    ckpt_steps: list[int] = []
    owed = False
    preempted = False
    for step in range(1, total + 1):
        epoch_end = step % epoch_len == 0
        epoch_number = (step - 1) // epoch_len + 1
        natural_last = step == total
        stopped = event == "stop" and step == at
        agreed = agreed_at == step
        last = natural_last or stopped  # single process: "the step during which it was asked is always the last"
        # "is_ckpt_step is also true at the end of every epoch (save_checkpoint_every_epoch), on the last step,
        # and once preemption was agreed" (a stop request's step: "is_last_step and is_ckpt_step are true").
        if fires(case.ckpt_every_steps, step) or (case.save_checkpoint_every_epoch and epoch_end) or last or agreed:
            ckpt_steps.append(step)
        here = step_validates(step, last=last, agreed=agreed)
        if epoch_end:
            # "The epoch-end validation ... is skipped when the epoch's last step was just validated."
            # "A preemption agreed at the last step of an epoch whose end validates (the epoch cadence
            # every_n_epochs, or validate_on_checkpoint with save_checkpoint_every_epoch) saves without that
            # validation and marks it owed ... At the run's last step there is nothing to resume: that
            # validation runs before the save". A stop request at an epoch's last step cuts nothing short.
            ends_validating = epoch_cadence(epoch_number) or (on_checkpoint and case.save_checkpoint_every_epoch)
            if not here and ends_validating:
                if agreed and not natural_last:
                    owed = True
                else:
                    here = True
        elif natural_last and step == max_steps and epoch_cadence(epoch_number):
            # "The run's last step is validated when max_steps ends the run inside an epoch that the epoch
            # cadence would validate at its end" (also when preempted there: "nor does a preemption there before
            # the run's last step"). Not a stop request's step (excluded above) nor a preemption's before it.
            here = True
        if here:
            validated.append(step)
        if agreed or late_at == step:
            # "preempted means cut short: a resume goes on", so False "when the preemption came at the run's
            # last step (nothing is left to resume)".
            preempted = not natural_last
            return Outcome(validated, ckpt_steps, owed, step, preempted)
        if stopped:
            return Outcome(validated, ckpt_steps, owed, step, False)
    return Outcome(validated, ckpt_steps, owed, total, preempted)


# -- the run ----------------------------------------------------------------------------------------


class Watch:
    """Records validations, checkpoint steps and the end of the run; makes the case's event happen."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.validated: list[int] = []
        self.ckpt_steps: list[int] = []
        self.end: tuple[bool, bool] | None = None  # (ctx.preempted, is_ckpt_step) at AFTER_TRAINING

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        case = self.case
        if case.event == "preempt_during" and ctx.window_position == 0 and ctx.step_count == case.at - 1:
            os.kill(os.getpid(), getattr(signal, PREEMPTION_SIGNAL))

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        case = self.case
        if ctx.sync_gradients and ctx.step_count == case.at:
            if case.event == "stop":
                ctx.request_stop(f"stop at {case.at}")
            elif case.event == "preempt_after":
                os.kill(os.getpid(), getattr(signal, PREEMPTION_SIGNAL))

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.sync_gradients and ctx.scheduler.is_ckpt_step:
            self.ckpt_steps.append(ctx.step_count)

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.validated.append(ctx.step_count)

    @nvtrain.hookimpl
    def after_training(self, ctx: nvtrain.TrainingContext) -> None:
        self.end = (ctx.preempted, ctx.scheduler.is_ckpt_step)


class Saver:
    """Stands for a checkpoint plugin: ``last_saved`` (the SavesCheckpoints protocol) and a marked hook."""

    last_saved = None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        pass


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(count)
    return [(torch.randn(1, 2, generator=generator), torch.randn(1, 1, generator=generator)) for _ in range(count)]


VALIDATION_DATA = batches(1)


def run(case: Case) -> tuple[Watch, nvtrain.RunResult, nvtrain.StepScheduler]:
    watch = Watch(case)
    hooks: list[object] = [watch]
    if case.saver:
        hooks.append(Saver())
    if case.via_hook and case.window > 1:
        hooks.append(GradientAccumulationHook(steps=case.window))
    config = StepSchedulerConfig(
        global_batch_size=None if case.via_hook else case.window,  # batches of 1 sample: window micro-batches
        ckpt_every_steps=case.ckpt_every_steps,
        save_checkpoint_every_epoch=case.save_checkpoint_every_epoch,
        validate_on_checkpoint=case.validate_on_checkpoint,
        val_every_steps=case.val_every_steps,
        preemption_signal=PREEMPTION_SIGNAL,
    )
    validation = ValidationConfig(
        data=VALIDATION_DATA, every_n_epochs=case.every_n_epochs, every_n_steps=case.every_n_steps
    )
    torch.manual_seed(0)
    with nvtrain.TrainingStrategy(
        models=torch.nn.Linear(2, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        hooks=hooks,
        num_epochs=case.num_epochs,
        max_steps=case.max_steps,
        validation=validation,
        step_scheduler=config,
    ) as strategy:
        result = strategy.run(batches(case.batches))
        scheduler = strategy.ctx.scheduler
    assert isinstance(scheduler, nvtrain.StepScheduler)
    return watch, result, scheduler


# -- the property -----------------------------------------------------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> Case:
    optional = functools.partial(st.one_of, st.none())
    fields: dict[str, Any] = {
        "batches": draw(st.integers(1, 6)),
        "window": draw(st.integers(1, 3)),
        "via_hook": draw(st.booleans()),
        "num_epochs": draw(optional(st.integers(1, 3))),
        "max_steps": draw(optional(st.integers(1, 10))),
        "ckpt_every_steps": draw(optional(st.integers(1, 4))),
        "save_checkpoint_every_epoch": draw(st.booleans()),
        "validate_on_checkpoint": draw(st.booleans()),
        "val_every_steps": draw(optional(st.integers(1, 3))),
        "every_n_epochs": draw(st.sampled_from([None, 1, 2])),
        "every_n_steps": draw(optional(st.integers(1, 3))),
        "saver": draw(st.booleans()),
        "event": draw(st.sampled_from(EVENTS)),
        "at": 0,
    }
    case = Case(**fields)
    if case.event != "none":
        case = Case(**{**fields, "at": draw(st.integers(1, case.total_steps))})
    return case


def _case(**changes: Any) -> Case:
    base: dict[str, Any] = {
        "batches": 4,
        "window": 2,
        "via_hook": False,
        "num_epochs": 3,
        "max_steps": None,
        "ckpt_every_steps": None,
        "save_checkpoint_every_epoch": True,
        "validate_on_checkpoint": True,
        "val_every_steps": None,
        "every_n_epochs": 1,
        "every_n_steps": None,
        "saver": False,
        "event": "none",
        "at": 0,
    }
    return Case(**{**base, **changes})


# cadences longer than a drawn run are part of the sweep: that they warn is tested in test_validation_cadence.py
@pytest.mark.filterwarnings("ignore:TrainingStrategy.validation. the run never validates:RuntimeWarning")
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
# a preemption at an epoch's last step owes that epoch's validation to the resumed run
@example(case=_case(event="preempt_during", at=2))
@example(case=_case(event="preempt_during", at=2, every_n_epochs=None, saver=True))
# ... but not at the run's last step, nor when a step cadence validated that step
@example(case=_case(event="preempt_during", at=6))
@example(case=_case(event="preempt_during", at=2, val_every_steps=2))
# a signal after the boundary: polled after the step's validation, before the next epoch, or at the next step
@example(case=_case(event="preempt_after", at=2))
@example(case=_case(event="preempt_after", at=3, every_n_steps=3))
@example(case=_case(event="preempt_after", at=3))
# max_steps inside an epoch under the epoch cadence; a stop request inside an epoch and at its end
@example(case=_case(max_steps=3))
@example(case=_case(max_steps=3, every_n_epochs=2))
@example(case=_case(event="stop", at=3))
@example(case=_case(event="stop", at=4, every_n_epochs=2, saver=True))
# a stop request at the max_steps step inside an epoch; a preemption at the run's own last step
@example(case=_case(event="stop", at=3, max_steps=3))
@example(case=_case(event="preempt_during", at=3, max_steps=3, saver=True))
@example(case=_case(event="preempt_during", at=6, every_n_epochs=None, saver=True, save_checkpoint_every_epoch=False))
def test_run_validates_and_checkpoints_as_documented(case: Case) -> None:
    want = expected(case)
    watch, result, scheduler = run(case)
    got = Outcome(
        validated=watch.validated,
        ckpt_steps=watch.ckpt_steps,
        owed=scheduler.validation_owed,
        last_step=result.step_count,
        preempted=result.preempted,
    )
    assert got == want, f"{case}\n  docs: {want}\n  run:  {got}"
    assert scheduler.state_dict()["validation_owed"] is want.owed
    assert scheduler.validate_on_checkpoint is (case.validate_on_checkpoint and case.saver)
    # "ctx.preempted is True before AFTER_TRAINING, and the state describes the last completed step
    # (is_ckpt_step is True), so a checkpoint hook can save it there."
    assert watch.end is not None and watch.end[0] is want.preempted
    if want.preempted:
        assert watch.end[1], f"{case}: is_ckpt_step is False at AFTER_TRAINING of a preempted run"
