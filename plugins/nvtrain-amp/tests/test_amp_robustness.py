"""fp16 on the paths a happy run never takes: a batch that raises mid-unscale, a resume under other scaler
settings, scalers and states that cannot work, weights already in float16 (CPU autocast and GradScaler)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from nvtrain_amp import MixedPrecisionHook

import nvtrain
from nvtrain.validators import FieldProblem


def two_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 1)}


def make_strategy(hook: MixedPrecisionHook, models: dict[str, torch.nn.Module] | None = None) -> Any:
    models = models if models is not None else two_models()
    sgd = functools.partial(torch.optim.SGD, lr=0.01)

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        return ctx.models["b"](ctx.models["a"](ctx.batch[0]))

    return nvtrain.TrainingStrategy(
        models=models,
        optimizers=dict.fromkeys(models, sgd),
        forward_fn=forward,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def scaler_progress(hook: MixedPrecisionHook) -> tuple[float, int]:
    state = hook.scaler.state_dict()  # type: ignore[union-attr]
    return state["scale"], state["_growth_tracker"]


def test_a_batch_that_raises_between_two_unscales_leaves_the_scaler_usable() -> None:
    hook = MixedPrecisionHook(precision="fp16", init_scale=4.0, growth_interval=2)
    strategy = make_strategy(hook)
    data = batches(4)
    strategy.train_batch(data[0])  # the scaler exists from here on
    real_unscale = type(hook.scaler).unscale_
    calls = {"n": 0}

    def unscale_then_fail(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("interrupted during the second optimizer's unscale")
        real_unscale(scaler, optimizer)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(hook.scaler), "unscale_", unscale_then_fail)
        with pytest.raises(KeyboardInterrupt):
            strategy.train_batch(data[1])
    settled = scaler_progress(hook)  # what a checkpoint taken now holds: the interrupted batch not counted
    state = copy.deepcopy(strategy.state_dict())
    for batch in data[2:]:
        strategy.train_batch(batch)  # no "unscale_() has already been called" from here on
    resumed_hook = MixedPrecisionHook(precision="fp16", init_scale=4.0, growth_interval=2)
    resumed = make_strategy(resumed_hook)
    resumed.load_state_dict(state)
    for batch in data[2:]:
        resumed.train_batch(batch)
    # the interrupted batch stepped nothing and is trained again: 1 clean step of growth_interval=2 so far
    assert settled == (4.0, 1)
    assert scaler_progress(resumed_hook) == scaler_progress(hook)
    for name in ("a", "b"):
        for got, want in zip(
            resumed.ctx.models[name].parameters(), strategy.ctx.models[name].parameters(), strict=True
        ):
            assert torch.equal(got, want)


def test_a_resumed_scaler_keeps_its_scale_and_takes_this_hooks_growth_settings() -> None:
    saving = MixedPrecisionHook(precision="fp16", init_scale=8.0)
    strategy = make_strategy(saving)
    strategy.train_batch(batches(1)[0])
    state = strategy.state_dict()
    hook = MixedPrecisionHook(precision="fp16", init_scale=1.0, growth_interval=1, growth_factor=4.0)
    resumed = make_strategy(hook)
    resumed.load_state_dict(state)
    for batch in batches(3):
        resumed.train_batch(batch)
    scaler = hook.scaler
    assert scaler is not None
    assert (scaler.get_growth_interval(), scaler.get_growth_factor()) == (1, 4.0)
    assert scaler.get_scale() == 8.0 * 4.0**3  # the saved scale, grown 4x by each clean step (its saved
    # count of 1 good step is capped below the new interval of 1, or torch would never grow it again)


@pytest.mark.parametrize(
    ("scaler_state", "message"),
    [
        ({}, r"the state's 'scaler' must hold a finite positive 'scale', got None"),
        (8.0, r"the state's 'scaler' must be a GradScaler state \(a dict\), got float"),
        ({"scale": float("inf")}, r"finite positive 'scale', got inf"),
        ({"scale": 8.0, "_growth_tracker": -1}, r"an int '_growth_tracker' >= 0, got -1"),
    ],
)
def test_a_malformed_scaler_state_is_refused_when_loaded(scaler_state: Any, message: str) -> None:
    hook = MixedPrecisionHook(precision="fp16")
    with pytest.raises(ValueError, match=message):
        hook.load_state_dict({"precision": "float16", "scaler": scaler_state})


@pytest.mark.parametrize("saved", ["fp16", "torch.float16", "float16"])
def test_a_state_naming_the_precision_another_way_loads(saved: str) -> None:
    MixedPrecisionHook(precision="fp16").load_state_dict({"precision": saved, "scaler": None})


def test_a_state_of_an_unknown_precision_is_refused_naming_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"the state's precision 'float64' is none this hook knows \(expected one of"):
        MixedPrecisionHook(precision="fp16").load_state_dict({"precision": "float64", "scaler": None})


def test_a_disabled_scaler_is_refused_before_any_step() -> None:
    class CudaScaler(MixedPrecisionHook):
        def create_scaler(self, device_type: str) -> torch.amp.GradScaler:
            return torch.amp.GradScaler("cuda", enabled=False)

    strategy = make_strategy(CudaScaler(precision="fp16"))
    before = [p.detach().clone() for p in strategy.ctx.models["a"].parameters()]
    with pytest.raises(ValueError, match=r"create_scaler\(\) returned a disabled GradScaler .* torch\.amp\.GradScaler\('cpu'"):
        strategy.train_batch(batches(1)[0])
    assert strategy.ctx.step_count == 0
    assert all(torch.equal(p, q) for p, q in zip(strategy.ctx.models["a"].parameters(), before, strict=True))


def test_float16_weights_with_float16_scaling_are_refused_before_the_forward() -> None:
    models = two_models()
    models["b"] = models["b"].half()
    strategy = make_strategy(MixedPrecisionHook(precision="fp16"), models)
    with pytest.raises(ValueError, match=r"optimizer 'b' trains float16 parameters.*keep the weights in float32"):
        strategy.train_batch(batches(1)[0])
    assert strategy.ctx.batch_count == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"growth_factor": float("inf")}, r"MixedPrecisionHook\.growth_factor"),
        ({"growth_interval": 2**63}, r"MixedPrecisionHook\.growth_interval must be an int below 2\*\*63"),
    ],
)
def test_scaler_settings_torch_cannot_take_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(FieldProblem, match=message):
        MixedPrecisionHook(precision="fp16", **settings)
