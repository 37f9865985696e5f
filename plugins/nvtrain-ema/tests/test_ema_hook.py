"""EMAHook: the average itself, when it updates, validation with it, and its checkpoint state."""

from __future__ import annotations

import functools
import io
import types
import warnings
from typing import Any

import attrs
import pytest
import torch
from nvtrain_ema import EMAHook

import nvtrain
from nvtrain import TrainingStage as S
from nvtrain.hooks import GradientAccumulationHook

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)

#: What torch warns at each synchronising CUDA call in sync debug mode "warn". The first
#: ``set_sync_debug_mode`` of a process also warns, once, that the mode is a prototype
#: ("Synchronization debug mode is a prototype feature ..."): that is no synchronisation.
SYNC_WARNING = "called a synchronizing CUDA operation"

# Hand computations use plain tensor arithmetic; the hook uses lerp. They agree to float32 rounding.
TOL = {"rtol": 0.0, "atol": 1e-6}


# -- helpers ------------------------------------------------------------------------------------


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def make_strategy(
    hooks: list[object], model: torch.nn.Module | None = None, device: str = "cpu", **kwargs: Any
) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=model if model is not None else make_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device=device,
        **kwargs,
    )


def make_batches(n: int, device: str = "cpu", seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 4, generator=gen).to(device), torch.randn(8, 1, generator=gen).to(device)) for _ in range(n)
    ]


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@attrs.define(eq=False)
class RecordAfterBatch:
    """After every micro-batch: the model's weights, the step count and the EMA update count."""

    ema: EMAHook
    model_weights: list[list[torch.Tensor]] = attrs.field(factory=list)
    updated_at: list[int] = attrs.field(factory=list)
    _last: int = 0

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.model_weights.append(weights(ctx.models["main"]))
        if self.ema.num_updates != self._last:
            self._last = self.ema.num_updates
            self.updated_at.append(ctx.step_count)


@attrs.define(eq=False)
class VetoOn(nvtrain.TrainingUpdateHook):
    """Veto the optimizer step on the given micro-batches."""

    batches: frozenset[int]
    priority: int = 40
    stages = frozenset({S.DO_OPTIMIZER_STEP})

    def __call__(self, ctx: Any, stage: S, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        return ctx.batch_count not in self.batches, None


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay": 1.0}, r"EMAHook\.decay must be in \[0\.0, 1\.0\) \(got 1\.0\)"),
        ({"decay": -0.1}, r"EMAHook\.decay must be in \[0\.0, 1\.0\) \(got -0\.1\)"),
        ({"decay": "0.9"}, r"EMAHook\.decay must be in \[0\.0, 1\.0\) \(got '0\.9'\)"),
        ({"update_every": 0}, r"EMAHook\.update_every must be an int >= 1 \(got 0\)"),
        ({"start_step": -1}, r"EMAHook\.start_step must be an int >= 0 \(got -1\)"),
        ({"model_key": ""}, r"EMAHook\.model_key must be a non-empty model name \(got ''\)"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EMAHook(**kwargs)


def test_the_update_count_is_an_output_not_a_setting() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_updates'"):
        EMAHook(num_updates=3)  # type: ignore[call-arg]
    hook = EMAHook()
    with pytest.raises(AttributeError):
        hook.num_updates = 3  # type: ignore[misc]  # read only, as docs/ema.md says
    assert hook.num_updates == 0


def test_use_buffers_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"EMAHook\.use_buffers must be True or False \(got 1\)"):
        EMAHook(use_buffers=1)  # type: ignore[arg-type]


def test_plugin_metadata() -> None:
    import nvtrain_ema

    assert nvtrain_ema.__nvtrain_hooks__ == (EMAHook,)
    assert EMAHook.plugin_name == "ema"
    assert EMAHook().priority == 50
    assert isinstance(EMAHook(), nvtrain.CheckpointableHook)


def test_discovered_through_its_entry_point() -> None:
    import nvtrain.plugins

    nvtrain.plugins.refresh()
    info = {plugin.name: plugin for plugin in nvtrain.plugins.available()}["ema"]
    assert info.status is nvtrain.plugins.PluginStatus.OK, info.error
    assert info.distribution == "nvtrain-ema"
    assert [hook.name for hook in info.hooks] == ["EMAHook"]
    hook = nvtrain.plugins.load("ema", decay=0.5)
    assert isinstance(hook, EMAHook)
    assert hook.decay == 0.5


def test_unknown_model_key_is_named() -> None:
    strategy = make_strategy([EMAHook(model_key="student")])
    with pytest.raises(ValueError, match=r"EMAHook\.model_key: no model named 'student' \(models: \['main'\]\)"):
        strategy.run(make_batches(1))


def test_unknown_model_key_is_refused_at_setup() -> None:
    """At SETUP, where ``nvtrain validate`` builds the strategy, not only once training starts."""
    strategy = make_strategy([EMAHook(model_key="student")])
    with pytest.raises(ValueError, match=r"EMAHook\.model_key: no model named 'student'"):
        strategy.setup()


def test_no_averaged_model_before_a_strategy() -> None:
    with pytest.raises(RuntimeError, match=r"EMAHook\.get_averaged_model\(\): there is no averaged model yet"):
        EMAHook().get_averaged_model()


# -- the average ------------------------------------------------------------------------------------


def test_ema_weights_equal_a_hand_computation() -> None:
    ema = EMAHook(decay=0.9)
    record = RecordAfterBatch(ema)
    strategy = make_strategy([ema, record])
    strategy.run(make_batches(4))
    expected = record.model_weights[0]  # the first update copies the weights
    for step_weights in record.model_weights[1:]:
        expected = [0.9 * e + 0.1 * w for e, w in zip(expected, step_weights, strict=True)]
    averaged = ema.get_averaged_model()
    assert ema.num_updates == 4
    assert int(averaged.n_averaged) == 4
    for got, want in zip(averaged.module.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, **TOL)
    # and it is an average, not the model
    assert not torch.equal(next(averaged.module.parameters()), record.model_weights[-1][0])


def test_copy_is_made_at_before_training_from_the_initial_weights() -> None:
    model = make_model()
    initial = weights(model)
    ema = EMAHook()
    seen: list[list[torch.Tensor]] = []

    class Peek:
        priority = 60

        @nvtrain.hookimpl
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            seen.append(weights(ema.get_averaged_model().module))

    make_strategy([ema, Peek()], model=model).run(make_batches(1))
    assert all(torch.equal(a, b) for a, b in zip(seen[0], initial, strict=True))


def test_update_is_one_multi_tensor_op_without_host_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    lerp_calls: list[int] = []
    real_lerp = torch._foreach_lerp_

    def counting_lerp(dst: list[torch.Tensor], src: list[torch.Tensor], weight: float) -> None:
        lerp_calls.append(len(dst))
        real_lerp(dst, src, weight)

    ema = EMAHook(decay=0.5)
    strategy = make_strategy([ema])
    batches = make_batches(3)
    strategy.train_batch(batches[0])  # the first update copies
    monkeypatch.setattr(torch, "_foreach_lerp_", counting_lerp)
    reads: list[str] = []
    to_bool, item = torch.Tensor.__bool__, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or to_bool(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or item(t))
    strategy.train_batch(batches[1])
    strategy.train_batch(batches[2])
    monkeypatch.undo()
    assert lerp_calls == [4, 4]  # all four parameters of the model, in one call per update
    assert reads == []
    assert ema.num_updates == 3


@pytest.mark.parametrize("device", [CUDA])
def test_update_makes_no_cuda_sync(device: str) -> None:
    ema = EMAHook(decay=0.5)
    strategy = make_strategy([ema], device=device)
    batches = make_batches(3, device)
    strategy.train_batch(batches[0])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            strategy.train_batch(batches[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if SYNC_WARNING in str(w.message)] == []
    assert ema.num_updates == 2


@pytest.mark.parametrize("use_buffers", [True, False])
def test_buffers_averaged_or_followed(use_buffers: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    ema = EMAHook(decay=0.5, use_buffers=use_buffers)
    strategy = make_strategy([ema], model=model)
    strategy.run(make_batches(3))
    averaged = ema.get_averaged_model().module
    source = strategy.ctx.models["main"]
    same_mean = torch.equal(averaged[1].running_mean, source[1].running_mean)
    assert same_mean is (not use_buffers)
    assert torch.equal(averaged[1].num_batches_tracked, source[1].num_batches_tracked)


# -- when it updates ---------------------------------------------------------------------------------


def test_accumulation_updates_once_per_real_step() -> None:
    ema = EMAHook()
    record = RecordAfterBatch(ema)
    strategy = make_strategy([GradientAccumulationHook(steps=4), ema, record])
    strategy.run(make_batches(8))
    assert strategy.ctx.batch_count == 8
    assert strategy.ctx.step_count == 2
    assert ema.num_updates == 2
    assert record.updated_at == [1, 2]


def test_accumulation_standalone_train_batch() -> None:
    ema = EMAHook()
    strategy = make_strategy([GradientAccumulationHook(steps=4), ema])
    for batch in make_batches(8):
        strategy.train_batch(batch)
    assert ema.num_updates == 2


def test_vetoed_steps_do_not_update() -> None:
    ema = EMAHook(decay=0.5)
    record = RecordAfterBatch(ema)
    strategy = make_strategy([VetoOn(batches=frozenset({1, 2})), ema, record])
    strategy.run(make_batches(5))
    assert strategy.ctx.step_count == 3
    assert ema.num_updates == 3
    assert record.updated_at == [1, 2, 3]


def test_fp16_inf_skips_do_not_update() -> None:
    amp = pytest.importorskip("nvtrain_amp")

    class InjectInf:
        @nvtrain.hookimpl
        def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.batch_count == 1:
                with torch.no_grad():
                    next(ctx.models["main"].parameters()).grad[0, 0] = float("inf")

    ema = EMAHook()
    strategy = make_strategy([amp.MixedPrecisionHook(precision="fp16"), ema, InjectInf()])
    strategy.run(make_batches(4))
    assert strategy.ctx.step_count == 3
    assert ema.num_updates == 3


@pytest.mark.parametrize(
    ("update_every", "start_step", "updated_at"),
    [
        (1, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),
        (3, 0, [3, 6, 9, 12]),
        (1, 5, [5, 6, 7, 8, 9, 10, 11, 12]),
        (3, 4, [6, 9, 12]),  # a global modulo: not counted from start_step
        (4, 8, [8, 12]),
    ],
)
def test_update_every_and_start_step(update_every: int, start_step: int, updated_at: list[int]) -> None:
    ema = EMAHook(update_every=update_every, start_step=start_step)
    record = RecordAfterBatch(ema)
    make_strategy([ema, record]).run(make_batches(12))
    assert record.updated_at == updated_at
    assert ema.num_updates == len(updated_at)


# -- using the average -------------------------------------------------------------------------------


def test_validation_uses_the_ema_weights() -> None:
    data = make_batches(2, seed=7)
    ema = EMAHook(decay=0.5)
    strategy = make_strategy([ema], validation=nvtrain.ValidationConfig(data=data, use_ema=True))
    strategy.run(make_batches(3))
    averaged = ema.get_averaged_model()
    with torch.no_grad():
        expected = sum(torch.nn.functional.mse_loss(averaged(x), y) * x.shape[0] for x, y in data) / 16
        plain = sum(torch.nn.functional.mse_loss(strategy.ctx.models["main"](x), y) * x.shape[0] for x, y in data) / 16
    summary = strategy.validate()
    torch.testing.assert_close(summary["loss"], expected, **TOL)
    assert not torch.allclose(summary["loss"], plain)


def test_modify_ema_methods_runs_once_on_the_copy() -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.modified = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def modify_ema_methods(self) -> None:
            self.modified += 1

    model = Wrapper()
    ema = EMAHook()
    make_strategy([ema], model=model).run(make_batches(3))
    assert ema.get_averaged_model().module.modified == 1
    assert model.modified == 0


def test_ddp_wrapper_is_not_copied(tmp_path: Any) -> None:
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        ema = EMAHook(decay=0.5)
        make_strategy([ema], model=model).run(make_batches(2))
        copy = ema.get_averaged_model().module
        assert isinstance(copy, torch.nn.Sequential)
        assert ema.num_updates == 2
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group(tmp_path: Any) -> Any:
    """A one-process gloo group, for a model sharded with FSDP2 in this process."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_weights_left_gathered_never_reach_the_average_or_the_next_forward(one_rank_group: Any) -> None:
    """Without reshard_after_forward FSDP2 keeps the weights a forward gathered, and the next forward uses
    them as they are: the average must be made of the shards, run on its own weights, and leave the
    model's for the next forward."""
    from nvtrain_ema import ShardedAverage
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model, plain = make_model(), make_model()
    fully_shard(model, reshard_after_forward=False)
    shards = [p.to_local() for p in model.parameters()]  # the storage of the model's own weights
    x = make_batches(1)[0][0]
    with torch.no_grad():
        model(x)
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # the case under test: left gathered
    ema = EMAHook(decay=0.5)
    ema.setup(types.SimpleNamespace(models={"main": model}))
    averaged = ema.get_averaged_model()
    assert isinstance(averaged, ShardedAverage)  # made of the shards, not a copy of the gathered module
    with torch.no_grad():
        averaged_output = averaged(x)  # the average is a copy of the initial weights
        assert all(isinstance(p, DTensor) for p in model.parameters())  # the average's gathered weights are gone
        torch._foreach_add_(shards, 1.0)  # the model moves on
        torch._foreach_add_(list(plain.parameters()), 1.0)
        torch.testing.assert_close(averaged(x), averaged_output, rtol=0.0, atol=0.0)
    next_output = model(x)  # as a training step's forward: with grad
    torch.testing.assert_close(next_output, plain(x), **TOL)


# -- checkpoint state --------------------------------------------------------------------------------


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_round_trip_resumes_bitwise() -> None:
    batches = make_batches(5)
    ema = EMAHook(decay=0.8)
    straight = make_strategy([ema])
    for batch in batches[:3]:
        straight.train_batch(batch)
    ema_state = roundtrip(ema.state_dict())
    model_state = roundtrip(straight.ctx.models["main"].state_dict())
    optimizer_state = roundtrip(straight.ctx.optimizers["main"].state_dict())
    assert ema_state["num_updates"] == 3
    assert int(ema_state["averaged"]["n_averaged"]) == 3

    resumed_ema = EMAHook(decay=0.8)
    resumed_ema.load_state_dict(ema_state)  # before the copy exists: kept until it is made
    assert resumed_ema.num_updates == 3
    model = make_model()
    model.load_state_dict(model_state)
    resumed = make_strategy([resumed_ema], model=model)
    resumed.setup()
    resumed.ctx.optimizers["main"].load_state_dict(optimizer_state)
    resumed.ctx.step_count = 3
    for got, want in zip(resumed_ema.get_averaged_model().state_dict().values(), ema_state["averaged"].values(), strict=True):
        assert torch.equal(got, want)

    for batch in batches[3:]:
        straight.train_batch(batch)
        resumed.train_batch(batch)
    assert resumed_ema.num_updates == ema.num_updates == 5
    for got, want in zip(
        resumed_ema.get_averaged_model().state_dict().values(), ema.get_averaged_model().state_dict().values(), strict=False
    ):
        assert torch.equal(got, want)


def test_load_into_an_existing_copy_and_mismatch() -> None:
    ema = EMAHook(decay=0.5)
    make_strategy([ema]).run(make_batches(2))
    state = roundtrip(ema.state_dict())
    other = EMAHook(decay=0.5)
    make_strategy([other]).run(make_batches(4, seed=3))
    other.load_state_dict(state)
    assert other.num_updates == 2
    for got, want in zip(other.get_averaged_model().module.parameters(), ema.get_averaged_model().module.parameters(), strict=True):
        assert torch.equal(got, want)

    wrong = EMAHook()
    make_strategy([wrong], model=torch.nn.Linear(4, 1)).run(make_batches(1))
    with pytest.raises(ValueError, match=r"EMAHook\.load_state_dict: the saved averaged weights do not fit model 'main'"):
        wrong.load_state_dict(state)
    with pytest.raises(ValueError, match=r"EMAHook.load_state_dict: the state lacks \['averaged'\]"):
        wrong.load_state_dict({"num_updates": 1})
