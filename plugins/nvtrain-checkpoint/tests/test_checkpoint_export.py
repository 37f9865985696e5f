"""Exporting weights for inference: a model's weights or its EMA average, from single-file and sharded
checkpoints, as one plain file that loads into the plain model; which EMA state is taken; errors."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointError, CheckpointHook, export_weights, save_checkpoint, storage
from nvtrain_checkpoint.sharded import MARKER

import nvtrain

nvtrain_ema = pytest.importorskip("nvtrain_ema")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def train(root: Path, *hooks: Any) -> tuple[nvtrain.TrainingStrategy, Any]:
    """Four steps with an EMA of the model, a checkpoint every two; returns the strategy and the EMA hook."""
    ema = nvtrain_ema.EMAHook(decay=0.5)
    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 3, generator=generator), torch.randn(16, 2, generator=generator)
    )
    strategy = nvtrain.TrainingStrategy(
        make_model(),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        hooks=[*hooks, ema, CheckpointHook(root, step_interval=2)],
        device="cpu",
        num_epochs=1,
    )
    with strategy:
        strategy.run(torch.utils.data.DataLoader(data, batch_size=4))
    return strategy, ema


def full(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True) for k, v in weights.items()
    }


def assert_same(expected: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> None:
    assert sorted(exported) == sorted(expected)
    for key, value in expected.items():
        assert type(exported[key]) is torch.Tensor and torch.equal(exported[key], value), key


def test_a_single_file_checkpoint_exports_the_weights_and_the_ema_average(tmp_path: Path) -> None:
    strategy, ema = train(tmp_path / "checkpoints")
    hook = CheckpointHook(tmp_path / "checkpoints")
    read: list[Path] = []
    weights = torch.load(hook.export(tmp_path / "model.pt", on_checkpoint=read.append), weights_only=True)
    assert [path.name for path in read] == [f"step_{strategy.ctx.step_count}"]  # the latest, told to the caller
    assert_same(full(strategy.ctx.models["main"].state_dict()), weights)
    averaged = torch.load(hook.export(tmp_path / "ema.pt", ema=True), weights_only=True)
    assert_same(ema.averaged_weights(), averaged)  # the BatchNorm buffers too: the plain model's keys
    assert not torch.equal(averaged["0.weight"], weights["0.weight"])
    model = make_model()
    model.load_state_dict(averaged)  # strict: loads into the plain model
    step_2 = torch.load(export_weights(tmp_path / "checkpoints" / "step_2", tmp_path / "ema-2.pt", ema="ema:main"))
    assert not torch.equal(step_2["0.weight"], averaged["0.weight"])  # from the checkpoint named, not the latest


def test_a_sharded_checkpoint_exports_the_ema_average_consolidated(tmp_path: Path, world_of_one: None) -> None:
    nvtrain_fsdp = pytest.importorskip("nvtrain_fsdp")
    strategy, ema = train(tmp_path / "checkpoints", nvtrain_fsdp.FSDPHook())
    step_4 = tmp_path / "checkpoints" / "step_4"
    assert storage.read_manifest(step_4).get("sharded")
    averaged = storage.load_state_file(step_4 / storage.STATE_NAME)["hooks"]["ema:main"]["averaged"]
    assert averaged["module.0.weight"] == {MARKER: "hooks/ema:main/averaged/module.0.weight"}  # in the shards
    expected = full(ema.averaged_weights())
    hook = CheckpointHook(tmp_path / "checkpoints")
    assert_same(expected, torch.load(hook.export(tmp_path / "ema.pt", ema=True), weights_only=True))
    assert_same(full(strategy.ctx.models["main"].state_dict()), torch.load(hook.export(tmp_path / "model.pt")))


def test_a_sharded_save_of_a_cpu_run_makes_no_cuda_context(
    tmp_path: Path, world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where CUDA is available, DCP's writer copies tensors ahead on the current CUDA stream unless told not to:
    a CUDA context in every rank of a CPU run on a GPU machine. Here CUDA looks available and any use of it fails."""
    nvtrain_fsdp = pytest.importorskip("nvtrain_fsdp")

    def no_cuda(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a CPU run's sharded save used CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no_cuda)
    train(tmp_path / "checkpoints", nvtrain_fsdp.FSDPHook())
    assert storage.read_manifest(tmp_path / "checkpoints" / "step_4").get("sharded")


# -- which EMA state, and the errors ------------------------------------------------------------------------


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


def _average(value: float) -> dict[str, Any]:
    return {"num_updates": 3, "averaged": {"module.weight": torch.full((2,), value), "n_averaged": torch.tensor(3)}}


def _checkpoint(root: Path, models: list[str], hooks: dict[str, Any]) -> Path:
    weights = {name: {"weight": torch.full((2,), float(index))} for index, name in enumerate(models)}
    return save_checkpoint(root, 1, _state(weights, hooks), {})


def _exported(checkpoint: Path, tmp_path: Path, model_key: str | None = None, **options: Any) -> float:
    path = export_weights(checkpoint, tmp_path / "out.pt", model_key, **options)
    weights = torch.load(path, weights_only=True)
    assert list(weights) == ["weight"]
    return float(weights["weight"][0])


def test_the_ema_of_the_chosen_model_is_taken_by_its_key(tmp_path: Path) -> None:
    hooks = {"ema:main": _average(10.0), "ema:teacher": _average(20.0), "amp": {"precision": "float32", "scaler": None}}
    checkpoint = _checkpoint(tmp_path / "c", ["main", "teacher"], hooks)
    assert _exported(checkpoint, tmp_path, "teacher") == 1.0
    assert _exported(checkpoint, tmp_path, "teacher", ema=True) == 20.0
    assert _exported(checkpoint, tmp_path, "main", ema=True) == 10.0
    assert _exported(checkpoint, tmp_path, "teacher", ema="ema:teacher") == 20.0
    with pytest.raises(ValueError, match=r"holds the models \['main', 'teacher'\]: name the one to export"):
        _exported(checkpoint, tmp_path, ema=True)
    with pytest.raises(ValueError, match=r"holds no EMA state 'amp' \(EMA states: \['ema:main', 'ema:teacher'\]\)"):
        _exported(checkpoint, tmp_path, "main", ema="amp")
    assert _exported(checkpoint, tmp_path, ema="ema:teacher") == 20.0  # the key says which average: no model_key


def test_one_model_with_one_average_under_another_key_is_taken(tmp_path: Path) -> None:
    """A state_key of its own, or ``ema:0`` from releases that keyed hook states by position."""
    for key in ("ema:slow", "ema:0"):
        checkpoint = _checkpoint(tmp_path / key, ["main"], {key: _average(7.0)})
        assert _exported(checkpoint, tmp_path, ema=True) == 7.0


def test_asking_for_an_average_the_checkpoint_lacks_names_what_it_has(tmp_path: Path) -> None:
    none = _checkpoint(tmp_path / "none", ["main"], {})
    with pytest.raises(ValueError, match=r"holds no EMA average: its run had no EMA hook"):
        _exported(none, tmp_path, ema=True)
    two = _checkpoint(tmp_path / "two", ["main", "other"], {"ema:slow": _average(1.0), "ema:fast": _average(2.0)})
    with pytest.raises(ValueError, match=r"EMA states: \['ema:fast', 'ema:slow'\]\); name the one to export"):
        _exported(two, tmp_path, "main", ema=True)
    early = _checkpoint(tmp_path / "early", ["main"], {"ema:main": {"num_updates": 0, "averaged": None}})
    with pytest.raises(CheckpointError, match=r"the EMA state 'ema:main' holds no average yet"):
        _exported(early, tmp_path, ema=True)
    assert not (tmp_path / "out.pt").exists()  # a refused export writes nothing


def test_a_copy_saved_before_the_first_update_is_no_average(tmp_path: Path) -> None:
    """Saved before the first EMA update (start_step not reached), the copy holds the weights training started
    from (n_averaged 0): exporting them as "the EMA average" is refused, as a state with no copy is."""
    ema = nvtrain_ema.EMAHook(decay=0.9, start_step=100)
    strategy = nvtrain.TrainingStrategy(
        make_model(),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        hooks=[ema, CheckpointHook(tmp_path / "checkpoints", step_interval=2)],
        device="cpu",
    )
    with strategy:
        strategy.run([(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(2)])
    assert ema.num_updates == 0
    with pytest.raises(
        CheckpointError, match=r"the EMA state 'ema:main' holds no average yet \(saved before its first update"
    ):
        export_weights(tmp_path / "checkpoints", tmp_path / "out.pt", ema=True)
    for state in (  # either count at 0 is enough
        {"num_updates": 0, "averaged": {"module.weight": torch.ones(2), "n_averaged": torch.tensor(3)}},
        {"num_updates": 3, "averaged": {"module.weight": torch.ones(2), "n_averaged": torch.tensor(0)}},
    ):
        checkpoint = _checkpoint(tmp_path / f"c{state['num_updates']}", ["main"], {"ema:main": state})
        with pytest.raises(CheckpointError, match=r"holds no average yet"):
            _exported(checkpoint, tmp_path, ema=True)
    assert not (tmp_path / "out.pt").exists()


def test_an_export_replaces_the_file_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = _checkpoint(tmp_path / "c", ["main"], {"ema:main": _average(5.0)})
    (tmp_path / "out.pt").write_bytes(b"previous")
    assert _exported(checkpoint, tmp_path) == 0.0

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_weights(checkpoint, tmp_path / "out.pt", ema=True)
    monkeypatch.undo()
    assert float(torch.load(tmp_path / "out.pt", weights_only=True)["weight"][0]) == 0.0  # the previous export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "out.pt"]  # no temporary file left
