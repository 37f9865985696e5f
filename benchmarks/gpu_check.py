"""GPU check: what the standard stack costs per step, what a checkpoint costs, and no host sync per step.

    python benchmarks/gpu_check.py                    # on CUDA; skips cleanly (exit 0) without it
    python benchmarks/gpu_check.py --device cuda:1 --json-out gpu_check.json
    python benchmarks/gpu_check.py --device cpu --model tiny --steps 20   # a smoke run on CPU (no sync check)

The standard stack is bf16 autocast (fp32 on CPU), EMA, gradient clipping and
AdamW-free SGD; the hand-written stack does the same work in a plain loop. Models
(``--model``, repeatable): ``gpu`` MLP 2048->8192->2048 batch 512 (33.6 M
parameters), ``small`` MLP 256->1024->256 batch 64 (launch-bound), ``tiny``
(a CPU smoke run). Each model gets three sections:

1. **Loop cost, no checkpoints.** Whole-run time per step, round-robin:
   nvtrain with no plugins against a bare hand-written loop, and nvtrain with
   the standard stack against the hand-written stack. ``torch.cuda.synchronize()``
   before each clock stop. Then the steady state: the median single step (host
   interval between two batch hand-outs, all rounds pooled), which leaves out the
   run's start and end and the steps a busy host disturbed; the targets are read
   from these ratios, the whole-run ones are reported next to them. Last, the
   host work per step as a count of Python calls (one more run of each loop,
   under cProfile): exact where the timings differ by less than the noise. On
   CUDA, the peak device memory of one more run of each, above what was allocated
   when it began: a loop that keeps a micro-batch's outputs into the next forward
   shows them here.
2. **Checkpoint cost**, reported apart from the loop: a save every
   ``--checkpoint-every`` steps (and at the end of the run). The hand-written
   loop writes as durably as ``CheckpointHook`` does (``torch.save`` to a
   temporary file, fsync, atomic rename, fsync of the directory). Per save:
   the time the training thread is blocked (the device queue drained first, in
   both loops, so the figure is the save's own), the time in the writer, the
   bytes written and the write throughput; the wait for the last write at the
   end of the run; whole-run ratios against the durable hand-written loop; and,
   for ``async_save``, the median step time while a write runs in the background
   against steps with none (host-side intervals between batch hand-outs). Both
   background writers are measured: the writer process (the default) and a
   thread of the training process (``async_writer="thread"``).
3. **No host-device synchronisation** (CUDA only) on a step that neither logs
   nor checkpoints: those steps run under ``torch.cuda.set_sync_debug_mode("error")``,
   which raises on any synchronising call. The mode is switched on at
   BEFORE_BATCH (before every other implementation) and off at AFTER_BATCH
   (after every other), except on checkpoint steps, which copy the state to the
   host by design. (The warm-up step before ``run()`` is not guarded.)

Then, on CUDA with the nvtrain-fsdp plugin installed (``--no-fsdp`` leaves it out),
**FSDP on one rank**: a one-process NCCL group, the first model trained with the
standard stack under ``FSDPHook(param_dtype="bf16")`` against the same stack
without it (per step, round-robin), and one checked run: the parameters are
DTensor shards, the run writes a sharded checkpoint, and its consolidated export
equals the gathered weights.

Exit status: 0 passed or skipped, 1 a synchronisation was found or the FSDP check failed, 2 bad
arguments (a ``--device`` that is not a torch device, ``meta``, or one this machine lacks other than
CUDA, which skips).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch

import nvtrain
from nvtrain import plugins
from nvtrain.hooks import GradientClippingHook
from nvtrain.state import strategy_hooks

from harness import (
    TINY_MLP,
    MLPSpec,
    StampedBatches,
    Timing,
    hand_written_workload,
    make_batches,
    measure,
    peak_device_memory,
    python_calls_per_unit,
    ratio,
    strategy_workload,
)

GPU_MLP = MLPSpec(2048, 8192, 2048, 512)
SMALL_MLP = MLPSpec(256, 1024, 256, 64)
MODELS = {"gpu": GPU_MLP, "small": SMALL_MLP, "tiny": TINY_MLP}
CHECKPOINT_EVERY = 100
EMA_DECAY = 0.999
MAX_NORM = 1.0

StepFactory = Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[Any, Any, int], None]]


@functools.lru_cache(maxsize=1)
def _batches(spec: MLPSpec, steps: int, device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """One model's batches, drawn once for all its sections (200 batches of the 33.6M model take seconds to
    draw); the next model's replace them. No section changes them: each gets a list of its own."""
    return tuple(make_batches(spec, steps, device=device))


def resolve_device(name: str) -> torch.device | None:
    """The device to measure on, with its index (``cuda`` means the current CUDA device); None without CUDA."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        return None
    if device.index is None:  # torch.cuda.set_device and friends need an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_problem(name: str) -> str | None:
    """Why ``--device name`` cannot be measured on, or None; CUDA on a machine without it is no problem (a skip)."""
    from nvtrain.commands.bench import device_problem as bench_device_problem

    with contextlib.suppress(RuntimeError, ValueError, TypeError):
        if torch.device(name).type == "cuda" and not torch.cuda.is_available():
            return None
    return bench_device_problem(name)


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the stacks -------------------------------------------------------------------------------------


def standard_stack(precision: str, checkpoint: dict[str, Any] | None = None) -> list[object]:
    """bf16/fp32 autocast, EMA, clipping; with ``checkpoint`` (CheckpointHook settings) also saves."""
    hooks: list[object] = [
        plugins.load("amp", precision=precision),
        plugins.load("ema", decay=EMA_DECAY),
        GradientClippingHook(max_norm=MAX_NORM),
    ]
    if checkpoint is not None:
        hooks.append(plugins.load("checkpoint", **checkpoint))
    return hooks


def durable_save(state: Any, path: Path) -> int:
    """What CheckpointHook guarantees, by hand: temporary file, fsync, atomic rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path.stat().st_size


class SaveLog:
    """Per-save figures of one candidate: blocked time, writer time, bytes, the writer's busy intervals."""

    def __init__(self) -> None:
        self.blocked_ns: list[int] = []
        #: The blocked time of each run's first save: it pays for what a run sets up once (the writer
        #: process's shared-memory block, and on CUDA its page-locking), so it is reported apart.
        self.first_blocked_ns: list[int] = []
        self.writer_ns: list[int] = []
        self.bytes: list[int] = []
        self.end_wait_ns: list[int] = []
        self.busy: list[tuple[int, int]] = []  # perf_counter_ns (start, end) of each write
        self._lock = threading.Lock()

    def blocked(self, elapsed: int, *, first: bool) -> None:
        (self.first_blocked_ns if first else self.blocked_ns).append(elapsed)

    def wrote(self, start: int, end: int) -> None:
        with self._lock:
            self.writer_ns.append(end - start)
            self.busy.append((start, end))

    def summary(self) -> dict[str, Any]:
        def median_ms(values: Sequence[int]) -> float | None:
            return statistics.median(values) / 1e6 if values else None

        size = int(statistics.median(self.bytes)) if self.bytes else None
        writer_ms = median_ms(self.writer_ns)
        later = self.blocked_ns or self.first_blocked_ns  # a run of one save has only first ones
        return {
            "saves": len(self.blocked_ns) + len(self.first_blocked_ns),
            # a run's later saves: the steady cost; its first one apart (what it sets up once)
            "blocked_ms_per_save": median_ms(later),
            "blocked_ms_first_save": median_ms(self.first_blocked_ns),
            "blocked_ms_max": max(later) / 1e6 if later else None,
            "writer_ms_per_save": writer_ms,
            "bytes_per_save": size,
            "write_mb_per_s": size / 1e3 / writer_ms if size and writer_ms else None,
            # nvtrain: AFTER_TRAINING, the save of the last step and the wait for the write in flight
            "end_of_run_ms": median_ms(self.end_wait_ns),
        }


def hand_written_stack(
    device: torch.device, dtype: torch.dtype, *, save: tuple[Path, int, int, SaveLog] | None = None
) -> StepFactory:
    """The standard stack by hand; ``save=(directory, every, last_step, log)`` adds durable saves."""

    def make(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Any, Any, int], None]:
        params: list[torch.Tensor] = list(model.parameters())
        averaged = [p.detach().clone() for p in params]
        mse_loss = torch.nn.functional.mse_loss
        clock = time.perf_counter_ns
        saved_once: list[int] = []  # this run's saves (its first one is logged apart)

        def step(inputs: Any, targets: Any, number: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = mse_loss(model(inputs), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
            with torch.no_grad():
                torch._foreach_lerp_(averaged, params, 1.0 - EMA_DECAY)
            if save is None or number == 1:  # the warm-up step saves nothing (nvtrain's saves none either)
                return
            directory, every, last_step, log = save
            if number % every == 0 or number == last_step:
                _drain(device)
                start = clock()
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "ema": averaged}
                written = durable_save(state, directory / f"step_{number}.pt")
                end = clock()
                log.blocked(end - start, first=not saved_once)
                saved_once.append(number)
                log.wrote(start, end)
                log.bytes.append(written)

        return step

    return make


class _SaveStopwatch:
    """Times CheckpointHook's save of a due step, from just before the hook (PRIORITY_LAST - 1) to just after.

    The save of a step happens at its AFTER_BATCH, or at the AFTER_VALIDATION / AFTER_EPOCH that
    follows it (a step whose validation follows, or that ends its epoch); each of those stages is
    timed while the step is unsaved, and the one in which the hook's ``last_saved_step``
    moved is logged. On save stages the device queue is drained before the clock starts, as in
    the hand-written loop.
    """

    plugin_name = "gpu_check_save_stopwatch"

    def __init__(self, device: torch.device, every: int, log: SaveLog) -> None:
        self.device, self.every, self.log = device, every, log
        self.started: int | None = None
        self.pending = False
        self.saved_before: int | None = None
        self.first = True  # one stopwatch per run: its first save is logged apart
        self.stop = _StopwatchEnd(self)

    def due(self, ctx: nvtrain.TrainingContext) -> bool:
        return bool(ctx.sync_gradients) and not ctx.step_skipped and ctx.step_count % self.every == 0

    def saved_step(self, ctx: nvtrain.TrainingContext) -> int | None:
        """The checkpoint hook's last save taken (set at once, also when an async write goes on)."""
        for hook in strategy_hooks(ctx.strategy):  # type: ignore[arg-type]
            if hasattr(hook, "last_saved_step"):
                return hook.last_saved_step  # type: ignore[no-any-return]
        return None

    def start(self, ctx: nvtrain.TrainingContext) -> None:
        _drain(self.device)
        self.saved_before = self.saved_step(ctx)
        self.started = time.perf_counter_ns()

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST - 1)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.started = None
        if ctx.windowed and self.due(ctx):
            self.pending = True
        if self.pending:
            self.start(ctx)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST - 1)
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        if self.pending:
            self.start(ctx)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST - 1)
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        if self.pending:
            self.start(ctx)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST - 1)
    def after_training(self, ctx: nvtrain.TrainingContext) -> None:
        self.pending = False
        _drain(self.device)
        self.started = time.perf_counter_ns()


class _StopwatchEnd:
    plugin_name = "gpu_check_save_stopwatch_end"

    def __init__(self, start: _SaveStopwatch) -> None:
        self.start = start

    def _stop_if_saved(self, ctx: nvtrain.TrainingContext) -> None:
        start = self.start
        if start.started is None:
            return
        elapsed = time.perf_counter_ns() - start.started
        start.started = None
        if start.saved_step(ctx) != start.saved_before:  # the save happened in this stage
            start.log.blocked(elapsed, first=start.first)
            start.first = False
            start.pending = False

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST + 1)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self._stop_if_saved(ctx)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST + 1)
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self._stop_if_saved(ctx)

    @nvtrain.hookimpl(wrapper=True, priority=nvtrain.PRIORITY_LAST - 1)
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> Generator[None, Any, Any]:
        # CheckpointHook saves an epoch's end in its (innermost) AFTER_EPOCH wrapper, after every plain hook
        result = yield
        self._stop_if_saved(ctx)
        return result

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST + 1)
    def after_training(self, ctx: nvtrain.TrainingContext) -> None:
        if self.start.started is not None:
            self.start.log.end_wait_ns.append(time.perf_counter_ns() - self.start.started)
            self.start.started = None


@contextlib.contextmanager
def timing_the_writer(logs: dict[str, SaveLog], current: list[str]) -> Iterator[bool]:
    """Time every write: the checkpoint plugin's ``save_checkpoint`` in this process (sync saves and the
    writer thread) and the hand-over to its writer process (from the hand-over to the answer, not counting
    the writer's start-up). Yields whether it could."""
    try:
        from nvtrain_checkpoint import storage
        from nvtrain_checkpoint.writer_process import WriterProcess
    except ImportError:
        yield False
        return
    original = storage.save_checkpoint
    handed_over = WriterProcess.save

    def timed(*args: Any, **kwargs: Any) -> Any:
        log = logs[current[0]]
        start = time.perf_counter_ns()
        result = original(*args, **kwargs)
        log.wrote(start, time.perf_counter_ns())
        return result

    def timed_handover(process: WriterProcess, *args: Any, **kwargs: Any) -> Any:
        process.wait_until_ready()  # a run's first save may find the writer still importing torch
        log = logs[current[0]]
        start = time.perf_counter_ns()
        result = handed_over(process, *args, **kwargs)
        log.wrote(start, time.perf_counter_ns())
        return result

    storage.save_checkpoint = timed
    WriterProcess.save = timed_handover  # type: ignore[method-assign]
    try:
        yield True
    finally:
        storage.save_checkpoint = original
        WriterProcess.save = handed_over  # type: ignore[method-assign]


def _warm_writer_process() -> None:
    """Start one checkpoint writer process and leave it idle, so no timed run waits for one to start
    (runs hand it on to the next, as the runs of a sweep in one process do)."""
    try:
        from nvtrain_checkpoint import writer_process
        from nvtrain_checkpoint.staging import shared_memory_supported
    except ImportError:
        return
    if shared_memory_supported():
        writer = writer_process.acquire()
        writer.wait_until_ready()
        writer_process.release(writer)


class ClockedBatches:
    """Batches that record ``perf_counter_ns`` at each hand-out (absolute times, one list per pass)."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches
        self.passes: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]

    def __iter__(self) -> Iterator[Any]:
        stamps: list[int] = []
        self.passes.append(stamps)
        for batch in self.batches:
            stamps.append(time.perf_counter_ns())
            yield batch


def steps_during_writes(clocked: ClockedBatches, log: SaveLog) -> dict[str, Any]:
    """Median step interval while a background write runs against steps with none.

    A step is "during a write" when its interval lies inside a write's busy interval;
    steps that contain a save call (blocked) or overlap a write's start or end are left out.
    """
    during: list[int] = []
    idle: list[int] = []
    busy = sorted(log.busy)
    for stamps in clocked.passes:
        for start, end in itertools.pairwise(stamps[1:]):  # the first interval includes the run's start
            inside = any(b0 <= start and end <= b1 for b0, b1 in busy)
            touches = any(start < b1 and b0 < end for b0, b1 in busy)
            if inside:
                during.append(end - start)
            elif not touches:
                idle.append(end - start)
    result: dict[str, Any] = {"steps_during_writes": len(during), "steps_without": len(idle)}
    if during and idle:
        result["step_us_during_writes"] = statistics.median(during) / 1e3
        result["step_us_without"] = statistics.median(idle) / 1e3
        result["ratio"] = statistics.median(during) / statistics.median(idle)
    return result


# -- the sections ------------------------------------------------------------------------------------


def _per_step(timings: dict[str, Timing]) -> dict[str, dict[str, float]]:
    return {name: {"median_us": t.median / 1e3, "min_us": t.min / 1e3} for name, t in timings.items()}


def loop_cost(spec: MLPSpec, device: torch.device, steps: int, rounds: int) -> dict[str, Any]:
    """Whole-run time per step without any checkpoint: nvtrain against hand-written loops."""
    batches = list(_batches(spec, steps, device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    precision = "bf16" if device.type == "cuda" else "fp32"
    names = ("bare loop", "nvtrain, no plugins", "hand-written stack", "nvtrain, standard stack")
    stamped = {name: StampedBatches(batches) for name in names}  # each candidate's own single-step clock
    timings = measure(
        {
            names[0]: hand_written_workload(spec, stamped[names[0]], device=device),
            names[1]: strategy_workload(spec, stamped[names[1]], device=device),
            names[2]: hand_written_workload(
                spec, stamped[names[2]], make_step=hand_written_stack(device, dtype), device=device
            ),
            names[3]: strategy_workload(spec, stamped[names[3]], lambda: standard_stack(precision), device=device),
        },
        rounds=rounds,
    )
    steady = {name: stamped[name].step_figures() for name in names}
    # One more run of each, profiled, on unstamped batches: the host work per step as a call count.
    calls = {
        names[0]: python_calls_per_unit(hand_written_workload(spec, batches, device=device)),
        names[1]: python_calls_per_unit(strategy_workload(spec, batches, device=device)),
        names[2]: python_calls_per_unit(
            hand_written_workload(spec, batches, make_step=hand_written_stack(device, dtype), device=device)
        ),
        names[3]: python_calls_per_unit(strategy_workload(spec, batches, lambda: standard_stack(precision), device=device)),
    }
    # Peak device memory above the run's start (CUDA only): what a loop keeps alive between micro-batches.
    peak = {
        names[0]: peak_device_memory(hand_written_workload(spec, batches, device=device), device),
        names[1]: peak_device_memory(strategy_workload(spec, batches, device=device), device),
        names[2]: peak_device_memory(
            hand_written_workload(spec, batches, make_step=hand_written_stack(device, dtype), device=device), device
        ),
        names[3]: peak_device_memory(
            strategy_workload(spec, batches, lambda: standard_stack(precision), device=device), device
        ),
    }
    # When the device is the bottleneck the host runs ahead and then waits in bursts, so its single-step
    # intervals say nothing about the step; they do when the host is (a launch-bound model).
    launch_bound = steady[names[0]]["median"] >= 0.9 * timings[names[0]].median
    return {
        "launch_bound": launch_bound,
        "per_step": _per_step(timings),
        "ratio_no_plugins": ratio(timings[names[1]], timings[names[0]]).to_dict(),
        "ratio_standard_stack": ratio(timings[names[3]], timings[names[2]]).to_dict(),
        # single steps (host intervals between batch hand-outs, every round pooled): the run's start and
        # end and the odd disturbed step left out, so these resolve a few per cent on a busy host
        "steady_step": {name: {key: value / 1e3 for key, value in figures.items()} for name, figures in steady.items()},
        "steady_ratio_no_plugins": _steady_ratio(steady[names[1]], steady[names[0]]),
        "steady_ratio_standard_stack": _steady_ratio(steady[names[3]], steady[names[2]]),
        "python_calls_per_step": calls,
        "peak_memory_bytes": peak,
    }


def _steady_ratio(candidate: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    return {"median": candidate["median"] / baseline["median"], "p10": candidate["p10"] / baseline["p10"]}


def checkpoint_cost(
    spec: MLPSpec, device: torch.device, steps: int, rounds: int, every: int, directory: Path
) -> dict[str, Any]:
    """The standard stack saving every ``every`` steps: blocked time, writer time, bytes, throughput, ratios."""
    batches = list(_batches(spec, steps, device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    precision = "bf16" if device.type == "cuda" else "fp32"
    names = (
        "hand-written, durable save",
        "nvtrain, checkpoint (sync)",
        "nvtrain, checkpoint (async)",
        "nvtrain, checkpoint (async, thread)",
    )
    logs = {name: SaveLog() for name in names}
    current = [names[0]]
    clocked = ClockedBatches(batches)
    clocked_thread = ClockedBatches(batches)
    last_step = steps + 1  # the warm-up step is 1; the timed run's steps are 2 .. steps + 1

    def fresh(name: str) -> Path:
        current[0] = name
        path = directory / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def hand() -> StepFactory:
        log = logs[names[0]]
        return hand_written_stack(device, dtype, save=(fresh(names[0]), every, last_step, log))

    def nvtrain_stack(name: str, async_save: bool, writer: str = "process") -> Callable[[], list[object]]:
        def hooks() -> list[object]:
            root = fresh(name)
            stopwatch = _SaveStopwatch(device, every, logs[name])
            settings = {"checkpoint_dir": root, "step_interval": every, "async_save": async_save}
            if async_save:
                settings["async_writer"] = writer
            return [*standard_stack(precision, settings), stopwatch, stopwatch.stop]

        return hooks

    workloads = {
        "hand-written stack, no checkpoint": hand_written_workload(
            spec, batches, make_step=hand_written_stack(device, dtype), device=device
        ),
        names[0]: hand_written_workload(
            spec, batches, make_step=lambda model, optimizer: hand()(model, optimizer), device=device
        ),
        names[1]: strategy_workload(spec, batches, nvtrain_stack(names[1], False), device=device),
        names[2]: strategy_workload(spec, cast(Sequence[Any], clocked), nvtrain_stack(names[2], True), device=device),
        names[3]: strategy_workload(
            spec, cast(Sequence[Any], clocked_thread), nvtrain_stack(names[3], True, "thread"), device=device
        ),
    }
    _warm_writer_process()
    with timing_the_writer(logs, current) as writer_timed:
        # No warm-up round: the writer process is warm, each run's first save is reported apart, and a
        # round of the 33.6M model writes 12 fsync'd checkpoints of 268 MB.
        timings = measure(workloads, rounds=rounds, warmup=0)
    for name in names[1:]:  # bytes of the last round's checkpoints
        root = directory / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        for step_dir in sorted(p for p in root.glob("step_*") if p.is_dir()):
            logs[name].bytes.append(sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file()))
    saves = {name: logs[name].summary() for name in names}
    if not writer_timed:
        for name in names[1:]:
            saves[name]["writer_ms_per_save"] = saves[name]["write_mb_per_s"] = None
    baseline = timings[names[0]]
    return {
        "every": every,
        "per_step": _per_step(timings),
        "saves": saves,
        "ratio_sync_vs_hand_written_durable": ratio(timings[names[1]], baseline).to_dict(),
        "ratio_async_vs_hand_written_durable": ratio(timings[names[2]], baseline).to_dict(),
        "async_steps_during_writes": steps_during_writes(clocked, logs[names[2]]),
        "ratio_async_thread_vs_hand_written_durable": ratio(timings[names[3]], baseline).to_dict(),
        "async_thread_steps_during_writes": steps_during_writes(clocked_thread, logs[names[3]]),
    }


class SyncGuard:
    """Raises on any host-device sync between BEFORE_BATCH and AFTER_BATCH of a non-checkpoint step."""

    plugin_name = "sync_guard"

    def __init__(self, every: int) -> None:
        self.every = every
        self.guarded_steps = 0

    # Wrappers, outermost: the bus calls every wrapper before the plain implementations, so plain hookimpls at
    # any priority would leave other wrappers' code before BEFORE_BATCH's and after AFTER_BATCH's yield unguarded.
    @nvtrain.hookimpl(wrapper=True, priority=nvtrain.PRIORITY_FIRST - 1)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> Any:
        if ctx.windowed and (ctx.step_count + 1) % self.every:
            torch.cuda.set_sync_debug_mode("error")
            self.guarded_steps += 1
        return (yield)

    @nvtrain.hookimpl(wrapper=True, priority=nvtrain.PRIORITY_FIRST - 1)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> Any:
        try:
            return (yield)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def close(self) -> None:
        torch.cuda.set_sync_debug_mode("default")


def check_no_sync(spec: MLPSpec, device: torch.device, steps: int, every: int, directory: Path) -> dict[str, Any]:
    """Train ``steps`` steps with the stack, checkpoints and the guard; a sync inside a guarded step raises."""
    guard = SyncGuard(every)
    batches = list(_batches(spec, steps, device))
    checkpoint = {"checkpoint_dir": directory, "step_interval": every}
    workload = strategy_workload(spec, batches, lambda: [guard, *standard_stack("bf16", checkpoint)], device=device)
    strategy = workload.prepare()
    try:
        workload.run(strategy)
    finally:
        torch.cuda.set_sync_debug_mode("default")  # first: closing may synchronise (a checkpoint's flush)
        strategy.close()
    return {"guarded_steps": guard.guarded_steps, "synchronisations": 0}


def fsdp_one_rank(
    spec: MLPSpec, device: torch.device, steps: int, rounds: int, every: int, directory: Path
) -> dict[str, Any]:
    """The standard stack sharded by FSDPHook in a one-process group (NCCL on CUDA, gloo on the CPU).

    Per step against the same stack without FSDP (round-robin), then one run that checks the
    parameters are DTensors, a sharded checkpoint was written, and its export equals the weights.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return {"skipped": "a process group exists already"}
    cuda = device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    options: dict[str, Any] = {"device_id": device} if cuda else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    try:
        param_dtype = "bf16" if cuda else None
        batches = list(_batches(spec, steps, device))
        timings = measure(
            {
                "standard stack": strategy_workload(
                    spec, batches, lambda: standard_stack("bf16" if cuda else "fp32"), device=device
                ),
                "standard stack, FSDP": strategy_workload(
                    spec,
                    batches,
                    lambda: [plugins.load("fsdp", param_dtype=param_dtype), *standard_stack("fp32")],
                    device=device,
                ),
            },
            rounds=rounds,
        )
        root = directory / "fsdp"
        saves = {"checkpoint_dir": root, "step_interval": every}
        checked = [plugins.load("fsdp", param_dtype=param_dtype), *standard_stack("fp32", saves)]
        workload = strategy_workload(spec, batches, lambda: checked, device=device)
        strategy = workload.prepare()
        try:
            workload.run(strategy)
            model = strategy.ctx.models["main"]
            sharded = all(type(p).__name__ == "DTensor" for p in model.parameters())
            weights = {
                name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu()
                for name, value in model.state_dict().items()
            }
        finally:
            strategy.close()
        latest = root / (root / "latest").read_text(encoding="utf-8").strip()
        manifest = json.loads((latest / "manifest.json").read_text(encoding="utf-8"))
        exported = torch.load(checked[-1].export(directory / "fsdp-export.pt"), weights_only=True)  # type: ignore[attr-defined]
        export_equal = sorted(exported) == sorted(weights) and all(
            torch.equal(exported[name], value) for name, value in weights.items()
        )
    finally:
        dist.destroy_process_group()
    return {
        "backend": backend,
        "param_dtype": param_dtype or "float32",
        "per_step": _per_step(timings),
        "ratio_fsdp_vs_plain": ratio(timings["standard stack, FSDP"], timings["standard stack"]).to_dict(),
        "sharded_parameters": sharded,
        "checkpoint": {"step": manifest["step"], "sharded": manifest.get("sharded"), "files": len(manifest["files"])},
        "export_equals_weights": export_equal,
        "passed": sharded and isinstance(manifest.get("sharded"), dict) and export_equal,
    }


# -- the report ---------------------------------------------------------------------------------------


def _ratio_text(figures: dict[str, float]) -> str:
    return f"{figures['median']:.3f}x (min {figures['min']:.3f}x)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e6:.1f} MB" if value >= 1e6 else f"{value / 1e3:.1f} kB"


def _print_loop(loop: dict[str, Any]) -> None:
    print("  loop cost, no checkpoints (whole run / steps):")
    for name, figures in loop["per_step"].items():
        print(f"    {name:36s} {figures['median_us']:10.1f} us/step (min {figures['min_us']:.1f})")
    print(f"    nvtrain / bare loop:               {_ratio_text(loop['ratio_no_plugins'])}")
    print(f"    standard stack / hand-written:     {_ratio_text(loop['ratio_standard_stack'])}")
    print("  loop cost, steady state (single steps, every round pooled):")
    if not loop["launch_bound"]:
        print("    (the device is the bottleneck here: host intervals are bursts; read the whole-run figures)")
    for name, figures in loop["steady_step"].items():
        print(f"    {name:36s} {figures['median']:10.1f} us/step (p10 {figures['p10']:.1f})")
    for label_, key in (
        ("nvtrain / bare loop", "steady_ratio_no_plugins"),
        ("standard stack / hand-written", "steady_ratio_standard_stack"),
    ):
        figures = loop[key]
        print(f"    {label_ + ':':34s} {figures['median']:.3f}x (p10 {figures['p10']:.3f}x)")
    calls = list(loop["python_calls_per_step"].values())
    print(
        "  host work (Python calls per step, cProfile): "
        f"bare {calls[0]:.0f}, nvtrain {calls[1]:.0f} ({calls[1] - calls[0]:+.0f}); "
        f"hand-written stack {calls[2]:.0f}, standard stack {calls[3]:.0f} ({calls[3] - calls[2]:+.0f})"
    )
    peak = list(loop["peak_memory_bytes"].values())
    if None not in peak:
        print(
            "  peak device memory above the run's start: "
            f"bare {_size(peak[0])}, nvtrain {_size(peak[1])} ({(peak[1] - peak[0]) / 1e6:+.1f} MB); "
            f"hand-written stack {_size(peak[2])}, standard stack {_size(peak[3])} "
            f"({(peak[3] - peak[2]) / 1e6:+.1f} MB)"
        )


def _print_checkpoint(ckpt: dict[str, Any]) -> None:
    print(f"  checkpoint cost (a save every {ckpt['every']} steps and at the end):")
    for name, figures in ckpt["per_step"].items():
        print(f"    {name:36s} {figures['median_us']:10.1f} us/step (min {figures['min_us']:.1f})")
    for name, save in ckpt["saves"].items():
        rate = save["write_mb_per_s"]
        print(
            f"    {name:36s} blocked {_ms(save['blocked_ms_per_save'])}/save (a run's first "
            f"{_ms(save['blocked_ms_first_save'])}), writer {_ms(save['writer_ms_per_save'])}"
            f"/save, {_size(save['bytes_per_save'])}/save, {'-' if rate is None else f'{rate:.0f} MB/s'}"
            + (f", end of run {_ms(save['end_of_run_ms'])}" if save["end_of_run_ms"] is not None else "")
        )
    print(f"    sync save / durable hand-written:  {_ratio_text(ckpt['ratio_sync_vs_hand_written_durable'])}")
    print(f"    async save / durable hand-written: {_ratio_text(ckpt['ratio_async_vs_hand_written_durable'])}")
    print(f"    (writer thread) / hand-written:    {_ratio_text(ckpt['ratio_async_thread_vs_hand_written_durable'])}")
    for label_, key in (("async", "async_steps_during_writes"), ("async, thread", "async_thread_steps_during_writes")):
        during = ckpt[key]
        if "ratio" in during:
            print(
                f"    {label_}: steps during a write {during['step_us_during_writes']:.1f} us vs "
                f"{during['step_us_without']:.1f} us without ({during['ratio']:.3f}x; "
                f"{during['steps_during_writes']} / {during['steps_without']} steps)"
            )
        else:
            print(f"    {label_}: too few steps during a write to compare ({during})")


def _print_fsdp(fsdp: dict[str, Any]) -> None:
    if "skipped" in fsdp:
        print(f"fsdp, one rank: skipped: {fsdp['skipped']}")
        return
    print(f"fsdp, one rank ({fsdp['backend']}, param_dtype {fsdp['param_dtype']}, model {fsdp['model']}):")
    for name, figures in fsdp["per_step"].items():
        print(f"    {name:36s} {figures['median_us']:10.1f} us/step (min {figures['min_us']:.1f})")
    print(f"    FSDP / plain:                      {_ratio_text(fsdp['ratio_fsdp_vs_plain'])}")
    print(
        f"    DTensor parameters {fsdp['sharded_parameters']}, sharded checkpoint at step "
        f"{fsdp['checkpoint']['step']} ({fsdp['checkpoint']['files']} files), export equals the weights "
        f"{fsdp['export_equals_weights']}: {'passed' if fsdp['passed'] else 'FAILED'}"
    )


def print_report(report: dict[str, Any]) -> None:
    """The report in text; a section that failed prints its error, one the run did not reach is left out."""
    gpu = f" ({report['gpu']})" if "gpu" in report else ""
    print(f"gpu_check: {report['device']}{gpu}, torch {report['torch']}")
    for label, model in report["models"].items():
        print(f"model {label}: MLP {model['spec']}, {model['steps']} steps x {model['rounds']} rounds")
        for key, printer in (("loop", _print_loop), ("checkpoint", _print_checkpoint)):
            section = model.get(key)
            if section is not None and "error" in section:
                print(f"  {key}: FAILED: {section['error']}")
            elif section is not None:
                printer(section)
        if "sync_check" in model:
            print(f"  sync check: {model['sync_check']}")
    fsdp = report.get("fsdp")
    if fsdp is not None and "error" in fsdp:
        print(f"fsdp, one rank: FAILED: {fsdp['error']}")
    elif fsdp is not None:
        _print_fsdp(fsdp)
    if not report.get("complete", True):
        print(f"gpu_check: INCOMPLETE: {report.get('stopped', 'the run stopped before its last section')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default: the current CUDA device), cuda:N, or cpu")
    parser.add_argument(
        "--model",
        action="append",
        choices=sorted(MODELS),
        help="gpu, small or tiny; repeatable (default: gpu and small)",
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per timed run (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per candidate (default 3)")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=CHECKPOINT_EVERY,
        help=f"steps between saves (default {CHECKPOINT_EVERY}; at most half the steps)",
    )
    parser.add_argument("--no-fsdp", action="store_true", help="leave out the one-rank FSDP case (CUDA only)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--json-out", type=Path, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.rounds < 1 or args.checkpoint_every < 1:
        parser.error("--steps must be >= 3, --rounds and --checkpoint-every >= 1")
    problem = device_problem(args.device)
    if problem is not None:
        parser.error(problem)
    device = resolve_device(args.device)
    if device is None:
        print("gpu_check: skipped: no CUDA device (GPU figures are not measured on this machine)")
        return 0
    every = min(args.checkpoint_every, max(1, args.steps // 2))
    report: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "models": {}, "complete": False}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        report["gpu"] = torch.cuda.get_device_name(device)
    directory = Path(tempfile.mkdtemp(prefix="nvtrain-gpu-check-"))
    failed = False

    def section(slot: dict[str, Any], key: str, measure_it: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one section into ``slot[key]``: its error is recorded and the next section runs; the report so
        far is written after each one, so a time limit or a crash later loses none of it."""
        nonlocal failed
        try:
            slot[key] = measure_it()
        except Exception as err:  # recorded in the report, which goes on: one broken section loses no other
            slot[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            failed = True
        _write_json(args.json_out, report)
        return slot[key]  # type: ignore[no-any-return]

    previous_term = signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a time limit's SIGTERM ends the script
    try:
        for label in args.model or ["gpu", "small"]:
            spec = MODELS[label]
            model: dict[str, Any] = {"spec": spec.label, "steps": args.steps, "rounds": args.rounds}
            report["models"][label] = model
            if device.type == "cuda":
                check = functools.partial(check_no_sync, spec, device, args.steps, every, directory / f"sync-{label}")
                failed = failed or "error" in section(model, "sync_check", check)
            section(model, "loop", functools.partial(loop_cost, spec, device, args.steps, args.rounds))
            costs = functools.partial(checkpoint_cost, spec, device, args.steps, args.rounds, every, directory / label)
            section(model, "checkpoint", costs)
        if device.type == "cuda" and not args.no_fsdp:
            label = (args.model or ["gpu"])[0]
            if not any(info.name == "fsdp" for info in plugins.available()):
                report["fsdp"] = {"skipped": "the nvtrain-fsdp plugin is not installed"}
            else:
                one_rank = functools.partial(
                    fsdp_one_rank, MODELS[label], device, args.steps, args.rounds, every, directory / "fsdp-check"
                )
                fsdp = section(report, "fsdp", lambda: {"model": label, **one_rank()})
                failed = failed or fsdp.get("passed") is False
        report["complete"] = True
    except _Stopped as stopped:
        report["stopped"] = str(stopped)
        failed = True
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)
    _write_json(args.json_out, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 1 if failed else 0


class _Stopped(BaseException):
    """SIGTERM (the suite's time limit): the sections done so far are reported, the temporary folder removed.
    Not an Exception: a section's own error handling must not take it for a failure of that section."""


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise _Stopped("stopped by SIGTERM (a time limit) before the last section; the sections above are complete")


def _write_json(path: Path | None, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` whole or not at all (a temporary file, then one rename)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
