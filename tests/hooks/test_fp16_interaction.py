"""A veto after gradients were unscaled keeps GradScaler consistent: the next batch trains.

The stack under test is the documented one: 10 accumulate, 20 mixed precision,
30 clip, 40 spike-skip. ``ScalerStub`` plays the mixed-precision hook with
``torch.amp.GradScaler("cpu")``; the last test runs the real nvtrain-amp hook.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook, SpikeSkipHook
from nvtrain.stages import TrainingStage

S = TrainingStage
SPIKE_AT = 6


class ScalerStub(nvtrain.TrainingUpdateHook):
    """Loss scaling with GradScaler: scale at DO_BACKWARD, unscale before a step that will run,
    step through the scaler, update after every batch that unscaled (vetoed or not)."""

    priority = 20
    stages = frozenset({S.DO_BACKWARD, S.DO_OPTIMIZER_STEP, S.AFTER_OPTIMIZER_STEP})
    exclusive_key = "mixed_precision"

    def __init__(self, update_on_veto: bool = True) -> None:
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10_000)
        self.update_on_veto = update_on_veto
        self.unscaled = False
        self.updates = 0
        self._stepped = False

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage is S.DO_BACKWARD:
            return True, self.scaler.scale(ctx.loss)
        if stage is S.DO_OPTIMIZER_STEP and not will_skip:
            for optimizer in ctx.optimizers.values():
                self.scaler.unscale_(optimizer)
            self.unscaled = True
        elif stage is S.AFTER_OPTIMIZER_STEP and self.unscaled and (self.update_on_veto or not will_skip):
            self.unscaled = False
            self.scaler.update()
            self.updates += 1
        return True, None

    def step_optimizer(self, ctx: Any, name: str, optimizer: torch.optim.Optimizer) -> bool:
        self._stepped = False
        handle = optimizer.register_step_post_hook(self._mark)
        try:
            self.scaler.step(optimizer)
        finally:
            handle.remove()
        return self._stepped

    def _mark(self, *args: Any) -> None:
        self._stepped = True


class VetoAt(nvtrain.TrainingUpdateHook):
    """Vetoes the step of chosen micro-batches from the clipping slot (priority 30)."""

    priority = 30
    stages = frozenset({S.DO_OPTIMIZER_STEP})
    uses_gradients = False
    veto_discards = True  # a vetoed micro-batch's gradients are zeroed by the next one (no accumulation)

    def __init__(self, batches: set[int]) -> None:
        self.batches = batches

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        return ctx.batch_count not in self.batches, None


class SpikingLoss:
    def __init__(self, at: int = SPIKE_AT) -> None:
        self.at, self.calls = at, 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(outputs.float(), targets)
        self.calls += 1
        return loss * 1e3 if self.calls - 1 == self.at else loss


def make_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, generator=generator), torch.randn(8, 2, generator=generator)) for _ in range(count)]


def make_strategy(hooks: Sequence[object], loss_fn: Any = None) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=0.05),
        loss_fn=loss_fn or torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
    )


def params(strategy: nvtrain.TrainingStrategy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]


def train_through_a_veto(strategy: nvtrain.TrainingStrategy, veto_at: int, count: int = 10) -> None:
    """Train ``count`` micro-batches; the one at ``veto_at`` must be vetoed and change nothing."""
    for index, batch in enumerate(make_batches(count)):
        before = params(strategy)
        strategy.train_batch(batch)
        assert strategy.ctx.step_skipped == (index == veto_at), index
        if index == veto_at:
            assert all(torch.equal(a, b) for a, b in zip(before, params(strategy), strict=True))
    assert strategy.ctx.step_count == count - 1


def test_spike_skip_veto_after_unscale_keeps_the_scaler_consistent() -> None:
    stub = ScalerStub()
    spike = SpikeSkipHook(warmup_steps=4, threshold_sigmas=20.0)
    strategy = make_strategy([spike, GradientClippingHook(max_norm=10.0), stub], SpikingLoss())
    train_through_a_veto(strategy, SPIKE_AT)
    assert spike.skipped_steps == 1
    assert stub.updates == 10  # updated after every unscale, the vetoed batch included
    assert stub.scaler.get_scale() == 2.0**10  # no inf was found: the scale never backed off
    # the statistics saw unscaled gradient norms, like the ones of a run without a scaler
    plain = SpikeSkipHook(warmup_steps=4, threshold_sigmas=20.0)
    reference = make_strategy([plain, GradientClippingHook(max_norm=10.0)], SpikingLoss())
    for batch in make_batches(10):
        reference.train_batch(batch)
    assert spike.state_dict()["norm_history"] == pytest.approx(plain.state_dict()["norm_history"], rel=1e-5)


def test_veto_from_the_clipping_slot_keeps_the_scaler_consistent() -> None:
    stub = ScalerStub()
    strategy = make_strategy([VetoAt({3}), GradientClippingHook(max_norm=10.0), stub])
    train_through_a_veto(strategy, 3)
    assert stub.updates == 10


def test_without_the_update_on_veto_the_next_batch_fails() -> None:
    # the failure the stack avoids: a scaler that only updates after real steps
    strategy = make_strategy([VetoAt({1}), ScalerStub(update_on_veto=False)])
    batches = make_batches(3)
    strategy.train_batch(batches[0])
    strategy.train_batch(batches[1])
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        strategy.train_batch(batches[2])


def test_accumulation_keeps_gradients_scaled_until_the_window_ends() -> None:
    stub = ScalerStub()
    scaled = make_strategy([GradientAccumulationHook(steps=2), stub, SpikeSkipHook(warmup_steps=50)])
    plain = make_strategy([GradientAccumulationHook(steps=2)])
    for batch in make_batches(6):
        scaled.train_batch(batch)
        plain.train_batch(batch)
    assert scaled.ctx.step_count == plain.ctx.step_count == 3
    assert stub.updates == 3  # one unscale and one update per window
    # scaling by a power of two and unscaling is exact
    assert all(torch.equal(a, b) for a, b in zip(params(scaled), params(plain), strict=True))


def test_real_mixed_precision_hook_survives_a_spike_skip() -> None:
    nvtrain_amp = pytest.importorskip("nvtrain_amp")
    amp = nvtrain_amp.MixedPrecisionHook(precision="fp16", init_scale=2.0**10, growth_interval=10_000)
    spike = SpikeSkipHook(warmup_steps=4, threshold_sigmas=20.0)
    strategy = make_strategy(
        [GradientAccumulationHook(steps=1), amp, GradientClippingHook(max_norm=10.0), spike], SpikingLoss()
    )
    train_through_a_veto(strategy, SPIKE_AT)
    assert spike.skipped_steps == 1
    # the spike overflowed the fp16 gradients: the vetoed batch still let the scaler back off, once
    assert amp.scaler is not None and amp.scaler.get_scale() == 2.0**9
