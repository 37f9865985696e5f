"""Progress bar, CSV and TensorBoard logging: observer plugins that read tensors only on logging steps.

All three share one rule: on the per-batch path they only add the detached loss
tensor to a running sum (no host sync). Every ``log_every_n_steps`` completed
optimizer steps they read the window's mean loss and the scalar tensors in
``ctx.metrics`` to the host in one transfer, and only then take the wall clock,
so on CUDA the step time covers finished work (the read is the sync). Step time
and samples/s are measured over the steps since the previous logging step;
validation time is left out. Each hook is active on rank 0 only.

They are ordinary plugins, usable from Python::

    strategy = nvtrain.TrainingStrategy(..., hooks=[ProgressBarHook(), CSVLoggerHook("runs/x/metrics.csv")])
"""

from __future__ import annotations

import collections
import csv
import itertools
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

import attrs
import torch

from nvtrain.batching import batch_size
from nvtrain.errors import naming_file
from nvtrain.hookspecs import hookimpl
from nvtrain.validators import int_at_least, optional_int_at_least, optional_non_empty_str, satisfies

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["CSVLoggerHook", "ProgressBarHook", "StepLogReader", "TensorBoardHook", "estimate_total_steps"]

logger = logging.getLogger(__name__)

#: Columns every ``metrics.csv`` starts with; other columns (validation metrics,
#: ``ctx.metrics`` entries) follow in the order they first appear.
CSV_COLUMNS: tuple[str, ...] = (
    "step",
    "epoch",
    "train_loss",
    "train_loss_avg",
    "lr",
    "val_loss",
    "val_accuracy",
    "step_time",
    "samples_per_s",
)

#: Observers run after the default-priority hooks at the same stage.
LOGGING_PRIORITY = 90

#: ProgressBarHook.refresh_interval: seconds between redraws.
_seconds_above_zero = satisfies(
    "a number of seconds > 0", lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and not v <= 0
)


def estimate_total_steps(ctx: TrainingContext) -> int | None:
    """Optimizer steps the current run will reach (absolute), or None when unknown.

    The step scheduler's ``total_steps`` (the one owner of the run length) when the
    run has one, else the strategy's ``max_steps`` / ``num_epochs`` and ``len(ctx.train_loader)``.
    """
    scheduler = ctx.scheduler
    if scheduler is not None:
        return scheduler.total_steps  # type: ignore[no-any-return]
    strategy = ctx.strategy
    max_steps = getattr(strategy, "max_steps", None)
    num_epochs = getattr(strategy, "num_epochs", None)
    if num_epochs is None and max_steps is None:
        num_epochs = 1
    try:
        epoch_len: int | None = len(ctx.train_loader)
    except (TypeError, NotImplementedError):
        epoch_len = None
    by_epochs = num_epochs * epoch_len if num_epochs is not None and epoch_len is not None else None
    candidates = [n for n in (max_steps, by_epochs) if n is not None]
    return min(candidates) if candidates else None


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


def _format(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return str(int(value))
    return f"{value:.6g}"


# -- progress ------------------------------------------------------------------------------------


@attrs.define(eq=False)
class ProgressBarHook:
    """A tqdm bar (epoch, step, smoothed loss, samples/s) on a terminal; log lines otherwise.

    The bar advances once per optimizer step (host counters only) and redraws at
    most every ``refresh_interval`` seconds; loss and throughput are refreshed on
    logging steps. When ``stream`` is not a terminal (a batch job's log file) it
    writes one line per logging step and one per validation instead. The shown
    loss is ``train_loss_avg``: the mean over the last ``loss_average_window_steps``
    steps of the step scheduler (in whole logging windows). The steps after the
    last logging step are shown when the run ends, also by an exception.
    """

    plugin_name: ClassVar[str] = "progress_bar"

    log_every_n_steps: int = attrs.field(default=10, validator=int_at_least(1))
    refresh_interval: float = attrs.field(default=0.5, validator=_seconds_above_zero)
    #: Where to draw; default ``sys.stderr`` at the time the run starts.
    stream: TextIO | None = None
    #: Force the bar (True) or log lines (False); None: a bar only on a terminal.
    use_bar: bool | None = None
    #: Width of the bar in columns; None follows the terminal (resizes included).
    ncols: int | None = None
    priority: int = LOGGING_PRIORITY
    #: Tells two bars apart in a checkpoint (their smoothing state); None for the only one.
    state_key: str | None = attrs.field(default=None, validator=optional_non_empty_str())

    _reader: StepLogReader = attrs.field(init=False)
    _bar: Any = attrs.field(init=False, default=None)
    _out: TextIO | None = attrs.field(init=False, default=None)
    _active: bool = attrs.field(init=False, default=False)
    _started: bool = attrs.field(init=False, default=False)
    #: Between BEFORE_TRAINING and AFTER_TRAINING: a close() now is a run ended by an exception.
    _running: bool = attrs.field(init=False, default=False)
    _total: int | None = attrs.field(init=False, default=None)
    _epochs: int | None = attrs.field(init=False, default=None)
    _postfix: dict[str, str] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._reader = StepLogReader(self.log_every_n_steps)

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        if self._running:  # the last run ended by an exception and nobody closed the strategy
            self.close()  # shows its unlogged steps; its open window is not continued
        self._active = ctx.rank == 0
        self._started = False
        self._running = True
        self._reader.start(ctx)

    @hookimpl
    def before_epoch(self, ctx: TrainingContext) -> None:
        if not self._active:
            return
        self._begin(ctx)
        if self._bar is not None:
            self._bar.set_description(_epoch_label(ctx), refresh=False)

    def _begin(self, ctx: TrainingContext) -> None:
        """At the run's first epoch, or a validation before it (one a preemption left owed): a resume has
        been applied by then."""
        if not self._started:
            self._started = True
            self._reader.begin(ctx)
            self._open_bar(ctx)

    def _open_bar(self, ctx: TrainingContext) -> None:
        self._out = self.stream if self.stream is not None else sys.stderr
        self._total = estimate_total_steps(ctx)
        epochs = getattr(ctx.scheduler, "num_epochs", None) if ctx.scheduler is not None else None
        self._epochs = epochs if isinstance(epochs, int) else None
        use_bar = self.use_bar if self.use_bar is not None else _is_terminal(self._out)
        if not use_bar:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError as err:
            raise ImportError("ProgressBarHook needs tqdm: pip install 'nvtrain[cli]'") from err
        self._bar = tqdm(
            total=self._total,
            initial=ctx.step_count,
            unit="step",
            file=self._out,
            mininterval=self.refresh_interval,
            dynamic_ncols=self.ncols is None,
            ncols=self.ncols,
            leave=True,
            # No it/s rate (samples/s is in the postfix) and a short postfix: the bar keeps its width at 80 columns.
            bar_format=_BAR_FORMAT if self._total is not None else None,
        )

    @hookimpl
    def after_batch(self, ctx: TrainingContext) -> None:
        if not self._active:
            return
        record = self._reader.observe_batch(ctx)
        if self._out is None:
            return
        if self._bar is not None and not ctx.step_skipped:
            self._bar.update(1)
        if record is not None:
            self._show(record, refresh=False)

    def _show(self, record: dict[str, float], *, refresh: bool) -> None:
        """A training record: the bar's loss and samples/s, or a log line."""
        smoothed = record.get("train_loss_avg")
        if self._bar is not None:
            if smoothed is not None:
                self._postfix["loss"] = f"{smoothed:.4g}"
            if "samples_per_s" in record:
                self._postfix["samples/s"] = f"{record['samples_per_s']:.0f}"
            self._bar.set_postfix_str(self._postfix_text(), refresh=refresh)
        elif self._out is not None:
            self._line(record, smoothed=smoothed)

    @hookimpl
    def after_validation(self, ctx: TrainingContext) -> None:
        if not self._active:
            return
        self._begin(ctx)
        record = self._reader.read_validation(ctx)
        if self._out is None:
            return
        if self._bar is not None:
            for key, value in record.items():
                if key.startswith("val_"):
                    self._postfix[key] = f"{value:.4g}"
            self._bar.set_postfix_str(self._postfix_text(), refresh=True)
        else:
            self._line(record, smoothed=None)

    @hookimpl
    def after_training(self, ctx: TrainingContext) -> None:
        """Show the steps since the last logging step (a run stopped at a validation), then finish the bar."""
        self._running = False
        try:
            record = self._reader.finish()
            if record is not None and self._active:
                self._show(record, refresh=True)
        finally:
            self.close()

    def _line(self, record: dict[str, float], smoothed: float | None) -> None:
        total = f"/{self._total}" if self._total is not None else ""
        epochs = f"/{self._epochs}" if self._epochs is not None else ""
        parts = [f"epoch {int(record['epoch'])}{epochs}", f"step {int(record['step'])}{total}"]
        if smoothed is not None:
            parts.append(f"loss {smoothed:.4g}")
        for key, value in record.items():
            if key in ("step", "epoch", "train_loss", "train_loss_avg"):
                continue
            parts.append(f"{key} {value:.4g}")
        assert self._out is not None
        print("  ".join(parts), file=self._out, flush=True)

    def _postfix_text(self) -> str:
        """The postfix entries that fit beside a bar of at least ``_BAR_MIN`` characters, in order; one that
        does not fit is left out (a shorter one after it may still fit)."""
        width = self.ncols
        if width is None and self._bar is not None:
            width = getattr(self._bar, "ncols", None)
        if width is None:
            width = shutil.get_terminal_size((80, 24)).columns
        budget = max(0, width - _BAR_FIXED - len(_epoch_label_text(self._bar)) - _BAR_MIN)
        text = ""
        for item in _postfix_items(self._postfix):
            candidate = f"{text} {item}" if text else item
            if len(candidate) <= budget:
                text = candidate
        return text

    def close(self) -> None:
        """Finish the bar (idempotent); for a run ended by an exception, show its unlogged last steps first."""
        try:
            if self._running:
                self._running = False
                record = self._reader.abandon()
                if record is not None and self._active:
                    self._show(record, refresh=True)
        finally:
            bar, self._bar = self._bar, None
            if bar is not None:
                bar.close()

    def state_dict(self) -> dict[str, Any]:
        """The smoothed loss's state, so a resumed run's bar shows what the straight run's does."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_reader_state(self._reader, state, self, self.state_key)


_BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}"
#: Columns the bar's fixed parts take with a 4-digit step count; the rest is shared by bar and postfix.
_BAR_FIXED = 34
_BAR_MIN = 8


def _epoch_label(ctx: TrainingContext) -> str:
    """``epoch 3/15``: 1-based, like every epoch a person reads (``ctx.epoch`` is the 0-based index)."""
    scheduler = ctx.scheduler
    total = getattr(scheduler, "num_epochs", None) if scheduler is not None else None
    return f"epoch {ctx.epoch + 1}" + (f"/{total}" if isinstance(total, int) else "")


def _validated_ema(ctx: TrainingContext) -> bool:
    """Whether the strategy validates the EMA weights (``ValidationConfig.use_ema``)."""
    validation = getattr(ctx.strategy, "validation", None)
    return bool(getattr(validation, "use_ema", False))


def _postfix_items(postfix: Mapping[str, str]) -> list[str]:
    """The bar's postfix entries, most useful first: loss, samples/s, then validation values (metrics
    before the loss); names shortened (``val_accuracy`` -> ``val_acc``)."""
    first = {"loss": 0, "samples/s": 1}
    order = sorted(postfix, key=lambda key: (first.get(key, 2), key.endswith("_loss")))
    short = {"accuracy": "acc"}
    items = []
    for key in order:
        name = key
        for long, brief in short.items():
            name = name.replace(long, brief)
        items.append(f"{name} {postfix[key]}")
    return items


def _epoch_label_text(bar: Any) -> str:
    return str(getattr(bar, "desc", "") or "")


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed or detached stream
        return False


# -- step-record loggers ---------------------------------------------------------------------------


class _StepRecordLogger:
    """The observer side shared by the file loggers: rank 0 writes a record per logging step and validation.

    A subclass is an attrs class with the fields ``_reader`` (a :class:`StepLogReader`),
    ``_active``, ``_running``, ``_start_step`` and ``state_key``; it writes a record in
    ``_write`` and releases its file in ``_release``. ``_start_step`` is the step count
    at the first BEFORE_EPOCH, so after a resume it is the step the run resumed from
    (0 for a fresh run). The steps after the last logging step are written when the
    run ends (AFTER_TRAINING, or ``close()`` after an exception). The smoothing state
    is the hook's checkpoint state (``state_dict``).
    """

    __slots__ = ("_active", "_reader", "_running", "_start_step")

    _reader: StepLogReader
    _active: bool
    #: Between BEFORE_TRAINING and AFTER_TRAINING: a close() now is a run ended by an exception.
    _running: bool
    _start_step: int | None
    state_key: str | None

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        if self._running:  # the last run ended by an exception and nobody closed the strategy
            self.close()  # writes its unlogged steps; its open window is not continued
        self._active = ctx.rank == 0
        self._running = True
        self._start_step = None
        self._reader.start(ctx)

    @hookimpl
    def before_epoch(self, ctx: TrainingContext) -> None:
        self._begin(ctx)

    def _begin(self, ctx: TrainingContext) -> None:
        """At the run's first epoch, or a validation before it (one a preemption left owed): a resume has
        been applied by then, so the start step is known."""
        if self._active and self._start_step is None:
            self._start_step = ctx.step_count
            self._reader.begin(ctx)

    @hookimpl
    def after_batch(self, ctx: TrainingContext) -> None:
        if self._active:
            record = self._reader.observe_batch(ctx)
            if record is not None:
                self._write(record)

    @hookimpl
    def after_validation(self, ctx: TrainingContext) -> None:
        if self._active:
            self._begin(ctx)
            self._write(self._reader.read_validation(ctx))

    @hookimpl
    def after_training(self, ctx: TrainingContext) -> None:
        """Write the steps since the last logging step (a run stopped at a validation), then release the file."""
        self._running = False
        try:
            record = self._reader.finish()
            if record is not None and self._active:
                self._write(record)
        finally:
            self.close()

    def close(self) -> None:
        """Release the file (idempotent); for a run ended by an exception, write its unlogged last steps first."""
        try:
            if self._running:
                self._running = False
                record = self._reader.abandon()
                if record is not None and self._active:
                    self._write(record)
        finally:
            self._release()

    def state_dict(self) -> dict[str, Any]:
        """The smoothing state of ``train_loss_avg``, so a resumed run writes what the straight run does."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_reader_state(self._reader, state, self, self.state_key)

    def _write(self, record: dict[str, float]) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError


def _load_reader_state(reader: StepLogReader, state: Mapping[str, Any], hook: object, key: str | None) -> None:
    try:
        reader.load_state_dict(state)
    except ValueError as err:
        name = type(hook).__name__ + (f"(state_key={key!r})" if key is not None else "")
        raise ValueError(f"{name}: {err}") from None


# -- CSV -------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class CSVLoggerHook(_StepRecordLogger):
    """Appends one row per logging step and one per validation to ``path`` (flushed per row).

    Columns start with :data:`CSV_COLUMNS`; a metric seen for the first time adds a
    column, and the file is then rewritten atomically with the wider header. On a
    resumed run, rows after the step the run resumed from are dropped first, so
    the file describes one continuous run; with the smoothing state restored from
    the checkpoint, its ``train_loss`` and ``train_loss_avg`` are the straight run's.
    """

    plugin_name: ClassVar[str] = "csv_logger"

    path: Path = attrs.field(converter=Path)
    log_every_n_steps: int = attrs.field(default=10, validator=int_at_least(1))
    priority: int = LOGGING_PRIORITY
    #: Tells two CSV loggers apart in a checkpoint (their smoothing state); default: the file's name.
    state_key: str | None = attrs.field(
        default=attrs.Factory(lambda self: self.path.name or None, takes_self=True), validator=optional_non_empty_str()
    )

    _reader: StepLogReader = attrs.field(init=False)
    _columns: list[str] = attrs.field(init=False, factory=list)
    _file: TextIO | None = attrs.field(init=False, default=None)
    _writer: Any = attrs.field(init=False, default=None)
    _active: bool = attrs.field(init=False, default=False)
    _running: bool = attrs.field(init=False, default=False)
    _start_step: int | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._reader = StepLogReader(self.log_every_n_steps)

    def _write(self, record: dict[str, float]) -> None:
        with naming_file(self.path):  # a full disk is reported naming metrics.csv
            self._append(record)

    def _append(self, record: dict[str, float]) -> None:
        if self._file is None:
            self._open()
        new = [key for key in record if key not in self._columns]
        if new:
            self._rewrite([*self._columns, *new])
        assert self._writer is not None and self._file is not None
        self._writer.writerow({key: _format(value) for key, value in record.items()})
        self._file.flush()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[dict[str, str]] = []
        columns = list(CSV_COLUMNS)
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="", encoding="utf-8") as file:
                reader = csv.DictReader(file)
                columns += [c for c in reader.fieldnames or () if c not in columns]
                rows = list(reader)
            start = self._start_step or 0
            kept = [row for row in rows if _row_step(row) <= start]
            if start == 0:
                kept = []  # a fresh run replaces the file of an earlier one
            self._write_file(columns, kept)
        else:
            self._write_file(columns, [])
        self._columns = columns
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")

    def _rewrite(self, columns: list[str]) -> None:
        assert self._file is not None
        self._file.close()
        with self.path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
        self._write_file(columns, rows)
        self._columns = columns
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")

    def _write_file(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        """Write header and rows to a temporary file, then publish it under ``path`` atomically."""
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", newline="", encoding="utf-8") as file:
                writer = csv.DictWriter(file, fieldnames=columns, restval="")
                writer.writeheader()
                writer.writerows(rows)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _release(self) -> None:
        file, self._file, self._writer = self._file, None, None
        if file is not None:
            file.close()


def _row_step(row: Mapping[str, str]) -> float:
    try:
        return float(row.get("step") or "nan")
    except ValueError:
        return math.nan


# -- TensorBoard -----------------------------------------------------------------------------------


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write event files here (the ``tensorboard`` extra)."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


@attrs.define(eq=False)
class TensorBoardHook(_StepRecordLogger):
    """Writes the same scalars as the CSV logger as TensorBoard events under ``log_dir``.

    It is an experiment logger: unless ``log_every_n_steps`` is given, it writes on
    the step scheduler's ``log_remote_every_steps`` cadence.

    Tags: ``train/loss``, ``train/loss_avg``, ``train/lr``, ``perf/step_time``, ``perf/samples_per_s``,
    ``val/<metric>`` and ``train/<name>`` for other ``ctx.metrics`` entries. A run
    purges the events ``log_dir`` holds after the step it starts from (all of them
    for a fresh run), as the CSV logger drops or replaces rows. Needs the
    ``tensorboard`` package (``pip install 'nvtrain[tensorboard]'``).
    """

    plugin_name: ClassVar[str] = "tensorboard"

    log_dir: Path = attrs.field(converter=Path)
    #: None: follow the step scheduler's ``log_remote_every_steps`` (the experiment-logger cadence).
    log_every_n_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    priority: int = LOGGING_PRIORITY
    #: Tells two TensorBoard loggers apart in a checkpoint (their smoothing state); default: the folder's name.
    state_key: str | None = attrs.field(
        default=attrs.Factory(lambda self: self.log_dir.name or None, takes_self=True),
        validator=optional_non_empty_str(),
    )

    _reader: StepLogReader = attrs.field(init=False)
    _writer: Any = attrs.field(init=False, default=None)
    _active: bool = attrs.field(init=False, default=False)
    _running: bool = attrs.field(init=False, default=False)
    _start_step: int | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if not tensorboard_available():
            raise ImportError("TensorBoardHook needs the tensorboard package: pip install 'nvtrain[tensorboard]'")
        self._reader = StepLogReader(self.log_every_n_steps)

    def _write(self, record: dict[str, float]) -> None:
        writer = self._writer
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # Events of an earlier run after the start step are void, like the rows of metrics.csv: a fresh
            # run replaces the earlier event files (TensorBoard applies a purge step only to files it reads
            # before, in name order, which two runs started within one second do not keep); a resumed run
            # keeps the events up to its step and purges the rest.
            start = self._start_step or 0
            if start == 0:
                for stale in Path(self.log_dir).glob("events.out.tfevents.*"):
                    stale.unlink(missing_ok=True)
            writer = self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=start + 1)
        step = int(record["step"])
        for key, value in record.items():
            if key not in ("step", "epoch"):
                writer.add_scalar(_tag(key), value, step)
        writer.flush()

    def _release(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def _tag(key: str) -> str:
    if key == "train_loss":
        return "train/loss"
    if key == "train_loss_avg":
        return "train/loss_avg"
    if key.startswith("val_"):
        return "val/" + key[4:]
    if key in ("step_time", "samples_per_s"):
        return "perf/" + key
    if key == "lr" or key.startswith("lr/"):
        return "train/" + key
    return "train/" + key
