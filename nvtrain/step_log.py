"""What the loggers read per logging step, with no host sync in between: the window's mean loss, the
smoothed loss, throughput and learning rates, validation summaries as floats, and the smoothing state a
checkpoint keeps so that a resumed run logs what the straight run does."""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nvtrain.batching import batch_size

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["RESERVED_METRIC_NAMES", "RESERVED_METRIC_PREFIXES", "StepLogReader"]

logger = logging.getLogger(__name__)

#: Names the loggers write themselves: a ``ctx.metrics`` entry of such a name is refused (it would overwrite
#: the column), as is one starting with :data:`RESERVED_METRIC_PREFIXES`.
RESERVED_METRIC_NAMES = frozenset({"step", "epoch", "train_loss", "train_loss_avg", "lr", "step_time", "samples_per_s"})
#: ``lr/<optimizer>``: the learning rate of another optimizer; ``val_``: a validation column.
RESERVED_METRIC_PREFIXES = ("lr/", "val_")


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
    #: The logger, as errors name it.
    owner: str = attrs.field(default="the logger", kw_only=True)
    #: ``ctx.metrics`` names this logger cannot write besides the reserved ones, with what they would
    #: overwrite (a TensorBoard tag).
    also_reserved: Mapping[str, str] = attrs.field(factory=dict, kw_only=True)
    _every: int = attrs.field(init=False, default=10)
    #: Finished logging windows, newest first: (mean loss, steps).
    _recent: collections.deque[tuple[float, int]] = attrs.field(init=False, factory=collections.deque)
    _loss_sum: torch.Tensor | None = None
    _loss_batches: int = 0
    #: Steps in the logging window the loss sum covers (the weight of its mean in ``train_loss_avg``).
    _window_steps: int = 0
    #: The step count the smoothing state describes (None: none); a run starting elsewhere starts it afresh.
    _at_step: int | None = None
    #: The last step of the log this reader has written or restored (None: none): a run starting at or before
    #: it continues that log; kept when a failed run abandons its smoothing window.
    _log_step: int | None = None
    _samples: int = 0
    #: Real steps in the open timing window (since the last training record).
    _steps: int = 0
    #: Micro-batches observed since the last training record (a diverged run's skipped ones too).
    _unrecorded: int = 0
    #: When the window's running stretch of training began (a validation pauses it; its time is not training).
    _clock: float | None = None
    #: Training seconds of the window before its latest validation, and its steps then.
    _banked: float = 0.0
    _banked_steps: int = 0
    #: When the last step ended, if ``run()`` validates right after it (``ctx.validation_follows``): the pause.
    _pause: float | None = None
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
        self._restart_window(time.perf_counter())
        self._last_step, self._ctx, self._unrecorded = None, ctx, 0

    def begin(self, ctx: TrainingContext) -> bool:
        """At the run's first BEFORE_EPOCH (a resume has been applied): keep the smoothing state only when it
        describes this step (restored from the checkpoint, or left by a previous ``run()`` that ended here).

        Returns whether the run continues this reader's log: it starts at or before a step the reader
        wrote or restored (a resume, a second ``run()``, a retry after a failure). A run that starts
        at ``start_step`` with nothing restored is a fresh one, whatever its step.
        """
        continues = self._log_step is not None and ctx.step_count <= self._log_step
        if self._at_step != ctx.step_count:
            self._recent.clear()
            self._loss_sum, self._loss_batches, self._window_steps = None, 0, 0
        self._at_step = self._log_step = ctx.step_count
        self._last_logged = ctx.step_count  # steps up to here belong to an earlier run
        self._ctx = ctx
        return continues

    def observe_batch(self, ctx: TrainingContext) -> dict[str, float] | None:
        """Add the micro-batch to the window (no host sync); a record on a logging step."""
        loss = ctx.loss
        if loss is not None:
            # float32: a bf16 or fp16 sum of a window's losses stops growing (bf16 near 1024)
            value = loss.detach().float()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_batches += 1
        self._samples += batch_size(ctx.batch)
        self._unrecorded += 1
        self._at_step, self._log_step, self._ctx = ctx.step_count, ctx.step_count, ctx
        if ctx.step_skipped:
            return None
        self._steps += 1
        self._window_steps += 1
        step = ctx.step_count
        self._last_step, self._last_epoch = step, ctx.epoch
        record = self._step_record(ctx, step)
        # the host clock (no device sync), read only before a validation: where its pause starts
        self._pause = time.perf_counter() if ctx.validation_follows else None
        return record

    def _step_record(self, ctx: TrainingContext, step: int) -> dict[str, float] | None:
        """The record of a real step on the logging cadence or the run's last step, else None."""
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

    def finish(self, *, strict: bool = True) -> dict[str, float] | None:
        """A record of the micro-batches observed since the last record (None when there are none).

        For a run that ended off the logging cadence where :meth:`observe_batch` could not
        tell (a stop at a validation, an exception). It is written at the run's last real
        step, so a diverged run whose skipped micro-batches followed a logging step logs them
        in a second record of that step (its NaN loss, its ``skipped_steps``). ``strict``: a
        reserved ``ctx.metrics`` name raises; otherwise (an exception is already on its way)
        it is left out.
        """
        ctx, step = self._ctx, self._last_step
        self._ctx = None
        if ctx is None or not self._unrecorded:
            return None
        epoch = self._last_epoch
        if step is None or ctx.step_count > step:
            # only skipped micro-batches, or a step this reader never saw end (a hook before it raised at
            # AFTER_OPTIMIZER_STEP or AFTER_BATCH): the step the run is at, not one already written
            step, epoch = ctx.step_count, ctx.epoch
        self._last_logged = step
        return self._read(ctx, step, epoch, close_window=False, strict=strict)

    def abandon(self) -> dict[str, float] | None:
        """:meth:`finish` for a run that ended by an exception; its open window is not continued later."""
        try:
            return self.finish(strict=False)
        finally:
            self._at_step = None

    def _read(
        self, ctx: TrainingContext, step: int, epoch: int, *, close_window: bool, strict: bool = True
    ) -> dict[str, float]:
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        device = self._loss_sum.device if self._loss_sum is not None else torch.device("cpu")
        if self._loss_sum is not None:
            names.append("train_loss")
            tensors.append(self._loss_sum.float() / self._loss_batches)
        refused = self._refused_metrics(ctx.metrics, step, strict=strict)
        for name, value in ctx.metrics.items():
            if name not in refused and isinstance(value, torch.Tensor) and value.numel() == 1:
                names.append(name)
                tensors.append(value.detach().reshape(()).to(device=device, dtype=torch.float32))
        values = torch.stack(tensors).tolist() if tensors else []  # the logging step's one host sync
        now = time.perf_counter()
        record: dict[str, float] = {"step": step, "epoch": epoch + 1}  # 1-based for people
        record.update(zip(names, values, strict=True))
        if "train_loss" in record and self._window_steps:
            record["train_loss_avg"] = self._average(record["train_loss"], self._window_steps, keep=close_window)
        record.update(_learning_rates(ctx))
        elapsed = self._training_seconds(now)
        if elapsed is not None and self._steps:
            record["step_time"] = elapsed / self._steps
            if elapsed > 0:
                record["samples_per_s"] = self._samples * ctx.world_size / elapsed
        if close_window:
            self._loss_sum, self._loss_batches, self._window_steps = None, 0, 0
        self._restart_window(now)
        self._unrecorded = 0
        return record

    def _refused_metrics(self, metrics: Mapping[str, Any], step: int, *, strict: bool) -> set[str]:
        """The ``ctx.metrics`` names that would overwrite what the logger writes itself: a ValueError naming
        the first (``strict``), else the names, left out (checked on logging steps only)."""
        refused = set()
        for name in metrics:
            clash = _reserved(name) or self.also_reserved.get(name)
            if clash is None:
                continue
            if strict:
                raise ValueError(
                    f"{self.owner}: ctx.metrics[{name!r}] (seen at the logging step {step}, set by a hook at "
                    f"this step or before) would overwrite {clash}; names {_RESERVED_TEXT} are the loggers' "
                    f"own: rename the metric, e.g. ctx.metrics[{'my_' + name!r}]"
                )
            refused.add(name)
        if refused:
            logger.warning("%s: left out ctx.metrics %s (reserved names)", self.owner, sorted(refused))
        return refused

    def _restart_window(self, now: float) -> None:
        """A new timing window: its clock runs from ``now``, with no steps or samples yet."""
        self._clock, self._samples, self._steps = now, 0, 0
        self._banked, self._banked_steps, self._pause = 0.0, 0, None

    def _training_seconds(self, now: float) -> float | None:
        """The window's training time: before its validations, plus the running stretch if a step ran in it."""
        if self._clock is None:
            return None
        running = now - self._clock if self._steps > self._banked_steps else 0.0
        return self._banked + running

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
        """``ctx.validation`` as ``val_<name>`` floats (one host transfer); inside a run the step clock pauses.

        Outside ``run()`` (a ``validate()`` after it) the row belongs to the epoch the run's last
        step was in, as an epoch-end validation inside the run records it.
        """
        summary = ctx.validation or {}
        names = [n for n, v in summary.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
        tensors = [summary[n].detach().reshape(()).float().cpu() for n in names]
        epoch = ctx.epoch if ctx.windowed else _ended_epoch(ctx)
        record: dict[str, float] = {"step": ctx.step_count, "epoch": epoch + 1}  # 1-based for people
        values = torch.stack(tensors).tolist() if tensors else []  # the one host transfer of a validation
        prefix = "val_ema_" if _validated_ema(ctx) else "val_"  # say which weights the numbers describe
        record.update(zip((f"{prefix}{n}" for n in names), values, strict=True))
        if ctx.windowed:
            self._pause_clock(time.perf_counter())
        return record

    def _pause_clock(self, now: float) -> None:
        """Validation time is not training time: bank the window's training up to the validation's start
        (the end of the step ``ctx.validation_follows`` announced it after) and run the clock again from now.

        A validation nobody announced (a hook calling ``validate()`` itself) has no known start: the
        window restarts after it, leaving the steps before it untimed. On CUDA, the steps' work still
        queued at the pause finishes during the validation.
        """
        if self._pause is None or self._clock is None:
            self._restart_window(now)
            return
        self._banked += self._pause - self._clock
        self._banked_steps, self._clock, self._pause = self._steps, now, None

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
        self._at_step = self._log_step = step
        self._recent = collections.deque(windows)
        if loss_sum is not None:
            loss_sum = loss_sum.float()  # a state saved before the sum was float32 may hold a bf16 or fp16 one
        self._loss_sum, self._loss_batches, self._window_steps = loss_sum, loss_batches, window_steps


_RESERVED_TEXT = ", ".join([*sorted(RESERVED_METRIC_NAMES), *(f"{prefix}..." for prefix in RESERVED_METRIC_PREFIXES)])


def _reserved(name: str) -> str | None:
    """What a ``ctx.metrics`` entry of this name would overwrite in every logger, or None."""
    if name in RESERVED_METRIC_NAMES:
        return f"the logged column {name!r}"
    if name.startswith("lr/"):
        return f"the logged learning rate of optimizer {name[3:]!r}"
    if name.startswith("val_"):
        return f"the validation column {name!r}"
    return None


def _ended_epoch(ctx: TrainingContext) -> int:
    """The 0-based epoch of the last run's last step: ``ctx.epoch`` names the next epoch once the run used
    an epoch's data up (the scheduler then stands at its start), else the epoch the run stopped in."""
    scheduler = ctx.scheduler
    if scheduler is not None and ctx.epoch > 0 and getattr(scheduler, "position", None) == 0:
        return ctx.epoch - 1
    return ctx.epoch


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
