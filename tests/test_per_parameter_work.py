"""No Python loop over the parameters per step beyond what torch's own functions do.

A hook that looks at every parameter (or gradient) in Python on every step costs a
few microseconds per hundred parameters, on every step, which a launch-bound model
on a GPU pays in full. Work that depends only on which parameters exist is done when
they change. The check counts Python calls (cProfile: exact, unlike a timing) per
step on two depths of the same model: the extra calls per extra layer must equal
those of a hand-written loop calling the same torch functions (clipping, norms,
the loss scaler), so nvtrain adds none of its own.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch

import nvtrain
from nvtrain import plugins
from nvtrain.hooks import GradientClippingHook, SpikeSkipHook

STEPS = 24
SHALLOW, DEEP = 4, 24
EMA_DECAY = 0.99

Batches = list[tuple[torch.Tensor, torch.Tensor]]
HandStep = Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[torch.Tensor, torch.Tensor], None]]


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])


def _batches() -> Batches:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)) for _ in range(STEPS)]


def _calls_per_step(run: Callable[[], None]) -> float:
    profile = cProfile.Profile()
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls / STEPS  # type: ignore[attr-defined,no-any-return]


def _nvtrain_calls(layers: int, hooks: Callable[[], Sequence[object]], batches: Batches) -> float:
    strategy = nvtrain.TrainingStrategy(
        models=_model(layers),
        optimizers=functools.partial(torch.optim.SGD, lr=1e-3),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks(),
        device="cpu",
    )
    with strategy:
        strategy.train_batch(batches[0])  # built and warm, as the hand-written loop's first step
        return _calls_per_step(lambda: strategy.run(batches))


def _hand_calls(layers: int, make_step: HandStep, batches: Batches) -> float:
    model = _model(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = make_step(model, optimizer)
    step(*batches[0])

    def run() -> None:
        for inputs, targets in batches:
            step(inputs, targets)

    return _calls_per_step(run)


def _hand(*, clip: str | None = None, ema: bool = False, norm: bool = False, fp16: bool = False) -> HandStep:
    """The step a user would write for a stack: torch's own functions, lists built once."""

    def make(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], None]:
        params = list(model.parameters())
        averaged = [p.detach().clone() for p in params]
        scaler = torch.amp.GradScaler("cpu") if fp16 else None
        autocast = torch.autocast("cpu", dtype=torch.float16, enabled=fp16)

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
            if clip == "norm":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(params, 1.0)
            if norm:  # the total gradient norm: spike skipping's measure, value clipping's metric
                torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            if ema:
                with torch.no_grad():
                    torch._foreach_lerp_(averaged, params, 1.0 - EMA_DECAY)

        return step

    return make


def _spike() -> SpikeSkipHook:
    return SpikeSkipHook(warmup_steps=STEPS * 10, window=STEPS * 10)  # measures every step, never skips here


STACKS: dict[str, tuple[Callable[[], Sequence[object]], HandStep]] = {
    "no plugins": (list, _hand()),
    "clipping by norm": (lambda: [GradientClippingHook(max_norm=1.0)], _hand(clip="norm")),
    # clipping by value reports the total norm before it clips (ctx.metrics["grad_norm"]): a norm by hand too
    "clipping by value": (lambda: [GradientClippingHook(max_value=1.0)], _hand(clip="value", norm=True)),
    "EMA": (lambda: [plugins.load("ema", decay=EMA_DECAY)], _hand(ema=True)),
    "spike skipping": (lambda: [_spike()], _hand(norm=True)),
    "fp16 mixed precision": (lambda: [plugins.load("amp", precision="fp16")], _hand(fp16=True)),
    # spike skipping reuses the norm the clipping hook measured: no second pass over the gradients
    "fp16, clipping, spike skipping, EMA": (
        lambda: [
            plugins.load("amp", precision="fp16"),
            GradientClippingHook(max_norm=1.0),
            _spike(),
            plugins.load("ema", decay=EMA_DECAY),
        ],
        _hand(fp16=True, clip="norm", ema=True),
    ),
}


@pytest.mark.parametrize("name", list(STACKS))
def test_per_parameter_host_work_is_torchs_own(name: str) -> None:
    hooks, hand = STACKS[name]
    batches = _batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on the CPU, a loss scaler on the CPU: beside the point here
        nvtrain_per_layer = (_nvtrain_calls(DEEP, hooks, batches) - _nvtrain_calls(SHALLOW, hooks, batches)) / (
            DEEP - SHALLOW
        )
        hand_per_layer = (_hand_calls(DEEP, hand, batches) - _hand_calls(SHALLOW, hand, batches)) / (DEEP - SHALLOW)
    # each layer is two parameters; a Python pass over them costs at least one call per parameter
    assert nvtrain_per_layer == pytest.approx(hand_per_layer, abs=0.5), (
        f"{name}: {nvtrain_per_layer:.2f} Python calls per layer per step, a hand-written loop {hand_per_layer:.2f}"
    )
    assert hand_per_layer > 0  # the measure sees the model's own per-layer work
