"""A ``run()`` after one that raised during a completed epoch's end work finishes that work first, each part
once (the validation's summary, AFTER_VALIDATION, the per-epoch LR step, AFTER_EPOCH), so the run ends as one
that never failed: the same weights, learning rate, validations and epoch ends, bitwise."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

import nvtrain

EPOCHS = 3
FAIL_POINTS = ("metric", "after_validation", "after_epoch")


class Recorder:
    """What the epoch ends produced. Listed after the failing hook, so it is called after that one:
    it sees a stage only once the stage got past the failure."""

    def __init__(self) -> None:
        self.validations: list[tuple[int, int, dict[str, Any]]] = []
        self.epoch_ends: list[tuple[int, int, float]] = []

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.validations.append((ctx.epoch, ctx.step_count, dict(ctx.validation or {})))

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        lr = ctx.optimizers["main"].param_groups[0]["lr"]
        self.epoch_ends.append((ctx.epoch, ctx.step_count, lr))


class FailsOnce:
    """Raises once, at ``point`` of the end of epoch ``epoch`` (0-based); also the run's validation metric."""

    def __init__(self, point: str | None, epoch: int) -> None:
        self.point, self.epoch, self.fired = point, epoch, False
        self.metric_calls = 0  # the metric's completed calls: the validation summaries computed

    def _fail(self, point: str, epoch: int) -> None:
        if point == self.point and epoch == self.epoch and not self.fired:
            self.fired = True
            raise RuntimeError(f"transient failure at {point}")

    def metric(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._fail("metric", self.metric_calls)  # one validation batch, one validation per epoch
        self.metric_calls += 1
        return (outputs - targets).abs().mean()

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self._fail("after_validation", ctx.epoch)

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        self._fail("after_epoch", ctx.epoch)


SCHEDULES = {
    "epoch": nvtrain.LRSchedule(
        functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5), interval="epoch"
    ),
    # steps with each validation's loss; patience 0 halves the rate at once when the loss does not improve
    "plateau": nvtrain.LRSchedule(functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0)),
}


def make_strategy(failing: FailsOnce, recorder: Recorder, schedule: str) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        loss_fn=torch.nn.functional.mse_loss,
        lr_schedulers=SCHEDULES[schedule],
        hooks=[failing, recorder],
        validation=nvtrain.ValidationConfig(data=data[:1], every_n_epochs=1, metrics={"error": failing.metric}),
        num_epochs=EPOCHS,
        device="cpu",
    )


def train(point: str | None, epoch: int, schedule: str) -> tuple[nvtrain.TrainingStrategy, Recorder, FailsOnce, Any]:
    """Run to the end; after a failure, once more on the same strategy."""
    recorder, failing = Recorder(), FailsOnce(point, epoch)
    trainer = make_strategy(failing, recorder, schedule)
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]
    if point is not None:
        with pytest.raises(RuntimeError, match=f"transient failure at {point}"):
            trainer.run(data)
        assert failing.fired
    result = trainer.run(data)
    return trainer, recorder, failing, result


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("epoch", [0, EPOCHS - 1])
@pytest.mark.parametrize("point", FAIL_POINTS)
def test_a_run_after_a_failed_epoch_end_finishes_it_as_a_straight_run_did(
    point: str, epoch: int, schedule: str
) -> None:
    straight, straight_seen, straight_metric, straight_result = train(None, epoch, schedule)
    retried, seen, metric, result = train(point, epoch, schedule)
    assert seen.epoch_ends == straight_seen.epoch_ends  # every epoch's end once, at its step, at its rate
    assert seen.validations == straight_seen.validations
    assert metric.metric_calls == straight_metric.metric_calls  # no summary computed twice
    assert result == straight_result
    for name, tensor in straight.models["main"].state_dict().items():
        assert torch.equal(retried.models["main"].state_dict()[name], tensor), name
    assert retried.ctx.optimizers["main"].param_groups[0]["lr"] == straight.ctx.optimizers["main"].param_groups[0]["lr"]
    assert retried.ctx.epoch == EPOCHS


def test_an_epoch_end_that_fails_again_is_finished_by_the_run_after() -> None:
    recorder = Recorder()

    class FailsTwice(FailsOnce):
        calls = 0

        @nvtrain.hookimpl
        def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.epoch == 0 and self.calls < 2:
                self.calls += 1
                raise RuntimeError("transient failure at after_epoch")

    failing = FailsTwice(None, 0)
    trainer = make_strategy(failing, recorder, "epoch")
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="transient"):
            trainer.run(data)
        assert trainer.ctx.epoch == 0 and trainer.ctx.step_count == 3  # still at the end of the first epoch
    trainer.run(data)
    assert [(epoch, step) for epoch, step, _ in recorder.epoch_ends] == [(0, 3), (1, 6), (2, 9)]
    assert [lr for _, _, lr in recorder.epoch_ends] == [0.05, 0.025, 0.0125]  # one LR step per epoch end
    assert failing.metric_calls == EPOCHS


def test_a_state_loaded_after_the_failure_drops_the_unfinished_epoch_end() -> None:
    """The loaded state's position (the next epoch, at its start) replaces the one that work belonged to."""
    recorder, failing = Recorder(), FailsOnce("after_epoch", 0)
    trainer = make_strategy(failing, recorder, "epoch")
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="transient"):
        trainer.run(data)
    state = copy.deepcopy(trainer.state_dict())  # counters at the end of epoch 1: same step, next epoch
    trainer.load_state_dict(state)
    recorder.epoch_ends.clear()
    trainer.run(data)
    assert [epoch for epoch, _, _ in recorder.epoch_ends] == [1, 2]
