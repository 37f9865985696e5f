"""Per-stage wall-clock timing of the batch loop, written to a CSV file."""

from __future__ import annotations

import csv
import io
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from nvtrain.atomic_files import replaced_atomically
from nvtrain.hookspecs import hookimpl
from nvtrain.stages import BATCH_STAGES, REPLACEMENT_STAGES, TrainingStage
from nvtrain.validators import (
    FieldProblem,
    as_path,
    as_tuple,
    file_path,
    int_at_least,
    refused,
    strict_bool,
    strict_int,
)

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["StageTimingHook"]

logger = logging.getLogger(__name__)

#: CSV header of the report.
CSV_COLUMNS = ("stage", "count", "mean_ms", "p50_ms", "p95_ms")


_EXPECTED_STAGES = "TrainingStage values, their names or numbers"


def _as_stages(value: Any) -> tuple[TrainingStage, ...]:
    """Stages as members, names in any case (how a config spells them) or values."""
    single = isinstance(value, (int, str)) or not isinstance(value, Iterable)
    stages: set[TrainingStage] = set()
    for item in (value,) if single else as_tuple(value, "StageTimingHook", "stages", _EXPECTED_STAGES):
        try:
            stages.add(_as_stage(item))
        except (TypeError, ValueError, KeyError):
            raise _no_stage(value, item) from None
    return tuple(sorted(stages))


def _no_stage(value: Any, item: Any) -> FieldProblem:
    """The error for ``item`` of ``value``, listing the names a config can use."""
    expected = _EXPECTED_STAGES
    where = "" if item is value else f", where {item!r} is no stage"
    names = ", ".join(stage.name for stage in sorted(BATCH_STAGES))
    message = f"StageTimingHook.stages must be {expected} (got {value!r}{where}; batch stage names: {names})"
    return refused("StageTimingHook", "stages", value, expected, message=message)


def _as_stage(item: Any) -> TrainingStage:
    if isinstance(item, bool):
        raise TypeError(item)
    if isinstance(item, str):
        return TrainingStage[item.upper()]
    return TrainingStage(item)


def _output_path(value: Any) -> Path:
    return as_path(value, "StageTimingHook", "output")


#: Refused when built, not at the first flush (or at the end of the whole run).
_writable_file_path = file_path("a CSV file path, neither an existing directory nor under a file")


def _check_stages(instance: Any, attribute: attrs.Attribute[Any], value: tuple[TrainingStage, ...]) -> None:
    outside = [s.name for s in value if s not in BATCH_STAGES]
    if not value or outside:
        expected = "a non-empty set of batch stages (BEFORE_BATCH ... AFTER_BATCH)"
        message = (
            f"{type(instance).__name__}.{attribute.name} must be {expected} "
            f"(got {[s.name for s in value] or 'nothing'}; not batch stages: {outside})"
        )
        raise refused(type(instance).__name__, attribute.name, value, expected, message=message)


@attrs.define(slots=True)
class _StageStats:
    """Exact count and mean; percentiles from a bounded uniform sample of the durations."""

    capacity: int
    count: int = 0
    total_ms: float = 0.0
    sample: list[float] = attrs.field(factory=list)

    def add(self, ms: float, rng: random.Random) -> None:
        self.count += 1
        self.total_ms += ms
        if len(self.sample) < self.capacity:
            self.sample.append(ms)
        else:  # reservoir sampling keeps a uniform sample of everything seen
            slot = rng.randrange(self.count)
            if slot < self.capacity:
                self.sample[slot] = ms

    def row(self, stage: TrainingStage) -> list[str]:
        if not self.count:
            return [stage.name, "0", "", "", ""]
        if len(self.sample) > 1:
            cuts = statistics.quantiles(self.sample, n=100, method="inclusive")
            p50, p95 = cuts[49], cuts[94]
        else:
            p50 = p95 = self.sample[0]
        return [stage.name, str(self.count), *(f"{v:.6f}" for v in (self.total_ms / self.count, p50, p95))]


@attrs.define(eq=False, slots=False)
class StageTimingHook:
    """Time the batch stages and report count, mean, p50 and p95 per stage.

    What is measured: the row of stage S is the time from S firing until the next
    timed stage fires, so it covers S's own hooks and the loop's work up to the
    next timed stage (the BEFORE_FORWARD row includes the forward pass when
    AFTER_FORWARD is timed, BEFORE_BACKWARD includes the backward pass when
    DO_BACKWARD is not). The interval of the last timed stage of a micro-batch
    runs until the first timed stage of the next one (step-boundary work and
    loading the next batch); intervals cut by an epoch end or the end of training are
    dropped (a flush closes the open one and leaves its own time out).

    The hook stamps each timed stage before any other implementation of it
    (``priority`` -1000): ``time.perf_counter()`` on CPU, a CUDA event on a CUDA
    device, where it also emits one NVTX range per interval. It synchronises only
    when it flushes: every ``flush_every_n_steps`` optimizer steps, at
    AFTER_TRAINING and on ``close()``. Then it rewrites ``output`` (atomically)
    with the statistics of the whole run, and logs one line when ``log`` is set.
    Under torch.distributed each rank writes ``<stem>.rank<N><suffix>``.

    Rows count micro-batches: under gradient accumulation the optimizer step and
    the step-boundary work land only on a window's last micro-batch, so read p95
    or count x mean / steps for the cost per step. ``stages`` takes members, names
    in any case or values; in ``nvtrain train`` an ``output`` the config leaves
    out goes into the run directory (``output_settings``).

    Timing DO_BACKWARD or DO_OPTIMIZER_STEP (both in the default set) puts a
    pluggy wrapper on those slots, about a microsecond per call; leave them out
    of ``stages`` to avoid it. Count and mean are exact; p50 and p95 come from a
    uniform sample of at most ``max_samples`` durations per stage.
    """

    plugin_name: ClassVar[str] = "stage_timing"
    #: The setting naming the file this hook writes, and its name in the run directory when a config leaves it
    #: out (``nvtrain train``), so ``nvtrain bench`` also knows to keep it in its temporary folder.
    output_settings: ClassVar[Mapping[str, str]] = {"output": "stage_timing.csv"}

    #: CSV file to write (columns: stage, count, mean_ms, p50_ms, p95_ms); an existing directory is refused.
    output: Path = attrs.field(
        default=Path("stage_timing.csv"),
        converter=_output_path,
        validator=_writable_file_path,
    )
    #: Which batch stages to stamp; default all twelve.
    stages: tuple[TrainingStage, ...] = attrs.field(
        default=tuple(sorted(BATCH_STAGES)), converter=_as_stages, validator=_check_stages
    )
    flush_every_n_steps: int = attrs.field(default=100, validator=int_at_least(1))
    #: Also log a summary line (logger ``nvtrain.hooks.timing``, level INFO) at each flush.
    log: bool = attrs.field(default=False, validator=strict_bool)
    #: Emit NVTX ranges when timing on CUDA.
    nvtx: bool = attrs.field(default=True, validator=strict_bool)
    max_samples: int = attrs.field(default=10_000, validator=int_at_least(1))
    priority: int = attrs.field(default=-1000, validator=strict_int)

    _stats: dict[TrainingStage, _StageStats] = attrs.field(init=False, repr=False)
    _rng: random.Random = attrs.field(init=False, repr=False, factory=lambda: random.Random(0))
    _cuda: bool | None = attrs.field(init=False, repr=False, default=None)
    _open_stage: TrainingStage | None = attrs.field(init=False, repr=False, default=None)
    _open_mark: Any = attrs.field(init=False, repr=False, default=None)
    _pending: list[tuple[TrainingStage, Any, Any]] = attrs.field(init=False, repr=False, factory=list)
    _next_flush: int | None = attrs.field(init=False, repr=False, default=None)
    _path: Path | None = attrs.field(init=False, repr=False, default=None)
    _dirty: bool = attrs.field(init=False, repr=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._stats = {stage: _StageStats(self.max_samples) for stage in self.stages}
        first = self.stages[0]
        for stage in self.stages:
            stamp = self._stamper(stage, first=stage is first)
            if stage in REPLACEMENT_STAGES:
                setattr(self, stage.hook_name, hookimpl(wrapper=True)(_wrapping(stamp, stage)))
            else:
                setattr(self, stage.hook_name, hookimpl(_named(stamp, stage)))

    # -- stamping -----------------------------------------------------------------------

    def _stamper(self, stage: TrainingStage, first: bool) -> Callable[[TrainingContext], None]:
        def stamp(ctx: TrainingContext) -> None:
            if self._cuda is None:
                self._start(ctx)
            if self._cuda:
                mark: Any = torch.cuda.Event(enable_timing=True)
                mark.record()
            else:
                mark = time.perf_counter()
            self._close_interval(mark)
            if first and ctx.step_count >= self._next_flush:  # type: ignore[operator]
                self.flush()
                self._next_flush = ctx.step_count + self.flush_every_n_steps
                mark = self._new_mark()
            self._open_stage, self._open_mark = stage, mark
            if self._cuda and self.nvtx:
                torch.cuda.nvtx.range_push(stage.name)

        return stamp

    def _start(self, ctx: TrainingContext) -> None:
        self._cuda = ctx.device.type == "cuda" and torch.cuda.is_available()
        self._next_flush = ctx.step_count + self.flush_every_n_steps
        path = self.output
        if ctx.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{ctx.rank}{path.suffix}")
        self._path = path
        self._dirty = True  # a run that timed nothing still gets its (empty) rows

    def _new_mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _close_interval(self, end: Any) -> None:
        stage = self._open_stage
        if stage is None:
            return
        self._open_stage = None
        self._dirty = True
        if self._cuda:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
            self._pending.append((stage, self._open_mark, end))
        else:
            self._stats[stage].add((end - self._open_mark) * 1000.0, self._rng)

    def _drop_interval(self) -> None:
        if self._open_stage is not None and self._cuda and self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._open_stage = None

    # -- flushing ---------------------------------------------------------------------------

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        """Drop the interval a run that raised left open: the time until this run is no stage's."""
        self._drop_interval()

    @hookimpl
    def after_epoch(self, ctx: TrainingContext) -> None:
        """Do not let an interval span the epoch boundary."""
        self._drop_interval()

    @hookimpl
    def after_training(self, ctx: TrainingContext) -> None:
        self._drop_interval()
        self.flush()

    def flush(self) -> None:
        """Resolve pending CUDA timings (one synchronisation) and rewrite the CSV report."""
        self._drop_interval()
        if self._cuda and self._pending:
            self._pending[-1][2].synchronize()
            for stage, start, end in self._pending:
                self._stats[stage].add(start.elapsed_time(end), self._rng)
            self._pending.clear()
        if not self._dirty or self._path is None:
            return
        self._dirty = False
        rows = [self._stats[stage].row(stage) for stage in self.stages]
        _write_csv_atomically(self._path, rows)
        if self.log:
            logger.info("stage timing (ms, mean/p95): %s", _summary(rows))

    def report(self) -> dict[str, dict[str, float]]:
        """Statistics by stage name (count, mean_ms, p50_ms, p95_ms); on CUDA, as of the last flush."""
        result: dict[str, dict[str, float]] = {}
        for stage in self.stages:
            name, count, *figures = self._stats[stage].row(stage)
            result[name] = {"count": float(count)} | {
                column: float(v) if v else math.nan for column, v in zip(CSV_COLUMNS[2:], figures, strict=True)
            }
        return result

    def close(self) -> None:
        """Write what was measured since the last flush."""
        self.flush()


def _named(stamp: Callable[[Any], None], stage: TrainingStage) -> Callable[[Any], None]:
    def impl(ctx: Any) -> None:
        stamp(ctx)

    impl.__name__ = stage.hook_name
    return impl


def _wrapping(stamp: Callable[[Any], None], stage: TrainingStage) -> Callable[[Any], Generator[None, Any, Any]]:
    def impl(ctx: Any) -> Generator[None, Any, Any]:
        stamp(ctx)
        return (yield)

    impl.__name__ = stage.hook_name
    return impl


def _summary(rows: Iterable[list[str]]) -> str:
    parts = [f"{name.lower()} {float(mean):.3f}/{float(p95):.3f}" for name, count, mean, _, p95 in rows if count != "0"]
    return ", ".join(parts)


def _write_csv_atomically(path: Path, rows: list[list[str]]) -> None:
    """Write to a temporary file beside ``path`` and rename it over, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    writer.writerows(rows)
    text = buffer.getvalue()
    with replaced_atomically(path, suffix=".tmp") as tmp, tmp.open("w", encoding="utf-8", newline="") as handle:
        handle.write(text)
