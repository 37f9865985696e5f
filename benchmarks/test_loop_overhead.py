"""Per-step cost of TrainingStrategy against a hand-written loop on the same tiny model.

Targets (tiny MLP 32->64->1, batch 8, SGD, CPU, one thread): no plugins <= 1.05x
the hand-written loop; 5 no-op observers on every stage but the two DO slots
<= 1.15x. Each round trains STEPS steps from a fresh model, so per-round fixed
costs (building the strategy, SETUP) are outside the timed region.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.stages import REPLACEMENT_STAGES, TrainingStage

STEPS = 200
ROUNDS = 30


def _data(batch: int = 8, features: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, features, generator=gen), torch.randn(batch, 1, generator=gen)) for _ in range(STEPS)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _noop_observer() -> object:
    """A plugin implementing every stage except the two replacement slots, doing nothing."""
    namespace: dict[str, Any] = {}
    for stage in TrainingStage:
        if stage in REPLACEMENT_STAGES:
            continue
        namespace[stage.hook_name] = nvtrain.hookimpl(lambda self, ctx: None)
    return type("NoopObserver", (), namespace)()


def _hand_written(model: torch.nn.Module, data: list[Any]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.functional.mse_loss
    for inputs, targets in data:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()


def _strategy(model: torch.nn.Module, hooks: list[object]) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        num_epochs=1,
        device="cpu",
    )


@pytest.mark.benchmark(group="loop-tiny-mlp")
def test_baseline_hand_written_loop(benchmark: Any) -> None:
    data = _data()
    benchmark.pedantic(_hand_written, setup=lambda: ((_model(), data), {}), rounds=ROUNDS, warmup_rounds=2)


@pytest.mark.benchmark(group="loop-tiny-mlp")
def test_strategy_no_plugins(benchmark: Any) -> None:
    data = _data()
    benchmark.pedantic(
        lambda strategy: strategy.run(data),
        setup=lambda: ((_strategy(_model(), []),), {}),
        rounds=ROUNDS,
        warmup_rounds=2,
    )


@pytest.mark.benchmark(group="loop-tiny-mlp")
def test_strategy_five_noop_observers(benchmark: Any) -> None:
    data = _data()
    benchmark.pedantic(
        lambda strategy: strategy.run(data),
        setup=lambda: ((_strategy(_model(), [_noop_observer() for _ in range(5)]),), {}),
        rounds=ROUNDS,
        warmup_rounds=2,
    )


@pytest.mark.benchmark(group="loop-tiny-mlp")
def test_direct_pluggy_18_hooks(benchmark: Any) -> None:
    """For scale: the hand-written loop plus one direct pluggy call per stage (no implementations)."""
    data = _data()
    bus = nvtrain.HookBus()
    hooks = [getattr(bus.pluggy.hook, stage.hook_name) for stage in TrainingStage if stage is not TrainingStage.AFTER_VALIDATION]

    def loop(model: torch.nn.Module) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        ctx = object()
        for inputs, targets in data:
            for hook in hooks[:4]:
                hook(ctx=ctx)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            for hook in hooks[4:9]:
                hook(ctx=ctx)
            loss.backward()
            for hook in hooks[9:]:
                hook(ctx=ctx)
            optimizer.step()

    benchmark.pedantic(loop, setup=lambda: ((_model(),), {}), rounds=ROUNDS, warmup_rounds=2)
