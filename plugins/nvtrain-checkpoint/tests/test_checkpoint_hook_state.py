"""What CheckpointHook reports about checkpoints on disk after an explicit load (load_checkpoint, load_into)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from nvtrain_checkpoint import CheckpointHook

import nvtrain


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 2, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(6)]


def _kwargs() -> dict[str, Any]:
    return {
        "models": torch.nn.Linear(2, 1),
        "optimizers": functools.partial(torch.optim.SGD, lr=0.1),
        "loss_fn": torch.nn.functional.mse_loss,
        "device": "cpu",
    }


def _write_steps_2_and_4(directory: Path) -> None:
    with nvtrain.TrainingStrategy(hooks=[CheckpointHook(directory, step_interval=2)], max_steps=4, **_kwargs()) as s:
        s.run(_data())


def test_load_checkpoint_from_its_own_directory_reports_it_on_disk(tmp_path: Path) -> None:
    _write_steps_2_and_4(tmp_path)
    hook = CheckpointHook(tmp_path, step_interval=2)
    with nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_4", hooks=[hook], max_steps=6, **_kwargs()):
        assert hook.last_checkpoint_index == 4
        assert hook.last_saved_step == 4
        assert hook.last_saved == (4, tmp_path / "step_4")


def test_load_into_of_the_latest_in_its_directory_reports_it(tmp_path: Path) -> None:
    _write_steps_2_and_4(tmp_path)
    hook = CheckpointHook(tmp_path)
    strategy = nvtrain.TrainingStrategy(hooks=[hook], max_steps=6, **_kwargs())
    with strategy:
        strategy.setup(_data())
        directory = hook.load_into(strategy)
        assert directory == tmp_path / "step_4"
        assert (hook.last_checkpoint_index, hook.last_saved, hook.last_saved_step) == (4, (4, directory), 4)


def test_a_checkpoint_loaded_from_elsewhere_is_not_reported_as_in_its_directory(tmp_path: Path) -> None:
    elsewhere, own = tmp_path / "elsewhere", tmp_path / "own"
    _write_steps_2_and_4(elsewhere)
    hook = CheckpointHook(own, step_interval=2)
    with nvtrain.TrainingStrategy.load_checkpoint(elsewhere / "step_4", hooks=[hook], max_steps=4, **_kwargs()):
        assert hook.last_checkpoint_index is None and hook.last_saved is None
        assert hook.last_saved_step == 4  # the step the next run starts from


def test_another_spelling_of_its_directory_counts_as_its_own(tmp_path: Path) -> None:
    real = tmp_path / "real"
    _write_steps_2_and_4(real)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    hook = CheckpointHook(tmp_path / "link", step_interval=2)
    loaded = tmp_path / "real" / ".." / "real" / "step_2"
    with nvtrain.TrainingStrategy.load_checkpoint(loaded, hooks=[hook], max_steps=4, **_kwargs()):
        assert hook.last_checkpoint_index == 2 and hook.last_saved == (2, loaded)
