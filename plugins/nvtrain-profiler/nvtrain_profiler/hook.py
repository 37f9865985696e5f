"""TorchProfilerHook: torch.profiler over a training run, Chrome traces per rank."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from torch.profiler import ProfilerAction, ProfilerActivity

import nvtrain
from nvtrain.validators import (
    FieldProblem,
    FieldTypeError,
    FieldValueError,
    as_path,
    as_tuple,
    folder_path,
    refused,
    satisfies,
    strict_bool,
    strict_int,
)

__all__ = ["TorchProfilerHook"]

_ACTIVITY_NAMES = {name.lower(): activity for name, activity in ProfilerActivity.__members__.items()}


def _as_activities(value: Any) -> tuple[ProfilerActivity, ...] | None:
    """Accept ProfilerActivity members or their names ("cpu", "cuda"), as configs spell them."""
    if value is None:
        return None
    expected = "torch.profiler.ProfilerActivity values or their names, or None"

    def refuse(message: str, error: type[FieldProblem] = FieldValueError) -> FieldProblem:
        return refused("TorchProfilerHook", "activities", value, expected, message=message, error=error)

    items = [value] if isinstance(value, (str, ProfilerActivity)) else value
    if not isinstance(items, Iterable):
        raise refuse(
            f"TorchProfilerHook.activities must be ProfilerActivity values or None (got {value!r})", FieldTypeError
        )
    activities = []
    for item in as_tuple(items, "TorchProfilerHook", "activities", expected):
        if isinstance(item, str):
            if item.lower() not in _ACTIVITY_NAMES:
                names = ", ".join(sorted(_ACTIVITY_NAMES))
                raise refuse(f"TorchProfilerHook.activities: unknown activity name {item!r} (known: {names})")
            item = _ACTIVITY_NAMES[item.lower()]
        if not isinstance(item, ProfilerActivity):
            raise refuse(
                f"TorchProfilerHook.activities must hold torch.profiler.ProfilerActivity values or their names "
                f"(got {item!r})",
                FieldTypeError,
            )
        if item not in activities:
            activities.append(item)
    if not activities:
        raise refuse("TorchProfilerHook.activities is empty: give at least one activity, or None for the default")
    unsupported = [item for item in activities if item not in torch.profiler.supported_activities()]
    if unsupported:
        raise refuse(_unsupported_message(unsupported))
    return tuple(activities)


def _unsupported_message(unsupported: list[ProfilerActivity]) -> str:
    """Refused here, not at the first batch: torch.profiler drops them and fails on an empty set."""
    names = ", ".join(item.name.lower() for item in unsupported)
    supported = ", ".join(sorted(item.name.lower() for item in torch.profiler.supported_activities())) or "none"
    return (
        f"TorchProfilerHook.activities: {names} cannot be profiled on this machine "
        f"(torch.profiler supports: {supported}; or None for what is available)"
    )


def _output_dir_path(value: Any) -> Path:
    return as_path(value, "TorchProfilerHook", "output_dir")


_output_dir = folder_path()

_schedule = satisfies(
    "a callable step -> ProfilerAction, e.g. torch.profiler.schedule(wait=1, warmup=1, active=3), "
    "a mapping of its arguments ({wait: 1, warmup: 1, active: 3}), or None",
    lambda value: value is None or callable(value),
    error=FieldTypeError,
)

#: torch.profiler.schedule's arguments, each an int of at least this (``active`` records at least one step).
_SCHEDULE_ARGUMENTS = {"wait": 0, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0}


def _as_schedule(value: Any) -> Any:
    """A mapping of ``torch.profiler.schedule``'s arguments (all a config can give) as that schedule; anything
    else unchanged, for the validator."""
    if not isinstance(value, Mapping):
        return value
    unknown = sorted(set(map(str, value)) - set(_SCHEDULE_ARGUMENTS))
    if unknown or "active" not in value:
        why = f"unknown key(s) {unknown}" if unknown else "no 'active'"
        raise refused(
            "TorchProfilerHook",
            "schedule",
            dict(value),
            f"torch.profiler.schedule's arguments ({', '.join(_SCHEDULE_ARGUMENTS)}; 'active' required)",
            message=f"TorchProfilerHook.schedule: {why} in {dict(value)!r}; torch.profiler.schedule takes "
            f"{', '.join(_SCHEDULE_ARGUMENTS)} (ints; 'active' >= 1 is required)",
        )
    for key, least in _SCHEDULE_ARGUMENTS.items():
        given = value.get(key, least if key != "active" else None)
        if isinstance(given, bool) or not isinstance(given, int) or given < least:
            raise refused(
                "TorchProfilerHook",
                "schedule",
                dict(value),
                f"schedule.{key} an int >= {least}",
                message=f"TorchProfilerHook.schedule.{key} must be an int >= {least} (got {given!r})",
            )
    arguments = {key: least for key, least in _SCHEDULE_ARGUMENTS.items() if key != "active"}  # torch's defaults
    return torch.profiler.schedule(**(arguments | {str(key): int(arg) for key, arg in value.items()}))


@attrs.define(eq=False)
class TorchProfilerHook:
    """Profiles training with ``torch.profiler`` and writes Chrome traces.

    The profiler starts at BEFORE_TRAINING (lazily at the first BEFORE_BATCH for
    standalone ``train_batch()`` calls), advances its ``schedule`` at every
    AFTER_BATCH (one profiler step per micro-batch) and is finalised at
    AFTER_TRAINING, when a run raises (``abort_run``: the trace up to the failure
    is written then), or when the strategy's context exits. A hook collected with
    its session still open (standalone ``train_batch()`` calls, its strategy never
    closed) stops the profiler then, writing no trace: torch's profiler would
    otherwise record every op for the rest of the process. Each
    trace is a ``*.pt.trace.json`` file under
    ``output_dir/rank_<global rank>/torch/``, written under a temporary name and
    renamed when complete; TensorBoard's profiler plugin and chrome://tracing read it.

    With ``schedule=None`` every micro-batch from start to finish is recorded and
    one trace is written at the end: fine for a few steps, large and slow for
    long runs. Use ``torch.profiler.schedule(wait=..., warmup=..., active=..., repeat=...)``
    to record a window (one trace per active cycle).
    """

    plugin_name: ClassVar[str] = "profiler"

    #: Root folder of the traces; each rank writes to ``rank_<global rank>/torch/`` below it.
    output_dir: Path = attrs.field(default=Path("profiles"), converter=_output_dir_path, validator=_output_dir)
    #: What to trace; None: the CPU, plus the run's accelerator when the strategy trains on one (CUDA for a
    #: CUDA device), so a run on the CPU of a machine with GPUs never initialises CUDA to profile it.
    activities: tuple[ProfilerActivity, ...] | None = attrs.field(default=None, converter=_as_activities)
    #: ``step -> ProfilerAction`` (``torch.profiler.schedule(...)``); None records everything.
    schedule: Callable[[int], ProfilerAction] | None = attrs.field(
        default=None, converter=_as_schedule, validator=_schedule
    )
    record_shapes: bool = attrs.field(default=False, validator=strict_bool)
    profile_memory: bool = attrs.field(default=False, validator=strict_bool)
    with_flops: bool = attrs.field(default=False, validator=strict_bool)
    priority: int = attrs.field(default=50, validator=strict_int)

    #: Trace files written so far, in order.
    traces: list[Path] = attrs.field(init=False, factory=list, repr=False)
    _session: _Session | None = attrs.field(init=False, default=None, repr=False)
    #: Stops the open session without a trace when this hook is collected unclosed; close() detaches it.
    _abandon: weakref.finalize[[], TorchProfilerHook] | None = attrs.field(init=False, default=None, repr=False)

    @property
    def running(self) -> bool:
        """Whether a profiling session is open."""
        return self._session is not None

    def trace_dir(self, rank: int) -> Path:
        """Where the traces of global rank ``rank`` go."""
        return self.output_dir / f"rank_{rank}" / "torch"

    # -- stages ----------------------------------------------------------------------------

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Start profiling the run."""
        self._start(ctx.rank, ctx.device)

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        """Start lazily for ``train_batch()`` used without ``run()``."""
        if self._session is None:
            self._start(ctx.rank, ctx.device)

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        """One profiler step per micro-batch: the schedule counts these."""
        if self._session is not None:
            self._session.step()

    @nvtrain.hookimpl
    def after_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Finish the session and write the last trace."""
        self.close()

    def abort_run(self, error: BaseException) -> None:
        """The run failed: stop profiling now and write what was recorded up to the failure, rather than
        record everything the process runs next until the strategy is closed."""
        self.close()

    def close(self) -> None:
        """Finish an open session (the strategy calls this on exit, also after an exception)."""
        session, self._session = self._session, None
        if self._abandon is not None:
            self._abandon.detach()
            self._abandon = None
        if session is not None:
            session.close()

    # -- internals ----------------------------------------------------------------------------

    def _start(self, rank: int, device: torch.device) -> None:
        if self._session is not None:
            return
        trace_dir = self.trace_dir(rank)
        trace_dir.mkdir(parents=True, exist_ok=True)
        session = _Session.open(
            trace_dir,
            rank,
            self.traces,
            activities=self.activities if self.activities is not None else run_activities(device),
            schedule=self.schedule,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_flops=self.with_flops,
        )
        self._session = session
        self._abandon = weakref.finalize(self, session.abandon)
        self._abandon.atexit = False  # the process ends, and its profiler with it


def run_activities(device: torch.device) -> tuple[ProfilerActivity, ...]:
    """What ``activities=None`` traces for a run on ``device``: the CPU, and the device's own activity (CUDA,
    XPU, ...) when it has one this build can profile. torch's own default adds CUDA whenever it is available,
    which initialises it (a context on the GPU) for a run that never uses it."""
    activity = getattr(ProfilerActivity, device.type.upper(), None)
    if activity is None or activity == ProfilerActivity.CPU or activity not in torch.profiler.supported_activities():
        return (ProfilerActivity.CPU,)
    return (ProfilerActivity.CPU, activity)


@attrs.define(eq=False)
class _Session:
    """One open torch.profiler session and its trace writing.

    It refers to nothing of the hook (``traces`` is the hook's list), so the hook's
    finalizer can hold it and still let the hook be collected.
    """

    trace_dir: Path
    rank: int
    traces: list[Path]
    profiler: torch.profiler.profile = attrs.field(init=False)
    #: Micro-batches since the last trace was written; a trace the session's end would write with none
    #: (a cycle opened after the last micro-batch, a run with nothing left to train) is not written.
    batches_since_trace: int = attrs.field(init=False, default=0, on_setattr=attrs.setters.NO_OP)
    closing: bool = attrs.field(init=False, default=False)
    #: Set when the session is abandoned: the trace the profiler still reports is not written.
    discard: bool = attrs.field(init=False, default=False)

    @classmethod
    def open(cls, trace_dir: Path, rank: int, traces: list[Path], **settings: Any) -> _Session:
        """Start a profiler (``settings``: torch.profiler.profile's arguments) that writes into ``traces``."""
        session = cls(trace_dir, rank, traces)
        session.profiler = torch.profiler.profile(on_trace_ready=session._write, **settings)
        session.profiler.__enter__()
        return session

    def step(self) -> None:
        self.batches_since_trace += 1
        self.profiler.step()

    def close(self) -> None:
        """Stop profiling; the last cycle's trace is written unless no micro-batch reached it."""
        self.closing = True
        try:
            self.profiler.__exit__(None, None, None)
        finally:
            self.closing = False
            self.batches_since_trace = 0

    def abandon(self) -> None:
        """Stop profiling without writing a trace: the hook is gone, so nobody reads ``traces``."""
        self.discard = True
        self.close()

    def _write(self, profiler: torch.profiler.profile) -> None:
        """``on_trace_ready``: export under a temporary name, then publish it with one rename."""
        empty = self.closing and self.batches_since_trace == 0
        self.batches_since_trace = 0
        if empty or self.discard:  # a cycle no micro-batch reached shows nothing; an abandoned one nobody reads
            return
        final = self.trace_dir / f"rank_{self.rank}.{time.time_ns()}.pt.trace.json"
        partial = final.with_name(final.name + ".partial")
        try:
            profiler.export_chrome_trace(str(partial))
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)
        self.traces.append(final)
