"""FSDPHook's sharding settings take effect: each test fails if the hook ignored its setting.

Everything runs in one process: a gloo world of one (the root conftest's ``world_of_one``), or, for
``backend``, the group the hook itself initialises from torchrun's variables. ``cpu_offload`` is
refused on a CPU device, so its effect is checked on a CUDA device only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from nvtrain_fsdp import FSDPHook, sharding
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import nvtrain

#: A single process, whatever torchrun variables the shell has (the root conftest's fixture clears them).
pytestmark = pytest.mark.usefixtures("no_torchrun_env")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


def make_model() -> torch.nn.Module:
    """Three units (two Blocks and a Linear: the top-level children), and a buffer on the root."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(4, 2))
    model.register_buffer("scale", torch.ones(2))
    return model


def make_loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator))
    return DataLoader(data, batch_size=4)


def make_strategy(
    hook: FSDPHook, model: torch.nn.Module, *hooks: object, device: str = "cpu"
) -> nvtrain.TrainingStrategy:
    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(outputs.float(), targets)  # outputs may be bf16

    return nvtrain.TrainingStrategy(
        model, functools.partial(torch.optim.AdamW, lr=0.01), loss, hooks=[hook, *hooks], device=device
    )


class AfterForward:
    """Records, right after each forward, the outputs' dtype and the kind of every model parameter."""

    def __init__(self) -> None:
        self.output_dtypes: list[torch.dtype] = []
        self.parameter_types: list[set[type]] = []

    @nvtrain.hookimpl
    def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
        self.output_dtypes.append(ctx.outputs.dtype)
        self.parameter_types.append({type(p) for p in ctx.models["main"].parameters()})


# -- backend -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "expected"), [("cpu:gloo", "cpu:gloo"), (None, "gloo")])
def test_the_process_group_the_hook_initialises_uses_its_backend(
    init_calls: list[dict[str, Any]], backend: str | None, expected: str
) -> None:
    hook = FSDPHook(backend=backend)
    model = make_model()
    with make_strategy(hook, model) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert hook.mesh is not None and dist.get_backend(hook.mesh.get_group()) == expected
        assert isinstance(model, FSDPModule)
    assert init_calls == [{"backend": expected, "init_method": "env://", "rank": 0, "world_size": 2}]
    assert not dist.is_initialized()  # the hook created the group, so close() destroyed it


# -- process_group -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_the_models_are_sharded_over_the_given_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # The mesh each fully_shard call gets. A parameter's DTensor mesh cannot show the group: torch reuses cached
    # DTensor specs by mesh equality, which ignores the group, so an equal mesh of an earlier test's world may
    # stand in for it.
    meshes: list[DeviceMesh] = []
    real_fully_shard = sharding.fully_shard

    def fully_shard(module: torch.nn.Module, **kwargs: Any) -> Any:
        meshes.append(kwargs["mesh"])
        return real_fully_shard(module, **kwargs)

    monkeypatch.setattr(sharding, "fully_shard", fully_shard)
    group = dist.new_group([0])
    assert group is not dist.group.WORLD
    model = make_model()
    hook = FSDPHook(process_group=group)
    with make_strategy(hook, model) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert hook.mesh is not None and hook.mesh.get_group() is group
        assert hook.units == {"main": ["2", "1", "0", ""]}
        assert len(meshes) == 4 and all(mesh is hook.mesh for mesh in meshes)


# -- reshard_after_forward -----------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_frees_or_keeps_the_gathered_parameters(reshard: bool) -> None:
    probe = AfterForward()
    model = make_model()
    with make_strategy(FSDPHook(reshard_after_forward=reshard), model, probe) as strategy:
        strategy.train_batch(next(iter(make_loader())))
    # resharded: the modules hold their DTensor shards again; kept: the gathered, plain parameters
    expected: set[type] = {DTensor} if reshard else {torch.nn.Parameter}
    assert probe.parameter_types == [expected]
    assert all(isinstance(p, DTensor) for p in model.parameters())  # backward resharded them either way


# -- output_dtype --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"param_dtype": "bf16", "output_dtype": "bf16"}, torch.bfloat16),
        ({"param_dtype": "bf16"}, torch.float32),  # None with param_dtype set: float32
        ({"output_dtype": "fp32"}, torch.float32),
    ],
)
def test_output_dtype_is_the_dtype_of_the_models_outputs(settings: dict[str, Any], expected: torch.dtype) -> None:
    probe = AfterForward()
    with make_strategy(FSDPHook(**settings), make_model(), probe) as strategy:
        strategy.train_batch(next(iter(make_loader())))
    assert probe.output_dtypes == [expected]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    ("settings", "units", "root"),
    [
        ({"output_dtype": "bf16"}, torch.float32, torch.bfloat16),  # float32 weights never see bf16 inputs
        ({"param_dtype": "bf16"}, torch.bfloat16, torch.float32),  # no float32 round trip between units
    ],
)
def test_output_dtype_casts_only_the_root_output(
    settings: dict[str, Any], units: torch.dtype, root: torch.dtype
) -> None:
    probe, units_probe = AfterForward(), UnitOutputs()
    with make_strategy(FSDPHook(**settings), make_model(), probe, units_probe) as strategy:
        strategy.train_batch(next(iter(make_loader())))
    assert units_probe.dtypes == [units, units]
    assert probe.output_dtypes == [root]


class UnitOutputs:
    """Records the dtype each Block hands on; its forward hooks are added once the model is sharded,
    so they run after FSDP's own (which casts to ``output_dtype``)."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        model = ctx.models["main"]
        assert isinstance(model[0], FSDPModule)
        for block in (model[0], model[1]):
            block.register_forward_hook(lambda module, inputs, output: self.dtypes.append(output.dtype))


# -- sync_module_states --------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("sync", [True, False])
def test_sync_module_states_broadcasts_first_ranks_parameters_and_buffers(
    monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    # In a world of one a broadcast changes nothing: record what is broadcast, from where, over which group.
    broadcasts: list[tuple[type, int, int, Any]] = []
    real_broadcast = dist.broadcast

    def broadcast(tensor: torch.Tensor, src: int, group: Any = None, **kwargs: Any) -> Any:
        broadcasts.append((type(tensor), tensor.data_ptr(), src, group))
        return real_broadcast(tensor, src, group=group, **kwargs)

    monkeypatch.setattr(dist, "broadcast", broadcast)
    model = make_model()
    before_sharding = [t.data_ptr() for t in (*model.parameters(), *model.buffers())]
    with make_strategy(FSDPHook(sync_module_states=sync), model) as strategy:
        strategy.setup(make_loader())
        assert isinstance(model, FSDPModule)
    if sync:  # each plain parameter and buffer, before it was sharded, from rank 0 of the default group
        assert broadcasts == [(torch.Tensor, pointer, 0, dist.group.WORLD) for pointer in before_sharding]
    else:
        assert broadcasts == []


# -- cpu_offload ---------------------------------------------------------------------------------------


@pytest.fixture
def cuda_world_of_one() -> Iterator[None]:
    """A real process group of one process for CUDA tensors (NCCL) and CPU ones (gloo)."""
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("cuda_world_of_one")
@pytest.mark.parametrize(("offload", "shard_device"), [(True, "cpu"), (False, "cuda")])
def test_cpu_offload_keeps_the_shards_in_host_memory(offload: bool, shard_device: str) -> None:
    model = make_model()
    with make_strategy(FSDPHook(cpu_offload=offload), model, device="cuda") as strategy:
        strategy.train_batch(next(iter(make_loader())))
        outputs = strategy.ctx.outputs
    assert outputs is not None and outputs.device.type == "cuda"  # computed on the GPU either way
    shards = [p.to_local() for p in model.parameters() if isinstance(p, DTensor)]
    assert len(shards) == 6 and {shard.device.type for shard in shards} == {shard_device}


# -- replicate_degree (HSDP; the 4-rank run is in test_fsdp_multiprocess.py) -----------------------------


def test_replicate_degree_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"FSDPHook.replicate_degree must be an int >= 1 or None \(got 0\)"):
        FSDPHook(replicate_degree=0)


@pytest.mark.usefixtures("world_of_one")
def test_replicate_degree_must_divide_the_ranks() -> None:
    message = r"FSDPHook.replicate_degree=2 must divide the number of ranks \(1\)"
    with (
        pytest.raises(ValueError, match=message),
        make_strategy(FSDPHook(replicate_degree=2), make_model()) as strategy,
    ):
        strategy.setup()


@pytest.mark.usefixtures("world_of_one")
def test_replicate_degree_needs_the_whole_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of 2 ranks in a job of more (here: of one, with the group's ranks made up) is refused."""
    group = dist.new_group([0])
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: [0, 1] if g is group else [0])
    hook = FSDPHook(replicate_degree=2, process_group=group)
    message = r"replicate_degree=2 needs every rank of the job \(world size 1\), but .* group of 2 ranks"
    with pytest.raises(ValueError, match=message), make_strategy(hook, make_model()) as strategy:
        strategy.setup()


@pytest.mark.usefixtures("world_of_one")
def test_replicate_degree_one_is_plain_sharding() -> None:
    hook = FSDPHook(replicate_degree=1)
    with make_strategy(hook, make_model()) as strategy:
        strategy.setup()
        assert hook.mesh is not None and hook.mesh.mesh_dim_names == ("dp",)
