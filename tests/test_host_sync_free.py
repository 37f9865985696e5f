"""No host-device synchronisation on the per-batch path of a step that neither logs, saves nor validates.

``benchmarks/gpu_check.py`` checks one stack on a GPU under CUDA's sync debug mode; these tests
check about twenty stacks on the CPU with :mod:`tests.sync_spy`, which recognises the calls
that would synchronise on CUDA (``.item()``, ``bool(tensor)``, printing, blocking copies,
data-dependent shapes...). Only the documented policies (spike skipping's one read per
optimizer step, fp16's GradScaler read per real step, same-device copies) may appear.
"""

from __future__ import annotations

import functools
import inspect
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler

import nvtrain
from nvtrain.hooks import (
    CSVLoggerHook,
    EarlyStoppingHook,
    GradientAccumulationHook,
    GradientClippingHook,
    ProgressBarHook,
    SpikeSkipHook,
    StageTimingHook,
)
from nvtrain.lr_schedule import LRSchedule
from nvtrain.step_scheduler import StepSchedulerConfig
from nvtrain.validation import ValidationConfig
from tests.sync_spy import (
    ALLOWED,
    CallSite,
    MicroBatchRecord,
    SyncEvent,
    SyncGuard,
    SyncSpy,
    modes_left_active,
    report,
    violations,
)

BATCHES_PER_EPOCH = 8
SGD = functools.partial(torch.optim.SGD, lr=1e-2)
# fused: the unfused AdamW reads its step counter, a host tensor even under CUDA, which the CPU cannot tell apart
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)

HookFactory = Callable[[Path], list[object]]


@pytest.fixture(autouse=True)
def no_spy_left_active() -> Iterator[None]:
    """A failing run must leave no spy mode on torch's stacks for the tests after it."""
    assert modes_left_active() == []
    yield
    assert modes_left_active() == [], "a SyncSpy mode outlived its test"


def _plugin(module: str, class_name: str) -> Any:
    """A plugin's hook class, or a clean skip when that plugin is not installed."""
    return getattr(pytest.importorskip(module), class_name)


def _amp(precision: str) -> Any:
    return _plugin("nvtrain_amp", "MixedPrecisionHook")(precision=precision)


def _ema(**settings: Any) -> Any:
    return _plugin("nvtrain_ema", "EMAHook")(**settings)


def _checkpoint(directory: Path, **settings: Any) -> Any:
    return _plugin("nvtrain_checkpoint", "CheckpointHook")(
        checkpoint_dir=directory / "ckpt", step_interval=4, **settings
    )


def _loggers(directory: Path) -> list[object]:
    return [
        CSVLoggerHook(path=directory / "metrics.csv", log_every_n_steps=5),
        ProgressBarHook(log_every_n_steps=5, stream=io.StringIO()),
        StageTimingHook(output=directory / "timing.csv", flush_every_n_steps=5),
    ]


def _profiler(directory: Path) -> list[object]:
    from torch.profiler import ProfilerActivity, schedule

    hook_class = _plugin("nvtrain_profiler", "TorchProfilerHook")
    every_few = schedule(wait=1, warmup=1, active=2, repeat=1)
    return [hook_class(output_dir=directory / "profiles", activities=[ProfilerActivity.CPU], schedule=every_few)]


def _one_cycle(optimizer: torch.optim.Optimizer) -> Any:
    return lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=2 * BATCHES_PER_EPOCH)


def _validation() -> ValidationConfig:
    generator = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)) for _ in range(2)]
    return ValidationConfig(data=data, every_n_steps=3)


@dataclass(frozen=True)
class Stack:
    """One configuration: its hooks, the every-N-steps cadences they read the host on, what else the run uses."""

    hooks: HookFactory
    cadences: tuple[int, ...] = ()
    optimizer: Callable[..., torch.optim.Optimizer] = SGD
    lr_schedulers: Callable[[], dict[str, LRSchedule]] = dict
    validation: Callable[[], ValidationConfig | None] = lambda: None
    #: Allow-list sites (path suffixes) the run must show on guarded micro-batches: the spy sees them.
    expected_sites: tuple[str, ...] = ()


SPIKE = "nvtrain/hooks/spike_skip.py"
GRAD_SCALER = "nvtrain_amp/hook.py"

STACKS: dict[str, Stack] = {
    "no hooks, SGD": Stack(lambda d: []),
    "no hooks, AdamW": Stack(lambda d: [], optimizer=ADAMW),
    "accumulation 3, ragged last window": Stack(lambda d: [GradientAccumulationHook(steps=3)]),
    "clip norm 2": Stack(lambda d: [GradientClippingHook(max_norm=0.5)]),
    "clip norm inf": Stack(lambda d: [GradientClippingHook(max_norm=0.5, norm_type=float("inf"))]),
    "clip value": Stack(lambda d: [GradientClippingHook(max_value=0.01)]),
    "spike skip on loss": Stack(
        lambda d: [SpikeSkipHook(monitor="loss", warmup_steps=2, window=4)], expected_sites=(SPIKE,)
    ),
    "spike skip on grad_norm": Stack(
        lambda d: [SpikeSkipHook(monitor="grad_norm", warmup_steps=2, window=4)], expected_sites=(SPIKE,)
    ),
    "spike skip + clip + accumulation 3": Stack(
        lambda d: [
            GradientAccumulationHook(steps=3),
            GradientClippingHook(max_norm=0.5),
            SpikeSkipHook(monitor=("loss", "grad_norm"), warmup_steps=2, window=4),
        ],
        expected_sites=(SPIKE,),
    ),
    "EMA every 3 from step 4": Stack(lambda d: [_ema(decay=0.9, update_every=3, start_step=4)]),
    "amp bf16": Stack(lambda d: [_amp("bf16")], optimizer=ADAMW),
    "amp fp16 + accumulation 3": Stack(
        lambda d: [_amp("fp16"), GradientAccumulationHook(steps=3)], expected_sites=(GRAD_SCALER,)
    ),
    "amp fp16, fused AdamW": Stack(lambda d: [_amp("fp16")], optimizer=ADAMW, expected_sites=(GRAD_SCALER,)),
    "checkpoint every 4, sync": Stack(lambda d: [_checkpoint(d)], cadences=(4,)),
    "checkpoint every 4, async writer thread": Stack(
        lambda d: [_checkpoint(d, async_save=True, async_writer="thread")], cadences=(4,)
    ),
    "CSV + progress bar + stage timing": Stack(_loggers, cadences=(5,)),
    "profiler with a schedule": Stack(_profiler),
    "OneCycleLR per step": Stack(lambda d: [], lr_schedulers=lambda: {"main": LRSchedule(_one_cycle)}),
    "plateau + validation every 3 + early stopping": Stack(
        lambda d: [EarlyStoppingHook(patience=2)],
        lr_schedulers=lambda: {"main": LRSchedule(lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0))},
        validation=_validation,
    ),
    "standard stack: bf16 + clip + EMA + checkpoint + loggers": Stack(
        lambda d: [
            _amp("bf16"),
            GradientClippingHook(max_norm=1.0),
            _ema(decay=0.9),
            _checkpoint(d, async_save=True, async_writer="thread"),
            *_loggers(d),
        ],
        cadences=(4, 5),
        optimizer=ADAMW,
    ),
}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator))
        for _ in range(BATCHES_PER_EPOCH)
    ]


def run_guarded(hooks: list[object], *, stack: Stack = Stack(lambda d: [])) -> SyncGuard:
    """Two epochs of a tiny MLP on the CPU with the spy on for every micro-batch; return the guard's records."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with SyncSpy() as spy:
        guard = SyncGuard(spy, stack.cadences)
        strategy = nvtrain.TrainingStrategy(
            models=model,
            optimizers=stack.optimizer,
            loss_fn=torch.nn.functional.mse_loss,
            lr_schedulers=stack.lr_schedulers(),
            hooks=[guard, *hooks],
            device="cpu",
            validation=stack.validation(),
            step_scheduler=StepSchedulerConfig(num_epochs=2, preemption_signal=None),
        )
        with strategy:
            strategy.run(_batches())
    return guard


@pytest.mark.parametrize("name", list(STACKS))
def test_guarded_micro_batches_make_only_documented_syncs(name: str, tmp_path: Path) -> None:
    stack = STACKS[name]
    guard = run_guarded(stack.hooks(tmp_path), stack=stack)
    guarded = guard.guarded
    assert len(guarded) >= 4, f"only {len(guarded)} guarded micro-batches of {len(guard.records)}"
    assert violations(guard.records) == [], report(guard)
    seen = {event.site.path for record in guarded for event in record.events}
    for site in stack.expected_sites:
        assert any(path.endswith(site) for path in seen), f"the spy saw no sync at {site}: {sorted(seen)}"


def _compares_the_loss(ctx: nvtrain.TrainingContext) -> None:
    if ctx.loss is not None and ctx.loss > 100:  # reported
        ctx.metrics["huge"] = ctx.loss


def _formats_the_loss(ctx: nvtrain.TrainingContext) -> None:
    print(f"loss {ctx.loss:.3f}", file=io.StringIO())  # reported


def _masks_the_outputs(ctx: nvtrain.TrainingContext) -> None:
    ctx.metrics["positive"] = ctx.outputs[ctx.outputs > 0].sum()  # reported


def _one_hot_without_classes(ctx: nvtrain.TrainingContext) -> None:
    torch.nn.functional.one_hot(ctx.outputs.argmax(dim=1))  # reported


def _copies_the_inputs_to_the_host(ctx: nvtrain.TrainingContext) -> None:
    ctx.metrics["inputs"] = ctx.batch[0].to("cpu").sum()  # reported


class HostRead:
    """A hook that makes one host read on every micro-batch, at ``stage``: AFTER_LOSS, or at the edges of
    the guarded span, in a PRIORITY_FIRST wrapper before BEFORE_BATCH's and after AFTER_BATCH's others."""

    def __init__(self, read: Callable[[nvtrain.TrainingContext], None], stage: str) -> None:
        self.read, self.stage = read, stage

    @nvtrain.hookimpl(wrapper=True, priority=nvtrain.PRIORITY_FIRST)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> Any:
        if self.stage == "before_batch":
            self.read(ctx)
        return (yield)

    @nvtrain.hookimpl
    def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
        if self.stage == "after_loss":
            self.read(ctx)

    @nvtrain.hookimpl(wrapper=True, priority=nvtrain.PRIORITY_FIRST)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> Any:
        result = yield
        if self.stage == "after_batch":
            self.read(ctx)
        return result


@pytest.mark.parametrize(
    ("read", "stage", "kind"),
    [
        (_compares_the_loss, "after_loss", "host read __bool__"),
        (_formats_the_loss, "after_batch", "host read __format__"),
        (_masks_the_outputs, "after_loss", "data-dependent shape __getitem__ with a boolean mask"),
        (_one_hot_without_classes, "after_loss", "aten._local_scalar_dense (from C++)"),
        (_copies_the_inputs_to_the_host, "before_batch", "blocking device copy"),
    ],
)
def test_a_host_read_in_a_hook_is_reported_with_its_line(
    read: Callable[[nvtrain.TrainingContext], None], stage: str, kind: str
) -> None:
    guard = run_guarded([HostRead(read, stage)])
    lines, first = inspect.getsourcelines(read)
    line = first + next(i for i, text in enumerate(lines) if text.rstrip().endswith("# reported"))
    found = violations(guard.records)
    reported = {text.split(":", 1)[0] for text in found}
    assert reported == {f"micro-batch {record.batch_count} (step {record.step_count})" for record in guard.guarded}
    assert all(
        f"undocumented {kind} at tests/test_host_sync_free.py:{line} ({read.__name__})" in text for text in found
    )
    assert "# reported" in found[0]


def _event(kind: str, path: str, function: str, source: str) -> SyncEvent:
    frame = CallSite(path, 1, function, source)
    return SyncEvent(kind, frame, frame, ())


def _record(*events: SyncEvent, ends_window: bool = True) -> MicroBatchRecord:
    return MicroBatchRecord(1, 1, ends_window, step_skipped=False, exempt=(), events=events)


_SPIKE_READ = _event("host read tolist", "nvtrain/hooks/spike_skip.py", "_decide", "rows = [local.tolist()]")
_NORM_MOVE = _event("blocking device copy", "torch/nn/utils/clip_grad.py", "_get_total_norm", "norm.to(first_device)")


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        pytest.param(_record(_SPIKE_READ), None, id="once per step"),
        pytest.param(_record(_SPIKE_READ, _SPIKE_READ), "more than 1", id="twice"),
        pytest.param(_record(_SPIKE_READ, ends_window=False), "on an accumulating micro-batch", id="accumulating"),
        pytest.param(
            _record(_event("host read item", "nvtrain/hooks/spike_skip.py", "_decide", "x.item()")),
            "undocumented",
            id="another kind",
        ),
        pytest.param(
            _record(_event("host read tolist", "nvtrain/hooks/clipping.py", "_decide", "x.tolist()")),
            "undocumented",
            id="another file",
        ),
        pytest.param(_record(_NORM_MOVE, _NORM_MOVE, ends_window=False), None, id="same-device copies"),
        pytest.param(
            _record(_event("blocking device copy", _NORM_MOVE.inner.path, "_get_total_norm", 'n.to("cpu")')),
            "undocumented",
            id="a copy to the host",
        ),
    ],
)
def test_an_allowance_holds_only_at_its_site_kind_and_count(record: MicroBatchRecord, problem: str | None) -> None:
    found = violations([record], ALLOWED)
    expected = [] if problem is None else [True]
    assert [problem in text for text in found if problem is not None] == expected, found
    assert len(found) == len(expected)
