"""Two ranks resume from a checkpoint an interrupted replacement left parked (``.replaced-step_<N>-…``): they
agree on its step and both continue from it (gloo, CPU)."""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, storage

import nvtrain
from nvtrain.testing import gloo_group, spawn_ranks

WORLD_SIZE = 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)) for _ in range(4)]


def _strategy(hook: CheckpointHook, started: list[int], max_steps: int) -> nvtrain.TrainingStrategy:
    class RecordStart:
        @nvtrain.hookimpl
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            started.append(ctx.step_count)  # after the checkpoint hook (first) restored the run

    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook, RecordStart()],
        max_steps=max_steps,
        device="cpu",
    )


def _rank(rank: int, port: int, directory: str, max_steps: int) -> None:
    torch.set_num_threads(1)
    started: list[int] = []
    with gloo_group(rank, WORLD_SIZE, port):
        hook = CheckpointHook(Path(directory), step_interval=2, resume="auto")
        with _strategy(hook, started, max_steps) as strategy:
            strategy.run(_batches())
    (Path(directory) / f"started.{rank}").write_text(str(started[0]))


def _spawn(root: Path, max_steps: int) -> list[str]:
    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks import this module by name
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_ranks(_rank, str(root), max_steps, nprocs=WORLD_SIZE)
    return [(root / f"started.{rank}").read_text() for rank in range(WORLD_SIZE)]


def test_two_ranks_resume_from_a_parked_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert _spawn(root, max_steps=2) == ["0", "0"]  # saves step 2
    os.rename(root / "step_2", root / f"{storage.REPLACED_PREFIX}step_2-{uuid.uuid4().hex}")  # as a kill leaves it
    assert _spawn(root, max_steps=3) == ["2", "2"]
    assert [info.step for info in storage.list_checkpoints(root)] == [2, 3]  # put back by the next save
