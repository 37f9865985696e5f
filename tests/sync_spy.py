"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode``: records the calls that would synchronise on CUDA.

nvtrain promises no host-device synchronisation on the per-batch path of a step that
neither logs, checkpoints nor validates, apart from a few documented policies. On a GPU,
``benchmarks/gpu_check.py`` checks that with CUDA's own sync debug mode; CI has no GPU, so
this module recognises the same calls on CPU tensors:

- :class:`SyncSpy` enters a ``TorchFunctionMode`` (host reads such as ``.item()``,
  ``bool(tensor)``, ``.tolist()``, printing a tensor, blocking ``.to(device)``, boolean-mask
  indexing, ops whose output shape depends on the data) and a ``TorchDispatchMode`` (the
  same aten ops reached from C++, which no Python function call announces);
- :class:`SyncGuard` is a hook that switches the spy on from the first BEFORE_BATCH
  implementation to the last AFTER_BATCH one, and keeps one :class:`MicroBatchRecord` per
  micro-batch the promise covers (accumulating micro-batches always; a window's last one
  unless its step logs, checkpoints, validates or ends an epoch or the run);
- :data:`ALLOWED` lists the documented sites with how often each may synchronise, and
  :func:`violations` reports every other event with its call site and a stack excerpt.

Not watched: ``copy_`` and tensors made on a device from host data (on the CPU nothing tells
them from same-device work), and other threads (torch's modes are per thread).
"""

from __future__ import annotations

import functools
import re
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import nvtrain

__all__ = [
    "ALLOWED",
    "GUARD_PRIORITY",
    "Allowance",
    "CallSite",
    "MicroBatchRecord",
    "SyncEvent",
    "SyncGuard",
    "SyncSpy",
    "modes_left_active",
    "report",
    "violations",
]

_REPO = Path(__file__).resolve().parents[1]
_THIS_FILE = __file__
#: Where the code the promise is about lives; a frame there names an event's call site.
_PROJECT_DIRS = ("nvtrain/", "plugins/", "tests/", "benchmarks/")
_STACK_EXCERPT = 6
#: Frames of the interception itself, left out of the stacks events report.
_MACHINERY = (_THIS_FILE, "torch/overrides.py", "torch/utils/_python_dispatch.py")

_T = torch.Tensor
#: Functions that read a tensor's value to the host (the printing ones read all of it).
_HOST_READS: frozenset[Callable[..., Any]] = frozenset(
    {
        _T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.__complex__, _T.tolist, _T.numpy,
        _T.__array__, _T.cpu, _T.__repr__, _T.__format__, _T.__contains__, _T.is_nonzero, torch.is_nonzero,
        _T.equal, torch.equal, _T.allclose, torch.allclose,
    }
)  # fmt: skip
#: Functions whose output shape depends on the data, so the host must wait for it.
_DATA_DEPENDENT_SHAPES: frozenset[Callable[..., Any]] = frozenset(
    {
        _T.nonzero, torch.nonzero, _T.argwhere, torch.argwhere, _T.masked_select, torch.masked_select,
        _T.unique, torch.unique, _T.unique_consecutive, torch.unique_consecutive, _T.bincount, torch.bincount,
    }
)  # fmt: skip
#: aten ops that synchronise when C++ calls them (``clip_grad_norm_(error_if_nonfinite=True)``, a sampler...).
_SYNCING_ATEN_OPS = frozenset(
    {
        "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2", "unique_dim",
        "unique_consecutive", "equal", "is_nonzero", "bincount", "histc", "repeat_interleave", "multinomial",
        "_assert_async",
    }
)  # fmt: skip


def _has_bool_mask(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def _move_target(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The device (or tensor whose device) ``Tensor.to``/``.cuda`` is given, or None for a dtype-only cast."""
    if "device" in kwargs:
        return kwargs["device"]
    for arg in args[1:]:
        if isinstance(arg, torch.Tensor | torch.device | str | int) and not isinstance(arg, bool):
            return arg
    return None


def _non_blocking(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """``non_blocking=True``, as a keyword or positionally (``x.to(device, dtype, True)``)."""
    return bool(kwargs.get("non_blocking")) or any(arg is True for arg in args[1:])


def sync_reason(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """What kind of synchronisation ``func(*args, **kwargs)`` makes on CUDA, or None when it makes none."""
    if func in _HOST_READS:
        return f"host read {func.__name__}"
    if func in _DATA_DEPENDENT_SHAPES:
        return f"data-dependent shape {func.__name__}"
    if func in (torch.repeat_interleave, _T.repeat_interleave) and kwargs.get("output_size") is None:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return "data-dependent shape repeat_interleave" if isinstance(repeats, torch.Tensor) else None
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "data-dependent shape where(condition)"
    if func in (_T.__getitem__, _T.__setitem__) and len(args) > 1 and _has_bool_mask(args[1]):
        return f"data-dependent shape {func.__name__} with a boolean mask"
    if func in (_T.to, _T.cuda) and not _non_blocking(args, kwargs):
        return "blocking device copy" if func is _T.cuda or _move_target(args, kwargs) is not None else None
    return None


@dataclass(frozen=True)
class CallSite:
    """One frame: repository-relative path (site-packages-relative for libraries), line, function, source."""

    path: str
    line: int
    function: str
    source: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}: {self.source}"


@dataclass(frozen=True)
class SyncEvent:
    """One would-be synchronisation: its kind, where nvtrain (or a test's hook) made it, and where it happened.

    ``site`` is the innermost frame in nvtrain/, plugins/, tests/ or benchmarks/ (the code that
    made the call, perhaps through torch), else the innermost frame outside torch; ``inner``
    is the frame that called the syncing function itself (inside torch for GradScaler's read).
    """

    kind: str
    site: CallSite
    inner: CallSite
    stack: tuple[CallSite, ...]

    def describe(self) -> str:
        frames = "\n".join(f"      {frame}" for frame in self.stack)
        return f"{self.kind} at {self.site.path}:{self.site.line} ({self.site.function})\n{frames}"


@functools.cache
def _relative(filename: str) -> str:
    """A frame's file relative to the repository (or to site-packages), as reports and allowances name it."""
    path = str(Path(filename).resolve()) if filename.startswith("/") else filename
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    if path.startswith(str(_REPO) + "/"):
        return path[len(str(_REPO)) + 1 :]
    return path


def _function_name(frames: Sequence[traceback.FrameSummary], index: int) -> str:
    """A frame's function, or for a comprehension or generator expression the function it sits in."""
    frame = frames[index]
    name = frame.name
    while name.startswith("<") and name.endswith(("comp>", "genexpr>")) and index > 0:
        index -= 1
        if frames[index].filename != frame.filename:
            break
        name = frames[index].name
    return name


def _call_site(frames: Sequence[traceback.FrameSummary], index: int, *, enclosing: bool = True) -> CallSite:
    """``frames[index]``; ``enclosing`` names a comprehension's frame after the function it sits in."""
    frame = frames[index]
    function = _function_name(frames, index) if enclosing else frame.name
    return CallSite(_relative(frame.filename), frame.lineno or 0, function, (frame.line or "").strip())


def _site_index(frames: Sequence[traceback.FrameSummary]) -> int:
    """The innermost project frame, else the innermost frame outside torch, else the innermost frame."""
    for index in range(len(frames) - 1, -1, -1):
        if _relative(frames[index].filename).startswith(_PROJECT_DIRS):
            return index
    for index in range(len(frames) - 1, -1, -1):
        if not _relative(frames[index].filename).startswith("torch/"):
            return index
    return len(frames) - 1


def _event(kind: str) -> SyncEvent:
    """The event of a call being made now: the stack without the spy's and torch's mode machinery."""
    frames = [frame for frame in traceback.extract_stack() if not frame.filename.endswith(_MACHINERY)]
    site = _site_index(frames)
    innermost = range(max(site + 1, len(frames) - _STACK_EXCERPT + 1), len(frames))
    stack = tuple(_call_site(frames, i, enclosing=False) for i in (site, *innermost))
    return SyncEvent(kind, _call_site(frames, site), _call_site(frames, len(frames) - 1), stack)


class SyncSpy:
    """Records a :class:`SyncEvent` for every call that would synchronise on CUDA while ``active``.

    Enter it (a ``with`` block) around a whole run: it enters both modes and always leaves them,
    also when the run raises. A call it records runs unobserved inside, so ``print(tensor)``
    (a repr that calls ``.item()`` that calls ``_local_scalar_dense``) counts once.
    """

    def __init__(self) -> None:
        self.events: list[SyncEvent] = []
        self.active = False
        self._recording = 0
        self._modes: ExitStack | None = None

    def __enter__(self) -> SyncSpy:
        if self._modes is not None:
            raise RuntimeError("SyncSpy is already entered; use one with-block per run")
        with ExitStack() as modes:
            modes.enter_context(_FunctionSpy(self))
            modes.enter_context(_DispatchSpy(self))
            self._modes = modes.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.active = False
        modes, self._modes = self._modes, None
        if modes is not None:
            modes.close()

    def observe(self, kind: str | None, call: Callable[[], Any]) -> Any:
        """Run ``call``; record ``kind`` first when it names a synchronisation and nothing records already."""
        if kind is None or not self.active or self._recording:
            return call()
        self.events.append(_event(kind))
        self._recording += 1
        try:
            return call()
        finally:
            self._recording -= 1


class _FunctionSpy(TorchFunctionMode):
    """The Python-level calls: host reads, blocking copies, data-dependent shapes."""

    def __init__(self, spy: SyncSpy) -> None:
        super().__init__()
        self.spy = spy

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = sync_reason(func, args, kwargs) if self.spy.active and not self.spy._recording else None
        return self.spy.observe(kind, lambda: func(*args, **kwargs))


class _DispatchSpy(TorchDispatchMode):
    """The aten ops that synchronise when reached from C++ (no Python call the function mode could see)."""

    def __init__(self, spy: SyncSpy) -> None:
        super().__init__()
        self.spy = spy

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = None
        if self.spy.active and not self.spy._recording:
            name = func._schema.name.split("::")[-1]
            if name in _SYNCING_ATEN_OPS and not (
                name == "repeat_interleave" and kwargs.get("output_size") is not None
            ):
                kind = f"aten.{name} (from C++)"
        return self.spy.observe(kind, lambda: func(*args, **kwargs))


def modes_left_active() -> list[str]:
    """The spy modes still on torch's mode stacks (none once every SyncSpy left its with-block)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    stacks = [*_get_current_function_mode_stack(), *_get_current_dispatch_mode_stack()]
    return [type(mode).__name__ for mode in stacks if isinstance(mode, _FunctionSpy | _DispatchSpy)]


# -- the guard --------------------------------------------------------------------------------------


#: Before every ordinary implementation at BEFORE_BATCH, and (a wrapper's code after ``yield``) after
#: every one at AFTER_BATCH: one below nvtrain's PRIORITY_FIRST, as gpu_check's guard.
GUARD_PRIORITY = nvtrain.PRIORITY_FIRST - 1
#: The scheduler's predicates of a step whose last micro-batch may synchronise (it saves or validates, or ends).
_EXEMPT_PREDICATES = ("is_ckpt_step", "is_val_step", "is_last_step", "is_last_batch")


@dataclass(frozen=True)
class MicroBatchRecord:
    """One micro-batch from BEFORE_BATCH to AFTER_BATCH: its counters, why it may sync (if it may), its events."""

    batch_count: int
    step_count: int
    ends_window: bool
    step_skipped: bool
    exempt: tuple[str, ...]
    events: tuple[SyncEvent, ...]


class SyncGuard:
    """Switches the spy on for each micro-batch and records it with the reasons it is exempt (if any).

    ``cadences`` are the stack's own every-N-steps host reads (a logger's ``log_every_n_steps``,
    a CheckpointHook's ``step_interval``, a timing flush): the scheduler does not know them.
    Exempt is only a window's last micro-batch, when its step is such a cadence step (not a
    skipped one) or the scheduler says it saves, validates or ends an epoch or the run.
    Accumulating micro-batches are never exempt.
    """

    plugin_name = "sync_spy_guard"

    def __init__(self, spy: SyncSpy, cadences: Iterable[int] = ()) -> None:
        self.spy = spy
        self.cadences = tuple(cadences)
        self.records: list[MicroBatchRecord] = []
        self._first_event = 0

    @nvtrain.hookimpl(wrapper=True, priority=GUARD_PRIORITY)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> Any:
        self._first_event = len(self.spy.events)
        self.spy.active = True
        return (yield)

    @nvtrain.hookimpl(wrapper=True, priority=GUARD_PRIORITY)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> Any:
        try:
            return (yield)
        finally:
            self.spy.active = False
            events = tuple(self.spy.events[self._first_event :])
            self.records.append(
                MicroBatchRecord(
                    ctx.batch_count, ctx.step_count, ctx.sync_gradients, ctx.step_skipped, self.exempt(ctx), events
                )
            )

    def exempt(self, ctx: nvtrain.TrainingContext) -> tuple[str, ...]:
        """Why this micro-batch may synchronise; empty when the promise covers it."""
        if not ctx.sync_gradients:
            return ()
        reasons = [f"every {n} steps" for n in self.cadences if not ctx.step_skipped and ctx.step_count % n == 0]
        scheduler = ctx.scheduler if ctx.windowed else None
        if scheduler is not None:
            reasons += [name for name in _EXEMPT_PREDICATES if getattr(scheduler, name)]
        if ctx.validation_follows:
            reasons.append("validation_follows")
        if ctx.preempted:
            reasons.append("preempted")
        return tuple(reasons)

    @property
    def guarded(self) -> list[MicroBatchRecord]:
        """The micro-batches the promise covers."""
        return [record for record in self.records if not record.exempt]


# -- the allow-list ---------------------------------------------------------------------------------

#: ``.to(<something>.device)``, ``.to(device)``, ``.to(first_device)``: onto a device another tensor is on.
_ONTO_A_TENSORS_DEVICE = re.compile(r"\.to\(\s*[\w.\[\]]*device\s*\)")


@dataclass(frozen=True)
class Allowance:
    """A documented synchronisation: where (file suffix and function of a frame), which kinds, how often.

    ``frame`` is the frame matched: ``"site"`` (the event's call site) or ``"inner"`` (the frame
    making the call). ``per_micro_batch`` caps the events per guarded micro-batch (None: any
    number, for no-op copies); ``window_end_only`` allows them only on a window's last
    micro-batch (the one that steps). ``same_device`` also requires the call's source line to
    move onto a device named after a tensor's (``.to(x.device)``, ``.to(first_device)``).
    """

    path_suffix: str
    function: str
    kinds: frozenset[str]
    per_micro_batch: int | None
    window_end_only: bool
    policy: str
    frame: Literal["site", "inner"] = "site"
    same_device: bool = False

    def matches(self, event: SyncEvent) -> bool:
        frame = event.site if self.frame == "site" else event.inner
        return (
            event.kind in self.kinds
            and frame.path.endswith(self.path_suffix)
            and frame.function == self.function
            and (not self.same_device or bool(_ONTO_A_TENSORS_DEVICE.search(event.inner.source)))
        )


_COPY = frozenset({"blocking device copy"})

ALLOWED: tuple[Allowance, ...] = (
    Allowance(
        "nvtrain/hooks/spike_skip.py", "_decide", frozenset({"host read tolist"}), 1, True,
        "SpikeSkipHook reads its values once per optimizer step (update-hooks.md)",
    ),
    Allowance(
        "nvtrain_amp/hook.py", "_scaled_step", frozenset({"host read item", "host read __bool__"}), 1, True,
        "fp16: one inf-check read per real step (one optimizer), inside GradScaler.step, or the hook's own for "
        "an optimizer that scales in its kernels (mixed-precision.md)",
    ),
    # Same-device moves: no copy on one GPU, anywhere and any number of times; the CPU cannot
    # tell them from a device-to-host copy, so the call site says which they are.
    *(
        Allowance(path, function, _COPY, None, False, why, frame="inner", same_device=True)
        for path, function, why in (
            ("torch/nn/utils/clip_grad.py", "_get_total_norm", "per-device norms onto the first gradient's device"),
            ("torch/nn/utils/clip_grad.py", "_clip_grads_with_norm_", "the clip coefficient onto each gradient's device"),
            ("nvtrain/hooks/spike_skip.py", "_decide", "the gradient norm onto the loss's device"),
            ("nvtrain_amp/hook.py", "_scaled_step", "fp16, fused optimizer: inf flags onto the first flag's device"),
            ("nvtrain_amp/hook.py", "_publish_metrics", "fp16: inf flags onto the first flag's device"),
        )
    ),
)  # fmt: skip


def _allowance(event: SyncEvent, allowed: Sequence[Allowance]) -> Allowance | None:
    return next((allowance for allowance in allowed if allowance.matches(event)), None)


def violations(records: Iterable[MicroBatchRecord], allowed: Sequence[Allowance] = ALLOWED) -> list[str]:
    """Every event of a guarded micro-batch no allowance covers, or beyond an allowance's count, described."""
    found: list[str] = []
    for record in records:
        if record.exempt:
            continue
        where = f"micro-batch {record.batch_count} (step {record.step_count})"
        used: Counter[Allowance] = Counter()
        for event in record.events:
            allowance = _allowance(event, allowed)
            if allowance is None:
                found.append(f"{where}: undocumented {event.describe()}")
                continue
            used[allowance] += 1
            if allowance.window_end_only and not record.ends_window:
                found.append(f"{where}: on an accumulating micro-batch ({allowance.policy}): {event.describe()}")
            elif allowance.per_micro_batch is not None and used[allowance] > allowance.per_micro_batch:
                found.append(f"{where}: more than {allowance.per_micro_batch} ({allowance.policy}): {event.describe()}")
    return found


def report(guard: SyncGuard, allowed: Sequence[Allowance] = ALLOWED) -> str:
    """A failure message: the violations, one block each, and how many micro-batches were guarded."""
    found = violations(guard.records, allowed)
    head = f"{len(found)} host-device synchronisation(s) in {len(guard.guarded)} guarded micro-batches"
    return "\n".join([head, *found])
