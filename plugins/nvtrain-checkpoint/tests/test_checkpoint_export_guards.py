"""What an export refuses, and how it says so: an output inside the checkpoint it reads, an EMA key that is
another model's average, an empty key or output, a crafted average; a full disk and a long output name."""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointError, CheckpointHook, export_weights, save_checkpoint, storage
from nvtrain_checkpoint import export as export_module
from nvtrain_checkpoint.sharded import MARKER

import nvtrain
from nvtrain.cli import main


def _state(models: dict[str, dict[str, torch.Tensor]], hooks: dict[str, Any]) -> dict[str, Any]:
    """A minimal valid training state with these models and hook states."""
    return {
        "format": 1,
        "models": models,
        "optimizers": {},
        "lr_schedulers": {},
        "counters": {"step_count": 1, "global_step_count": 1, "batch_count": 1, "epoch": 0, "epoch_step_count": 1},
        "scheduler": None,
        "hooks": hooks,
        "rng": {"python": (3, tuple(range(625)), None), "torch": torch.get_rng_state()},
    }


def _average(value: float, shape: tuple[int, ...] = (2,)) -> dict[str, Any]:
    return {"num_updates": 3, "averaged": {"module.weight": torch.full(shape, value), "n_averaged": torch.tensor(3)}}


def _save(root: Path, step: int, hooks: dict[str, Any], **shapes: tuple[int, ...]) -> Path:
    """A checkpoint of models named by ``shapes`` (default: one ``main`` of shape (2,)), weights 0.0, 1.0, ..."""
    shapes = shapes or {"main": (2,)}
    models = {name: {"weight": torch.full(shape, float(i))} for i, (name, shape) in enumerate(shapes.items())}
    return save_checkpoint(root, step, _state(models, hooks), {})


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _exported(path: Path) -> float:
    return float(torch.load(path, weights_only=True)["weight"].flatten()[0])


# -- an output inside the checkpoint it reads ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "output", "inside"),
    [
        ("root", "root/step_2/state.pt", "the checkpoint root root"),  # the latest's own file
        ("root", "root/model.pt", "the checkpoint root root"),  # among the checkpoints
        ("root/step_1", "root/step_2/state.pt", "the checkpoint root root"),  # a step beside the one named
        ("root/step_2/state.pt", "root/step_2/state.pt", "the checkpoint root root"),  # the very file named
        ("root", "link/state.pt", "the checkpoint root root"),  # through a symbolic link to a step
        ("copy/step_2", "copy/step_2/model.pt", "the checkpoint copy/step_2"),  # a copied checkpoint on its own
    ],
)
def test_an_output_inside_the_checkpoint_read_is_refused_and_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, output: str, inside: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _save(Path("root"), 1, {})
    step_2 = _save(Path("root"), 2, {})
    Path("link").symlink_to(step_2.resolve(), target_is_directory=True)
    _save(Path("copy"), 2, {}).parent.joinpath("latest").unlink()  # a lone step_2: not in a checkpoint root
    before = {path: _digest(path) for path in Path().rglob("*") if path.is_file()}
    with pytest.raises(ValueError, match=f"the output {output} is inside {inside} it reads"):
        export_weights(source, output)
    assert {path: _digest(path) for path in Path().rglob("*") if path.is_file()} == before


def test_an_output_beside_a_lone_checkpoint_is_written(tmp_path: Path) -> None:
    """A step directory copied out on its own is no checkpoint root: the folder around it is not guarded."""
    checkpoint = _save(tmp_path / "copy", 2, {})
    (checkpoint.parent / "latest").unlink()
    assert _exported(export_weights(checkpoint, tmp_path / "copy" / "model.pt")) == 0.0


def test_the_command_refuses_an_output_in_the_checkpoint_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step_1 = _save(tmp_path / "root", 1, {})
    before = _digest(step_1 / "state.pt")
    assert main(["export", str(tmp_path / "root"), str(step_1 / "state.pt")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"nvtrain export: error: the output {step_1 / 'state.pt'} is inside the checkpoint root {tmp_path / 'root'} "
        "it reads: it would replace a checkpoint's file or lie among them; write it elsewhere "
        f"(e.g. {tmp_path / 'state.pt'})\n"
    )
    assert _digest(step_1 / "state.pt") == before


# -- which average: --model and --ema-key must agree ----------------------------------------------------------


def test_a_key_that_is_another_models_average_is_refused(tmp_path: Path) -> None:
    hooks = {"ema:main": _average(10.0), "ema:teacher": _average(20.0)}
    checkpoint = _save(tmp_path / "c", 1, hooks, main=(2,), teacher=(2,))
    with pytest.raises(ValueError, match=r"'ema:teacher' is the average of model 'teacher', not of model 'main'"):
        export_weights(checkpoint, tmp_path / "out.pt", "main", ema="ema:teacher")
    assert not (tmp_path / "out.pt").exists()
    assert _exported(export_weights(checkpoint, tmp_path / "out.pt", "main", ema="ema:main")) == 10.0
    assert _exported(export_weights(checkpoint, tmp_path / "out.pt", ema="ema:teacher")) == 20.0  # no model: the key's


def test_a_key_of_its_own_must_fit_the_model_named(tmp_path: Path) -> None:
    """``ema:<state_key>`` does not say whose average it is: one asked for as a model's must have its shapes."""
    hooks = {"ema:slow": _average(7.0, (2,)), "ema:wide": _average(8.0, (3,))}
    checkpoint = _save(tmp_path / "c", 1, hooks, main=(2,), other=(3,))
    assert _exported(export_weights(checkpoint, tmp_path / "out.pt", "main", ema="ema:slow")) == 7.0
    assert _exported(export_weights(checkpoint, tmp_path / "out.pt", "other", ema="ema:wide")) == 8.0
    with pytest.raises(ValueError, match=r"'ema:wide' is not an average of model 'main' \(weight is \[3\] in the av"):
        export_weights(checkpoint, tmp_path / "wrong.pt", "main", ema="ema:wide")
    assert not (tmp_path / "wrong.pt").exists()


def test_the_command_refuses_a_model_and_a_key_that_disagree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hooks = {"ema:main": _average(10.0), "ema:teacher": _average(20.0)}
    checkpoint = _save(tmp_path / "c", 1, hooks, main=(2,), teacher=(2,))
    code = main(["export", str(checkpoint), str(tmp_path / "out.pt"), "--model", "main", "--ema-key", "ema:teacher"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is the average of model 'teacher', not of model 'main'" in err
    assert not (tmp_path / "out.pt").exists()


# -- empty names, a run directory, no EMA hook ------------------------------------------------------------------


def test_an_empty_ema_key_is_refused_not_taken_for_the_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = _save(tmp_path / "c", 1, {"ema:main": _average(5.0)})
    with pytest.raises(ValueError, match="the EMA state key is empty"):
        export_weights(checkpoint, tmp_path / "out.pt", ema="")
    assert main(["export", str(checkpoint), str(tmp_path / "out.pt"), "--ema-key", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvtrain export: error: the EMA state key is empty: ") and err.count("\n") == 1
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("", "the output path is empty: name the weights file to write (e.g. model.pt)"),
        ("{tmp}", "the output {tmp} is a directory: name the weights file to write (e.g. {tmp}/model.pt)"),
    ],
)
def test_an_output_that_names_no_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str, message: str
) -> None:
    checkpoint = _save(tmp_path / "c", 1, {})
    assert main(["export", str(checkpoint), output.format(tmp=tmp_path)]) == 2
    assert capsys.readouterr().err == f"nvtrain export: error: {message.format(tmp=tmp_path)}\n"


def test_a_run_directory_is_refused_naming_its_checkpoint_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path / "run" / "checkpoints", 1, {})
    (tmp_path / "run" / "tensorboard").mkdir()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"; did you mean {tmp_path / 'run' / 'checkpoints'}?\n") and err.count("\n") == 1


def test_a_checkpoint_without_an_ema_hook_says_so(tmp_path: Path) -> None:
    checkpoint = _save(tmp_path / "c", 1, {"amp": {"precision": "float32", "scaler": None}})
    with pytest.raises(ValueError, match=r"holds no EMA average: its run had no EMA hook \(export the model's own"):
        export_weights(checkpoint, tmp_path / "out.pt", ema=True)


def test_the_success_line_names_the_step_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A root whose latest is damaged resolves to an earlier step: the line says which."""
    _save(tmp_path / "root", 1, {"ema:main": _average(5.0)})
    step_2 = _save(tmp_path / "root", 2, {"ema:main": _average(6.0)})
    assert main(["export", str(tmp_path / "root"), str(tmp_path / "q.pt"), "--ema"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'q.pt'} (the EMA average of step_2, ")
    (step_2 / "manifest.json").unlink()
    assert main(["export", str(tmp_path / "root"), str(tmp_path / "q.pt")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'q.pt'} (the weights of step_1, ")


# -- a crafted average ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("averaged", "message"),
    [
        (
            {"module.weight": None, "n_averaged": torch.tensor(3)},
            r"state.pt: the state's hooks\['ema:main'\]\['averaged'\]\['module.weight'\] must be a tensor "
            r"\(a weight of the average\); got None \(NoneType\)",
        ),
        (  # a marker of a sharded tensor means nothing in a single-file checkpoint
            {"module.weight": {MARKER: "hooks/ema:main/averaged/module.weight"}, "n_averaged": torch.tensor(3)},
            r"\['module.weight'\] must be a tensor \(a weight of the average\); got \{",
        ),
        (
            {"n_averaged": torch.tensor(3)},
            r"hooks\['ema:main'\]\['averaged'\] holds no weights \('module.<name>' tensors; keys: \['n_averaged'\]\)",
        ),
    ],
    ids=["none", "marker", "no-weights"],
)
def test_an_average_holding_no_tensor_is_refused_by_file_and_key(
    tmp_path: Path, averaged: dict[str, Any], message: str
) -> None:
    checkpoint = _save(tmp_path / "c", 1, {"ema:main": {"num_updates": 3, "averaged": averaged}})
    with pytest.raises(CheckpointError, match=message):
        export_weights(checkpoint, tmp_path / "out.pt", ema=True)
    assert not (tmp_path / "out.pt").exists()


def test_a_modules_extra_state_in_the_average_is_no_tensor_and_kept(tmp_path: Path) -> None:
    """``get_extra_state()`` may return any object: saved as ``<module>._extra_state``, it is exported as it is."""
    averaged = {"module.weight": torch.ones(2), "module.norm._extra_state": {"calls": 3}, "n_averaged": torch.tensor(3)}
    checkpoint = _save(tmp_path / "c", 1, {"ema:main": {"num_updates": 3, "averaged": averaged}})
    exported = torch.load(export_weights(checkpoint, tmp_path / "out.pt", ema=True), weights_only=True)
    assert exported["norm._extra_state"] == {"calls": 3} and torch.equal(exported["weight"], torch.ones(2))


# -- writing: a full disk, a long name ------------------------------------------------------------------------


class _FillingFile(io.FileIO):
    """A file whose writes fail with ENOSPC once ``room`` bytes were written: a disk that fills mid-write."""

    room = 1000

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return super().write(data)


def test_a_disk_that_fills_mid_write_is_one_line_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = _save(tmp_path / "c", 1, {}, main=(4096,))
    output = tmp_path / "out" / "model.pt"
    output.parent.mkdir()
    output.write_bytes(b"previous")
    monkeypatch.setattr(export_module, "open", _FillingFile, raising=False)
    with pytest.raises(OSError) as info:  # not torch's zip writer's RuntimeError ("unexpected pos ...")
        export_weights(checkpoint, output)
    assert type(info.value) is OSError and info.value.errno == errno.ENOSPC and info.value.filename == str(output)
    assert main(["export", str(checkpoint), str(output)]) == 1
    assert capsys.readouterr().err == (
        f"nvtrain export: error: cannot write {output}: [Errno 28] No space left on device: '{output}'\n"
    )
    assert output.read_bytes() == b"previous" and os.listdir(output.parent) == ["model.pt"]  # no temporary left


def test_an_output_name_near_the_limit_is_written(tmp_path: Path) -> None:
    """The temporary name (``.tmp-<name>-<32 hex>``) is cut short to fit where the output's own name fits."""
    checkpoint = _save(tmp_path / "c", 1, {})
    (tmp_path / "out").mkdir()
    limit = os.pathconf(tmp_path / "out", "PC_NAME_MAX")
    output = tmp_path / "out" / ("w" * (limit - 3) + ".pt")
    assert _exported(export_weights(checkpoint, output)) == 0.0
    assert os.listdir(tmp_path / "out") == [output.name]


def test_a_sharded_average_under_a_key_of_its_own_is_checked_against_the_model(
    tmp_path: Path, world_of_one: None
) -> None:
    """In a sharded checkpoint the shapes come from the shards' metadata, for the average and the model alike."""
    nvtrain_ema = pytest.importorskip("nvtrain_ema")
    nvtrain_fsdp = pytest.importorskip("nvtrain_fsdp")
    torch.manual_seed(0)
    ema = nvtrain_ema.EMAHook(decay=0.5, state_key="slow")
    strategy = nvtrain.TrainingStrategy(
        torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 2)),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        hooks=[nvtrain_fsdp.FSDPHook(), ema, CheckpointHook(tmp_path / "checkpoints", step_interval=2)],
        device="cpu",
    )
    with strategy:
        data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 2))
        strategy.run(torch.utils.data.DataLoader(data, batch_size=4))
    expected = {name: value.to("cpu") for name, value in ema.averaged_weights().items()}
    exported = torch.load(export_weights(tmp_path / "checkpoints", tmp_path / "slow.pt", "main", ema="ema:slow"))
    assert sorted(exported) == sorted(expected) and all(torch.equal(exported[k], v) for k, v in expected.items())

    step_2 = tmp_path / "checkpoints" / "step_2"
    state = storage.load_state_file(step_2 / storage.STATE_NAME)
    averaged = dict(state["hooks"]["ema:slow"]["averaged"])
    averaged["module.0.bias"], averaged["module.0.weight"] = averaged["module.0.weight"], averaged["module.0.bias"]
    weights = export_module._average_weights(averaged, "ema:slow", step_2, sharded=True)
    with pytest.raises(ValueError, match=r"0.bias is \[8, 3\] in the average, \[8\] in the model"):
        export_module._check_average_fits(weights, "ema:slow", state, "main", step_2, sharded=True)
