"""The loggers write the run's last steps however the run ends: at a validation (a stop request) or by an
exception (``close()`` on the error path), and ``nvtrain train`` draws the curves of a diverged run too."""

from __future__ import annotations

import csv
import functools
import io
import math
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.app import EXIT_DIVERGED
from nvtrain.cli import main
from nvtrain.errors import TrainingDivergedError
from nvtrain.hooks import SpikeSkipHook
from nvtrain.hooks.early_stopping import EarlyStoppingHook
from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook, TensorBoardHook, tensorboard_available
from nvtrain.step_scheduler import StepSchedulerConfig
from nvtrain.validation import ValidationConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(count: int, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 3, generator=generator), torch.randint(0, 2, (4,), generator=generator)) for _ in range(count)
    ]


class LossRecorder:
    """Every micro-batch loss, by the step count after it (what a window mean is made of)."""

    priority = 10

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.losses.append((ctx.step_count, float(ctx.loss.detach())))

    def window_mean(self, first: int, last: int) -> float:
        window = torch.tensor([loss for step, loss in self.losses if first <= step <= last], dtype=torch.float32)
        return float(window.sum() / len(window))


class StopAfterValidation:
    """Requests a stop at the AFTER_VALIDATION of step ``at`` (as EarlyStoppingHook does)."""

    def __init__(self, at: int) -> None:
        self.at = at

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.at:
            ctx.request_stop(f"stop at {self.at}")


class FailAt:
    """Raises at the BEFORE_BATCH that would take step ``step`` (the run ends by an exception)."""

    def __init__(self, step: int) -> None:
        self.step = step

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count + 1 == self.step:
            raise RuntimeError(f"failed before step {self.step}")


def make(hooks: list[object], *, max_steps: int, every_n_steps: int | None) -> nvtrain.TrainingStrategy:
    """A run validating every ``every_n_steps`` steps; None: never by a cadence (validate() only)."""
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        device="cpu",
        max_steps=max_steps,
        validation=ValidationConfig(
            data=batches(2, seed=5), every_n_steps=every_n_steps, every_n_epochs=None if every_n_steps is None else "auto"
        ),
    )


def training_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as file:
        return [row for row in csv.DictReader(file) if row["train_loss"]]


def loggers(tmp_path: Path, every: int) -> tuple[CSVLoggerHook, ProgressBarHook, io.StringIO, list[object]]:
    csv_hook = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=every)
    stream = io.StringIO()
    bar = ProgressBarHook(log_every_n_steps=every, stream=stream)
    hooks: list[object] = [csv_hook, bar]
    if tensorboard_available():
        hooks.append(TensorBoardHook(tmp_path / "tb", log_every_n_steps=every))
    return csv_hook, bar, stream, hooks


def tensorboard_steps(log_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.step for event in events.Scalars("train/loss")]


def progress_steps(stream: io.StringIO) -> list[str]:
    """The step field of the progress lines that show a training loss."""
    return [line.split("  ")[1] for line in stream.getvalue().splitlines() if "  loss " in line]


def test_early_stop_at_a_step_validation_logs_the_steps_since_the_last_logging_step(tmp_path: Path) -> None:
    recorder = LossRecorder()
    _, _, stream, hooks = loggers(tmp_path, every=10)
    early = EarlyStoppingHook(monitor="loss", mode="max", patience=0)  # the 2nd validation never improves on max
    with make([recorder, early, *hooks], max_steps=40, every_n_steps=7) as strategy:
        result = strategy.run(batches(40))
    assert result.step_count == 14 and result.stop_reason is not None  # stopped at step 14's validation
    rows = training_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["10", "14"]
    assert float(rows[1]["train_loss"]) == pytest.approx(recorder.window_mean(11, 14), rel=1e-5)
    # the smoothed loss weighs the windows by their steps: 10 and 4
    expected_avg = (float(rows[0]["train_loss"]) * 10 + float(rows[1]["train_loss"]) * 4) / 14
    assert float(rows[1]["train_loss_avg"]) == pytest.approx(expected_avg, rel=1e-5)
    assert progress_steps(stream) == ["step 10/40", "step 14/40"]
    if tensorboard_available():
        assert tensorboard_steps(tmp_path / "tb") == [10, 14]


@pytest.mark.parametrize(("stop_at", "logged"), [(6, ["4", "6"]), (8, ["4", "8"])])
def test_a_stop_requested_after_validation_logs_the_last_step_once(
    tmp_path: Path, stop_at: int, logged: list[str]
) -> None:
    # Step 6 is off the logging cadence (written at AFTER_TRAINING); step 8 is on it (written once).
    recorder = LossRecorder()
    _, _, stream, hooks = loggers(tmp_path, every=4)
    with make([recorder, StopAfterValidation(stop_at), *hooks], max_steps=20, every_n_steps=2) as strategy:
        result = strategy.run(batches(20))
    assert result.step_count == stop_at
    rows = training_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == logged
    assert float(rows[-1]["train_loss"]) == pytest.approx(recorder.window_mean(5, stop_at), rel=1e-5)
    assert progress_steps(stream) == [f"step {step}/20" for step in logged]
    if tensorboard_available():
        assert tensorboard_steps(tmp_path / "tb") == [int(step) for step in logged]


@pytest.mark.parametrize(("fail_at", "logged"), [(14, ["10", "13"]), (11, ["10"])])
def test_a_run_ended_by_an_exception_logs_its_last_steps_once(tmp_path: Path, fail_at: int, logged: list[str]) -> None:
    recorder = LossRecorder()
    _, _, stream, hooks = loggers(tmp_path, every=10)
    strategy = make([recorder, FailAt(fail_at), *hooks], max_steps=40, every_n_steps=None)
    with pytest.raises(RuntimeError, match=f"failed before step {fail_at}"), strategy:
        strategy.run(batches(40))
    rows = training_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == logged
    first = int(logged[-2]) + 1 if len(logged) > 1 else 1
    assert float(rows[-1]["train_loss"]) == pytest.approx(recorder.window_mean(first, int(logged[-1])), rel=1e-5)
    assert progress_steps(stream) == [f"step {step}/40" for step in logged]
    if tensorboard_available():
        assert tensorboard_steps(tmp_path / "tb") == [int(step) for step in logged]


def test_close_without_a_run_in_progress_writes_nothing(tmp_path: Path) -> None:
    hook = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=2)
    hook.close()
    with make([hook], max_steps=3, every_n_steps=None) as strategy:
        strategy.run(batches(3))
    hook.close()  # after AFTER_TRAINING: the last step (3) was written once, at the run's last step
    assert [row["step"] for row in training_rows(tmp_path / "metrics.csv")] == ["2", "3"]


# -- nvtrain train: a diverged run ------------------------------------------------------------------

HELPERS = """\
import torch


def nan_after_14(outputs, targets, calls=[0]):
    calls[0] += 1
    loss = torch.nn.functional.cross_entropy(outputs, targets)
    return loss * float("nan") if calls[0] > 14 else loss
"""


def test_a_diverged_run_keeps_its_last_steps_and_gets_its_curves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "diverging_helpers.py").write_text(HELPERS, encoding="utf-8")
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            output_dir: out
            device: cpu
            model: {factory: nvtrain.builtin.digits:make_classifier, kwargs: {hidden: 16, depth: 1}}
            data: {factory: nvtrain.builtin.digits:make_loaders, kwargs: {batch_size: 64}}
            loss: {function: "diverging_helpers:nan_after_14"}
            trainer: {max_steps: 40, num_epochs: null, max_consecutive_skipped_steps: 5}
            validation: {every_n_epochs: null}
            hooks: [spike_skip]
            logging: {log_every_n_steps: 10, tensorboard: false, plot: true, progress_bar: false}
            """
        ),
        encoding="utf-8",
    )
    assert main(["train", str(config)]) == EXIT_DIVERGED
    assert "training diverged: 5 optimizer steps in a row were skipped (none since step 14" in capsys.readouterr().err
    run_dir = tmp_path / "out" / "job"
    rows: list[dict[str, Any]] = training_rows(run_dir / "metrics.csv")
    # Step 14 is the last real step; its window holds the 5 skipped NaN micro-batches after it too.
    assert [row["step"] for row in rows] == ["10", "14"] and rows[1]["train_loss"] == "nan"
    assert float(rows[1]["lr"]) > 0
    assert (run_dir / "curves.png").stat().st_size > 0


# -- a diverged run whose last real step was a logging step ---------------------------------------


def nan_after(count: int) -> Any:
    calls = [0]

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = torch.nn.functional.cross_entropy(outputs, targets)
        return loss * float("nan") if calls[0] > count else loss

    return loss_fn


@pytest.mark.parametrize(("good", "logged"), [(8, ["4", "8", "8"]), (6, ["4", "6"])])
def test_a_diverged_run_logs_its_skipped_steps_also_after_a_logging_step(
    tmp_path: Path, good: int, logged: list[str]
) -> None:
    # Steps 1..good are real; the next three micro-batches are NaN and skipped, and the run raises.
    _, _, stream, hooks = loggers(tmp_path, every=4)
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=nan_after(good),
        hooks=[SpikeSkipHook(), *hooks],
        device="cpu",
        step_scheduler=StepSchedulerConfig(max_consecutive_skipped_steps=3, num_epochs=1),
    )
    with pytest.raises(TrainingDivergedError), strategy:
        strategy.run(batches(20))
    rows = training_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == logged  # the divergence is at the last real step's number
    assert rows[-1]["train_loss"] == "nan" and rows[-1]["skipped_steps"] == "3" and rows[-1]["epoch"] == "1"
    assert rows[-2]["train_loss"] != "nan"
    assert progress_steps(stream) == [f"step {step}/20" for step in logged]
    if tensorboard_available():
        assert tensorboard_steps(tmp_path / "tb") == [int(step) for step in logged]


def test_a_resume_from_the_diverged_step_keeps_both_of_its_rows(tmp_path: Path) -> None:
    """Rows are dropped by step: a run resumed from step 8 keeps what step 8 logged, its divergence too."""
    path = tmp_path / "metrics.csv"

    def log(start: int, losses: list[tuple[int, float]]) -> None:
        hook = CSVLoggerHook(path, log_every_n_steps=4)
        if start:  # as a resume from the checkpoint of that step restores it
            hook.load_state_dict({"step": start, "recent": [], "loss_sum": None, "loss_batches": 0, "window_steps": 0})
        ctx = nvtrain.TrainingContext(step_count=start)
        hook.before_training(ctx)
        hook.before_epoch(ctx)
        for step, loss in losses:
            ctx.step_skipped = step == ctx.step_count
            ctx.loss, ctx.batch, ctx.step_count = torch.tensor(loss), batches(1)[0], step
            hook.after_batch(ctx)
        hook.close()  # the run ended by an exception

    log(0, [(step, 1.0) for step in range(1, 9)] + [(8, math.nan)] * 3)  # diverged after step 8
    log(8, [(9, 0.5), (10, 0.5), (11, 0.5), (12, 0.5)])  # resumed from the checkpoint of step 8
    rows = training_rows(path)
    assert [(row["step"], row["train_loss"]) for row in rows] == [
        ("4", "1"), ("8", "1"), ("8", "nan"), ("12", "0.5")
    ]  # fmt: skip


# -- the row of a run stopped at a validation: its step time ---------------------------------------


class Sleep:
    """Sleeps ``seconds`` at BEFORE_BATCH of step ``step`` (training time), and at every AFTER_VALIDATION
    ``validation`` seconds (validation time, which step_time leaves out)."""

    def __init__(self, step: int, seconds: float, validation: float) -> None:
        self.step, self.seconds, self.validation = step, seconds, validation

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count + 1 == self.step:
            time.sleep(self.seconds)

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        time.sleep(self.validation)


def test_step_time_covers_the_windows_steps_across_a_validation_and_the_row_of_a_stop(tmp_path: Path) -> None:
    _, _, _, hooks = loggers(tmp_path, every=4)
    slow = Sleep(step=1, seconds=0.2, validation=1.0)
    with make([slow, StopAfterValidation(6), *hooks], max_steps=20, every_n_steps=2) as strategy:
        strategy.run(batches(20))
    rows = training_rows(tmp_path / "metrics.csv")
    assert [row["step"] for row in rows] == ["4", "6"]
    first, stop = (
        (float(row["step_time"]), float(row["samples_per_s"])) for row in rows
    )  # every training row is timed, the stop's too
    # Step 4's window holds steps 1-4 (the slow step 1 before step 2's validation too), not its validation.
    assert 0.2 / 4 <= first[0] < (0.2 + 1.0) / 4
    assert stop[0] < 1.0 / 2  # steps 5 and 6, without the validations of steps 4 and 6
    for step_time, samples_per_s in (first, stop):
        assert step_time * samples_per_s == pytest.approx(4, rel=1e-3)  # 4 samples per step


class FailsAfterAStep:
    """Raises at AFTER_BATCH of step ``step``'s last micro-batch: the optimizer stepped, the loggers (priority 90)
    never see that micro-batch."""

    def __init__(self, step: int) -> None:
        self.step = step

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step and ctx.sync_gradients:
            raise RuntimeError(f"a hook failed after step {self.step}")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_whose_logging_stage_never_ran_is_written_under_its_own_number(tmp_path: Path, accumulate: int) -> None:
    """The last row is step 3's (the step that happened), not a second row of step 2 holding step 3's losses."""
    _, _, stream, hooks = loggers(tmp_path, every=1)
    accumulation = [nvtrain.hooks.GradientAccumulationHook(steps=accumulate)] if accumulate > 1 else []
    strategy = make([*accumulation, FailsAfterAStep(3), *hooks], max_steps=10, every_n_steps=None)
    with pytest.raises(RuntimeError, match="failed after step 3"), strategy:
        strategy.run(batches(40))
    steps = [row["step"] for row in training_rows(tmp_path / "metrics.csv")]
    assert steps == (["1", "2", "3"] if accumulate > 1 else ["1", "2"])  # accumulating: step 3's first micro-batch
    assert progress_steps(stream) == [f"step {step}/10" for step in steps]
    if tensorboard_available():
        assert tensorboard_steps(tmp_path / "tb") == [int(step) for step in steps]
