"""Step-scheduler promises at the edges: which checkpoint steps validate (a stop request, a preemption),
a resume over another sample order, signals after a SIGTERM, and strict flags."""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nvtrain
from nvtrain import StepScheduler, StepSchedulerConfig
from nvtrain.preemption import PreemptionWatcher
from nvtrain.validators import FieldTypeError


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)) for _ in range(count)]


class Saver:
    """Stands for a checkpoint hook: validate_on_checkpoint applies only when one is registered."""

    last_saved = None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        pass


class StopAt:
    def __init__(self, step: int) -> None:
        self.step = step
        self.validated: list[int] = []

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            ctx.request_stop("enough")

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.validated.append(ctx.step_count)


@pytest.mark.parametrize("saver", [False, True], ids=["no-saver", "saver"])
def test_a_stop_request_inside_an_epoch_does_not_validate(saver: bool) -> None:
    stop = StopAt(2)
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[stop, *([Saver()] if saver else [])],
        device="cpu",
        validation=nvtrain.ValidationConfig(data=_batches(2)),
        step_scheduler=StepSchedulerConfig(num_epochs=1, ckpt_every_steps=None),
    )
    result = strategy.run(_batches(5))
    assert result.stop_reason == "enough" and result.step_count == 2
    assert stop.validated == []  # the epoch was cut short: no epoch-end validation, checkpoint step or not


def _sampled(samples: int, seed: int = 0, shuffle: bool = True) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(samples))
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=2, rank=0, shuffle=shuffle, seed=seed)
    return DataLoader(data, batch_size=10, sampler=sampler)


@pytest.mark.parametrize(
    ("loader", "difference"),
    [
        (lambda: _sampled(99), "samples: saved 100, now 99"),
        (lambda: _sampled(100, seed=1), "seed: saved 0, now 1"),
        (lambda: _sampled(100, shuffle=False), "shuffle: saved True, now False"),
    ],
    ids=["dataset-length", "sampler-seed", "shuffle"],
)
def test_a_state_over_another_sample_order_is_refused_whatever_the_batch_configuration(
    loader: Any, difference: str
) -> None:
    saving = StepScheduler(20, 10, 2, _sampled(100), preemption_signal=None)
    for _ in saving.epochs:
        for _ in saving:
            saving.finish_step()
            if saving.step == 2:
                break
        break
    state = saving.state_dict()
    loading = StepScheduler(20, 10, 2, loader(), preemption_signal=None)  # the same len(loader) and batch sizes
    with pytest.raises(ValueError, match=rf"the epoch's sample order differs \({difference}\)"):
        loading.load_state_dict(state)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_a_ctrl_c_after_a_sigterm_is_not_a_second_ctrl_c() -> None:
    watcher = PreemptionWatcher(signals=(signal.SIGTERM, signal.SIGINT))
    watcher.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: no KeyboardInterrupt, the run is stopping already
        assert watcher.received_signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C aborts
    finally:
        watcher.restore()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_no_not_acted_on_warning_when_the_run_ends_by_an_exception(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = StepScheduler(2, 2, 1, _batches(4), preemption_signal="SIGUSR1")
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="boom"), scheduler:
        for _ in scheduler.epochs:
            os.kill(os.getpid(), signal.SIGUSR1)
            raise RuntimeError("boom")
    assert "was not acted on" not in caplog.text


@pytest.mark.parametrize("field", ["save_checkpoint_every_epoch", "validate_on_checkpoint"])
def test_the_flags_take_booleans_only(field: str) -> None:
    with pytest.raises(FieldTypeError, match=rf"StepSchedulerConfig\.{field} must be True or False \(got 'no'\)"):
        StepSchedulerConfig(**{field: "no"})


def test_a_stop_request_at_an_epochs_last_step_validates_as_the_runs_last_step() -> None:
    stop = StopAt(5)  # the last step of the first epoch (5 batches)
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[stop, Saver()],
        device="cpu",
        validation=nvtrain.ValidationConfig(data=_batches(2), every_n_epochs=2),  # not this epoch's cadence
        step_scheduler=StepSchedulerConfig(num_epochs=3, ckpt_every_steps=None, save_checkpoint_every_epoch=False),
    )
    result = strategy.run(_batches(5))
    assert result.stop_reason == "enough" and stop.validated == [5] and result.validated_at_step == 5


def test_a_state_at_an_epoch_boundary_loads_over_another_sample_order() -> None:
    saving = StepScheduler(20, 10, 2, _sampled(100), preemption_signal=None)
    state = saving.state_dict()  # position 0: nothing of the epoch read yet
    loading = StepScheduler(20, 10, 2, _sampled(100, seed=1), preemption_signal=None)
    loading.load_state_dict(state)
    assert loading.position == 0


@pytest.mark.parametrize(
    "bounds",
    [{"start_epoch": 1, "num_epochs": 3}, {"start_step": 4, "num_epochs": 1}, {"start_step": 4, "num_epochs": 2}],
    ids=["start-epoch", "start-step", "start-step-two-epochs"],
)
def test_total_steps_is_the_step_the_run_ends_at(bounds: dict[str, int]) -> None:
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        step_scheduler=StepSchedulerConfig(ckpt_every_steps=None, **bounds),
    )
    totals: list[int | None] = []

    class Total:
        @nvtrain.hookimpl
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            totals.append(ctx.scheduler.total_steps)  # type: ignore[union-attr]

    strategy.register_hook(Total())
    result = strategy.run(_batches(5))
    assert totals == [result.step_count]


def test_total_steps_after_loading_a_state_inside_an_epoch() -> None:
    saving = StepScheduler(2, 2, 1, _batches(5), num_epochs=2, preemption_signal=None)
    for _ in saving.epochs:
        for _ in saving:
            saving.finish_step()
            if saving.step == 7:  # epoch 2, third step
                break
        if saving.step == 7:
            break
    loading = StepScheduler(2, 2, 1, _batches(5), num_epochs=2, preemption_signal=None)
    loading.load_state_dict(saving.state_dict())
    assert loading.total_steps == saving.total_steps == 10
