"""What the loggers read per logging step, with no host sync in between: the window's mean loss, the
smoothed loss, throughput and learning rates, validation summaries as floats, and the smoothing state a
checkpoint keeps so that a resumed run logs what the straight run does."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nvtrain.batching import batch_size

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["StepLogReader"]


@attrs.define(slots=True)
class StepLogReader:
    """The per-step bookkeeping every logger needs, with no host sync between logging steps.

    :meth:`observe_batch` runs once per micro-batch; it returns a record (a dict of
    host floats) on logging steps and None otherwise. :meth:`read_validation`
    turns ``ctx.validation`` into ``val_*`` floats; :meth:`finish` reads what the
    run's last steps left unlogged.

    The smoothing state (the open window's loss sum and the finished windows
    ``train_loss_avg`` covers) is :meth:`state_dict`: the loggers save it in a
    checkpoint, so a resumed run smooths exactly as the straight run does. A record
    written at the run's end (:meth:`finish`, a last or preempted step off the
    cadence) reads the open window without closing it, for the same reason.
    """

    #: Logging cadence in optimizer steps; None: the step scheduler's ``log_remote_every_steps``
    #: (an experiment logger's cadence), 10 outside ``run()``.
    every: int | None
    #: Steps the smoothed loss (``train_loss_avg``) covers, counted in whole logging windows; the
    #: step scheduler's ``loss_average_window_steps`` replaces it at the start of a run.
    average_steps: int = 50
    _every: int = attrs.field(init=False, default=10)
    #: Finished logging windows, newest first: (mean loss, steps).
    _recent: collections.deque[tuple[float, int]] = attrs.field(init=False, factory=collections.deque)
    _loss_sum: torch.Tensor | None = None
    _loss_batches: int = 0
    #: Steps in the logging window the loss sum covers (the weight of its mean in ``train_loss_avg``).
    _window_steps: int = 0
    #: The step count the smoothing state describes (None: none); a run starting elsewhere starts it afresh.
    _at_step: int | None = None
    _samples: int = 0
    #: Steps since the clock started (a validation restarts it: its time is not training time).
    _steps: int = 0
    _clock: float | None = None
    _last_logged: int = -1
    #: The run's last real (not skipped) step and its 0-based epoch: where :meth:`finish` writes.
    _last_step: int | None = None
    _last_epoch: int = 0
    #: The run's context, for :meth:`finish` (``close()`` on the error path gets none).
    _ctx: TrainingContext | None = None

    def start(self, ctx: TrainingContext | None = None) -> None:
        """Begin a run: timing starts now; the cadences come from the run's step scheduler."""
        scheduler = ctx.scheduler if ctx is not None else None
        if scheduler is not None:
            self.average_steps = scheduler.loss_average_window_steps
        remote = getattr(scheduler, "log_remote_every_steps", None)
        self._every = self.every if self.every is not None else remote if remote is not None else 10
        self._clock = time.perf_counter()
        self._samples = self._steps = 0
        self._last_step, self._ctx = None, ctx

    def begin(self, ctx: TrainingContext) -> None:
        """At the run's first BEFORE_EPOCH (a resume has been applied): keep the smoothing state only when it
        describes this step (restored from the checkpoint, or left by a previous ``run()`` that ended here)."""
        if self._at_step != ctx.step_count:
            self._recent.clear()
            self._loss_sum, self._loss_batches, self._window_steps = None, 0, 0
        self._at_step = ctx.step_count
        self._last_logged = ctx.step_count  # steps up to here belong to an earlier run
        self._ctx = ctx

    def observe_batch(self, ctx: TrainingContext) -> dict[str, float] | None:
        loss = ctx.loss
        if loss is not None:
            value = loss.detach()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_batches += 1
        self._samples += batch_size(ctx.batch)
        self._at_step, self._ctx = ctx.step_count, ctx
        if ctx.step_skipped:
            return None
        self._steps += 1
        self._window_steps += 1
        step = ctx.step_count
        self._last_step, self._last_epoch = step, ctx.epoch
        if step == self._last_logged:
            return None
        if step % self._every == 0:
            self._last_logged = step
            return self._read(ctx, step, ctx.epoch, close_window=True)
        scheduler = ctx.scheduler if ctx.windowed and ctx.sync_gradients else None
        if scheduler is not None and (scheduler.is_last_step or ctx.preempted):  # the run's last step
            self._last_logged = step
            return self._read(ctx, step, ctx.epoch, close_window=False)
        return None

    def finish(self) -> dict[str, float] | None:
        """A record of the steps taken since the last logging step (None when there are none).

        For a run that ended off the logging cadence where :meth:`observe_batch` could not
        tell (a stop at a validation, an exception); never twice for one step.
        """
        ctx, step = self._ctx, self._last_step
        self._ctx = None
        if ctx is None or step is None or step == self._last_logged:
            return None
        self._last_logged = step
        return self._read(ctx, step, self._last_epoch, close_window=False)

    def abandon(self) -> dict[str, float] | None:
        """:meth:`finish` for a run that ended by an exception; its open window is not continued later."""
        try:
            return self.finish()
        finally:
            self._at_step = None

    def _read(self, ctx: TrainingContext, step: int, epoch: int, *, close_window: bool) -> dict[str, float]:
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        device = self._loss_sum.device if self._loss_sum is not None else torch.device("cpu")
        if self._loss_sum is not None:
            names.append("train_loss")
            tensors.append(self._loss_sum.float() / self._loss_batches)
        for name, value in ctx.metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                names.append(name)
                tensors.append(value.detach().reshape(()).to(device=device, dtype=torch.float32))
        values = torch.stack(tensors).tolist() if tensors else []  # the logging step's one host sync
        now = time.perf_counter()
        record: dict[str, float] = {"step": step, "epoch": epoch + 1}  # 1-based for people
        record.update(zip(names, values, strict=True))
        if "train_loss" in record and self._window_steps:
            record["train_loss_avg"] = self._average(record["train_loss"], self._window_steps, keep=close_window)
        record.update(_learning_rates(ctx))
        if self._clock is not None and self._steps:
            elapsed = now - self._clock
            record["step_time"] = elapsed / self._steps
            if elapsed > 0:
                record["samples_per_s"] = self._samples * ctx.world_size / elapsed
        if close_window:
            self._loss_sum, self._loss_batches, self._window_steps = None, 0, 0
        self._clock, self._samples, self._steps = now, 0, 0
        return record

    def _average(self, window_mean: float, steps: int, *, keep: bool) -> float:
        """The mean loss over the newest logging windows that cover ``average_steps`` steps.

        ``keep``: the window is closed, and joins the history later windows are smoothed with.
        """
        total = weighted = 0.0
        kept = 0
        for mean, count in itertools.chain(((window_mean, steps),), self._recent):
            kept += 1
            total += count
            weighted += mean * count
            if total >= self.average_steps:
                break
        if keep:
            recent = self._recent
            recent.appendleft((window_mean, steps))
            while len(recent) > kept:
                recent.pop()
        return weighted / total

    def read_validation(self, ctx: TrainingContext) -> dict[str, float]:
        """``ctx.validation`` as ``val_<name>`` floats (one host transfer); restarts the step clock."""
        summary = ctx.validation or {}
        names = [n for n, v in summary.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
        tensors = [summary[n].detach().reshape(()).float().cpu() for n in names]
        record: dict[str, float] = {"step": ctx.step_count, "epoch": ctx.epoch + 1}  # 1-based for people
        values = torch.stack(tensors).tolist() if tensors else []  # the one host transfer of a validation
        prefix = "val_ema_" if _validated_ema(ctx) else "val_"  # say which weights the numbers describe
        record.update(zip((f"{prefix}{n}" for n in names), values, strict=True))
        # Validation time is not training time: the next window starts now.
        self._clock, self._samples, self._steps = time.perf_counter(), 0, 0
        return record

    def state_dict(self) -> dict[str, Any]:
        """The smoothing state at the step it describes; the loss sum stays a tensor (no host sync here)."""
        return {
            "step": self._at_step,
            "recent": [[mean, steps] for mean, steps in self._recent],
            "loss_sum": self._loss_sum,
            "loss_batches": self._loss_batches,
            "window_steps": self._window_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a :meth:`state_dict`; the next run continues it when it starts at that state's step."""
        try:
            step, recent, loss_sum = state["step"], state["recent"], state["loss_sum"]
            loss_batches, window_steps = int(state["loss_batches"]), int(state["window_steps"])
            windows = [(float(mean), int(steps)) for mean, steps in recent]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a logger's smoothing state ({type(err).__name__}: {err})") from None
        if not (step is None or isinstance(step, int)) or not (loss_sum is None or isinstance(loss_sum, torch.Tensor)):
            raise ValueError(f"not a logger's smoothing state (step {step!r}, loss_sum {type(loss_sum).__name__})")
        self._at_step = step
        self._recent = collections.deque(windows)
        self._loss_sum, self._loss_batches, self._window_steps = loss_sum, loss_batches, window_steps


def _learning_rates(ctx: TrainingContext) -> dict[str, float]:
    rates: dict[str, float] = {}
    for index, (name, optimizer) in enumerate(ctx.optimizers.items()):
        lr = optimizer.param_groups[0].get("lr")
        if lr is None:
            continue
        rates["lr" if index == 0 else f"lr/{name}"] = float(lr)
    return rates


def _validated_ema(ctx: TrainingContext) -> bool:
    """Whether the strategy validates the EMA weights (``ValidationConfig.use_ema``)."""
    validation = getattr(ctx.strategy, "validation", None)
    return bool(getattr(validation, "use_ema", False))
