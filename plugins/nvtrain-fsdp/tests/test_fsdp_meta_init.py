"""Models built on the meta device: the strategy leaves them to FSDPHook, which shards them, then allocates and
initialises each rank's shards (``meta_init``); a checkpoint resumes into one without a full copy ever existing.
The multi-rank layout (shards drawn apart, replicas alike) is in test_fsdp_multiprocess.py."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_fsdp import FSDPHook
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import nvtrain

#: A single process, whatever torchrun variables the shell has (the root conftest's fixture clears them).
pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))


def build_on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return build()


def strategy(model: torch.nn.Module, *hooks: object, **fields: Any) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        model,
        functools.partial(torch.optim.AdamW, lr=0.01),
        torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
        **fields,
    )


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 3, generator=generator))
    return DataLoader(data, batch_size=4)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor  # type: ignore[no-any-return]


def test_in_one_process_a_meta_model_is_initialised_as_if_built_on_the_device() -> None:
    """No process group: nothing to shard, but the model is allocated and reset_parameters() draws what the
    eager constructor would have drawn (the same calls, in module order, on the same stream)."""
    eager = build(seed=3)
    torch.manual_seed(3)
    with torch.device("meta"):
        lazy = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
    with strategy(lazy, FSDPHook()) as run:
        run.setup()
        model = run.ctx.models["main"]
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        for (name, got), want in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
            assert torch.equal(got, want), name
        run.run(loader())  # and it trains


@pytest.mark.usefixtures("world_of_one")
def test_a_sharded_meta_model_gets_initialised_shards_and_trains() -> None:
    data = loader()
    with strategy(build_on_meta(), FSDPHook()) as run:
        before = torch.get_rng_state()
        run.setup(data)
        assert torch.equal(before, torch.get_rng_state())  # the training stream is not drawn from
        model = run.ctx.models["main"]
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
        first = local(model[0].weight).detach()
        bound = 1 / 4**0.5  # Linear(4, 16).reset_parameters(): kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(4), ..)
        assert float(first.abs().max()) <= bound and float(first.std()) > 0.1
        assert torch.equal(local(model[1].running_var), torch.ones(16))  # BatchNorm's reset_parameters()
        assert torch.equal(local(model[1].weight), torch.ones(16))
        result = run.run(data)
    assert result.step_count == 4


@pytest.mark.usefixtures("world_of_one")
def test_two_meta_models_are_initialised_apart_as_eager_builds_one_after_the_other_are() -> None:
    """On a CPU mesh every model drew from the same stream (the seed and the shard index): a generator and a
    discriminator built on meta started with the same weights, under torchrun only."""

    def initialised() -> list[torch.Tensor]:
        torch.manual_seed(7)
        with torch.device("meta"):
            models = {"main": torch.nn.Linear(4, 8), "disc": torch.nn.Linear(4, 8)}
        adamw = functools.partial(torch.optim.AdamW, lr=0.01)
        run = nvtrain.TrainingStrategy(
            models, {"main": adamw, "disc": adamw}, torch.nn.functional.mse_loss, hooks=[FSDPHook()], device="cpu"
        )
        with run:
            run.setup()
            return [local(run.ctx.models[key].weight).detach().clone() for key in ("main", "disc")]

    main, disc = initialised()
    assert not torch.equal(main, disc)
    again = initialised()  # a later build in this process draws on, as an eager one would
    assert not torch.equal(again[0], main) and not torch.equal(again[1], disc)


class InitWeights(torch.nn.Module):
    """A model initialised by one root method, torchtitan-style (the layers' own resets not used)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]

    def init_weights(self) -> None:
        self.calls += 1
        torch.nn.init.constant_(self.body.weight, 0.5)
        torch.nn.init.zeros_(self.body.bias)


@pytest.mark.usefixtures("world_of_one")
def test_meta_init_names_the_method_that_initialises() -> None:
    with torch.device("meta"):
        model = InitWeights()
    with strategy(model, FSDPHook(meta_init="init_weights")) as run:
        run.setup()
        assert model.calls == 1
        assert torch.equal(local(model.body.weight), torch.full((3, 4), 0.5))
        assert torch.equal(local(model.body.bias), torch.zeros(3))


@pytest.mark.usefixtures("world_of_one")
def test_a_meta_init_no_module_has_is_refused_before_anything_is_allocated() -> None:
    message = r"FSDPHook.meta_init='init_weights': model 'main' was built on the meta device, and 0.weight, 0.bias"
    model = build_on_meta()
    with pytest.raises(ValueError, match=message), strategy(model, FSDPHook(meta_init="init_weights")) as run:
        run.setup()
    assert all(p.is_meta and not isinstance(p, DTensor) for p in model.parameters())  # refused before sharding


class RawParameter(torch.nn.Module):
    """A parameter of its own and no reset_parameters (as torch.nn.MultiheadAttention's in_proj_weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.body = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale  # type: ignore[no-any-return]


@pytest.mark.usefixtures("world_of_one")
def test_a_tensor_no_meta_init_reaches_is_refused_naming_it() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(RawParameter(), torch.nn.Linear(3, 2))
    with (
        pytest.raises(ValueError, match=r"and 0.scale would stay uninitialised memory"),
        strategy(model, FSDPHook()) as run,
    ):
        run.setup()


def test_a_multihead_attention_on_meta_needs_a_method_that_reaches_its_projections() -> None:
    """The check holds in one process too, where nothing is sharded."""
    with torch.device("meta"):
        model = torch.nn.MultiheadAttention(8, 2)
    with (
        pytest.raises(ValueError, match=r"in_proj_weight, in_proj_bias would stay uninitialised"),
        strategy(model, FSDPHook()) as run,
    ):
        run.setup()


def test_without_a_hook_that_materialises_a_meta_model_is_refused_naming_it() -> None:
    message = r"model 'main' has parameters on the meta device .* no registered hook materialises meta models"
    with pytest.raises(ValueError, match=message), strategy(build_on_meta()) as run:
        run.setup()


@pytest.mark.usefixtures("world_of_one")
def test_a_meta_model_the_hook_does_not_shard_is_refused_after_setup() -> None:
    models = {"main": build(), "other": build_on_meta()}  # "other": no optimizer (one it trains would be refused)
    optimizers = {"main": functools.partial(torch.optim.SGD, lr=0.1)}
    run = nvtrain.TrainingStrategy(
        models, optimizers, torch.nn.functional.mse_loss, hooks=[FSDPHook(model_keys=("main",))], device="cpu"
    )
    with pytest.raises(ValueError, match=r"model 'other' still has parameters on the meta device after SETUP"), run:
        run.setup()


@pytest.mark.usefixtures("world_of_one")
def test_a_checkpoint_resumes_into_a_meta_model(tmp_path: Path) -> None:
    """The large-model path: build on meta, shard, and load the saved shards: bitwise the saved run's state."""
    checkpoint_plugin = pytest.importorskip("nvtrain_checkpoint")
    with strategy(build(), FSDPHook(), checkpoint_plugin.CheckpointHook(tmp_path), max_steps=3) as saved:
        saved.run(loader())
        expected = {k: local(v).clone() for k, v in saved.ctx.models["main"].state_dict().items()}
    resume = checkpoint_plugin.CheckpointHook(tmp_path, resume="auto")
    with strategy(build_on_meta(), FSDPHook(), resume, max_steps=3) as resumed:
        resumed.run(loader())  # the checkpoint is at step 3 already: it loads, and nothing is trained
        state = resumed.ctx.models["main"].state_dict()
        for key, value in expected.items():
            assert torch.equal(local(state[key]), value), key
        assert resumed.ctx.step_count == 3


# -- nvtrain train: model.init_device -------------------------------------------------------------------


def write_job(tmp_path: Path, hooks: str) -> Path:
    config = tmp_path / "job.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "device: cpu\n"
        "model: {factory: nvtrain.builtin.digits:make_classifier, kwargs: {hidden: 16, depth: 1}, init_device: meta}\n"
        "data: {factory: nvtrain.builtin.digits:make_loaders, kwargs: {batch_size: 64}}\n"
        "trainer: {max_steps: 3}\n"
        "logging: {tensorboard: false, plot: false, progress_bar: false}\n"
        f"hooks: {hooks}\n",
        encoding="utf-8",
    )
    return config


def test_nvtrain_train_builds_the_model_on_meta_for_the_fsdp_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nvtrain.cli import main

    built: list[bool] = []
    real = FSDPHook._materialise

    def watch(
        self: FSDPHook, key: str, model: torch.nn.Module, initialisers: list[Any], device: torch.device
    ) -> None:
        built.append(all(p.is_meta for p in model.parameters()))  # as the factory left it
        real(self, key, model, initialisers, device)

    monkeypatch.setattr(FSDPHook, "_materialise", watch)
    assert main(["train", str(write_job(tmp_path, "[fsdp]"))]) == 0
    assert built == [True]
    assert (tmp_path / "out" / "job" / "metrics.csv").is_file()


def test_nvtrain_train_refuses_a_meta_model_without_the_fsdp_hook(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nvtrain.cli import main

    assert main(["train", str(write_job(tmp_path, "[]"))]) == 2
    err = capsys.readouterr().err
    assert "model.init_device" in err and "add the fsdp hook" in err
    assert not (tmp_path / "out").exists()  # nothing written
