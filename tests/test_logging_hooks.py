"""ProgressBarHook, CSVLoggerHook, TensorBoardHook: what they write; tensors are read only on logging steps."""

from __future__ import annotations

import csv
import functools
import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.logging_hooks import (
    CSV_COLUMNS,
    CSVLoggerHook,
    ProgressBarHook,
    TensorBoardHook,
    estimate_total_steps,
)
from nvtrain.validation import ValidationConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(count: int, size: int = 4, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, generator=generator), torch.randint(0, 2, (size,), generator=generator))
        for _ in range(count)
    ]


class LossRecorder:
    """Keeps every micro-batch loss (for the expected window means) and an optional metric."""

    priority = 10

    def __init__(self, metric_from_step: int | None = None) -> None:
        self.losses: list[float] = []
        self.metric_from_step = metric_from_step

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.losses.append(float(ctx.loss.detach()))
        if self.metric_from_step is not None and ctx.step_count >= self.metric_from_step:
            ctx.metrics["grad_norm"] = torch.tensor(float(ctx.step_count))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def strategy(
    hooks: list[object], *, max_steps: int | None, data: list[Batch] | None = None, **fields: Any
) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        device="cpu",
        max_steps=max_steps,
        validation=ValidationConfig(data=data, metrics={"accuracy": accuracy}) if data is not None else None,
        **fields,
    )


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or ()), list(reader)


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of tensor-to-host reads (tolist/item/float/bool) made from the loggers (nvtrain.logging_hooks and the
    reader they share, nvtrain.step_log)."""
    calls: list[str] = []
    for name in ("tolist", "item", "__float__", "__bool__", "cpu"):
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, _original: Any = original, _name: str = name) -> Any:
            if sys._getframe(1).f_globals.get("__name__") in ("nvtrain.logging_hooks", "nvtrain.step_log"):
                calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    yield calls


# -- CSV --------------------------------------------------------------------------------------------


def test_csv_rows_on_logging_steps_hold_window_means(tmp_path: Path) -> None:
    recorder = LossRecorder()
    path = tmp_path / "metrics.csv"
    with strategy([recorder, CSVLoggerHook(path, log_every_n_steps=3)], max_steps=7) as s:
        s.run(batches(10))
    columns, rows = read_rows(path)
    assert columns == list(CSV_COLUMNS)
    assert [row["step"] for row in rows] == ["3", "6", "7"]  # the last step is flushed too
    windows = (recorder.losses[0:3], recorder.losses[3:6], recorder.losses[6:7])
    for row, window in zip(rows, windows, strict=True):
        assert float(row["train_loss"]) == pytest.approx(sum(window) / len(window), rel=1e-5)
        assert float(row["lr"]) == pytest.approx(0.1)
        assert float(row["step_time"]) > 0 and float(row["samples_per_s"]) > 0
        assert row["epoch"] == "1" and row["val_loss"] == ""  # epochs people read are 1-based


def test_loggers_read_to_host_only_on_logging_steps(tmp_path: Path, host_reads: list[str]) -> None:
    hooks = [
        CSVLoggerHook(tmp_path / "m.csv", log_every_n_steps=4),
        ProgressBarHook(log_every_n_steps=4, stream=io.StringIO()),
    ]
    with strategy(hooks, max_steps=9) as s:
        s.run(batches(9))
    # Steps 4 and 8 are logging steps, and 9 ends the run: one tolist() per logger each, nothing on the
    # other six steps.
    assert host_reads == ["tolist"] * 6


def test_validation_rows_and_new_metric_columns(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    hooks = [LossRecorder(metric_from_step=4), CSVLoggerHook(path, log_every_n_steps=2)]
    with strategy(hooks, max_steps=6, data=batches(2, seed=5)) as s:
        s.run(batches(3))  # epochs of 3 steps: validation after steps 3 and 6
        summary = s.ctx.validation
    columns, rows = read_rows(path)
    assert columns == [*CSV_COLUMNS, "grad_norm"]  # the file was rewritten with the wider header
    assert [(row["step"], bool(row["train_loss"]), bool(row["val_loss"])) for row in rows] == [
        ("2", True, False), ("3", False, True), ("4", True, False), ("6", True, False), ("6", False, True)
    ]
    assert rows[0]["grad_norm"] == "" and rows[2]["grad_norm"] == "4"
    assert float(rows[-1]["val_loss"]) == pytest.approx(float(summary["loss"]), rel=1e-5)
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(float(summary["accuracy"]), rel=1e-5)


def smoothing_state_at(step: int) -> dict[str, Any]:
    """A logger's checkpoint state at ``step``, with an empty smoothing window."""
    return {"step": step, "recent": [], "loss_sum": None, "loss_batches": 0, "window_steps": 0}


def test_a_fresh_run_that_starts_counting_later_replaces_the_folders_rows(tmp_path: Path) -> None:
    """``start_step`` with nothing restored is a fresh run: an earlier run's rows (and extra columns) are not its
    own, whatever their steps."""
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,train_loss,grad_norm\n4,1,7.4,0.5\n8,1,9.8,0.4\n12,1,2.2,0.3\n", encoding="utf-8")
    config = nvtrain.StepSchedulerConfig(start_step=8, ckpt_every_steps=None)
    with strategy([CSVLoggerHook(path, log_every_n_steps=2)], max_steps=10, step_scheduler=config) as s:
        s.run(batches(4))
    header, rows = read_rows(path)
    assert [row["step"] for row in rows] == ["10"] and "grad_norm" not in header


def test_resumed_run_drops_rows_after_its_start(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,train_loss\n2,0,1.0\n4,0,0.9\n6,0,0.8\n8,0,0.7\n", encoding="utf-8")
    hook = CSVLoggerHook(path, log_every_n_steps=2)
    hook.load_state_dict(smoothing_state_at(4))  # as a resume from the checkpoint of step 4 restores it
    ctx = nvtrain.TrainingContext(step_count=4)
    hook.before_training(ctx)
    hook.before_epoch(ctx)
    ctx.loss, ctx.batch, ctx.step_count = torch.tensor(0.5), batches(1)[0], 6
    hook.after_batch(ctx)
    hook.close()
    _, rows = read_rows(path)
    assert [(row["step"], row["train_loss"]) for row in rows] == [("2", "1.0"), ("4", "0.9"), ("6", "0.5")]


def test_fresh_run_replaces_an_old_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,train_loss,grad_norm\n2,0,1.0,0.5\n4,0,0.9,0.4\n", encoding="utf-8")
    with strategy([CSVLoggerHook(path, log_every_n_steps=2)], max_steps=2) as s:
        s.run(batches(2))
    header, rows = read_rows(path)
    assert [row["step"] for row in rows] == ["2"] and rows[0]["train_loss"] != "1.0"
    assert "grad_norm" not in header  # the replaced file's columns went with its rows


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    hook = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=1)
    ctx = nvtrain.TrainingContext(rank=1, world_size=2)
    hook.before_training(ctx)
    hook.before_epoch(ctx)
    ctx.loss, ctx.batch, ctx.step_count = torch.tensor(0.5), batches(1)[0], 1
    hook.after_batch(ctx)
    assert not (tmp_path / "metrics.csv").exists()


@pytest.mark.parametrize("cls", [CSVLoggerHook, ProgressBarHook])
def test_log_interval_is_validated(cls: type, tmp_path: Path) -> None:
    args = (tmp_path / "m.csv",) if cls is CSVLoggerHook else ()
    with pytest.raises(ValueError, match=rf"{cls.__name__}.log_every_n_steps must be an int >= 1 \(got 0\)"):
        cls(*args, log_every_n_steps=0)


# -- progress --------------------------------------------------------------------------------------


def test_progress_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    with strategy([ProgressBarHook(log_every_n_steps=2, stream=stream)], max_steps=4, data=batches(1, seed=3)) as s:
        s.run(batches(4))
    lines = stream.getvalue().splitlines()
    assert [line.split("  ")[:2] for line in lines] == [
        ["epoch 1/1", "step 2/4"], ["epoch 1/1", "step 4/4"], ["epoch 1/1", "step 4/4"]
    ]
    assert lines[0].split("  ")[2].startswith("loss ") and "samples_per_s" in lines[0]
    assert "val_loss" in lines[2] and "val_accuracy" in lines[2]


def test_progress_bar_with_tqdm() -> None:
    stream = io.StringIO()
    hook = ProgressBarHook(log_every_n_steps=2, stream=stream, use_bar=True, refresh_interval=1e-9)
    with strategy([hook], max_steps=4) as s:
        s.run(batches(4))
    text = stream.getvalue()
    assert "epoch 1/1" in text and "4/4" in text and "loss " in text


def test_progress_bar_stays_readable_at_80_columns() -> None:
    stream = io.StringIO()
    hook = ProgressBarHook(log_every_n_steps=1, stream=stream, use_bar=True, refresh_interval=1e-9, ncols=80)
    with strategy([hook], max_steps=200, data=batches(1, seed=3)) as s:
        s.run(batches(200))
    frames = [frame for frame in stream.getvalue().replace("\n", "\r").split("\r") if frame.strip()]
    last = frames[-1]
    assert all(len(frame) <= 80 for frame in frames), max(frames, key=len)
    bar = last.split("|")[1]
    assert len(bar) >= 8, last  # the bar itself keeps its width
    assert "epoch 1/1" in last and "200/200" in last
    # after the validation too, the smoothed loss and the throughput come first; no room is left for val_*
    assert re.search(r", loss [0-9.]+ samples/s [0-9]+$", last), last


def test_progress_bar_shows_validation_after_the_throughput_where_it_fits() -> None:
    stream = io.StringIO()
    hook = ProgressBarHook(log_every_n_steps=1, stream=stream, use_bar=True, refresh_interval=1e-9, ncols=120)
    with strategy([hook], max_steps=20, data=batches(1, seed=3)) as s:
        s.run(batches(20))
    last = [frame for frame in stream.getvalue().replace("\n", "\r").split("\r") if frame.strip()][-1]
    assert re.search(r", loss [0-9.]+ samples/s [0-9]+ val_acc [0-9.]+ val_loss [0-9.]+$", last), last


def progress_bar_frames(steps: int, **settings: Any) -> list[str]:
    """The frames a bar drawn to a StringIO over ``steps`` steps shows (each redraw starts with a carriage return)."""
    stream = io.StringIO()
    hook = ProgressBarHook(log_every_n_steps=1, stream=stream, use_bar=True, **settings)
    with strategy([hook], max_steps=steps) as s:
        s.run(batches(steps))
    return [frame for frame in stream.getvalue().replace("\n", "\r").split("\r") if frame.strip()]


@pytest.mark.parametrize("ncols", [60, 100])
def test_progress_bar_ncols_is_the_width_of_every_frame(ncols: int) -> None:
    frames = progress_bar_frames(10, refresh_interval=1e-9, ncols=ncols)
    assert len(frames) == 12
    assert {len(frame) for frame in frames} == {ncols}


def test_progress_bar_redraws_at_most_every_refresh_interval() -> None:
    # A run of a few milliseconds: redrawn at every step, or only when it opens and when it closes.
    assert len(progress_bar_frames(30, refresh_interval=1e-9)) == 32
    assert len(progress_bar_frames(30, refresh_interval=1000.0)) == 2


def test_progress_postfix_skips_an_entry_that_does_not_fit() -> None:
    hook = ProgressBarHook(ncols=82)  # no bar drawn: 82 - 34 fixed - 8 for the bar = 40 columns of postfix
    hook._postfix.update(
        {
            "val_loss": "0.2994",
            "val_balanced_accuracy": "0.9526",
            "samples/s": "74130",
            "val_f1": "0.91",
            "loss": "0.1234",
        }
    )
    # loss and samples/s first; "val_balanced_acc 0.9526" does not fit, the shorter "val_f1 0.91" after it does
    assert hook._postfix_text() == "loss 0.1234 samples/s 74130 val_f1 0.91"
    hook.ncols = 60  # 18 columns: the loss only
    assert hook._postfix_text() == "loss 0.1234"


def test_progress_is_silent_off_rank_zero() -> None:
    stream = io.StringIO()
    hook = ProgressBarHook(log_every_n_steps=1, stream=stream)
    ctx = nvtrain.TrainingContext(rank=1, world_size=2)
    hook.before_training(ctx)
    hook.before_epoch(ctx)
    ctx.loss, ctx.batch, ctx.step_count = torch.tensor(0.5), batches(1)[0], 1
    hook.after_batch(ctx)
    assert stream.getvalue() == ""


def test_total_steps_follow_the_scheduler() -> None:
    seen: list[int | None] = []

    class Probe:
        @nvtrain.hookimpl
        def before_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            seen.append(estimate_total_steps(ctx))

    with strategy([Probe()], max_steps=None, num_epochs=2) as s:
        s.run(batches(5))
    assert seen == [10, 10]
    with strategy([Probe()], max_steps=3) as s:
        s.run(batches(5))
    assert seen[-1] == 3


# -- TensorBoard -----------------------------------------------------------------------------------


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with strategy([TensorBoardHook(tmp_path, log_every_n_steps=2)], max_steps=4, data=batches(1, seed=3)) as s:
        s.run(batches(4))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/step_time", "perf/samples_per_s", "val/loss", "val/accuracy"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in events.Scalars("val/accuracy")] == [4]


def test_tensorboard_resume_purges_later_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def log(start: int, steps: list[int], loss: float) -> None:
        hook = TensorBoardHook(tmp_path, log_every_n_steps=1)
        if start:  # as a resume from the checkpoint of that step restores it
            hook.load_state_dict(smoothing_state_at(start))
        ctx = nvtrain.TrainingContext(step_count=start)
        hook.before_training(ctx)
        hook.before_epoch(ctx)
        for step in steps:
            ctx.loss, ctx.batch, ctx.step_count = torch.tensor(loss), batches(1)[0], step
            hook.after_batch(ctx)
        hook.close()

    log(0, [1, 2, 3, 4], loss=1.0)
    log(2, [4, 6], loss=0.5)  # resumed from a checkpoint at step 2; steps 3 and 4 of the first run are void
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 1.0), (4, 0.5), (6, 0.5)]


def test_tensorboard_fresh_run_purges_an_earlier_runs_events(tmp_path: Path) -> None:
    """A fresh run into a used folder replaces the events, as the CSV logger replaces metrics.csv."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with strategy([TensorBoardHook(tmp_path, log_every_n_steps=2)], max_steps=6) as s:
        s.run(batches(6))
    with strategy([TensorBoardHook(tmp_path, log_every_n_steps=2)], max_steps=4, data=batches(1, seed=3)) as s:
        s.run(batches(4, seed=1))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]  # not step 6 of the first run
    assert len(events.Scalars("train/loss")) == 2  # nor its steps 2 and 4 beside the new ones
    assert [e.step for e in events.Scalars("val/loss")] == [4]
