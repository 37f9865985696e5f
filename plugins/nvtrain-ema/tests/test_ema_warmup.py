"""EMAHook's decay warmup: ``min(decay, 1 - (1 + n / warmup_gamma) ** -warmup_power)`` after ``n`` updates.

Early in training the weights move fast and an average at decay 0.9999 would stay near the
random initialisation for thousands of steps; the power-function warmup (timm's and
diffusers') lets the average follow at first and settle later. Its position is the update
count, which a checkpoint restores, so a resumed run warms up exactly as a straight one.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
from nvtrain_ema import EMAHook

import nvtrain
from nvtrain.hooks import GradientAccumulationHook

STEPS = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def make_strategy(hooks: list[object], **fields: Any) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=make_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        **fields,
    )


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(n)]


class WeightsAfterEachStep:
    """The model's weights after every optimizer step that happened."""

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if not ctx.step_skipped:
            self.seen.append([p.detach().clone() for p in ctx.models["main"].parameters()])


def test_decay_at_follows_the_power_function_and_stops_at_decay() -> None:
    hook = EMAHook(decay=0.99, warmup_power=0.75, warmup_gamma=2.0)
    for updates in (0, 1, 5, 40):
        assert hook.decay_at(updates) == min(0.99, 1.0 - (1.0 + updates / 2.0) ** -0.75)
    assert hook.decay_at(10**6) == 0.99  # the warmup is over: the decay itself
    assert EMAHook(decay=0.99).decay_at(1) == 0.99  # no warmup
    # the usual settings: about 0.37 after one update, 0.99 after a thousand (power 2/3)
    long_run = EMAHook(decay=0.9999, warmup_power=2 / 3)
    assert round(long_run.decay_at(1), 2) == 0.37 and round(long_run.decay_at(1000), 2) == 0.99


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_average_is_the_warmed_up_lerp_of_the_weights_after_each_step(accumulation: int) -> None:
    ema = EMAHook(decay=0.95, warmup_power=0.75, warmup_gamma=2.0)
    recorder = WeightsAfterEachStep()
    hooks: list[object] = [ema, recorder]
    if accumulation > 1:
        hooks.append(GradientAccumulationHook(accumulation))
    with make_strategy(hooks) as strategy:
        strategy.run(make_batches(STEPS * accumulation))
    assert len(recorder.seen) == STEPS and ema.num_updates == STEPS
    expected = [t.clone() for t in recorder.seen[0]]  # the first update copies
    for updates, step_weights in enumerate(recorder.seen[1:], start=1):
        torch._foreach_lerp_(expected, step_weights, 1.0 - ema.decay_at(updates))
    for got, want in zip(ema.get_averaged_model().module.parameters(), expected, strict=True):
        assert torch.equal(got, want)
    # and it is not the constant decay's average
    constant = [t.clone() for t in recorder.seen[0]]
    for step_weights in recorder.seen[1:]:
        torch._foreach_lerp_(constant, step_weights, 1.0 - 0.95)
    assert not all(torch.equal(a, b) for a, b in zip(expected, constant, strict=True))


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_resumed_average_warms_up_on_from_its_update_count() -> None:
    batches = make_batches(STEPS)
    settings = {"decay": 0.95, "warmup_power": 0.75, "warmup_gamma": 2.0}
    ema = EMAHook(**settings)
    with make_strategy([ema]) as straight:
        straight.run(batches)

    first = EMAHook(**settings)
    with make_strategy([first], max_steps=3) as before:  # stopped in the middle of the epoch
        before.run(batches)
        state = _roundtrip(before.state_dict())
    resumed_ema = EMAHook(**settings)
    with make_strategy([resumed_ema]) as resumed:
        resumed.load_state_dict(state)
        resumed.run(batches)  # the data position is restored: it trains the last three batches
    assert resumed_ema.num_updates == ema.num_updates == STEPS
    for got, want in zip(
        resumed_ema.get_averaged_model().state_dict().values(),
        ema.get_averaged_model().state_dict().values(),
        strict=True,
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"warmup_power": 0}, "warmup_power"),
        ({"warmup_power": -0.5}, "warmup_power"),
        ({"warmup_power": float("inf")}, "warmup_power"),
        ({"warmup_power": float("nan")}, "warmup_power"),
        ({"warmup_power": True}, "warmup_power"),
        ({"warmup_power": "2/3"}, "warmup_power"),
        ({"warmup_gamma": 0}, "warmup_gamma"),
        ({"warmup_gamma": None}, "warmup_gamma"),
    ],
)
def test_bad_warmup_settings_are_refused_naming_the_field(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^EMAHook.{field} must be "):
        EMAHook(**settings)
