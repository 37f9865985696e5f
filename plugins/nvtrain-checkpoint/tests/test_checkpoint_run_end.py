"""A run that ends inside an epoch (``max_steps``) validates its last step on the epoch cadence; its last
checkpoint is written after that validation, so it holds what the validation changed (early stopping's
best value, a ReduceLROnPlateau's), as an epoch-end checkpoint does."""

from __future__ import annotations

import csv
import functools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.hooks import EarlyStoppingHook
from nvtrain.logging_hooks import CSVLoggerHook


def loaders() -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    generator = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(20, 4, generator=generator), torch.randn(20, 1, generator=generator))
    val = TensorDataset(torch.randn(6, 4, generator=generator), torch.randn(6, 1, generator=generator))
    return DataLoader(train, batch_size=2), DataLoader(val, batch_size=2)  # 10 steps an epoch


@pytest.mark.parametrize("max_steps", [7, 17], ids=["in-epoch-1", "in-epoch-2"])
def test_the_last_checkpoint_of_a_run_ending_inside_an_epoch_holds_its_final_validation(
    tmp_path: Path, max_steps: int
) -> None:
    train, val = loaders()
    stopping = EarlyStoppingHook(patience=5)
    checkpoint = CheckpointHook(checkpoint_dir=tmp_path)
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        lr_schedulers=functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0),
        validation=nvtrain.ValidationConfig(data=val, every_n_epochs=1),
        hooks=[stopping, checkpoint],
        device="cpu",
        max_steps=max_steps,
    )
    with strategy:
        result = strategy.run(train)
    assert result.step_count == max_steps and result.validation is not None
    saved = checkpoint.last_saved
    assert saved is not None and saved[0] == max_steps
    state = checkpoint.read_checkpoint(saved[1])
    plateau = strategy.ctx.lr_schedulers["main"]
    assert state["hooks"]["early_stopping"]["best"] == stopping.state_dict()["best"] is not None
    assert state["lr_schedulers"]["main"]["best"] == plateau.best != float("inf")
    assert state["lr_schedulers"]["main"]["last_epoch"] == plateau.last_epoch


# -- a preemption at an epoch's end ------------------------------------------------------------------


class PreemptDuring:
    """Sends SIGUSR1 (the runs' preemption signal) while step ``step`` trains: its boundary agrees it."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step - 1 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)


class Validated:
    def __init__(self) -> None:
        self.steps: list[int] = []

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.steps.append(ctx.step_count)


def train_digits(
    directory: Path,
    *extra: object,
    resume: str = "never",
    patience: int = 0,
    on_checkpoint: bool = False,
    every_n_steps: int | None = None,
) -> tuple[Any, ...]:
    """3 epochs of 10 steps, validating every epoch; early stopping and a plateau scheduler act on validations
    (the validation loss rises: with patience 0 the run stops at the 2nd epoch's end, and the LR halves)."""
    train, val = loaders()
    stopping = EarlyStoppingHook(monitor="loss", mode="min", patience=patience)
    validated = Validated()
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        lr_schedulers=nvtrain.LRSchedule(
            functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5), monitor="loss"
        ),
        validation=nvtrain.ValidationConfig(
            data=val, every_n_epochs=None if every_n_steps else 1, every_n_steps=every_n_steps
        ),
        hooks=[
            stopping,
            validated,
            CheckpointHook(directory, resume=resume),
            CSVLoggerHook(directory / "metrics.csv", log_every_n_steps=4),
            *extra,
        ],
        device="cpu",
        step_scheduler=nvtrain.StepSchedulerConfig(
            ckpt_every_steps=None, preemption_signal="SIGUSR1", validate_on_checkpoint=on_checkpoint
        ),
        num_epochs=3,
    )
    with strategy:
        result = strategy.run(train)
    return strategy, result, stopping, validated


def weights(strategy: nvtrain.TrainingStrategy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
@pytest.mark.parametrize("preempted_at", [10, 20], ids=["epoch-1-end", "epoch-2-end"])
def test_a_preemption_at_an_epochs_end_owes_its_validation_to_the_resumed_run(
    tmp_path: Path, preempted_at: int
) -> None:
    """The preempted run saves without the epoch's validation (the grace period is for saving); the resumed run
    validates first, so early stopping and the plateau scheduler decide as in the run that never stopped."""
    straight, straight_result, straight_stopping, straight_validated = train_digits(tmp_path / "straight")
    assert straight_result.step_count == 20 and straight_result.stop_reason is not None  # early stopping
    assert straight_validated.steps == [10, 20]

    _, first, _, first_validated = train_digits(tmp_path / "resumed", PreemptDuring(preempted_at))
    assert first.preempted and first.step_count == preempted_at
    assert first_validated.steps == [10, 20][: preempted_at // 10 - 1]  # the preempted epoch's end: not yet
    state = CheckpointHook(tmp_path / "resumed").read_checkpoint(tmp_path / "resumed" / f"step_{preempted_at}")
    assert state["scheduler"]["validation_owed"] is True

    resumed, result, stopping, validated = train_digits(tmp_path / "resumed", resume="auto")
    assert validated.steps[0] == preempted_at  # the owed validation, before any step
    assert first_validated.steps + validated.steps == straight_validated.steps
    assert result.step_count == straight_result.step_count and result.stop_reason == straight_result.stop_reason
    assert stopping.state_dict() == straight_stopping.state_dict()
    assert resumed.ctx.lr_schedulers["main"].state_dict() == straight.ctx.lr_schedulers["main"].state_dict()
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(straight), strict=True))
    # metrics.csv: the straight run's rows, the owed validation's in its place, plus the preempted run's
    # documented row of its last step when that is off the logging cadence (every 4 steps)
    # the owed validation's checkpoint of that step was written again, as the straight run wrote it
    checkpoint = CheckpointHook(tmp_path)
    final, expected = (
        checkpoint.read_checkpoint(tmp_path / run / f"step_{preempted_at}") for run in ("resumed", "straight")
    )
    assert final["scheduler"]["validation_owed"] is False
    assert final["hooks"]["early_stopping"] == expected["hooks"]["early_stopping"]
    assert final["lr_schedulers"] == expected["lr_schedulers"]
    logged, straight_logged = csv_rows(tmp_path / "resumed"), csv_rows(tmp_path / "straight")
    end_row = [r for r in logged if r["step"] == str(preempted_at) and r["train_loss"]]
    if preempted_at % 4:
        assert len(end_row) == 1
        logged.remove(end_row[0])
    assert logged == straight_logged


def csv_rows(directory: Path) -> list[dict[str, str]]:
    with open(directory / "metrics.csv", encoding="utf-8") as file:
        return [{k: v for k, v in r.items() if k not in ("step_time", "samples_per_s")} for r in csv.DictReader(file)]


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_a_preempted_epoch_end_that_validates_as_a_checkpoint_step_owes_its_validation(tmp_path: Path) -> None:
    """With ``validate_on_checkpoint`` an epoch's end validates as a checkpoint step; preempted there, the run
    saves first (the grace period is for saving) and the resumed run makes that validation before training."""
    straight, straight_result, _, straight_validated = train_digits(tmp_path / "straight", on_checkpoint=True)
    _, first, _, first_validated = train_digits(tmp_path / "resumed", PreemptDuring(10), on_checkpoint=True)
    assert first.preempted and first_validated.steps == []
    state = CheckpointHook(tmp_path / "resumed").read_checkpoint(tmp_path / "resumed" / "step_10")
    assert state["scheduler"]["validation_owed"] is True
    resumed, result, _, validated = train_digits(tmp_path / "resumed", resume="auto", on_checkpoint=True)
    assert first_validated.steps + validated.steps == straight_validated.steps
    assert result.step_count == straight_result.step_count
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(straight), strict=True))


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_a_preemption_at_the_runs_last_step_still_validates_it(tmp_path: Path) -> None:
    """Nothing is left to resume: the last step's validation runs, and its checkpoint holds what it changed."""
    _, result, stopping, validated = train_digits(tmp_path, PreemptDuring(30), patience=5)
    # the run is complete: not "preempted" (a requeue would find nothing to train)
    assert not result.preempted and result.stop_reason is None
    assert result.step_count == 30 and validated.steps == [10, 20, 30]
    state = CheckpointHook(tmp_path).read_checkpoint(tmp_path / "step_30")
    assert state["scheduler"]["validation_owed"] is False
    assert state["hooks"]["early_stopping"] == stopping.state_dict()  # written after that validation
    assert stopping.state_dict()["wait"] == 2


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_a_preempted_step_on_the_validation_cadence_is_saved_after_its_validation(tmp_path: Path) -> None:
    """A step cadence validates a preempted step too; its checkpoint must hold what that validation changed."""
    straight, straight_result, straight_stopping, _ = train_digits(tmp_path / "straight", every_n_steps=5)
    _, first, stopping, first_validated = train_digits(tmp_path / "resumed", PreemptDuring(5), every_n_steps=5)
    assert first.preempted and first_validated.steps == [5]
    state = CheckpointHook(tmp_path / "resumed").read_checkpoint(tmp_path / "resumed" / "step_5")
    assert state["hooks"]["early_stopping"] == stopping.state_dict() and stopping.state_dict()["best"] is not None
    resumed, result, resumed_stopping, _ = train_digits(tmp_path / "resumed", resume="auto", every_n_steps=5)
    assert result.step_count == straight_result.step_count
    assert resumed_stopping.state_dict() == straight_stopping.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(straight), strict=True))


class PreemptAtValidation:
    """Sends SIGUSR1 at the first AFTER_VALIDATION: a second preemption, during the owed validation."""

    def __init__(self) -> None:
        self.sent = False

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_a_second_preemption_during_the_owed_validation_does_not_owe_it_again(tmp_path: Path) -> None:
    straight, straight_result, _, _ = train_digits(tmp_path / "straight", patience=5)
    train_digits(tmp_path / "resumed", PreemptDuring(10), patience=5)  # owes epoch 1's validation
    _, second, _, second_validated = train_digits(
        tmp_path / "resumed", PreemptAtValidation(), resume="auto", patience=5
    )
    assert second.preempted and second.step_count == 10 and second_validated.steps == [10]
    state = CheckpointHook(tmp_path).read_checkpoint(tmp_path / "resumed" / "step_10")
    assert state["scheduler"]["validation_owed"] is False  # written again after the validation
    resumed, result, _, validated = train_digits(tmp_path / "resumed", resume="auto", patience=5)
    assert validated.steps == [20, 30]  # epoch 1's validation is not made twice
    assert result.step_count == straight_result.step_count == 30
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(straight), strict=True))
    logged = [r for r in csv_rows(tmp_path / "resumed") if not (r["step"] == "10" and r["train_loss"])]
    assert logged == csv_rows(tmp_path / "straight")  # one validation row at step 10, not two
