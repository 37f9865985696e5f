"""How long a checkpoint save blocks the training loop, for a model of about 100 MB: sync against async.

Target: with ``async_save=True`` the loop is blocked (snapshot copy + hand-over) for at most a quarter
of the time a synchronous save blocks it (copy + serialise + fsync + rename). Each round times one
save call at AFTER_BATCH; before each round the previous background write is flushed outside the
timed region, so the async figure never includes waiting for an earlier write.

    python -m pytest benchmarks/test_checkpoint_blocking.py
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain

nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")

ROUNDS = 5
WIDTH = 2560  # four Linear(2560, 2560): 26.2 M float32 parameters, 105 MB


def _strategy(root: Path, async_save: bool) -> tuple[nvtrain.TrainingStrategy, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    hook = nvtrain_checkpoint.CheckpointHook(root, step_interval=1, async_save=async_save, keep_last_n=1)
    strategy = nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=1e-3),  # no momentum: the state is the weights
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )
    strategy.train_batch((torch.randn(2, WIDTH), torch.randn(2, WIDTH)))  # set up (and save step 1)
    hook.flush()
    return strategy, hook


def _blocked_time(benchmark: Any, tmp_path: Path, async_save: bool) -> None:
    strategy, hook = _strategy(tmp_path, async_save)
    ctx = strategy.ctx
    size = sum(t.numel() * t.element_size() for t in ctx.models["main"].state_dict().values())
    benchmark.extra_info["state_mb"] = round(size / 1e6, 1)

    def next_step() -> None:
        hook.flush()  # outside the timed region
        ctx.step_count += 1

    with strategy:
        benchmark.pedantic(hook.after_batch, args=(ctx,), setup=next_step, rounds=ROUNDS, iterations=1)
    assert hook.last_checkpoint_index == ctx.step_count


@pytest.mark.benchmark(group="checkpoint save: loop blocked per save (~100 MB)")
def test_save_blocking_sync_baseline(benchmark: Any, tmp_path: Path) -> None:
    _blocked_time(benchmark, tmp_path, async_save=False)


@pytest.mark.benchmark(group="checkpoint save: loop blocked per save (~100 MB)")
def test_save_blocking_async(benchmark: Any, tmp_path: Path) -> None:
    _blocked_time(benchmark, tmp_path, async_save=True)
