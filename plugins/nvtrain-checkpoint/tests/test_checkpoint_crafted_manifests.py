"""Crafted or foreign checkpoints are refused with one clear error naming the file and the field: a model entry
that is no state dict, a malformed "sharded" entry, a run_config that is no mapping, and a newer format named by
an explicit resume path (the advice the directory search gives)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import (
    CheckpointError,
    CheckpointHook,
    export_weights,
    read_checkpoint,
    save_checkpoint,
    storage,
)

import nvtrain
from nvtrain.app import EXIT_USAGE
from nvtrain.cli import main


def _state(step: int) -> dict[str, Any]:
    """A minimal valid training state of one model."""
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


def _save(root: Path, step: int, state: dict[str, Any] | None = None, **metadata: Any) -> Path:
    return save_checkpoint(root, step, state or _state(step), {"nvtrain_version": nvtrain.__version__, **metadata})


def _edit_manifest(directory: Path, **fields: Any) -> None:
    manifest_file = directory / storage.MANIFEST_NAME
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    manifest.update(fields)
    manifest_file.write_text(json.dumps(manifest, indent=2), encoding="utf-8")


@pytest.mark.parametrize("entry", [None, [1, 2]], ids=["none", "a-list"])
def test_export_refuses_a_model_entry_that_is_no_state_dict_naming_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: Any
) -> None:
    state = _state(1)
    state["models"]["main"] = entry  # a verified, weights-only loadable state file: crafted, not damaged
    checkpoint = _save(tmp_path / "checkpoints", 1, state)
    expected = (
        f"{checkpoint / storage.STATE_NAME}: the state's models['main'] must be a dict of tensors by parameter "
        f"name (the model's state_dict); got {entry!r} ({type(entry).__name__})"
    )
    with pytest.raises(CheckpointError) as refused:
        export_weights(checkpoint, tmp_path / "model.pt")
    assert str(refused.value) == expected
    assert main(["export", str(checkpoint), str(tmp_path / "model.pt")]) == EXIT_USAGE
    assert capsys.readouterr().err == f"nvtrain export: error: {expected}\n"
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize(
    "entry",
    [{}, [], {"format": "torch.distributed.checkpoint", "directory": "sharded", "world_size": 0}],
    ids=["empty", "a-list", "no-ranks"],
)
def test_a_malformed_sharded_entry_is_refused_naming_the_manifest_field(tmp_path: Path, entry: Any) -> None:
    checkpoint = _save(tmp_path / "checkpoints", 1)
    _edit_manifest(checkpoint, sharded=entry)
    message = (
        f"{checkpoint / storage.MANIFEST_NAME}: 'sharded' is malformed: expected a mapping "
        '{"format": "torch.distributed.checkpoint", "directory": "sharded", "world_size": <int >= 1>} '
        "(what a sharded checkpoint's manifest holds; a plain one has no 'sharded'), "
        f"got {entry!r} ({type(entry).__name__}): the manifest was modified"
    )
    for read in (read_checkpoint, lambda path: export_weights(path, tmp_path / "model.pt")):
        with pytest.raises(CheckpointError) as refused:
            read(checkpoint)
        assert str(refused.value) == message


@pytest.mark.parametrize("run_config", [["model", "optimizer"], "job.yaml"], ids=["a-list", "a-string"])
def test_a_run_config_that_is_no_mapping_is_refused_naming_the_manifest_field(tmp_path: Path, run_config: Any) -> None:
    checkpoint = _save(tmp_path, 1, run_config=run_config)
    message = (
        f"{checkpoint / storage.MANIFEST_NAME}: 'run_config' must be a mapping (the resolved config of the run that "
        f"wrote the checkpoint; one written from Python has none), got {run_config!r} ({type(run_config).__name__}): "
        "the manifest was modified"
    )
    hook = CheckpointHook(tmp_path, resume=str(checkpoint))
    # what nvtrain train / validate ask before comparing the configs, and what load_checkpoint builds from
    for read in (
        hook.resume_checkpoint,
        lambda: hook.read_manifest(checkpoint),
        lambda: storage.read_manifest(checkpoint),
    ):
        with pytest.raises(CheckpointError) as refused:
            read()
        assert str(refused.value) == message
    with pytest.raises(CheckpointError) as refused:  # not "written from Python: its manifest holds no run_config"
        nvtrain.TrainingStrategy.load_checkpoint(checkpoint)
    assert str(refused.value) == message


def test_an_explicit_resume_path_in_a_newer_format_gets_the_advice_of_the_directory_search(tmp_path: Path) -> None:
    checkpoint = _save(tmp_path / "checkpoints", 3)
    plugins = {"checkpoint": {"distribution": "nvtrain-checkpoint", "version": "99.0"}}
    _edit_manifest(checkpoint, format_version=storage.FORMAT_VERSION + 1, plugins=plugins)
    advice = (
        f"{checkpoint} is a checkpoint in format {storage.FORMAT_VERSION + 1}, which this nvtrain-checkpoint does not "
        f"read (it reads format {storage.FORMAT_VERSION}); it is left as it is. Install nvtrain-checkpoint 99.0 to "
        "resume from it, or "
    )
    with pytest.raises(CheckpointError) as searched:
        CheckpointHook(tmp_path / "checkpoints", resume="auto").resume_checkpoint()
    with pytest.raises(CheckpointError) as named:
        CheckpointHook(tmp_path / "elsewhere", resume=str(checkpoint)).resume_checkpoint()
    assert str(searched.value).startswith(advice)
    assert str(named.value) == advice + f"name a checkpoint in format {storage.FORMAT_VERSION}"
    manifest = storage.raw_manifest(checkpoint)
    assert str(named.value) == storage.newer_format_message(checkpoint, manifest)  # one message, one function
    with pytest.raises(CheckpointError) as exported:
        export_weights(checkpoint, tmp_path / "model.pt")
    assert str(exported.value) == str(named.value)


def test_the_manifest_reader_names_the_plugin_as_the_hook_does() -> None:
    """The newer-format refusal looks up the writer's version under the hook's plugin name."""
    assert CheckpointHook.plugin_name == storage._PLUGIN_NAME
