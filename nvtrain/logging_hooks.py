"""Progress bar, CSV and TensorBoard logging: observer plugins that read tensors only on logging steps.

All three share one rule: on the per-batch path they only add the detached loss
tensor to a running sum (no host sync). Every ``log_every_n_steps`` completed
optimizer steps they read the window's mean loss and the scalar tensors in
``ctx.metrics`` to the host in one transfer, and only then take the wall clock,
so on CUDA the step time covers finished work (the read is the sync). Step time
and samples/s are measured over the steps since the previous logging step;
validation time is left out (the clock pauses from the end of the step a
validation follows to the validation's end). A ``ctx.metrics`` entry named like a
logged column (``train_loss``, ``lr``, ``val_...``: :data:`~nvtrain.step_log.RESERVED_METRIC_NAMES`)
is refused at the logging step that sees it. Each hook is active on rank 0 only.

They are ordinary plugins, usable from Python::

    strategy = nvtrain.TrainingStrategy(..., hooks=[ProgressBarHook(), CSVLoggerHook("runs/x/metrics.csv")])
"""

from __future__ import annotations

import csv
import logging
import math
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

import attrs

from nvtrain.atomic_files import replaced_atomically
from nvtrain.errors import naming_file
from nvtrain.hookspecs import hookimpl
from nvtrain.step_log import StepLogReader
from nvtrain.validators import (
    FieldTypeError,
    as_path,
    file_path,
    folder_path,
    int_at_least,
    optional_bool,
    optional_int_at_least,
    optional_non_empty_str,
    refused,
    satisfies,
    strict_int,
)

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = [
    "CSVLoggerHook",
    "LogFolderError",
    "ProgressBarHook",
    "StepLogReader",
    "TensorBoardHook",
    "estimate_total_steps",
]

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

#: ProgressBarHook.refresh_interval: seconds between redraws (NaN or infinity would never redraw).
_seconds_above_zero = satisfies(
    "a finite number of seconds > 0",
    lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0,
)

#: ProgressBarHook.stream: the lines are printed to it (flushed) and tqdm draws on it.
_text_stream = satisfies(
    "a text stream with write() and flush() (sys.stderr, an open file, io.StringIO)",
    lambda v: callable(getattr(v, "write", None)) and callable(getattr(v, "flush", None)),
    or_none=True,
    error=FieldTypeError,
)


def _output_path(value: Any, owner: str, field: str) -> Path:
    """``Path(value)`` refusing what is no path, and "" (``Path("")`` is the working directory)."""
    path = as_path(value, owner, field)
    if not os.fspath(value):
        raise refused(owner, field, value, "a non-empty path")
    return path


def _csv_path(value: Any) -> Path:
    return _output_path(value, "CSVLoggerHook", "path")


def _log_dir_path(value: Any) -> Path:
    return _output_path(value, "TensorBoardHook", "log_dir")


#: Refused when built, not at the first logging step (an IsADirectoryError or FileExistsError then).
_csv_file_path = file_path("a CSV file path, neither an existing directory nor under a file")
#: Refused when built, not at the first logging step (a FileExistsError then).
_folder_path = folder_path()


class LogFolderError(OSError):
    """The folder a logger writes in cannot be created when its run starts; ``str()`` names the setting.

    The OS error's ``errno``, ``strerror`` and ``filename`` are kept, so it is handled as that error
    (``nvtrain train`` reports a run directory that cannot be made as a config error).
    """

    def __init__(self, setting: str, folder: Path, err: OSError) -> None:
        super().__init__(err.errno, err.strerror, err.filename if err.filename is not None else str(folder))
        #: ``CSVLoggerHook.path``, ``TensorBoardHook.log_dir``.
        self.setting = setting
        #: The folder the logger writes in (``filename`` is where creating it failed: it or a folder above).
        self.folder = folder

    def __str__(self) -> str:
        reason = self.strerror or "OSError"
        failed = os.fsdecode(self.filename)
        at = "" if Path(failed) == self.folder else f" at {failed!r}"
        return f"{self.setting}: the folder {str(self.folder)!r} cannot be created ({reason}{at})"


def _make_log_folder(folder: Path, setting: str) -> None:
    """Create the folder a logger writes in before the run's first step, not at its first logging step."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LogFolderError(setting, folder, err) from err


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


def _format(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return str(int(value))
    return f"{value:.6g}"


# -- run end, shared by the three loggers -----------------------------------------------------------


class _RunEndOutput:
    """How every logger ends a run: the steps after its last logging step reach the output once.

    A run that returns fires AFTER_TRAINING; one ended by an exception leaves ``close()`` to the
    strategy. Either way the unlogged steps are shown or written (``_emit``), then the output is
    finished (``_end_output``). A subclass has the fields ``_reader``, ``_active``, ``_running``
    and ``state_key``.
    """

    __slots__ = ("_active", "_reader", "_running")

    _reader: StepLogReader
    #: Rank 0 once a run started (False before any run): whether this process shows or writes anything.
    _active: bool
    #: Between BEFORE_TRAINING and AFTER_TRAINING: a close() now is a run ended by an exception.
    _running: bool
    state_key: str | None

    @hookimpl
    def after_training(self, ctx: TrainingContext) -> None:
        """Emit the steps since the last logging step (a run stopped at a validation), then finish the output."""
        self._running = False
        try:
            record = self._reader.finish()
            if record is not None and self._active:
                self._emit(record)
        finally:
            self.close()

    def close(self) -> None:
        """Finish the output (idempotent); for a run ended by an exception, emit its unlogged last steps first."""
        try:
            if self._running:
                self._running = False
                record = self._reader.abandon()
                if record is not None and self._active:
                    self._emit(record)
        finally:
            self._end_output()

    def state_dict(self) -> dict[str, Any]:
        """The smoothing state of the window's loss, so a resumed run shows and writes what the straight run does."""
        return self._reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_reader_state(self._reader, state, self, self.state_key)

    def _emit(self, record: dict[str, float]) -> None:
        raise NotImplementedError

    def _end_output(self) -> None:
        raise NotImplementedError


def _load_reader_state(reader: StepLogReader, state: Mapping[str, Any], hook: object, key: str | None) -> None:
    try:
        reader.load_state_dict(state)
    except ValueError as err:
        name = type(hook).__name__ + (f"(state_key={key!r})" if key is not None else "")
        raise ValueError(f"{name}: {err}") from None


# -- progress ------------------------------------------------------------------------------------


@attrs.define(eq=False)
class ProgressBarHook(_RunEndOutput):
    """A tqdm bar (epoch, step, smoothed loss, samples/s) on a terminal; log lines otherwise.

    The bar advances once per optimizer step (host counters only) and redraws at
    most every ``refresh_interval`` seconds; loss and throughput are refreshed on
    logging steps. When ``stream`` is not a terminal (a batch job's log file) it
    writes one line per logging step and one per validation instead. The shown
    loss is ``train_loss_avg``: the mean over the last ``loss_average_window_steps``
    steps of the step scheduler (in whole logging windows). The steps after the
    last logging step are shown when the run ends, also by an exception; a window
    without a completed step (a diverged run's skipped steps) shows its mean loss.
    """

    plugin_name: ClassVar[str] = "progress_bar"

    log_every_n_steps: int = attrs.field(default=10, validator=int_at_least(1))
    refresh_interval: float = attrs.field(default=0.5, validator=_seconds_above_zero)
    #: Where to draw (an object with ``write`` and ``flush``); default ``sys.stderr`` at the time the run starts.
    stream: TextIO | None = attrs.field(default=None, validator=_text_stream)
    #: Force the bar (True) or log lines (False); None: a bar only on a terminal.
    use_bar: bool | None = attrs.field(default=None, validator=optional_bool)
    #: Width of the bar in columns; None follows the terminal (resizes included).
    ncols: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    priority: int = attrs.field(default=LOGGING_PRIORITY, validator=strict_int)
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
        self._reader = StepLogReader(self.log_every_n_steps, owner=type(self).__name__)

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
        smoothed = record.get("train_loss_avg", record.get("train_loss"))  # no step in the window: its mean
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
        """Show the validation; one outside ``run()`` only after a run (a line: the run's bar is closed)."""
        if not self._active:  # off rank 0, or before any run
            return
        if self._running:
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

    def _emit(self, record: dict[str, float]) -> None:
        self._show(record, refresh=True)

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

    def _end_output(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()


_BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}"
#: Columns the bar's fixed parts take with a 4-digit step count; the rest is shared by bar and postfix.
_BAR_FIXED = 34
_BAR_MIN = 8


def _epoch_label(ctx: TrainingContext) -> str:
    """``epoch 3/15``: 1-based, like every epoch a person reads (``ctx.epoch`` is the 0-based index)."""
    scheduler = ctx.scheduler
    total = getattr(scheduler, "num_epochs", None) if scheduler is not None else None
    return f"epoch {ctx.epoch + 1}" + (f"/{total}" if isinstance(total, int) else "")


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


class _StepRecordLogger(_RunEndOutput):
    """The observer side shared by the file loggers: rank 0 writes a record per logging step and validation.

    A subclass is an attrs class with the fields ``_reader`` (a :class:`StepLogReader`),
    ``_active``, ``_running``, ``_start_step``, ``_trim`` and ``state_key``; it writes a
    record in ``_write`` and releases its file in ``_release``. ``_start_step`` is the step
    count at the first BEFORE_EPOCH when the run continues the logger's log (a resume, a second
    ``run()``), else 0: a fresh run, ``start_step`` set or not. The steps after the last logging step are written when the
    run ends (AFTER_TRAINING, or ``close()`` after an exception). The smoothing state
    is the hook's checkpoint state (``state_dict``).

    A ``validate()`` outside ``run()`` is written after a run only (before any run there
    is no file of this strategy to add to): appended to what the file holds, never trimming it.
    """

    __slots__ = ("_start_step", "_trim")

    _start_step: int | None
    #: From BEFORE_TRAINING until the run opens its file: that open drops what an earlier run wrote after
    #: the start step (all of it for a fresh run). An open outside a run appends.
    _trim: bool

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        if self._running:  # the last run ended by an exception and nobody closed the strategy
            self.close()  # writes its unlogged steps; its open window is not continued
        self._active = ctx.rank == 0
        self._running, self._trim = True, True
        self._start_step = None
        self._reader.start(ctx)

    @hookimpl
    def before_epoch(self, ctx: TrainingContext) -> None:
        self._begin(ctx)

    def _begin(self, ctx: TrainingContext) -> None:
        """At the run's first epoch, or a validation before it (one a preemption left owed): a resume has
        been applied by then, so the start step is known."""
        if self._active and self._start_step is None:
            _make_log_folder(*self._output_folder())
            continues = self._reader.begin(ctx)
            self._start_step = ctx.step_count if continues else 0  # a fresh run replaces what the folder holds

    @hookimpl
    def after_batch(self, ctx: TrainingContext) -> None:
        if self._active:
            record = self._reader.observe_batch(ctx)
            if record is not None:
                self._write(record)

    @hookimpl
    def after_validation(self, ctx: TrainingContext) -> None:
        if not self._active:  # off rank 0, or before any run
            return
        if self._running:
            self._begin(ctx)
        self._write(self._reader.read_validation(ctx))

    def _emit(self, record: dict[str, float]) -> None:
        self._write(record)

    def _end_output(self) -> None:
        self._trim = False  # the run is over: a later validate() appends
        self._release()

    def _output_folder(self) -> tuple[Path, str]:
        """The folder the records go to, and the setting that names it."""
        raise NotImplementedError

    def _write(self, record: dict[str, float]) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError


# -- CSV -------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class CSVLoggerHook(_StepRecordLogger):
    """Appends one row per logging step and one per validation to ``path`` (flushed per row).

    Columns start with :data:`CSV_COLUMNS`; a metric seen for the first time adds a
    column, and the file is then rewritten atomically with the wider header. On a
    resumed run, rows after the step the run resumed from are dropped first, so
    the file describes one continuous run; with the smoothing state restored from
    the checkpoint, its ``train_loss`` and ``train_loss_avg`` are the straight run's.
    Rows are dropped by step: a diverged run whose last real step S was a logging
    step has two rows of step S (the second: its skipped micro-batches, NaN loss and
    ``skipped_steps``), and a run resumed from S keeps both. A ``validate()`` after
    the run appends its row.
    """

    plugin_name: ClassVar[str] = "csv_logger"

    path: Path = attrs.field(converter=_csv_path, validator=_csv_file_path)
    log_every_n_steps: int = attrs.field(default=10, validator=int_at_least(1))
    priority: int = attrs.field(default=LOGGING_PRIORITY, validator=strict_int)
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
    _trim: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._reader = StepLogReader(self.log_every_n_steps, owner=type(self).__name__)

    def _output_folder(self) -> tuple[Path, str]:
        return self.path.parent, "CSVLoggerHook.path"

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
        """Open for appending; a run's first open first drops the rows after its start step."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        columns = list(CSV_COLUMNS)
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="", encoding="utf-8") as file:
                reader = csv.DictReader(file)
                header = list(reader.fieldnames or ())
                rows = list(reader)
            kept = self._kept_rows(rows) if self._trim else rows
            if kept:  # the columns of the rows kept; a fresh run's file has its own
                columns += [c for c in header if c not in columns]
            if self._trim:
                self._write_file(columns, kept)
            elif columns != header:  # outside a run: append, under a header with every logged column
                self._write_file(columns, rows)
        else:
            self._write_file(columns, [])
        self._trim = False
        self._columns = columns
        self._file = self.path.open("a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")

    def _kept_rows(self, rows: list[dict[str, str]]) -> list[dict[str, str]]:
        """The rows of earlier runs this run continues: up to its start step; none for a fresh run."""
        start = self._start_step or 0
        if start == 0:
            return []  # a fresh run replaces the file of an earlier one
        return [row for row in rows if _row_step(row) <= start]

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
        with replaced_atomically(self.path) as tmp, tmp.open("w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(rows)

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
    ``val/<metric>`` and ``train/<name>`` for other ``ctx.metrics`` entries (``loss``
    and ``loss_avg`` are refused: their tags are taken). A run purges the events
    ``log_dir`` holds after the step it starts from (all of them for a fresh run),
    as the CSV logger drops or replaces rows; a ``validate()`` after the run adds
    its events to the run's. Needs the
    ``tensorboard`` package (``pip install 'nvtrain[tensorboard]'``).
    """

    plugin_name: ClassVar[str] = "tensorboard"

    log_dir: Path = attrs.field(converter=_log_dir_path, validator=_folder_path)
    #: None: follow the step scheduler's ``log_remote_every_steps`` (the experiment-logger cadence).
    log_every_n_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    priority: int = attrs.field(default=LOGGING_PRIORITY, validator=strict_int)
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
    _trim: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if not tensorboard_available():
            raise ImportError("TensorBoardHook needs the tensorboard package: pip install 'nvtrain[tensorboard]'")
        self._reader = StepLogReader(self.log_every_n_steps, owner=type(self).__name__, also_reserved=_TAKEN_TAGS)

    def _output_folder(self) -> tuple[Path, str]:
        return self.log_dir, "TensorBoardHook.log_dir"

    def _write(self, record: dict[str, float]) -> None:
        writer = self._writer
        if writer is None:
            writer = self._writer = self._open()
        step = int(record["step"])
        for key, value in record.items():
            if key not in ("step", "epoch"):
                writer.add_scalar(_tag(key), value, step)
        writer.flush()

    def _open(self) -> Any:
        """A writer; a run's first one first voids the events after its start step (outside a run: none)."""
        from torch.utils.tensorboard import SummaryWriter

        trim, self._trim = self._trim, False
        if not trim:  # a validate() after the run: its events join the run's
            return SummaryWriter(log_dir=str(self.log_dir))
        # Events of an earlier run after the start step are void, like the rows of metrics.csv: a fresh
        # run replaces the earlier event files (TensorBoard applies a purge step only to files it reads
        # before, in name order, which two runs started within one second do not keep); a resumed run
        # keeps the events up to its step and purges the rest.
        start = self._start_step or 0
        if start == 0:
            for stale in Path(self.log_dir).glob("events.out.tfevents.*"):
                stale.unlink(missing_ok=True)
        return SummaryWriter(log_dir=str(self.log_dir), purge_step=start + 1)

    def _release(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


#: ``ctx.metrics`` names whose tag (``train/<name>``) a TensorBoard logger writes itself.
_TAKEN_TAGS = {
    "loss": "the TensorBoard tag 'train/loss' of train_loss",
    "loss_avg": "the TensorBoard tag 'train/loss_avg' of train_loss_avg",
}


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
