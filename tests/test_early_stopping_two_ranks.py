"""Early stopping decides alike on every rank (gloo, CPU, two processes).

Each rank validates on its own data, so its summary differs from the other's. Judged on its own
value, each rank's hook kept its own best value and count, and a checkpoint (rank 0's state) gave
rank 1 rank 0's on resume: the resumed run stopped steps later than the straight one. The hook
judges the value averaged over the ranks, so the state is the same everywhere.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import EarlyStoppingHook
from nvtrain.testing import gloo_group, spawn_ranks

WORLD_SIZE = 2
#: Per rank and validation, the score it reports: rank 0 improves, rank 1 worsens, their mean worsens.
SCORES = {0: [1.0, 0.5, 0.25, 0.125], 1: [1.0, 2.0, 4.0, 8.0]}


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, WORLD_SIZE, port):
        torch.save(_train(rank), Path(out) / f"rank{rank}.pt")


def _train(rank: int) -> dict[str, Any]:
    validations: list[int] = []

    def score(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(SCORES[rank][len(validations)])

    class Count:
        @nvtrain.hookimpl
        def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
            validations.append(ctx.step_count)

    early = EarlyStoppingHook(monitor="score", mode="min", patience=1)
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)) for _ in range(2)]
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[early, Count()],  # listed first: it judges before Count records the validation
        num_epochs=4,
        device="cpu",
        validation=nvtrain.ValidationConfig(data=batches, metrics={"score": score}),
    )
    with strategy:
        result = strategy.run(batches)
    return {"step": result.step_count, "reason": result.stop_reason, "state": early.state_dict()}


def test_early_stopping_judges_the_mean_of_the_ranks_values(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks import this module by name
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        spawn_ranks(_rank, str(tmp_path), nprocs=WORLD_SIZE)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    # the mean score 1.0, 1.25 does not improve at the second validation (step 4): both ranks stop there,
    # each for the same reason, with the same best value and count, which a rank-0 checkpoint holds for both
    assert ranks[0] == ranks[1]
    assert ranks[0]["step"] == 4 and ranks[0]["reason"].startswith("early stopping: score did not improve")
    assert ranks[0]["state"] == {"monitor": "score", "mode": "min", "best": 1.0, "wait": 1}
