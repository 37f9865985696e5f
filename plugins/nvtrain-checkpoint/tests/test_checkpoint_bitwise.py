"""Resuming is indistinguishable from not stopping: N steps straight equal k steps, a checkpoint,
a fresh process, a load and N - k steps, bit for bit (parameters, optimizer, LR scheduler, EMA,
loss sequence), with shuffling and dropout, mid-epoch and at an epoch end, with accumulation."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, list_checkpoints

import nvtrain

# config -> (checkpoint cadence of the straight run, steps to resume from: mid-epoch, an epoch end)
CASES = {
    "plain": (4, (4, 9)),  # 9 steps per epoch, shuffled by the global RNG: 4 is mid-epoch, 9 ends epoch 0
    "accumulate": (3, (3, 5)),  # windows of 2, 2, 2, 2, 1 micro-batches; the loader has its own generator; EMA
}


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise_identical(
    driver: ModuleType, run_driver: Callable[..., str], tmp_path: Path
) -> None:
    configs = [c for c in CASES if c != "accumulate" or importlib.util.find_spec("nvtrain_ema") is not None]
    references, jobs = {}, []
    for config in configs:
        every, resume_steps = CASES[config]
        root = tmp_path / config
        references[config] = driver.straight(config, [CheckpointHook(root)], ckpt_every_steps=every)
        assert set(resume_steps) <= {info.step for info in list_checkpoints(root)}
        jobs += [f"{config}={root / f'step_{step}'}={tmp_path / f'{config}_{step}.pt'}" for step in resume_steps]
    run_driver("resume", *jobs)  # one fresh process: the second halves never saw the first
    for config in configs:
        reference = references[config]
        for step in CASES[config][1]:
            resumed: dict[str, Any] = torch.load(tmp_path / f"{config}_{step}.pt", weights_only=True)
            first_batch = resumed["losses"][0][0]
            tail = [entry for entry in reference["losses"] if entry[0] >= first_batch]
            assert 0 < len(tail) < len(reference["losses"])  # it really resumed, and did not restart
            where = f"{config}, resumed from step {step}"
            driver.assert_same(tail, resumed["losses"], f"losses ({where})")
            for key in ("params", "optimizer", "lr_scheduler", "ema", "counters"):
                driver.assert_same(reference[key], resumed[key], f"{key} ({where})")


def test_saving_does_not_perturb_training(driver: ModuleType, tmp_path: Path) -> None:
    """The save path draws no random numbers and changes no state: with and without saves, the same run."""
    without = driver.straight("plain")
    with_saves = driver.straight("plain", [CheckpointHook(tmp_path, step_interval=1, async_save=True)])
    driver.assert_same(without, with_saves)


def test_resume_in_process_from_every_checkpoint_of_an_interval(driver: ModuleType, tmp_path: Path) -> None:
    """step_interval cadence; each checkpoint restored into a new strategy finishes like the straight run."""
    reference = driver.straight("plain", [CheckpointHook(tmp_path, step_interval=5)])
    assert [info.step for info in list_checkpoints(tmp_path)] == [5, 10, 15, 18]  # 18: the run's end
    for step in (5, 10, 15):
        recorder = driver.LossRecorder()
        torch.manual_seed(step)
        strategy = nvtrain.TrainingStrategy.load_checkpoint(
            tmp_path / f"step_{step}", **driver.strategy_kwargs("plain", [recorder])
        )
        with strategy:
            strategy.run(driver.make_loader("plain"))
        driver.assert_same(reference["params"], driver.summary(strategy, recorder)["params"], f"from step {step}")


def test_a_checkpoint_saved_after_a_validation_holds_the_training_rng(driver: ModuleType, tmp_path: Path) -> None:
    """A step that validates saves at AFTER_VALIDATION. Iterating the validation DataLoader draws from the
    global RNG, which ``run()`` forks for it; the checkpoint must hold the training stream, not the forked one,
    or the resumed run's dropout differs from the straight run's."""
    data = torch.Generator().manual_seed(11)
    val_set = torch.utils.data.TensorDataset(torch.randn(8, 3, generator=data), torch.randn(8, 2, generator=data))

    def kwargs(hooks: list[object]) -> dict[str, Any]:
        loader = torch.utils.data.DataLoader(val_set, batch_size=4)
        validation = nvtrain.ValidationConfig(data=loader, every_n_steps=4, every_n_epochs=None)
        return {**driver.strategy_kwargs("plain", hooks), "validation": validation}

    recorder = driver.LossRecorder()
    torch.manual_seed(1)
    with nvtrain.TrainingStrategy(**kwargs([CheckpointHook(tmp_path, step_interval=4), recorder])) as strategy:
        strategy.run(driver.make_loader("plain"))
    reference = driver.summary(strategy, recorder)
    recorder = driver.LossRecorder()
    torch.manual_seed(4)  # whatever the process drew since: the checkpoint's RNG state replaces it
    with nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_4", **kwargs([recorder])) as strategy:
        strategy.run(driver.make_loader("plain"))
    resumed = driver.summary(strategy, recorder)
    tail = [entry for entry in reference["losses"] if entry[0] >= resumed["losses"][0][0]]
    driver.assert_same(tail, resumed["losses"], "losses after the resume")
    driver.assert_same(reference["params"], resumed["params"], "params")
