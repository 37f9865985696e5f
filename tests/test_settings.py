"""Every public setting acts: gc cadence, the smoothed loss, the experiment-logger cadence, and a walk
over every config class that fails when a field has no reader in the code."""

from __future__ import annotations

import csv
import gc
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

import nvtrain
from nvtrain import config as config_module
from nvtrain.hooks import (
    EarlyStoppingHook,
    GradientAccumulationHook,
    GradientClippingHook,
    ModulePatchHook,
    SpikeSkipHook,
    StageTimingHook,
    TrainableParameterHook,
)
from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook, TensorBoardHook

ROOT = Path(__file__).resolve().parents[1]


def test_gc_every_steps_collects_on_that_cadence_with_automatic_gc_off(
    make_strategy: Any, batches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    collected: list[int] = []
    enabled_during_run: list[bool] = []

    class Watch:
        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            enabled_during_run.append(gc.isenabled())

    strategy = make_strategy([Watch()], step_scheduler=nvtrain.StepSchedulerConfig(gc_every_steps=2), num_epochs=1)
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(strategy.ctx.step_count) or 0)
    assert gc.isenabled()
    strategy.run(batches(7))
    assert collected == [2, 4, 6]
    assert enabled_during_run == [False] * 7
    assert gc.isenabled()  # the interpreter's own gc is back after the run


def test_without_gc_every_steps_the_run_leaves_gc_alone(
    make_strategy: Any, batches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(1) or 0)
    make_strategy(num_epochs=1).run(batches(4))
    assert collected == []


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return [row for row in csv.DictReader(file) if row.get("train_loss")]


def test_loss_average_window_steps_drives_the_smoothed_loss(make_strategy: Any, batches: Any, tmp_path: Path) -> None:
    logger = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=1)
    config = nvtrain.StepSchedulerConfig(loss_average_window_steps=3)
    make_strategy([logger], step_scheduler=config, num_epochs=1).run(batches(6))
    rows = _csv_rows(tmp_path / "metrics.csv")
    losses = [float(row["train_loss"]) for row in rows]
    averages = [float(row["train_loss_avg"]) for row in rows]
    for index, average in enumerate(averages):
        window = losses[max(0, index - 2) : index + 1]
        assert average == pytest.approx(sum(window) / len(window), rel=1e-5)  # the CSV keeps 6 digits
    assert averages[-1] != pytest.approx(losses[-1])  # really smoothed


def test_a_validation_inside_a_logging_window_keeps_the_window_whole_in_the_average(
    make_strategy: Any, batches: Any, tmp_path: Path
) -> None:
    """A validation restarts the step clock, not the loss window: each window weighs the steps it covers."""
    logger = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=4)
    config = nvtrain.StepSchedulerConfig(loss_average_window_steps=4)
    validation = nvtrain.ValidationConfig(data=batches(1), every_n_steps=2, every_n_epochs=None)
    make_strategy([logger], step_scheduler=config, validation=validation, num_epochs=1).run(batches(12))
    rows = _csv_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["4", "8", "12"]
    for row in rows:  # a 4-step average over 4-step windows is the window's own mean
        assert float(row["train_loss_avg"]) == pytest.approx(float(row["train_loss"]), rel=1e-5)


def test_the_progress_bar_shows_the_smoothed_loss(make_strategy: Any, batches: Any, tmp_path: Path) -> None:
    import io

    stream = io.StringIO()
    bar = ProgressBarHook(log_every_n_steps=2, stream=stream, use_bar=False)
    csv_logger = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=2)
    config = nvtrain.StepSchedulerConfig(loss_average_window_steps=4)
    make_strategy([bar, csv_logger], step_scheduler=config, num_epochs=1).run(batches(8))
    shown = [float(m) for m in re.findall(r"loss (\S+)", stream.getvalue())]
    expected = [float(row["train_loss_avg"]) for row in _csv_rows(tmp_path / "metrics.csv")]
    assert shown == pytest.approx(expected, rel=1e-3)


def test_tensorboard_follows_log_remote_every_steps(make_strategy: Any, batches: Any, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = nvtrain.StepSchedulerConfig(log_remote_every_steps=3)
    with make_strategy([TensorBoardHook(tmp_path)], step_scheduler=config, max_steps=7) as strategy:
        strategy.run(batches(7))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [3, 6, 7]  # the cadence, then the last step


# -- every setting has a reader ---------------------------------------------------------------


def _settings_classes() -> list[type]:
    classes: list[type] = [
        nvtrain.StepSchedulerConfig,
        nvtrain.ValidationConfig,
        GradientAccumulationHook,
        GradientClippingHook,
        EarlyStoppingHook,
        SpikeSkipHook,
        StageTimingHook,
        TrainableParameterHook,
        ModulePatchHook,
        ProgressBarHook,
        CSVLoggerHook,
        TensorBoardHook,
    ]
    classes += [obj for obj in vars(config_module).values() if isinstance(obj, type) and attrs.has(obj)]
    for module, name in (
        ("nvtrain_amp", "MixedPrecisionHook"),
        ("nvtrain_ema", "EMAHook"),
        ("nvtrain_checkpoint", "CheckpointHook"),
        ("nvtrain_ddp", "DDPHook"),
        ("nvtrain_fsdp", "FSDPHook"),
        ("nvtrain_profiler", "TorchProfilerHook"),
    ):
        plugin = pytest.importorskip(module)
        classes.append(getattr(plugin, name))
    return classes


def _code_lines() -> list[str]:
    files = [*ROOT.joinpath("nvtrain").rglob("*.py"), *ROOT.glob("plugins/*/nvtrain_*/**/*.py")]
    lines: list[str] = []
    for path in files:
        lines += [line for line in path.read_text().splitlines() if "attrs.field" not in line]
    return lines


def test_every_public_setting_has_a_reader() -> None:
    code = "\n".join(_code_lines())
    unread = []
    for cls in _settings_classes():
        for field in attrs.fields(cls):
            if field.name.startswith("_") or not field.init:
                continue
            # A read: ``.name`` not followed by a plain assignment (``self.name = ...`` only writes it).
            if not re.search(rf"\.{re.escape(field.name)}\b(?!\s*=[^=])", code):
                unread.append(f"{cls.__qualname__}.{field.name}")
    assert unread == [], f"settings that nothing in nvtrain or its plugins reads: {unread}"


# -- environment switches ---------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "tracing"), [("false", False), ("No", False), (" off ", False), ("0", False),
                                                ("", False), ("1", True), ("true", True), ("yes", True)])
def test_nvtrain_trace_reads_false_values_as_off_like_the_autoload_switch(
    monkeypatch: pytest.MonkeyPatch, value: str, tracing: bool
) -> None:
    from nvtrain.bus import TRACE_ENV, HookBus
    from nvtrain.plugins import DISABLE_AUTOLOAD_ENV, autoload_disabled

    monkeypatch.setenv(TRACE_ENV, value)
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    bus = HookBus()
    try:
        assert bus.tracing is tracing
        assert autoload_disabled() is tracing  # one reading of a boolean variable for both
    finally:
        bus.close()
