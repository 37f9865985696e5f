"""save_checkpoint refuses what its readers would refuse before writing anything; the finders refuse a file for a
root; CheckpointHook.resume refuses a mistyped mode when built."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nvtrain_checkpoint import (
    CheckpointError,
    CheckpointHook,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from nvtrain_checkpoint.storage import MANIFEST_NAME, incomplete_checkpoints

from nvtrain.validators import FieldTypeError, FieldValueError

STATE = {"weight": torch.arange(3.0)}


def _tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")) if root.exists() else []


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root holding step_5 (``latest`` names it): a refused save must leave exactly this."""
    save_checkpoint(tmp_path / "ckpt", 5, STATE, {})
    return tmp_path / "ckpt"


# -- save_checkpoint: step and keep_last_n ----------------------------------------------------------


@pytest.mark.parametrize(
    "step", [True, False, -1, 1.5, None, "7", torch.tensor(True), torch.tensor([3]), np.float64(3)]
)
def test_a_step_that_is_no_int_at_least_zero_is_refused_before_anything_is_written(root: Path, step: Any) -> None:
    before = _tree(root)
    with pytest.raises(FieldValueError, match=r"^save_checkpoint: step must be an int >= 0 \(got "):
        save_checkpoint(root, step, STATE, {})
    assert _tree(root) == before
    assert latest_checkpoint(root) == root / "step_5"


@pytest.mark.parametrize("step", [np.int64(3), np.uint8(3), torch.tensor(3)])
def test_an_integer_scalar_step_is_saved_as_an_int(tmp_path: Path, step: Any) -> None:
    path = save_checkpoint(tmp_path, step, STATE, {})
    assert path == tmp_path / "step_3"
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 3 and type(manifest["step"]) is int


@pytest.mark.parametrize("keep_last_n", [0, -1, True, "2", 2.0, np.float64(2)])
def test_keep_last_n_takes_what_the_hooks_field_takes(root: Path, keep_last_n: Any) -> None:
    before = _tree(root)
    with pytest.raises(FieldValueError, match=r"^save_checkpoint: keep_last_n must be an int >= 1 or None \(got "):
        save_checkpoint(root, 6, STATE, {}, keep_last_n)
    assert _tree(root) == before
    with pytest.raises(FieldValueError, match=r"^CheckpointHook.keep_last_n must be an int >= 1 or None \(got "):
        CheckpointHook(root, keep_last_n=keep_last_n)


def test_an_integer_scalar_keep_last_n_applies(root: Path) -> None:
    save_checkpoint(root, 6, STATE, {}, keep_last_n=np.int64(1))
    assert [info.step for info in list_checkpoints(root)] == [6]


# -- save_checkpoint: state and metadata ------------------------------------------------------------


@pytest.mark.parametrize("key", ["step", "format_version", "files", "sharded"])
def test_metadata_may_not_set_what_the_writer_sets(root: Path, key: str) -> None:
    before = _tree(root)
    with pytest.raises(FieldValueError, match=rf"^save_checkpoint: metadata may not set '{key}': "):
        save_checkpoint(root, 6, STATE, {key: 99})
    assert _tree(root) == before


@pytest.mark.parametrize(
    "value, shown",
    [(torch.ones(1), "tensor"), (object(), "object"), ({"nested": np.int64(1)}, "int64"), ({1, 2}, "set")],
)
def test_metadata_that_is_no_json_is_refused_naming_its_key(root: Path, value: Any, shown: str) -> None:
    before = _tree(root)
    with pytest.raises(
        FieldTypeError, match=rf"^save_checkpoint: metadata\['note'\] must be JSON data \(got .*{shown}"
    ):
        save_checkpoint(root, 6, STATE, {"note": value})
    assert _tree(root) == before


def test_metadata_keys_must_be_str(root: Path) -> None:
    with pytest.raises(FieldTypeError, match=r"^save_checkpoint: metadata keys must be str .*got 1$"):
        save_checkpoint(root, 6, STATE, {1: "one"})


@pytest.mark.parametrize("argument, value", [("state", [1, 2]), ("state", None), ("metadata", None)])
def test_state_and_metadata_must_be_mappings(root: Path, argument: str, value: Any) -> None:
    arguments: dict[str, Any] = {"state": STATE, "metadata": {}, argument: value}
    with pytest.raises(FieldTypeError, match=rf"^save_checkpoint: {argument} must be a mapping"):
        save_checkpoint(root, 6, arguments["state"], arguments["metadata"])
    assert not (root / "step_6").exists()


def test_a_saved_checkpoint_reads_back_with_its_metadata(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 2, {"format": 1}, {"note": {"tags": ["a"], "nan": float("nan")}})
    manifest = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert manifest["step"] == 2 and manifest["note"]["tags"] == ["a"]
    with pytest.raises(CheckpointError, match="training state lacks"):  # read_checkpoint checks the state itself
        read_checkpoint(path)


# -- the finders on a root that is a file or missing ---------------------------------------------------


@pytest.mark.parametrize("finder", [list_checkpoints, latest_checkpoint, incomplete_checkpoints])
def test_a_file_for_a_checkpoint_root_is_refused_without_a_pointer_warning(tmp_path: Path, finder: Any) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=rf"^{afile} is a file, not a checkpoint root"):
            finder(afile)
    assert [str(warning.message) for warning in caught] == []


def test_a_root_that_does_not_exist_yet_holds_no_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "not-yet"
    assert list_checkpoints(missing) == [] and latest_checkpoint(missing) is None
    assert CheckpointHook(missing, resume="auto").resume_checkpoint() is None  # a first run with resume="auto"


# -- CheckpointHook.resume ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, meant", [("Auto", "auto"), ("AUTO", "auto"), ("Never", "never"), ("latest", "auto"), ("Latest", "auto")]
)
def test_a_mistyped_resume_mode_is_refused_when_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, meant: str
) -> None:
    monkeypatch.chdir(tmp_path)  # no path of that name
    expected = r"^CheckpointHook.resume must be 'never', 'auto' or a checkpoint path"
    with pytest.raises(FieldValueError, match=rf"{expected} \(got '{value}': .*\); did you mean resume='{meant}'\?$"):
        CheckpointHook(tmp_path / "ckpt", resume=value)


def test_a_resume_path_named_like_a_mode_is_a_path_when_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    save_checkpoint(tmp_path / "latest", 4, STATE, {})  # a checkpoint root named "latest"
    hook = CheckpointHook(tmp_path / "ckpt", resume="latest")
    assert hook.resume == Path("latest")
    assert hook.resume_checkpoint() == Path("latest") / "step_4"
