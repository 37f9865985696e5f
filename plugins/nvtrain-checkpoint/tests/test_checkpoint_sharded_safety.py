"""Sharded checkpoints in one process (a gloo world of one, the model sharded by FSDPHook): reading one
runs no code (DCP's metadata pickle and its non-tensor entries), a damaged shard is caught before
anything loads, the single-file reader refuses them with advice, and export writes plain weights."""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from nvtrain_checkpoint import CheckpointError, CheckpointHook, read_checkpoint, verify_checkpoint
from nvtrain_checkpoint.dcp_files import METADATA_NAME, SHARDED_DIR, read_dcp_metadata
from nvtrain_checkpoint.export import export_weights
from torch.distributed.tensor import DTensor

import nvtrain
from nvtrain.errors import ResumeError

pytest.importorskip("nvtrain_fsdp")

STEPS = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def train(root: Path, **hook_settings: Any) -> nvtrain.TrainingStrategy:
    from nvtrain_fsdp import FSDPHook

    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, generator=generator), torch.randn(16, 2, generator=generator))
    strategy = nvtrain.TrainingStrategy(
        make_model(),
        functools.partial(torch.optim.AdamW, lr=0.01),
        torch.nn.functional.mse_loss,
        hooks=[FSDPHook(), CheckpointHook(root, **({"step_interval": 2} | hook_settings))],
        device="cpu",
        num_epochs=1,
    )
    with strategy:
        strategy.run(torch.utils.data.DataLoader(data, batch_size=4))
    return strategy


@pytest.fixture
def sharded(tmp_path: Path, world_of_one: None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A world-of-one job's checkpoints (steps 2 and 4) and its final weights, gathered."""
    strategy = train(tmp_path / "checkpoints")
    model = strategy.ctx.models["main"]
    assert all(isinstance(p, DTensor) for p in model.parameters())
    weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    return tmp_path / "checkpoints", weights


def rewrite_listed(directory: Path, name: str, data: bytes) -> None:
    """Replace a file of a checkpoint and update the manifest's digest, so only the content can refuse it."""
    (directory / name).write_bytes(data)
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


class Planted:
    """Unpickling it would run ``Path.touch`` on the file it names: code that must never run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_doctored_metadata_pickle_is_refused_before_it_runs(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, _ = sharded
    step = root / "step_4"
    planted = tmp_path / "planted-by-the-metadata"
    rewrite_listed(step, f"{SHARDED_DIR}/{METADATA_NAME}", pickle.dumps(Planted(planted)))
    verify_checkpoint(step)  # the manifest agrees with the file: only the unpickler stands in the way
    with pytest.raises(CheckpointError, match=r"\.metadata was refused: a DCP metadata file may hold only DCP's"):
        read_dcp_metadata(step / SHARDED_DIR / METADATA_NAME)
    with pytest.raises(CheckpointError, match=r"global 'pathlib.Path.touch' is not part of a DCP metadata file"):
        train(tmp_path / "resumed", resume=step)
    with pytest.raises(CheckpointError, match="refused"):
        export_weights(step, tmp_path / "weights.pt")
    assert not planted.exists()


def test_a_doctored_non_tensor_entry_is_read_weights_only(tmp_path: Path) -> None:
    """DCP stores non-tensor values (optimizer hyper-parameters) as pickles; they are read with weights_only."""
    from nvtrain_checkpoint.dcp_files import dcp_load

    planted = tmp_path / "planted-by-an-entry"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"lr": Planted(planted)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(CheckpointError, match=r"entry 'lr' was refused by torch.load\(weights_only=True\)"):
        dcp_load({"lr": 0.1}, tmp_path / "dcp")
    assert not planted.exists()


def test_a_damaged_shard_is_caught_and_auto_resume_passes_over_it(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, _ = sharded
    shard = root / "step_4" / SHARDED_DIR / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp does not match the sha256 in its manifest"):
        verify_checkpoint(root / "step_4")
    assert CheckpointHook(root, resume="auto").resume_checkpoint() == root / "step_2"


def test_the_single_file_reader_refuses_a_sharded_checkpoint_with_advice(
    sharded: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, _ = sharded
    with pytest.raises(CheckpointError, match=r"is a sharded checkpoint \(written by 1 FSDP ranks\).*export"):
        read_checkpoint(root)


def test_export_writes_one_plain_weights_only_file(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    root, weights = sharded
    path = CheckpointHook(root).export(tmp_path / "out" / "model.pt")
    exported = torch.load(path, weights_only=True)
    assert sorted(exported) == sorted(weights)
    for key, value in weights.items():
        assert type(exported[key]) is torch.Tensor and torch.equal(exported[key], value)
    make_model().load_state_dict(exported)  # strict
    with pytest.raises(ValueError, match=r"holds no model 'teacher' \(models: \['main'\]\)"):
        export_weights(root, tmp_path / "teacher.pt", model_key="teacher")


def test_export_of_a_single_file_checkpoint(tmp_path: Path) -> None:
    model = make_model()
    generator = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, generator=generator), torch.randn(8, 2, generator=generator))
    hook = CheckpointHook(tmp_path / "checkpoints", step_interval=2)
    with nvtrain.TrainingStrategy(
        model, functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss, hooks=[hook], device="cpu"
    ) as strategy:
        strategy.run(torch.utils.data.DataLoader(data, batch_size=4))
    exported = torch.load(hook.export(tmp_path / "model.pt"), weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(exported[key], value)


def test_a_checkpoint_of_another_model_shape_is_refused_naming_it(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    from nvtrain_fsdp import FSDPHook

    root, _ = sharded
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(3, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 2))  # the saved data position fits
    strategy = nvtrain.TrainingStrategy(
        other,
        functools.partial(torch.optim.AdamW, lr=0.01),
        torch.nn.functional.mse_loss,
        hooks=[FSDPHook(), CheckpointHook(tmp_path / "new", resume=root / "step_4")],
        device="cpu",
    )
    with strategy, pytest.raises(ResumeError, match=r"checkpoint '.*step_4' does not fit this strategy's models"):
        strategy.run(torch.utils.data.DataLoader(data, batch_size=4))


def test_a_refused_data_position_leaves_the_sharded_model_as_it_was(
    sharded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """The step scheduler refuses another global batch size; DCP must not have loaded the weights before."""
    from nvtrain_fsdp import FSDPHook

    from nvtrain.step_scheduler import StepSchedulerConfig

    root, saved = sharded
    torch.manual_seed(7)  # other initial weights than the checkpoint's
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
    strategy = nvtrain.TrainingStrategy(
        model,
        functools.partial(torch.optim.AdamW, lr=0.01),
        torch.nn.functional.mse_loss,
        hooks=[FSDPHook(), CheckpointHook(tmp_path / "new", resume=root / "step_2")],
        device="cpu",
        step_scheduler=StepSchedulerConfig(num_epochs=1, global_batch_size=8, ckpt_every_steps=None),
    )
    strategy.setup()
    before = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    assert not all(torch.equal(before[k], saved[k]) for k in saved)
    with strategy, pytest.raises(ResumeError, match=r"global_batch_size"):
        strategy.run(torch.utils.data.DataLoader(data, batch_size=4))
    after = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert strategy.ctx.step_count == 0 and not strategy.ctx.optimizers["main"].state
