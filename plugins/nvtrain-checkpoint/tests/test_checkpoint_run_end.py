"""A run that ends inside an epoch (``max_steps``) validates its last step on the epoch cadence; its last
checkpoint is written after that validation, so it holds what the validation changed (early stopping's
best value, a ReduceLROnPlateau's), as an epoch-end checkpoint does."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.hooks import EarlyStoppingHook


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
