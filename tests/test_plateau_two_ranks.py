"""A metric-driven LR scheduler decides alike on every rank (gloo, CPU, two processes).

Each rank validates on its own data, so its summary differs from the other's; stepped on
its own value, each rank's ``ReduceLROnPlateau`` would take its own decisions and the
replicas would train at different learning rates. The strategy steps it on the value
averaged over the ranks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.testing import gloo_group, spawn_ranks

WORLD_SIZE = 2
#: Per rank and epoch, the "score" its validation reports: rank 0 improves, rank 1 worsens, the mean worsens.
SCORES = {0: [1.0, 0.5, 0.25], 1: [1.0, 2.0, 4.0]}


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, WORLD_SIZE, port):
        torch.save(_train(rank), Path(out) / f"rank{rank}.pt")


def _train(rank: int) -> list[float]:
    lrs: list[float] = []
    strategy: nvtrain.TrainingStrategy

    def score(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(SCORES[rank][strategy.ctx.epoch])

    class RecordLR:
        @nvtrain.hookimpl
        def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            lrs.append(ctx.optimizers["main"].param_groups[0]["lr"])

    plateau = nvtrain.LRSchedule(
        functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5, threshold=0.0),
        monitor="score",
    )
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)) for _ in range(2)]
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        lr_schedulers=plateau,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[RecordLR()],
        num_epochs=3,
        device="cpu",
        validation=nvtrain.ValidationConfig(data=batches, metrics={"score": score}),
    )
    with strategy:
        strategy.run(batches)
    return lrs


def test_a_plateau_scheduler_steps_on_the_mean_of_the_ranks_values(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks import this module by name
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        spawn_ranks(_rank, str(tmp_path), nprocs=WORLD_SIZE)
    lrs: dict[int, Any] = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)}
    # the mean score 1.0, 1.25, 2.125 never improves after the first validation: halved at epochs 2 and 3
    assert lrs[0] == lrs[1] == pytest.approx([0.1, 0.05, 0.025])
