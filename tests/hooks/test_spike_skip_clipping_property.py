"""Property: whatever clipping hooks run before it, spike skipping judges the gradient norm as it was before
any of them clipped, in the norm type the docs name, or the composition is refused when it is built.

The reference is written from docs/update-hooks.md (SpikeSkipHook): the first clipping hook without
``model_keys`` gives the total norm in its ``norm_type``; clipping hooks with ``model_keys`` must clip
disjoint models in one ``norm_type`` (else refused), and their norms with the unclipped rest's make the
total in that type; without clipping, the spike hook's own ``norm_type``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvtrain
from nvtrain.hooks import GradientClippingHook, SpikeSkipHook
from nvtrain.hooks.clipping import total_grad_norm

MODELS = ("a", "b", "c")
NORM_TYPES = (1.0, 2.0, math.inf)


@st.composite
def clipping_hooks(draw: st.DrawFn) -> list[tuple[tuple[str, ...] | None, float, int]]:
    """(model_keys, norm_type, priority) of 0 to 3 clipping hooks, before or after spike skipping (40; a tie
    goes to the clipping hook, registered first)."""
    count = draw(st.integers(0, 3))
    hooks = []
    for _ in range(count):
        keys = draw(st.none() | st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True).map(tuple))
        hooks.append((keys, draw(st.sampled_from(NORM_TYPES)), draw(st.integers(21, 45))))
    return hooks


def expected(hooks: list[tuple[tuple[str, ...] | None, float, int]], spike_norm: float) -> float | None:
    """The norm type the judged norm is in, or None when the composition is refused (the docs' rule)."""
    before = [h for _, h in sorted(enumerate(hooks), key=lambda item: (item[1][2], item[0])) if h[2] <= 40]
    if not before:
        return spike_norm
    first_keys, first_norm, _ = before[0]
    if first_keys is None:
        return first_norm
    seen: set[str] = set()
    for keys, norm, _ in before:
        if norm != first_norm or keys is None or seen & set(keys):
            return None
        seen |= set(keys)
    return first_norm


class PreClip:
    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        self.grads.append([p.grad.detach().clone() for m in ctx.models.values() for p in m.parameters()])  # type: ignore[union-attr]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hooks=clipping_hooks(), spike_norm=st.sampled_from(NORM_TYPES))
def test_the_judged_norm_is_the_pre_clip_norm_or_the_stack_is_refused(
    hooks: list[tuple[tuple[str, ...] | None, float, int]], spike_norm: float
) -> None:
    torch.manual_seed(0)
    models = {key: torch.nn.Linear(3, 2) for key in MODELS}
    clips = [
        GradientClippingHook(max_norm=1e-3, norm_type=norm, model_keys=keys, priority=priority)
        for keys, norm, priority in hooks
    ]
    spike = SpikeSkipHook(warmup_steps=50, monitor="grad_norm", norm_type=spike_norm)
    recorder = PreClip()
    norm_type = expected(hooks, spike_norm)

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        return sum(ctx.models[key](ctx.batch[0]) for key in MODELS)  # type: ignore[return-value]

    def build() -> nvtrain.TrainingStrategy:
        return nvtrain.TrainingStrategy(
            models=models,
            optimizers=dict.fromkeys(MODELS, functools.partial(torch.optim.SGD, lr=0.01)),
            forward_fn=forward,
            loss_fn=torch.nn.functional.mse_loss,
            hooks=[*clips, spike, recorder],
            device="cpu",
        )

    if norm_type is None:
        try:
            build()
        except ValueError as err:
            assert "SpikeSkipHook judges the gradient norm before clipping" in str(err)
            return
        raise AssertionError(f"{hooks} should have been refused")
    strategy = build()
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        strategy.train_batch((torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)))
    reference = [total_grad_norm_of(grads, norm_type) for grads in recorder.grads]
    judged = spike.state_dict()["norm_history"]
    assert judged == [pytest.approx(value, rel=1e-5) for value in reference]


def total_grad_norm_of(grads: list[torch.Tensor], norm_type: float) -> float:
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for holder, grad in zip(holders, grads, strict=True):
        holder.grad = grad
    return float(total_grad_norm(holders, norm_type))
