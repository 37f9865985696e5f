"""A ``torch.compile``'d model trains through nvtrain exactly as the eager one does.

Compiled with the ``aot_eager`` backend: TorchDynamo captures the forward and AOTAutograd
builds the joint forward/backward graph, as with the default backend, but the graph runs
torch's eager kernels, so the result is bitwise the eager one (and no C++ compiler is
needed). With the default ``inductor`` backend generated kernels round differently: the
same code paths, results equal within float tolerance. (A model with dropout draws its masks
another way once compiled, so the models here have none.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
import nvtrain.plugins
from nvtrain.distributed import unwrap_model
from nvtrain.hooks import GradientClippingHook
from nvtrain.testing import full_tensors, gloo_group, spawn_ranks

amp = pytest.importorskip("nvtrain_amp")
ema_plugin = pytest.importorskip("nvtrain_ema")
checkpoint = pytest.importorskip("nvtrain_checkpoint")

CPU = torch.device("cpu")


def _batches(rank: int = 0, world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(96, 8, generator=generator), torch.randn(96, 1, generator=generator)
    per_rank = 8 // world_size
    return [
        (
            inputs[i + rank * per_rank : i + (rank + 1) * per_rank],
            targets[i + rank * per_rank : i + (rank + 1) * per_rank],
        )
        for i in range(0, 96, 8)
    ]


class _MLP(torch.nn.Module):
    """A model class of its own: on a bare ``nn.Sequential``, ``model.compile()`` compiles nothing in this torch
    (Dynamo skips the container's forward), and the in-place variant would compare eager with eager."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))  # type: ignore[no-any-return]


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return _MLP()


#: Graphs the compiling backend was given (each compiled run must add some: it really compiled).
GRAPHS: list[int] = []


def _aot_eager(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
    """``aot_eager``, counting the graphs it is given."""
    GRAPHS.append(len(graph.graph.nodes))
    return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)


def _strategy(model: torch.nn.Module, hooks: list[object], max_steps: int) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models={"main": model},
        optimizers={"main": lambda params: torch.optim.AdamW(params, lr=1e-2)},
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device=CPU,
        max_steps=max_steps,
    )


def _standard_stack(directory: Path | None = None, resume: str = "never") -> list[object]:
    hooks: list[object] = [
        amp.MixedPrecisionHook(precision="bf16"),
        ema_plugin.EMAHook(decay=0.9),
        GradientClippingHook(max_norm=0.5),
    ]
    if directory is not None:
        hooks.append(checkpoint.CheckpointHook(directory, step_interval=4, resume=resume))
    return hooks


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile(model)``: a wrapper module (``OptimizedModule``) whose weights are named ``_orig_mod.*``."""
    return torch.compile(model, backend=_aot_eager)  # type: ignore[return-value]


def _compiled_in_place(model: torch.nn.Module) -> torch.nn.Module:
    """``model.compile()``: the same module, its ``__call__`` compiled (what torch recommends)."""
    model.compile(backend=_aot_eager)
    return model


COMPILERS = {"torch.compile(model)": _compiled, "model.compile()": _compiled_in_place}


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in unwrap_model(module).state_dict().items()}


def _assert_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert expected.keys() == actual.keys(), what
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{what}: {key} differs"


def _run(model: torch.nn.Module, hooks: list[object], max_steps: int = 10) -> dict[str, Any]:
    strategy = _strategy(model, hooks, max_steps)
    strategy.run(_batches() * 2)
    averaged = next(h for h in hooks if isinstance(h, ema_plugin.EMAHook)).get_averaged_model().module
    return {
        "weights": _weights(model),
        "ema": {key: value.clone() for key, value in averaged.state_dict().items()},
        "optimizer": strategy.ctx.optimizers["main"].state_dict()["state"],
    }


@pytest.fixture(scope="module")
def eager() -> dict[str, Any]:
    """The eager model's run with the standard stack: what every compiled run must equal."""
    return _run(_model(), _standard_stack())


@pytest.mark.parametrize("how", COMPILERS)
def test_a_compiled_model_trains_bitwise_like_the_eager_one_with_the_standard_stack(
    how: str, eager: dict[str, Any]
) -> None:
    torch._dynamo.reset()  # compile afresh: code compiled for another instance of the class would be reused
    graphs = len(GRAPHS)
    compiled = _run(COMPILERS[how](_model()), _standard_stack())
    assert len(GRAPHS) > graphs, f"{how}: nothing was compiled"
    _assert_equal(eager["weights"], compiled["weights"], "weights")
    _assert_equal(eager["ema"], compiled["ema"], "EMA average")  # a plain module's keys: no '_orig_mod.'
    for index, state in eager["optimizer"].items():
        _assert_equal(state, compiled["optimizer"][index], f"AdamW state of parameter {index}")


@pytest.mark.parametrize(("first", "second"), [(True, True), (True, False), (False, True)])
def test_checkpoints_move_between_compiled_and_eager_models(
    first: bool, second: bool, eager: dict[str, Any], tmp_path: Path
) -> None:
    """Saved with the compile wrapper looked through, a checkpoint resumes into either kind of model."""
    build = {True: lambda: _compiled(_model()), False: _model}
    _strategy(build[first](), _standard_stack(tmp_path), max_steps=4).run(_batches() * 2)
    saved = torch.load(tmp_path / "step_4" / "state.pt", weights_only=False, map_location="cpu")
    assert not [key for key in saved["models"]["main"] if "_orig_mod" in key]
    resumed = _run(build[second](), _standard_stack(tmp_path, resume="auto"))
    _assert_equal(eager["weights"], resumed["weights"], "weights after the resume")
    _assert_equal(eager["ema"], resumed["ema"], "EMA average after the resume")


def _data_parallel_rank(rank: int, port: int, plugins: list[str], out: str) -> None:
    """Each plugin's run with the eager and the compiled model, in one process group (one spawn for all)."""
    results: dict[str, dict[str, torch.Tensor]] = {}
    with gloo_group(rank, 2, port):
        for plugin in plugins:
            for how in ("eager", *COMPILERS):
                model = _model()
                hooks = [nvtrain.plugins.load(plugin), ema_plugin.EMAHook(decay=0.9)]
                compiled = COMPILERS[how](model) if how in COMPILERS else model
                _strategy(compiled, hooks, max_steps=6).run(_batches(rank, world_size=2))
                weights = unwrap_model(model).state_dict()
                results[f"{plugin}, {how}"] = {key: full_tensors(value) for key, value in weights.items()}
    if rank == 0:
        torch.save(results, out)


@pytest.mark.slow
def test_a_compiled_model_trains_bitwise_like_the_eager_one_under_ddp_and_fsdp(tmp_path: Path) -> None:
    plugins = [name for name in ("ddp", "fsdp") if importlib.util.find_spec(f"nvtrain_{name}") is not None]
    if not plugins:
        pytest.skip("neither nvtrain-ddp nor nvtrain-fsdp is installed")
    spawn_ranks(_data_parallel_rank, plugins, str(tmp_path / "weights.pt"), timeout_s=300)
    results = torch.load(tmp_path / "weights.pt", weights_only=True)
    for plugin in plugins:
        for how in COMPILERS:
            _assert_equal(
                results[f"{plugin}, eager"], results[f"{plugin}, {how}"], f"{plugin}, {how}: weights on rank 0"
            )
