"""The checkpoint of an epoch's last step waits for that epoch's end work. When that work raised, a ``run()``
of the same strategy finishes it and then writes the step: the checkpoint equals a straight run's, bitwise."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, list_checkpoints, read_checkpoint

import nvtrain

STEPS_PER_EPOCH = 9  # the driver's "plain" set-up: 2 epochs of 9 steps


class FailsOnce:
    """Raises once at ``point`` of the first epoch's end (before the hooks listed after it)."""

    def __init__(self, point: str | None) -> None:
        self.point, self.fired = point, False

    def _fail(self, point: str, ctx: nvtrain.TrainingContext) -> None:
        if point == self.point and ctx.epoch == 0 and not self.fired:
            self.fired = True
            raise RuntimeError(f"transient failure at {point}")

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self._fail("after_validation", ctx)

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        self._fail("after_epoch", ctx)


class EpochEnds:
    """A checkpointed hook whose state changes at every epoch end: a checkpoint written before its
    AFTER_EPOCH ran holds the old count."""

    state_key = "epoch-ends"

    def __init__(self) -> None:
        self.count = 0

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def train(driver: ModuleType, directory: Path, point: str | None) -> nvtrain.TrainingStrategy:
    """The driver's plain set-up with a validation every epoch; after a failure, one more run()."""
    validation_data = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(5)), torch.zeros(4, 2))]
    hooks: list[object] = [FailsOnce(point), EpochEnds(), CheckpointHook(directory)]
    kwargs = driver.strategy_kwargs("plain", hooks)
    kwargs["lr_schedulers"] = nvtrain.LRSchedule(
        functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5), interval="epoch"
    )
    kwargs["validation"] = nvtrain.ValidationConfig(data=validation_data, every_n_epochs=1)
    torch.manual_seed(1)
    strategy = nvtrain.TrainingStrategy(**kwargs)
    loader = driver.make_loader("plain")
    if point is not None:
        with pytest.raises(RuntimeError, match="transient"):
            strategy.run(loader)
    strategy.run(loader)
    strategy.close()
    return strategy


@pytest.mark.parametrize("point", ["after_validation", "after_epoch"])
def test_a_retried_epoch_end_writes_the_checkpoint_a_straight_run_wrote(
    driver: ModuleType, tmp_path: Path, point: str
) -> None:
    train(driver, tmp_path / "straight", None)
    train(driver, tmp_path / "retried", point)
    steps = [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    assert [c.step for c in list_checkpoints(tmp_path / "retried")] == steps
    for step in steps:
        expected = read_checkpoint(tmp_path / "straight" / f"step_{step}")
        actual = read_checkpoint(tmp_path / "retried" / f"step_{step}")
        assert actual["lr_schedulers"]["main"]["last_epoch"] == step // STEPS_PER_EPOCH  # after the epoch's LR step
        driver.assert_same(expected, actual, f"step_{step}")
