"""Replacing a same-numbered checkpoint never loses it, retention never counts a corrupt checkpoint, a
``checkpoint_dir`` that is a file is refused by name, and tied weights are written once by every writer."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, latest_checkpoint, list_checkpoints, save_checkpoint, storage
from nvtrain_checkpoint.snapshot import snapshot
from nvtrain_checkpoint.staging import shared_memory_supported

import nvtrain
from nvtrain.validators import FieldTypeError


def _state(step: int) -> dict[str, Any]:
    return {"models": {"main": {"weight": torch.full((2, 3), float(step))}}, "counters": {"step_count": step}}


def _weight(directory: Path) -> torch.Tensor:
    """The saved weight, after the manifest's size and sha256 check."""
    storage.verify_checkpoint(directory)
    return torch.load(directory / storage.STATE_NAME, weights_only=True)["models"]["main"]["weight"]


def _save(root: Path, step: int, **kwargs: Any) -> Path:
    return save_checkpoint(root, step, _state(step), {"nvtrain_version": nvtrain.__version__}, **kwargs)


class _Killed(BaseException):
    """Stands for a kill: nothing in the save catches it, so the disk stays as a dead process leaves it."""


@pytest.fixture
def killed_between_renames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``step_2`` saved, then saved again and "killed" after the old one was moved aside, before the new
    one took its name (the second of the two renames in ``publish``)."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    renames: list[tuple[Any, Any]] = []
    real_rename = os.rename

    def rename(source: Any, target: Any) -> None:
        renames.append((source, target))
        if len(renames) == 2:
            raise _Killed
        real_rename(source, target)

    monkeypatch.setattr(storage.os, "rename", rename)
    with pytest.raises(_Killed):
        save_checkpoint(tmp_path, 2, _state(20), {"nvtrain_version": nvtrain.__version__})
    monkeypatch.setattr(storage.os, "rename", real_rename)
    assert not (tmp_path / "step_2").exists()  # the window the readers have to cover
    yield tmp_path


def test_a_kill_between_the_renames_of_a_replacement_leaves_the_old_checkpoint_readable(
    killed_between_renames: Path,
) -> None:
    root = killed_between_renames
    parked = [entry for entry in root.iterdir() if entry.name.startswith(storage.REPLACED_PREFIX)]
    assert len(parked) == 1
    assert latest_checkpoint(root) == parked[0]  # latest names step_2: its parked copy stands for it
    assert [info.step for info in list_checkpoints(root)] == [1, 2]
    assert torch.equal(_weight(storage.resolve_checkpoint(root)), torch.full((2, 3), 2.0))


def test_auto_resume_after_a_kill_between_the_renames_continues_from_the_parked_checkpoint(
    killed_between_renames: Path,
) -> None:
    hook = CheckpointHook(killed_between_renames, resume="auto")
    chosen = hook.resume_checkpoint()
    assert chosen is not None and chosen.name.startswith(f"{storage.REPLACED_PREFIX}step_2-")
    assert storage.checkpoint_step(chosen) == 2


def test_an_explicit_path_of_a_parked_checkpoint_resolves_to_it(killed_between_renames: Path) -> None:
    resolved = storage.resolve_checkpoint(killed_between_renames / "step_2")
    assert resolved.name.startswith(f"{storage.REPLACED_PREFIX}step_2-")
    assert torch.equal(_weight(resolved), torch.full((2, 3), 2.0))


def test_the_next_save_puts_a_parked_checkpoint_back_before_removing_leftovers(killed_between_renames: Path) -> None:
    root = killed_between_renames
    _save(root, 3, keep_last_n=2)
    assert sorted(entry.name for entry in root.iterdir()) == ["latest", "step_2", "step_3"]
    assert torch.equal(_weight(root / "step_2"), torch.full((2, 3), 2.0))


def test_a_replacement_that_finishes_leaves_only_the_new_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    save_checkpoint(tmp_path, 2, _state(20), {"nvtrain_version": nvtrain.__version__})
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["latest", "step_2"]
    assert torch.equal(_weight(storage.resolve_checkpoint(tmp_path)), torch.full((2, 3), 20.0))


# -- retention and corrupt checkpoints -------------------------------------------------------------


def _train(driver: ModuleType, hook: CheckpointHook, max_steps: int) -> None:
    kwargs = driver.strategy_kwargs("plain", [hook])
    kwargs["step_scheduler"] = attrs.evolve(kwargs["step_scheduler"], max_steps=max_steps)
    with nvtrain.TrainingStrategy(**kwargs) as strategy:
        strategy.run(driver.make_loader("plain"))


def _corrupt(directory: Path) -> None:
    path = directory / storage.STATE_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _set_aside(root: Path) -> list[str]:
    return sorted(
        entry.name.rsplit("-", 1)[0] for entry in root.iterdir() if entry.name.startswith(storage.CORRUPT_PREFIX)
    )


def test_a_save_sets_aside_what_the_resume_passed_over_as_corrupt(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _save(tmp_path, step, keep_last_n=3)
    _corrupt(tmp_path / "step_6")
    _save(tmp_path, 7, keep_last_n=2, passed_over={"step_6"})
    assert [info.step for info in list_checkpoints(tmp_path)] == [4, 7]  # step_6 did not count
    assert _set_aside(tmp_path) == [".corrupt-step_6"]  # kept for inspection, out of the step_<N> names
    _save(tmp_path, 8, keep_last_n=2)
    assert [info.step for info in list_checkpoints(tmp_path)] == [7, 8]
    assert _set_aside(tmp_path) == [".corrupt-step_6"]  # retention never deletes it


def test_a_save_of_the_passed_over_step_itself_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 6)
    _corrupt(tmp_path / "step_6")
    _save(tmp_path, 6, passed_over={"step_6"})
    assert _set_aside(tmp_path) == [] and torch.equal(_weight(tmp_path / "step_6"), torch.full((2, 3), 6.0))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_resumed_run_keeps_keep_last_n_intact_checkpoints_beside_a_corrupt_one(
    tmp_path: Path, driver: ModuleType, async_save: bool
) -> None:
    _train(driver, CheckpointHook(tmp_path, step_interval=3, keep_last_n=2), max_steps=6)
    _corrupt(tmp_path / "step_6")
    second = CheckpointHook(tmp_path, step_interval=4, keep_last_n=2, resume="auto", async_save=async_save)
    _train(driver, second, max_steps=7)  # resumes at step 3, saves 4 and 7
    assert _intact(tmp_path) == [4, 7] and _set_aside(tmp_path) == [".corrupt-step_6"]
    third = CheckpointHook(tmp_path, step_interval=4, keep_last_n=2, resume="auto", async_save=async_save)
    _train(driver, third, max_steps=9)  # resumes at step 7 (no warning about step_6 now), saves 8 and 9
    assert _intact(tmp_path) == [8, 9] and _set_aside(tmp_path) == [".corrupt-step_6"]


def test_a_step_saved_again_after_its_corrupt_copy_was_set_aside_is_kept(tmp_path: Path, driver: ModuleType) -> None:
    _train(driver, CheckpointHook(tmp_path, step_interval=3), max_steps=6)
    _corrupt(tmp_path / "step_6")
    _train(driver, CheckpointHook(tmp_path, step_interval=3, resume="auto"), max_steps=9)  # saves 6 again, then 9
    assert _intact(tmp_path) == [3, 6, 9]


def _intact(root: Path) -> list[int]:
    intact = []
    for info in list_checkpoints(root):
        try:
            storage.verify_checkpoint(info.path)
        except storage.CheckpointError:
            continue
        intact.append(info.step)
    return intact


# -- checkpoint_dir that is a file -------------------------------------------------------------------


def test_a_checkpoint_dir_that_is_a_file_is_refused_when_the_hook_is_built(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints"
    path.write_text("not a directory")
    with pytest.raises(FieldTypeError, match=r"CheckpointHook\.checkpoint_dir must be a directory .* is a file"):
        CheckpointHook(path)


def test_a_checkpoint_dir_under_a_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "runs").write_text("not a directory")
    with pytest.raises(FieldTypeError, match=r"checkpoint_dir must be a directory .* lies under '.*runs', which is a file"):
        CheckpointHook(tmp_path / "runs" / "job" / "checkpoints")


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_a_checkpoint_dir_that_became_a_file_is_refused_at_the_start_of_a_run(
    tmp_path: Path, driver: ModuleType, resume: str
) -> None:
    path = tmp_path / "checkpoints"
    hook = CheckpointHook(path, resume=resume)
    path.write_text("not a directory")
    with pytest.raises(FieldTypeError, match=r"CheckpointHook\.checkpoint_dir"):
        _train(driver, hook, max_steps=1)


# -- tied weights -------------------------------------------------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = torch.nn.Linear(4, 4, bias=False)
        self.decode = torch.nn.Linear(4, 4, bias=False)
        self.decode.weight = self.encode.weight
        self.head = torch.nn.Linear(4, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.decode(torch.tanh(self.encode(inputs))))


_WRITERS = [("sync", False, "thread"), ("thread", True, "thread")]
if shared_memory_supported():
    _WRITERS.append(("process", True, "process"))


def _tied_checkpoint(directory: Path, async_save: bool, writer: str) -> Path:
    torch.manual_seed(0)
    model = _Tied()
    hook = CheckpointHook(directory, step_interval=2, async_save=async_save, async_writer=writer)
    batches = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(2)]
    with nvtrain.TrainingStrategy(
        models=model,
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        num_epochs=1,
        device="cpu",
    ) as strategy:
        strategy.run(batches)
    return directory / "step_2" / storage.STATE_NAME


def test_tied_weights_are_written_once_and_every_writer_writes_the_same_bytes(tmp_path: Path) -> None:
    digests = {}
    for name, async_save, writer in _WRITERS:
        path = _tied_checkpoint(tmp_path / name, async_save, writer)
        digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        weights = torch.load(path, weights_only=True)["models"]["main"]
        assert (
            weights["encode.weight"].untyped_storage().data_ptr()
            == weights["decode.weight"].untyped_storage().data_ptr()
        ), name
    assert len(set(digests.values())) == 1, digests


def test_a_buffer_reused_after_tied_weights_were_untied_takes_only_its_own_values() -> None:
    shared = torch.zeros(4)
    tied = snapshot({"encode": shared, "decode": shared.view_as(shared)}, copy_host=True)
    untied = {"encode": torch.full((4,), 1.0), "decode": torch.full((4,), 2.0)}
    again = snapshot(untied, reuse=tied, copy_host=True)
    assert torch.equal(again["encode"], untied["encode"]) and torch.equal(again["decode"], untied["decode"])
