"""How long a checkpoint save blocks the training loop, for a model of about 100 MB: sync against async.

Target: with ``async_save=True`` the loop is blocked (snapshot copy + hand-over) for at most a quarter
of the time a synchronous save blocks it (copy + serialise + fsync + rename). Each round times one
save call at AFTER_BATCH; before each round the previous background write is flushed outside the
timed region, so the async figure never includes waiting for an earlier write.

A second group times a synchronous save with ``keep_last_n=1`` (64 MB): the hand-written durable
save that unlinks the previous file (baseline), ``save_checkpoint`` deleting the dropped checkpoint
before it returns, and deleting it on the background writer as ``CheckpointHook`` does.

    python -m pytest benchmarks/test_checkpoint_blocking.py
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain

nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")
from nvtrain_checkpoint import storage  # noqa: E402
from nvtrain_checkpoint.writer import BackgroundWriter  # noqa: E402

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


# -- retention: deleting the dropped checkpoint inline, or on the background writer ----------------------

RETENTION_STATE_MB = 64


def _retention_state() -> dict[str, Any]:
    return {"model": {"weight": torch.randn(RETENTION_STATE_MB * (1 << 20) // 4)}}


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _time_saves(benchmark: Any, save: Callable[[int], None], rounds: int, settle: Callable[[], None]) -> None:
    steps = itertools.count(1)
    save(next(steps))  # a previous checkpoint for the first timed save to drop

    def next_save() -> tuple[tuple[int], dict[str, Any]]:
        settle()  # outside the timed region: the previous save's background work is done
        return (next(steps),), {}

    benchmark.pedantic(save, setup=next_save, rounds=rounds, iterations=1)
    settle()


@pytest.mark.benchmark(group=f"synchronous save with keep_last_n=1 ({RETENTION_STATE_MB} MB): time blocked")
def test_retention_hand_written_baseline(benchmark: Any, tmp_path: Path, scale: Any) -> None:
    """torch.save to a temporary file, fsync, rename, directory fsync, then unlink the previous file."""
    state = _retention_state()

    def save(step: int) -> None:
        temporary = tmp_path / f".tmp-{step}"
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, tmp_path / f"step_{step}.pt")
        _fsync_dir(tmp_path)
        (tmp_path / f"step_{step - 1}.pt").unlink(missing_ok=True)

    _time_saves(benchmark, save, scale.pick(15, 4), settle=lambda: None)


@pytest.mark.benchmark(group=f"synchronous save with keep_last_n=1 ({RETENTION_STATE_MB} MB): time blocked")
def test_retention_deleted_inline(benchmark: Any, tmp_path: Path, scale: Any) -> None:
    """``save_checkpoint``'s default: the dropped checkpoint is deleted before it returns."""
    state = _retention_state()
    save = functools.partial(_save_checkpoint, tmp_path, state=state)
    _time_saves(benchmark, save, scale.pick(15, 4), settle=lambda: None)


@pytest.mark.benchmark(group=f"synchronous save with keep_last_n=1 ({RETENTION_STATE_MB} MB): time blocked")
def test_retention_deleted_in_the_background(benchmark: Any, tmp_path: Path, scale: Any) -> None:
    """What CheckpointHook does on a synchronous save: the deletion goes to its background writer."""
    state = _retention_state()
    writer = BackgroundWriter()

    def discard(trash: list[Path]) -> None:
        writer.submit(functools.partial(storage.delete_trash, trash), "deleting in the background")

    save = functools.partial(_save_checkpoint, tmp_path, state=state, discard=discard)
    try:
        _time_saves(benchmark, save, scale.pick(15, 4), settle=writer.wait)
    finally:
        writer.close()


def _save_checkpoint(root: Path, step: int, *, state: dict[str, Any], **options: Any) -> None:
    storage.save_checkpoint(root, step, state, {}, keep_last_n=1, **options)
