"""Spike skipping judges the gradient norm as it was before any clipping hook clipped it.

A clipping hook with ``model_keys`` clips only some parameters; spike skipping then
builds the total norm from what each clipping hook measured before clipping and the
norm of the parameters none clipped. Compositions in which that cannot be known are
refused when the hooks are composed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import GradientClippingHook, SpikeSkipHook
from nvtrain.hooks.clipping import GRAD_NORM, total_grad_norm

Batch = tuple[torch.Tensor, torch.Tensor]
MODEL_KEYS = ("a", "b", "c")


def make_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        key: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)) for key in MODEL_KEYS
    }


def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
    inputs, _ = ctx.batch
    return sum(ctx.models[key](inputs) for key in MODEL_KEYS)  # type: ignore[return-value]


def make_batches(count: int, spike_at: int | None = None) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for index in range(count):
        scale = 1000.0 if index == spike_at else 1.0
        batches.append((torch.randn(8, 3, generator=generator), scale * torch.randn(8, 2, generator=generator)))
    return batches


class PreClipNorms:
    """Records the total gradient norm of every parameter at AFTER_BACKWARD, before any update hook clips."""

    def __init__(self, norm_type: float) -> None:
        self.norm_type = norm_type
        self.norms: list[float] = []

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        params = [p for model in ctx.models.values() for p in model.parameters()]
        self.norms.append(total_grad_norm(params, self.norm_type).item())


def make_strategy(
    hooks: Sequence[object], models: dict[str, torch.nn.Module] | None = None
) -> nvtrain.TrainingStrategy:
    sgd = functools.partial(torch.optim.SGD, lr=0.01)
    return nvtrain.TrainingStrategy(
        models=models or make_models(),
        optimizers=dict.fromkeys(MODEL_KEYS, sgd),
        forward_fn=forward,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
    )


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize(
    "clip_keys",
    [
        [("a",)],  # one model clipped, two not
        [("a",), ("b", "c")],  # every model clipped, by two hooks
        [("c",), ("a",)],  # one model left unclipped, the hooks in another order than the models
    ],
)
def test_the_judged_norm_is_the_norm_before_clipping(norm_type: float, clip_keys: list[tuple[str, ...]]) -> None:
    spike = SpikeSkipHook(warmup_steps=50, monitor="grad_norm")  # no threshold yet: every step is accepted
    clippers = [GradientClippingHook(max_norm=1e-3, norm_type=norm_type, model_keys=keys) for keys in clip_keys]
    recorder = PreClipNorms(norm_type)
    strategy = make_strategy([*clippers, spike, recorder])
    for batch in make_batches(4):
        strategy.train_batch(batch)
    judged = spike.state_dict()["norm_history"]
    assert judged == pytest.approx(recorder.norms, rel=1e-6)
    assert min(judged) > 1e-2  # far above what clipping leaves (at most 1e-3 per hook)


def test_a_spike_is_caught_when_clipping_names_its_models() -> None:
    spike = SpikeSkipHook(threshold_sigmas=3.0, warmup_steps=5, window=10, monitor="grad_norm")
    strategy = make_strategy([GradientClippingHook(max_norm=0.5, model_keys=("a", "b", "c")), spike])
    for batch in make_batches(12, spike_at=10):
        strategy.train_batch(batch)
    assert spike.skipped_steps == 1
    assert spike.thresholds()[1] > 0.5  # the statistics are of pre-clip norms, not of the clipped ones


def test_two_clipping_hooks_of_every_parameter_publish_the_first_ones_norm() -> None:
    """Clamping by value, then clipping the norm: the norm judged is of the gradients before the clamp."""
    spike = SpikeSkipHook(warmup_steps=50, monitor="grad_norm")
    recorder = PreClipNorms(2.0)
    clamp = GradientClippingHook(max_value=1e-4, priority=25)
    strategy = make_strategy([clamp, GradientClippingHook(max_norm=1.0), spike, recorder])
    for batch in make_batches(3):
        strategy.train_batch(batch)
    assert spike.state_dict()["norm_history"] == pytest.approx(recorder.norms, rel=1e-6)
    batch_count, norm = strategy.ctx.stash[GRAD_NORM]
    assert batch_count == strategy.ctx.batch_count - 1 and norm.item() == pytest.approx(recorder.norms[-1], rel=1e-6)


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        ({"model_keys": ("a",)}, {}, r"GradientClippingHook\(no model_keys, priority 30\) clips gradients that "),
        ({"model_keys": ("a",)}, {"model_keys": ("b", "a")}, r"clips gradients that GradientClippingHook\(model_"),
        ({"model_keys": ("a",)}, {"model_keys": ("b",), "norm_type": 1.0}, r"measures a 2\.0 norm and .* a 1\.0"),
    ],
)
def test_clipping_hooks_whose_norms_cannot_add_up_are_refused(
    first: dict[str, object], second: dict[str, object], message: str
) -> None:
    hooks = [
        GradientClippingHook(max_norm=1.0, priority=25, **first),  # type: ignore[arg-type]
        GradientClippingHook(max_norm=1.0, **second),  # type: ignore[arg-type]
    ]
    with pytest.raises(ValueError, match=message):
        make_strategy([*hooks, SpikeSkipHook()])
    make_strategy([*hooks, SpikeSkipHook(monitor="loss")])  # the loss alone needs no norm
    later = GradientClippingHook(max_norm=1.0, priority=45, **second)  # type: ignore[arg-type]
    make_strategy([hooks[0], SpikeSkipHook(), later])  # clipping after the judgement hides nothing


def test_clipping_everything_first_then_some_models_is_accepted() -> None:
    spike = SpikeSkipHook(warmup_steps=50, monitor="grad_norm")
    recorder = PreClipNorms(2.0)
    hooks = [GradientClippingHook(max_norm=1e-3, priority=25), GradientClippingHook(max_norm=1e-4, model_keys="a")]
    strategy = make_strategy([*hooks, spike, recorder])
    for batch in make_batches(3):
        strategy.train_batch(batch)
    assert spike.state_dict()["norm_history"] == pytest.approx(recorder.norms, rel=1e-6)


def test_a_parameter_two_clipping_hooks_share_is_refused_at_the_first_judgement() -> None:
    models = make_models()
    models["b"][0] = models["a"][0]  # a layer both models' optimizers hold
    hooks = [GradientClippingHook(max_norm=1.0, model_keys="a"), GradientClippingHook(max_norm=1.0, model_keys="b")]
    strategy = make_strategy([*hooks, SpikeSkipHook()], models=models)
    with pytest.raises(ValueError, match=r"clipped a parameter that GradientClippingHook\(model_keys=\('a',\)\)"):
        strategy.train_batch(make_batches(1)[0])


class FailsOnce(torch.optim.SGD):
    """An optimizer whose first step raises (after the clipping hooks ran)."""

    failed = False

    def step(self, closure: Any = None) -> Any:
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("a transient failure in optimizer.step")
        return super().step(closure)


@pytest.mark.parametrize("clip_keys", [[None], [("a",), ("b", "c")]])
def test_a_micro_batch_that_failed_after_clipping_leaves_no_norm_behind(clip_keys: list[Any]) -> None:
    """The next attempt has the same ctx.batch_count: it is judged by its own pre-clip norms."""
    FailsOnce.failed = False
    spike = SpikeSkipHook(warmup_steps=50, monitor="grad_norm")
    recorder = PreClipNorms(2.0)
    clippers = [GradientClippingHook(max_norm=1e-3, model_keys=keys) for keys in clip_keys]
    strategy = nvtrain.TrainingStrategy(
        models=make_models(),
        optimizers=dict.fromkeys(MODEL_KEYS, functools.partial(FailsOnce, lr=0.01)),
        forward_fn=forward,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[*clippers, spike, recorder],
        device="cpu",
    )
    big, *small = make_batches(4, spike_at=0)
    with pytest.raises(RuntimeError, match="transient failure"):
        strategy.train_batch(big)
    for batch in small:
        strategy.train_batch(batch)
    # every later one is judged by its own norm, and the failed one's left the statistics with its step
    assert spike.state_dict()["norm_history"] == pytest.approx(recorder.norms[1:], rel=1e-6)
    assert len(recorder.norms) == 4 and spike.accepted_steps == 3
