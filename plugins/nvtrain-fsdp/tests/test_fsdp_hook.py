"""FSDPHook in one process: settings, discovery, configs, what it refuses, the single-process no-op,
and (in a gloo world of one) sharding before the optimizers are built, the wrapping policy and the
gradient-sync switch. Real two-rank jobs are in test_fsdp_multiprocess.py."""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import json
import subprocess
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from nvtrain_fsdp import FSDPHook, shard_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nvtrain
import nvtrain.plugins
from nvtrain.app import prepare
from nvtrain.config import ConfigError, load_config
from nvtrain.validators import FieldProblem

#: A single process, whatever torchrun variables the shell has (the root conftest's fixture clears them).
pytestmark = pytest.mark.usefixtures("no_torchrun_env")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(4, 2))


def make_loader(**kwargs: Any) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator))
    return DataLoader(data, **({"batch_size": 4} | kwargs))


def make_strategy(hook: Any, models: Any = None, **kwargs: Any) -> nvtrain.TrainingStrategy:
    adamw = functools.partial(torch.optim.AdamW, lr=0.01)
    return nvtrain.TrainingStrategy(
        models if models is not None else make_model(),
        kwargs.pop("optimizers", adamw),
        torch.nn.functional.mse_loss,
        hooks=[hook, *kwargs.pop("hooks", ())],
        device="cpu",
        **kwargs,
    )


# -- configuration -------------------------------------------------------------------------------


def test_defaults() -> None:
    hook = FSDPHook()
    assert hook.model_keys is None and hook.shard_classes == ()
    assert hook.reshard_after_forward is True and hook.sync_module_states is True
    assert hook.param_dtype is None and hook.reduce_dtype is None and hook.output_dtype is None
    assert hook.cpu_offload is False and hook.process_group is None and hook.backend is None
    assert hook.auto_init is True
    assert hook.sampler_cls is DistributedSampler and hook.sampler_kwargs == {}
    assert FSDPHook.plugin_name == "fsdp" and FSDPHook.data_parallel is True


def test_settings_are_normalised() -> None:
    hook = FSDPHook(model_keys="main", shard_classes=["Block", "Block"], param_dtype="bf16", reduce_dtype="fp32")
    assert hook.model_keys == ("main",) and hook.shard_classes == ("Block",)
    assert hook.param_dtype is torch.bfloat16 and hook.reduce_dtype is torch.float32
    assert FSDPHook(shard_classes="Block").shard_classes == ("Block",)
    assert FSDPHook(param_dtype=torch.bfloat16, output_dtype="float32").output_dtype is torch.float32
    assert FSDPHook(sampler_cls="torch.utils.data:DistributedSampler").sampler_cls is DistributedSampler


@pytest.mark.parametrize(
    ("settings", "error", "field", "message"),
    [
        ({"model_keys": ()}, ValueError, "model_keys", r"FSDPHook.model_keys must name at least one model"),
        ({"model_keys": ("a", "a")}, ValueError, "model_keys", r"each once"),
        ({"model_keys": 3}, TypeError, "model_keys", r"FSDPHook.model_keys must be a str"),
        ({"shard_classes": 3}, TypeError, "shard_classes", r"FSDPHook.shard_classes must be a class name"),
        ({"shard_classes": ["my.Block"]}, ValueError, "shard_classes", r"module class names"),
        ({"param_dtype": "fp16"}, ValueError, "param_dtype", r"float16 needs loss scaling"),
        ({"param_dtype": "int8"}, ValueError, "param_dtype", r"FSDPHook.param_dtype must be None, 'bf16' or 'fp32'"),
        ({"reduce_dtype": torch.float64}, ValueError, "reduce_dtype", r"got torch.float64"),
        ({"output_dtype": 1}, ValueError, "output_dtype", r"got 1"),
        ({"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward", r"must be a bool \(got 'yes'\)"),
        ({"cpu_offload": 1}, TypeError, "cpu_offload", r"FSDPHook.cpu_offload must be a bool"),
        ({"sync_module_states": None}, TypeError, "sync_module_states", r"must be a bool"),
        ({"auto_init": 0}, TypeError, "auto_init", r"FSDPHook.auto_init must be a bool"),
        ({"backend": ""}, ValueError, "backend", r"FSDPHook.backend must be a non-empty backend name"),
    ],
)
def test_bad_settings_fail_at_construction_naming_hook_field_and_value(
    settings: dict[str, Any], error: type[Exception], field: str, message: str
) -> None:
    with pytest.raises(error, match=message) as caught:
        FSDPHook(**settings)
    assert isinstance(caught.value, FieldProblem)
    assert caught.value.owner == "FSDPHook" and caught.value.field == field


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sampler_cls": 5}, r"FSDPHook.sampler_cls must be a sampler class"),
        ({"sampler_cls": "no.such.module.Sampler"}, r"FSDPHook.sampler_cls: cannot import"),
        ({"sampler_kwargs": {"dataset": None}}, r"FSDPHook.sampler_kwargs must not hold 'dataset'"),
    ],
)
def test_bad_sampler_settings_name_the_fsdp_hook(settings: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        FSDPHook(**settings)


# -- discovery and configs --------------------------------------------------------------------------


def test_plugin_is_discovered_listed_and_re_exported() -> None:
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="nvtrain") if ep.name == "fsdp"]
    assert entry.load().__nvtrain_hooks__[0] is FSDPHook
    nvtrain.plugins.refresh()
    (info,) = [info for info in nvtrain.plugins.available() if info.name == "fsdp"]
    assert info.status is nvtrain.plugins.PluginStatus.OK and info.distribution == "nvtrain-fsdp"
    assert [hook.name for hook in info.hooks] == ["FSDPHook"]
    assert {"setup", "before_forward", "before_epoch"} <= set(info.hooks[0].stages)
    from nvtrain.hooks import FSDPHook as reexported

    assert reexported is FSDPHook
    hook = nvtrain.plugins.load("fsdp", param_dtype="bf16", shard_classes=["Block"])
    assert isinstance(hook, FSDPHook) and hook.param_dtype is torch.bfloat16


def test_nvtrain_plugins_command_lists_it() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "nvtrain", "plugins", "--json"], capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0, listed.stderr
    (row,) = [row for row in json.loads(listed.stdout) if row["name"] == "fsdp"]
    assert row["status"] == "ok" and row["distribution"] == "nvtrain-fsdp"


#: The built-in digits job's model and data, for configs that differ from it in their hooks.
JOB = "model: {factory: 'nvtrain.builtin.digits:make_classifier'}\ndata: {factory: 'nvtrain.builtin.digits:make_loaders'}\n"


def test_a_yaml_config_builds_it_and_a_torchrun_launch_adds_no_ddp_beside_it(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        JOB + "hooks:\n  - {name: fsdp, param_dtype: bf16, shard_classes: [Linear], reshard_after_forward: false}\n",
        encoding="utf-8",
    )
    plan = prepare(load_config(config), world_size=2)
    names = [getattr(hook, "plugin_name", None) for hook in plan.hooks]
    assert names.count("fsdp") == 1 and "ddp" not in names
    (hook,) = [hook for hook in plan.hooks if isinstance(hook, FSDPHook)]
    assert hook.param_dtype is torch.bfloat16 and hook.shard_classes == ("Linear",)
    assert hook.reshard_after_forward is False


def test_a_bad_yaml_setting_is_placed_at_its_field(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(JOB + "hooks:\n  - {name: fsdp, param_dtype: fp16}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"FSDPHook.param_dtype must be .*float16 needs loss scaling"):
        prepare(load_config(config), world_size=1)


# -- what it refuses ---------------------------------------------------------------------------------


def test_ddp_and_fsdp_hooks_refuse_each_other() -> None:
    from nvtrain_ddp import DDPHook

    for hooks in ([FSDPHook(), DDPHook()], [DDPHook(), FSDPHook()]):
        strategy = make_strategy(hooks[0], hooks=hooks[1:])
        with strategy, pytest.raises(ValueError, match=r"DDPHook and FSDPHook are both registered .* Keep one"):
            strategy.setup(make_loader())


def test_amp_autocast_beside_fsdp_mixed_precision_is_refused_as_a_double_cast() -> None:
    from nvtrain_amp import MixedPrecisionHook

    strategy = make_strategy(FSDPHook(param_dtype="bf16"), hooks=[MixedPrecisionHook(precision="bf16")])
    with strategy, pytest.raises(ValueError, match=r"both cast the forward pass.*Use one"):
        strategy.setup(make_loader())
    # each alone is fine: autocast over fp32 all-gathers, or FSDP's policy without autocast
    with make_strategy(FSDPHook(), hooks=[MixedPrecisionHook(precision="bf16")]) as strategy:
        strategy.setup(make_loader())
    with make_strategy(FSDPHook(param_dtype="bf16"), hooks=[MixedPrecisionHook(precision="fp32")]) as strategy:
        strategy.setup(make_loader())


@pytest.mark.usefixtures("world_of_one")
def test_amp_fp16_under_fsdp_scales_with_a_sharded_scaler() -> None:
    """fp16 loss scaling must agree across the shards: the amp plugin builds torch's ShardedGradScaler over the
    mesh's group once the models are sharded (the 2-rank skip is in test_fsdp_multiprocess.py)."""
    from nvtrain_amp import MixedPrecisionHook
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    amp = MixedPrecisionHook(precision="fp16")
    fsdp = FSDPHook()
    with make_strategy(fsdp, hooks=[amp]) as strategy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # once per location, as Python shows a warning by default
        strategy.register_hook(WarnsEveryBatch())
        strategy.run(make_loader())
        assert isinstance(amp.scaler, ShardedGradScaler)
        assert fsdp.mesh is not None and amp.scaler.process_group is fsdp.mesh.get_group()
        silenced = [f for f in warnings.filters if f[1] is not None and f[1].pattern.startswith("Found a non-scalar")]
        assert len(silenced) == 1 and silenced[0][3].pattern.startswith("torch")  # DTensor's dispatch alone
    assert not [w for w in caught if "non-scalar tensor with numel=1" in str(w.message)]
    # nothing per step resets the once-per-location registry: a hook's warning shows once, not at every step
    assert len([w for w in caught if "every batch" in str(w.message)]) == 1


class WarnsEveryBatch:
    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        warnings.warn("every batch", UserWarning, stacklevel=1)


def test_amp_fp16_beside_an_inactive_fsdp_hook_keeps_the_plain_scaler() -> None:
    """One process, no process group: nothing is sharded, so nothing needs agreeing."""
    from nvtrain_amp import MixedPrecisionHook

    amp = MixedPrecisionHook(precision="fp16")
    with make_strategy(FSDPHook(), hooks=[amp]) as strategy:
        strategy.run(make_loader())
    assert amp.scaler is not None and type(amp.scaler) is torch.amp.GradScaler


def test_amp_fp16_beside_fsdp_mixed_precision_is_refused_as_a_double_cast() -> None:
    from nvtrain_amp import MixedPrecisionHook

    strategy = make_strategy(FSDPHook(param_dtype="bf16"), hooks=[MixedPrecisionHook(precision="fp16")])
    with strategy, pytest.raises(ValueError, match=r"MixedPrecisionHook\(precision=fp16\) both cast the forward"):
        strategy.setup(make_loader())


@pytest.mark.parametrize("world", ["world_of_one", "no_torchrun_env"])  # refused alike under torchrun and python
def test_cpu_offload_on_a_cpu_device_is_refused_with_the_field(world: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(world)
    strategy = make_strategy(FSDPHook(cpu_offload=True))
    with strategy, pytest.raises(ValueError, match=r"FSDPHook.cpu_offload=True needs a CUDA device") as caught:
        strategy.setup(make_loader())
    assert isinstance(caught.value, FieldProblem) and caught.value.field == "cpu_offload"


@pytest.mark.usefixtures("world_of_one")
def test_a_shard_class_that_matches_nothing_is_refused() -> None:
    strategy = make_strategy(FSDPHook(shard_classes=["Blokc"]))
    with strategy, pytest.raises(ValueError, match=r"FSDPHook.shard_classes: model 'main' has no submodule of class "
                                 r"\['Blokc'\]; expected class names of its submodules \(it has \['Block', "):
        strategy.setup(make_loader())


def test_a_shard_class_that_matches_nothing_is_refused_in_one_process_too() -> None:
    """No process group (python, not torchrun): nothing is sharded, but a typo fails here as it would there."""
    strategy = make_strategy(FSDPHook(shard_classes=["Blokc"]))
    with strategy, pytest.raises(ValueError, match=r"FSDPHook.shard_classes: model 'main' has no submodule of class"):
        strategy.setup(make_loader())


class TiedHead(torch.nn.Module):
    """An input projection and an output head sharing one weight, blocks between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 4, bias=False)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight  # one parameter, registered in two modules
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.blocks(self.embed(x))))


@pytest.mark.parametrize("world", ["world_of_one", "no_group"])
def test_weights_tied_across_units_are_refused_naming_both(world: str, request: pytest.FixtureRequest) -> None:
    if world == "world_of_one":
        request.getfixturevalue("world_of_one")
    strategy = make_strategy(FSDPHook(), models=TiedHead())
    message = (
        r"FSDPHook: model 'main' ties one parameter as 'embed.weight' in unit 'embed' and as 'head.weight' in unit "
        r"'head'; .* set shard_classes to the class names of the repeated blocks"
    )
    with strategy, pytest.raises(ValueError, match=message):
        strategy.setup(make_loader())


@pytest.mark.usefixtures("world_of_one")
def test_tied_weights_in_the_root_shard_and_train() -> None:
    strategy = make_strategy(FSDPHook(shard_classes=["Block"]), models=TiedHead(), num_epochs=1)
    with strategy:
        result = strategy.run(make_loader())
        model = strategy.ctx.models["main"]
        assert isinstance(model, FSDPModule) and model.embed.weight is model.head.weight
        assert result.step_count == 4 and all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


@pytest.mark.usefixtures("world_of_one")
def test_an_unknown_model_key_is_refused() -> None:
    strategy = make_strategy(FSDPHook(model_keys="student"))
    with strategy, pytest.raises(ValueError, match=r"FSDPHook.model_keys: no model named 'student'"):
        strategy.setup(make_loader())


def test_world_size_above_one_without_a_group_and_auto_init_off_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    with make_strategy(FSDPHook(auto_init=False)) as strategy, pytest.raises(RuntimeError, match="auto_init=False"):
        strategy.setup(make_loader())


# -- one process, no process group -------------------------------------------------------------------


def test_single_process_trains_the_plain_model(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    loader = make_loader()
    with caplog.at_level("WARNING", logger="nvtrain_fsdp.hook"), make_strategy(
        FSDPHook(param_dtype="bf16"), model, num_epochs=1
    ) as strategy:
        result = strategy.run(loader)
        assert strategy.ctx.models["main"] is model and not isinstance(model, FSDPModule)
        assert strategy.ctx.train_loader is loader
    assert result.step_count == 4 and not dist.is_initialized()
    assert "param_dtype has no effect" in caplog.text


# -- a gloo world of one: the hook is active ---------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_models_are_sharded_before_the_optimizers_are_built() -> None:
    model = make_model()
    hook = FSDPHook()
    with make_strategy(hook, model, num_epochs=1) as strategy:
        strategy.run(make_loader(shuffle=True))
        assert strategy.ctx.models["main"] is model and isinstance(model, FSDPModule)
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params)
        optimizer_params = strategy.ctx.optimizers["main"].param_groups[0]["params"]
        assert [id(p) for p in optimizer_params] == [id(p) for p in params]
        state = strategy.ctx.optimizers["main"].state[params[0]]
        assert isinstance(state["exp_avg"], DTensor)  # the optimizer state is sharded like the parameter
        assert hook.units == {"main": ["2", "1", "0", ""]}  # the top-level children with weights, then the root
        assert hook.sharded_models == {"main": model} and hook.mesh is not None
        sampler = strategy.ctx.train_loader.sampler
        assert isinstance(sampler, DistributedSampler) and sampler.shuffle is True and sampler.epoch == 0
        gathered = hook.gathered_state_dict()
    assert sorted(gathered) == sorted(make_model().state_dict())
    assert all(type(t) is torch.Tensor for t in gathered.values())
    assert dist.is_initialized(), "the hook must not destroy a process group it did not create"


def test_a_closed_run_leaves_nothing_holding_its_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two things kept the group of a finished FSDP run alive after destroy_process_group(), so that its gloo
    # threads were torn down at interpreter exit, which aborted finished ranks now and then: the context held
    # the last step's autograd graph, whose FSDP functions keep the model (and the strategy) out of the garbage
    # collector's reach; and DTensor's plan caches keep every mesh they saw. Neither may survive the run.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    try:
        with make_strategy(FSDPHook(), num_epochs=1) as strategy:
            strategy.run(make_loader())
        model = weakref.ref(strategy.ctx.models["main"])
        del strategy
        gc.collect()
        assert model() is None, "the sharded model outlived its strategy"
    finally:
        dist.destroy_process_group()
    gc.collect()
    # CPython counts getrefcount's own argument: 2 means only this test's variable still holds the group
    assert sys.getrefcount(group) == 2


class _Layered(torch.nn.Module):
    """A transformer's layout: an embedding, its layers in a ModuleList, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(2, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.blocks = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4)})
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for layer in [*self.layers, *self.blocks.values()]:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("world_of_one")
def test_the_default_units_are_a_containers_members() -> None:
    """fully_shard refuses a ModuleList (no forward of its own): the default rule takes its members instead."""
    mesh = torch.distributed.device_mesh.DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = _Layered()
    assert shard_model(model, mesh) == ["head", "blocks.a", "layers.1", "layers.0", "emb", ""]
    assert all(isinstance(module, FSDPModule) for module in (model.emb, *model.layers, model.blocks["a"], model.head))
    model(torch.randn(3, 2)).sum().backward()


@pytest.mark.usefixtures("world_of_one")
def test_shard_classes_pick_the_units_innermost_first() -> None:
    mesh = torch.distributed.device_mesh.DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    assert shard_model(model, mesh, shard_classes=["Linear"]) == ["1", "0.1", "0.0", ""]
    assert all(isinstance(module, FSDPModule) for module in (model, model[0][0], model[0][1], model[1]))
    assert not isinstance(model[0], FSDPModule)  # a Sequential is not a listed class: its Linears are the units


class _SyncFlags:
    """Every other micro-batch continues its window; records the models' gradient-sync flag at AFTER_FORWARD."""

    def __init__(self) -> None:
        self.count = 0
        self.flags: list[bool] = []

    @nvtrain.hookimpl(tryfirst=True)
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        ctx.sync_gradients = self.count % 2 == 1
        self.count += 1

    @nvtrain.hookimpl
    def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
        model = ctx.models["main"]
        self.flags.append(all(group.reduce_grads for group in _param_groups(model)))


def _param_groups(model: torch.nn.Module) -> list[Any]:
    """FSDP's parameter groups (what set_requires_gradient_sync switches), read through torch internals."""
    return [
        group
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]


@pytest.mark.usefixtures("world_of_one")
def test_gradient_sync_is_off_only_on_micro_batches_that_continue_a_window() -> None:
    window = _SyncFlags()
    model = make_model()
    with make_strategy(FSDPHook(), model, hooks=[window]) as strategy:
        for batch in list(make_loader())[:4]:
            strategy.train_batch(batch)
        assert window.flags == [False, True, False, True]
        window.count = 0
        strategy.train_batch(next(iter(make_loader())))  # leaves gradient sync off ...
        assert window.flags[-1] is False
    # ... and close() turns it back on
    assert all(group.reduce_grads for group in _param_groups(model))


@pytest.mark.usefixtures("world_of_one")
def test_ddp_hook_refuses_a_model_sharded_with_fully_shard() -> None:
    from nvtrain_ddp import DDPHook

    model = make_model()
    shard_model(model, torch.distributed.device_mesh.DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    strategy = make_strategy(DDPHook(), model)
    with strategy, pytest.raises(ValueError, match=r"DDPHook: model 'main' is sharded with FSDP .* FSDPHook"):
        strategy.setup(make_loader())


@pytest.mark.usefixtures("world_of_one")
def test_a_model_sharded_by_the_caller_is_used_as_it_is() -> None:
    model = make_model()
    shard_model(model, torch.distributed.device_mesh.DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    hook = FSDPHook()
    with make_strategy(hook, model) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert hook.sharded_models == {"main": model} and hook.units == {}
