"""`nvtrain export`: a trained run's weights and EMA average as plain files that load without nvtrain;
one-line errors with exit status 2."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from nvtrain.app import EXIT_USAGE
from nvtrain.builtin.digits import make_classifier
from nvtrain.cli import main

pytest.importorskip("nvtrain_checkpoint")
pytest.importorskip("nvtrain_ema")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in job (EMA and checkpoint hooks) trained for 4 steps: its checkpoint root."""
    out = tmp_path_factory.mktemp("run")
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--set", "trainer.max_steps=4", "--set", f"output_dir={out}", "--set", "device=cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    return out / "digits" / "checkpoints"


def _saved(checkpoints: Path) -> dict[str, dict[str, torch.Tensor]]:
    from nvtrain_checkpoint import read_checkpoint

    state = read_checkpoint(checkpoints)
    averaged = state["hooks"]["ema:main"]["averaged"]
    ema = {key.removeprefix("module."): value for key, value in averaged.items() if key.startswith("module.")}
    return {"weights": state["models"]["main"], "ema": ema}


def _assert_same(expected: dict[str, torch.Tensor], path: Path) -> None:
    exported = torch.load(path, weights_only=True)
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[key], value) for key, value in expected.items())
    make_classifier(hidden=128, depth=2, dropout=0.1).load_state_dict(exported)  # strict, no nvtrain needed


def test_export_writes_the_weights_and_the_ema_average(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved(checkpoints)
    assert main(["export", str(checkpoints), str(tmp_path / "model.pt")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'model.pt'} (the weights of step_4, ")
    _assert_same(saved["weights"], tmp_path / "model.pt")
    assert main(["export", str(checkpoints / "step_4"), str(tmp_path / "out" / "ema.pt"), "--ema"]) == 0
    assert "(the EMA average of step_4, " in capsys.readouterr().out
    _assert_same(saved["ema"], tmp_path / "out" / "ema.pt")
    assert main(["export", str(checkpoints), str(tmp_path / "key.pt"), "--ema-key", "ema:main", "--model", "main"]) == 0
    _assert_same(saved["ema"], tmp_path / "key.pt")
    assert main(["export", str(checkpoints / "step_4" / "state.pt"), str(tmp_path / "file.pt")]) == 0  # its directory
    _assert_same(saved["weights"], tmp_path / "file.pt")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{root}/nope"], "no checkpoint at {root}/nope: it does not exist"),
        (["{checkpoints}", "--model", "teacher"], "holds no model 'teacher' (models: ['main'])"),
        (["{checkpoints}", "--ema-key", "amp"], "holds no EMA state 'amp' (EMA states: ['ema:main'])"),
        (["{checkpoints}/step_4/manifest.json", "--model", "x"], "{checkpoints}/step_4 holds no model 'x'"),
    ],
)
def test_export_errors_are_one_line_with_exit_2(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    places = {"root": tmp_path, "checkpoints": checkpoints}
    argv = [argument.format(**places) for argument in arguments]
    code = main(["export", argv[0], str(tmp_path / "model.pt"), *argv[1:]])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.startswith("nvtrain export: error: ") and err.count("\n") == 1
    assert message.format(**places) in err
    assert not (tmp_path / "model.pt").exists()


def test_export_without_the_checkpoint_plugin_says_what_to_install(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **selection: [])
    assert main(["export", str(checkpoints), str(tmp_path / "model.pt")]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "nvtrain export: error: nvtrain export needs the nvtrain-checkpoint distribution "
        "(pip install nvtrain-checkpoint)\n"
    )


def test_an_output_that_cannot_be_written_is_one_line_with_exit_1(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    output = tmp_path / "a-file" / "model.pt"
    assert main(["export", str(checkpoints), str(output)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain export: error: cannot write {output}: ") and err.count("\n") == 1
    assert (tmp_path / "a-file").read_text() == "not a directory"
