"""The on-disk format: layout, the latest pointer, retention, and refusing bad files with a clear error."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import (
    CheckpointError,
    CheckpointHook,
    CheckpointVersionWarning,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
    read_manifest,
    save_checkpoint,
    storage,
)
from nvtrain_checkpoint.storage import (
    MANIFEST_NAME,
    STATE_NAME,
    apply_retention,
    delete_trash,
    verify_checkpoint,
    write_latest,
)

import nvtrain


def _state(step: int = 1) -> dict[str, Any]:
    """A minimal valid training state."""
    return {
        "format": 1,
        "models": {"main": {"weight": torch.full((2, 3), float(step))}},
        "optimizers": {},
        "lr_schedulers": {},
        "counters": {
            "step_count": step,
            "global_step_count": step,
            "batch_count": step,
            "epoch": 0,
            "epoch_step_count": step,
        },
        "scheduler": None,
        "hooks": {},
        "rng": {"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state()},
    }


def _save(root: Path, step: int, keep_last_n: int | None = None, **metadata: Any) -> Path:
    return save_checkpoint(root, step, _state(step), {"nvtrain_version": nvtrain.__version__, **metadata}, keep_last_n)


# -- layout ----------------------------------------------------------------------------------------


def test_layout_manifest_and_latest(tmp_path: Path) -> None:
    path = _save(tmp_path, 7, epoch=2, plugins={})
    assert path == tmp_path / "step_7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_7"]
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST_NAME, STATE_NAME]
    assert (tmp_path / "latest").read_text() == "step_7\n"
    manifest = read_manifest(path)
    assert manifest["format_version"] == 1 and manifest["step"] == 7 and manifest["epoch"] == 2
    assert manifest["files"][STATE_NAME]["size"] == (path / STATE_NAME).stat().st_size
    assert len(manifest["files"][STATE_NAME]["sha256"]) == 64
    state = read_checkpoint(tmp_path)  # a root resolves to what latest names
    assert torch.equal(state["models"]["main"]["weight"], torch.full((2, 3), 7.0))


def test_the_manifest_holds_the_size_and_sha256_of_the_bytes_on_disk(tmp_path: Path) -> None:
    directory = _save(tmp_path, 1)
    data = (directory / STATE_NAME).read_bytes()
    entry = read_manifest(directory)["files"][STATE_NAME]
    assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_failed_fsync_fails_the_save_and_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state file is fsynced on a helper thread while its digest is taken: its error still fails the save."""
    _save(tmp_path, 1)
    real_fsync = os.fsync
    state_files: set[int] = set()
    real_open = open

    def failing_fsync(fd: int) -> None:
        if fd in state_files:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    def tracking_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if str(file).endswith(STATE_NAME) and "w" in mode:
            state_files.add(handle.fileno())
        return handle

    monkeypatch.setattr(os, "fsync", failing_fsync)
    monkeypatch.setattr("builtins.open", tracking_open)
    with pytest.raises(OSError, match="Input/output error"):
        _save(tmp_path, 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]  # no step_2, no temporary left
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"


def test_a_same_numbered_checkpoint_is_replaced_whole(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    save_checkpoint(tmp_path, 3, {**_state(3), "models": {"main": {"weight": torch.zeros(1)}}}, {})
    assert torch.equal(read_checkpoint(tmp_path / "step_3")["models"]["main"]["weight"], torch.zeros(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3"]


def test_leftovers_of_interrupted_saves_are_ignored_then_removed(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / ".tmp-step_2-dead").mkdir()
    (tmp_path / ".tmp-step_2-dead" / STATE_NAME).write_bytes(b"half")
    (tmp_path / ".trash-step_0-dead").mkdir()
    (tmp_path / ".tmp-latest-dead").write_text("step_2")
    assert [info.step for info in list_checkpoints(tmp_path)] == [1]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    _save(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1", "step_3"]


def test_a_stale_latest_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    write_latest(tmp_path, "step_9")  # names nothing complete
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    (tmp_path / "latest").write_text("../elsewhere\n")  # never followed outside the root
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"


# -- retention -----------------------------------------------------------------------------------


def test_keep_last_n_keeps_the_newest_complete_ones(tmp_path: Path) -> None:
    for step in range(1, 6):
        _save(tmp_path, step, keep_last_n=2)
    assert [info.step for info in list_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_5"]


def test_retention_counts_only_complete_checkpoints_and_spares_latest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / "step_8").mkdir()  # no manifest: not a checkpoint, not counted
    (tmp_path / ".tmp-step_9-x").mkdir()
    write_latest(tmp_path, "step_1")
    removed = apply_retention(tmp_path, 1)
    assert removed == [tmp_path / "step_2"]
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 3]
    assert (tmp_path / "step_8").is_dir()


def test_retention_renames_dropped_checkpoints_out_of_sight_before_discarding_them(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    handed: list[list[Path]] = []
    removed = apply_retention(tmp_path, 1, discard=handed.append)
    assert removed == [tmp_path / "step_1", tmp_path / "step_2"]
    assert [info.step for info in list_checkpoints(tmp_path)] == [3]  # gone from sight at once
    (trash,) = handed
    assert [path.name.split("-")[1] for path in trash] == ["step_1", "step_2"]
    assert all(path.name.startswith(".trash-") and (path / STATE_NAME).is_file() for path in trash)  # not deleted
    assert apply_retention(tmp_path, 1, discard=handed.append) == [] and len(handed) == 1  # nothing to hand over
    delete_trash(trash)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3"]


def test_a_save_hands_its_dropped_checkpoints_to_discard(tmp_path: Path) -> None:
    handed: list[list[Path]] = []
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(step), {}, keep_last_n=2, discard=handed.append)
    assert [[path.name.split("-")[1] for path in trash] for trash in handed] == [["step_1"]]
    _save(tmp_path, 4, keep_last_n=2)  # the next save sweeps leftovers, a discarded tree among them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]


# -- refusing what is not a complete, intact nvtrain checkpoint ---------------------------------


def test_truncated_state_file_is_refused_before_loading(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    data = (path / STATE_NAME).read_bytes()
    (path / STATE_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{STATE_NAME} is {len(data) // 2} bytes .* truncated"):
        read_checkpoint(path)


def test_corrupt_state_file_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    data = bytearray((path / STATE_NAME).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / STATE_NAME).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{STATE_NAME} does not match the sha256 .*corrupt"):
        read_checkpoint(path)


class _Payload:
    """Pickles to a call of os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _forge(directory: Path, payload: Any) -> None:
    """A checkpoint directory whose manifest matches its (hostile) state file."""

    directory.mkdir()
    torch.save(payload, directory / STATE_NAME)
    data = (directory / STATE_NAME).read_bytes()
    manifest = {
        "format_version": 1,
        "step": 1,
        "files": {STATE_NAME: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _forge(tmp_path / "step_1", {"format": 1, "evil": _Payload(marker)})
    with pytest.raises(CheckpointError, match=r"state.pt was refused by torch.load\(weights_only=True\)") as info:
        read_checkpoint(tmp_path / "step_1")
    assert "system" in str(info.value)  # names what was refused
    assert not marker.exists()


def test_a_foreign_state_file_is_refused(tmp_path: Path) -> None:
    _forge(tmp_path / "step_1", {"weights": torch.zeros(2)})  # a loadable torch file, but not a training state
    with pytest.raises(CheckpointError, match=r"state.pt: not a training state: it has no 'format' key"):
        read_checkpoint(tmp_path / "step_1")


def test_a_state_file_that_is_not_a_torch_file_is_refused(tmp_path: Path) -> None:
    _forge(tmp_path / "step_1", None)
    (tmp_path / "step_1" / STATE_NAME).write_bytes(b"not a zip")
    manifest = json.loads((tmp_path / "step_1" / MANIFEST_NAME).read_text())

    manifest["files"][STATE_NAME] = {"size": 9, "sha256": hashlib.sha256(b"not a zip").hexdigest()}
    (tmp_path / "step_1" / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"state.pt is not a readable torch file \(torch.save's zip format"):
        read_checkpoint(tmp_path / "step_1")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"manifest.json is not a valid manifest \(not JSON"),
        ('{"hello": 1}', r"manifest.json is not an nvtrain checkpoint manifest"),
        ('{"format_version": 99}', r"step_1 is a checkpoint in format 99, which this nvtrain-checkpoint does not read"),
        ('{"format_version": 0}', r"format_version 0 is one no nvtrain-checkpoint writes .*: the manifest was modified"),
        ('{"format_version": 1.0}', r"format_version must be an int \(got 1.0\)"),
        ('{"format_version": true}', r"format_version must be an int \(got True\)"),
        ('{"format_version": 1, "step": 1, "files": {}}', r"does not list state.pt with its size and sha256"),
        (
            '{"format_version": 1, "step": 1, "files": {"state.pt": {"size": 1, "sha256": "0"}, '
            '"sharded/__0_0.distcp": {}}}',
            r"does not list sharded/__0_0.distcp with its size and sha256 \(it has \{\}\)",
        ),
        ('{"format_version": 1, "files": {}}', r"'step' must be the checkpoint's step, an int >= 0 \(got None\)"),
        ('{"format_version": 1, "step": "1", "files": {}}', r"'step' must be .* \(got '1'\)"),
        ('{"format_version": 1, "step": true, "files": {}}', r"'step' must be .* \(got True\)"),
        ('{"format_version": 1, "step": 2, "files": {}}', r"records step 2, but its directory is step_1"),
    ],
)
def test_bad_manifests_are_refused(tmp_path: Path, content: str, message: str) -> None:
    path = _save(tmp_path, 1)
    (path / MANIFEST_NAME).write_text(content)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(path)


def test_paths_that_are_not_complete_checkpoints_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nowhere")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"model.pt is a file: an nvtrain checkpoint is a directory"):
        read_checkpoint(tmp_path / "model.pt")
    (tmp_path / "step_4").mkdir()
    with pytest.raises(CheckpointError, match=r"step_4 has no manifest.json"):
        read_checkpoint(tmp_path / "step_4")
    (tmp_path / ".tmp-step_5-x").mkdir()
    with pytest.raises(CheckpointError, match=r"unfinished save"):
        read_checkpoint(tmp_path / ".tmp-step_5-x")
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint"):
        read_checkpoint(tmp_path)


# -- versions --------------------------------------------------------------------------------------


def test_different_plugin_versions_are_listed_in_a_warning(tmp_path: Path) -> None:
    plugins = {
        "checkpoint": {"distribution": "nvtrain-checkpoint", "version": "0.0.1"},
        "gone": {"distribution": "nvtrain-not-installed-anywhere", "version": "1.0"},
    }
    path = _save(tmp_path, 1, plugins=plugins)
    with pytest.warns(CheckpointVersionWarning) as record:
        read_checkpoint(path)
    message = str(record[0].message)
    assert "plugin 'checkpoint' (nvtrain-checkpoint) 0.0.1 -> 0.1.0" in message
    assert "plugin 'gone' (nvtrain-not-installed-anywhere) 1.0 -> not installed" in message


def test_matching_versions_do_not_warn(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    path = _save(tmp_path, 1, plugins={"checkpoint": {"distribution": "nvtrain-checkpoint", "version": "0.1.0"}})
    read_checkpoint(path)
    assert not [w for w in recwarn if issubclass(w.category, CheckpointVersionWarning)]


def test_a_hook_from_the_script_of_no_known_version_does_not_warn(
    tmp_path: Path, recwarn: pytest.WarningsRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook class defined in the training script (or a module beside it) has a plugin_name but no version."""
    import types

    beside = types.ModuleType("my_local_hooks")
    beside.__version__ = "2.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_local_hooks", beside)
    plugins = {
        "running_stats": {"distribution": "__main__", "version": "unknown"},
        "local": {"distribution": "my_local_hooks", "version": "2.0"},
    }
    read_checkpoint(_save(tmp_path, 1, plugins=plugins))
    assert not [w for w in recwarn if issubclass(w.category, CheckpointVersionWarning)]
    beside.__version__ = "2.1"  # type: ignore[attr-defined]
    with pytest.warns(CheckpointVersionWarning, match=r"plugin 'local' \(my_local_hooks\) 2\.0 -> 2\.1"):
        read_checkpoint(_save(tmp_path, 2, plugins=plugins))


def test_a_resume_with_a_hook_defined_in_the_script_does_not_warn(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    class RunningStats:
        plugin_name = "running_stats"

        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            pass

        def state_dict(self) -> dict[str, int]:
            return {"n": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    def strategy(hook: CheckpointHook) -> nvtrain.TrainingStrategy:
        return nvtrain.TrainingStrategy(
            torch.nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            torch.nn.functional.mse_loss,
            hooks=[RunningStats(), hook],
            device="cpu",
            max_steps=2,
        )

    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2)]
    with strategy(CheckpointHook(tmp_path)) as first:
        first.run(data)
    manifest = json.loads(next(tmp_path.glob("step_*/manifest.json")).read_text())
    assert manifest["plugins"]["running_stats"]["version"] == "unknown"
    with strategy(CheckpointHook(tmp_path, resume="auto")) as resumed:
        resumed.run(data)
    assert not [w for w in recwarn if issubclass(w.category, CheckpointVersionWarning)]


# -- health and recovery ---------------------------------------------------------------------------


def test_keep_last_n_never_rotates_out_the_newest_healthy_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1, keep_last_n=2, healthy=True)
    _save(tmp_path, 2, keep_last_n=2, healthy=True)
    for step in (3, 4, 5):  # the loss went NaN: every later checkpoint is unhealthy
        _save(tmp_path, step, keep_last_n=2, healthy=False)
    assert [info.step for info in list_checkpoints(tmp_path)] == [2, 4, 5]
    assert json.loads((tmp_path / "step_2" / MANIFEST_NAME).read_text())["healthy"] is True
    _save(tmp_path, 6, keep_last_n=2, healthy=True)  # healthy again: the old one may go
    assert [info.step for info in list_checkpoints(tmp_path)] == [5, 6]


def test_a_checkpoint_without_a_health_mark_counts_as_healthy(tmp_path: Path) -> None:
    _save(tmp_path, 1, keep_last_n=1)
    _save(tmp_path, 2, keep_last_n=1)
    assert [info.step for info in list_checkpoints(tmp_path)] == [2]


def test_checkpoint_hook_marks_each_checkpoint_by_its_loss(tmp_path: Path) -> None:
    from nvtrain_checkpoint import CheckpointHook

    calls = [0]

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = torch.nn.functional.mse_loss(outputs, targets)
        return loss * float("nan") if calls[0] > 2 else loss

    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 1),
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=loss_fn,
        hooks=[CheckpointHook(tmp_path, step_interval=1, keep_last_n=2)],
        device="cpu",
        step_scheduler=nvtrain.StepSchedulerConfig(max_steps=6, preemption_signal=None),
    )
    with strategy:
        strategy.run(data)
    kept = {
        info.step: json.loads((info.path / MANIFEST_NAME).read_text())["healthy"] for info in list_checkpoints(tmp_path)
    }
    assert kept == {2: True, 5: False, 6: False}


def test_auto_resume_falls_back_to_the_newest_intact_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from nvtrain_checkpoint import CheckpointHook

    for step in (1, 2, 3):
        _save(tmp_path, step)
    state = tmp_path / "step_3" / STATE_NAME
    state.write_bytes(state.read_bytes()[:-10])  # truncated
    (tmp_path / "step_4").mkdir()  # a directory without its manifest
    assert CheckpointHook(tmp_path, resume="auto").resume_checkpoint() == tmp_path / "step_2"
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: passing over")]
    assert f"{tmp_path / 'step_4'} is incomplete (no manifest.json)" in message
    assert f"{state} is " in message and "truncated" in message
    assert message.endswith(f"resuming from {tmp_path / 'step_2'} instead")


def test_auto_resume_refuses_when_no_checkpoint_is_intact(tmp_path: Path) -> None:
    from nvtrain_checkpoint import CheckpointHook

    _save(tmp_path, 1)
    (tmp_path / "step_1" / STATE_NAME).write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .* to resume from: .*step_1"):
        CheckpointHook(tmp_path, resume="auto").resume_checkpoint()


def test_a_healthy_checkpoint_above_the_runs_own_does_not_stand_in_for_the_last_good_one(tmp_path: Path) -> None:
    """A run resumed from step_12 while an earlier run's healthy step_18 is still there (latest not moved by a
    kill, or an explicit resume path): its NaN saves keep step_12, not the stale step_18, as the healthy one."""
    for step in (6, 12, 18):
        _save(tmp_path, step, healthy=True)
    write_latest(tmp_path, "step_12")  # the resume point
    _save(tmp_path, 15, keep_last_n=1, healthy=False)
    assert [info.step for info in list_checkpoints(tmp_path)] == [12, 15, 18]
    _save(tmp_path, 18, keep_last_n=1, healthy=False)  # the resumed run reaches step 18 itself: replaced
    assert [info.step for info in list_checkpoints(tmp_path)] == [12, 18]
    assert json.loads((tmp_path / "step_12" / MANIFEST_NAME).read_text())["healthy"] is True


@pytest.mark.parametrize(
    "pointer",
    [b"\xff\xfe not utf-8", b"step_" + b"9" * 300 + b"\n", "directory", b"step_3\nstep_4\n", b"/abs/step_3\n"],
    ids=["not utf-8", "too long", "a directory", "two lines", "an absolute path"],
)
def test_a_latest_pointer_that_cannot_be_read_as_a_name_falls_back_to_the_highest_step(
    tmp_path: Path, pointer: bytes | str
) -> None:
    for step in (1, 2):
        _save(tmp_path, step)
    (tmp_path / "latest").unlink()
    if pointer == "directory":
        (tmp_path / "latest").mkdir()
    else:
        (tmp_path / "latest").write_bytes(pointer)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an unreadable pointer is named in a warning
        assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
        assert read_checkpoint(tmp_path)["counters"]["step_count"] == 2
        CheckpointHook(tmp_path, resume="never")  # a fresh start in that folder is not refused either


def test_a_manifest_or_state_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / "step_3" / MANIFEST_NAME).unlink()
    (tmp_path / "step_3" / MANIFEST_NAME).mkdir()  # read as a file: IsADirectoryError
    with pytest.raises(CheckpointError, match=r"step_3/manifest.json cannot be read"):
        read_manifest(tmp_path / "step_3")
    (tmp_path / "step_2" / STATE_NAME).unlink()
    (tmp_path / "step_2" / STATE_NAME).mkdir()
    with pytest.raises(CheckpointError, match=r"step_2/state.pt is not a file although the manifest lists it"):
        verify_checkpoint(tmp_path / "step_2")


def test_a_save_replaces_a_file_squatting_on_its_name(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    (tmp_path / "step_2").write_text("not a checkpoint")
    _save(tmp_path, 2)
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 2]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert not [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".")]


def test_a_pointer_that_cannot_be_written_names_the_published_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 1)

    def full(root: Path, name: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "write_latest", full)
    with pytest.raises(OSError, match="No space left") as raised:
        _save(tmp_path, 2)
    assert f"while pointing {tmp_path / 'latest'} at {tmp_path / 'step_2'}, which is published" in raised.value.__notes__[0]
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 2]


def test_retention_leaves_a_checkpoint_in_a_newer_format_alone(tmp_path: Path) -> None:
    """A later version's checkpoint is not this version's to rotate out (a resume: never run in its folder)."""
    _save(tmp_path, 1)
    manifest = json.loads((tmp_path / "step_1" / MANIFEST_NAME).read_text())
    (tmp_path / "step_1" / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 2}))
    for step in (2, 3):
        _save(tmp_path, step, keep_last_n=1)
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 3]


@pytest.mark.parametrize("listed", ["extra.bin", "../../outside"])
def test_every_reader_checks_every_file_the_manifest_lists(tmp_path: Path, listed: str) -> None:
    """read_checkpoint (and load_checkpoint through it) refuses what a resume and an export refuse."""
    path = _save(tmp_path, 1)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["files"][listed] = {"size": 1, "sha256": "0" * 64}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    message = "is missing although the manifest lists it" if listed == "extra.bin" else "which is not a file of"
    for reader in (read_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError, match=message):
            reader(path)
