"""Decide, then act, over random compositions.

Random stacks of the shipped update hooks (accumulation, mixed precision in
fp32 / bf16 / fp16, clipping, spike skipping, EMA) plus seed-style custom hooks
(an accumulation hook and a veto hook written as in the reference documents),
at random priorities and in random registration order. Every stack is either
refused at construction, exactly when the decide-then-act rule says so, or
trains to what a hand-written fp32 loop gives (within autocast tolerance).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import nvtrain
from nvtrain import TrainingStage
from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook, SpikeSkipHook

amp = pytest.importorskip("nvtrain_amp")
ema_plugin = pytest.importorskip("nvtrain_ema")

S = TrainingStage
DEVICE = torch.device("cpu")
WINDOWS = 3
LR = 0.5
MAX_NORM = 0.05  # small enough that clipping really clips
EMA_DECAY = 0.5
#: bf16 autocast keeps ~3 significant digits; a scale mix-up is off by 30-70 %.
TOLERANCE = {"fp32": (1e-5, 1e-6), "bf16": (3e-2, 3e-3), "fp16": (1e-2, 1e-3)}


class SeedAccumulation(nvtrain.TrainingUpdateHook):
    """Gradient accumulation as a user writes it from the seed's contract; declares nothing."""

    def __init__(self, steps: int, priority: int) -> None:
        self.steps, self.priority, self.count = steps, priority, 0

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage == S.BEFORE_BATCH:
            return self.count % self.steps == 0, None
        if stage == S.DO_BACKWARD:
            return True, ctx.loss / self.steps
        if stage == S.DO_OPTIMIZER_STEP:
            last = self.count % self.steps == self.steps - 1
            self.count += 1
            return last, None
        return True, None


class DeclaredSeedAccumulation(SeedAccumulation):
    """The same hook, declaring what the error message asks for: it decides from its counter alone."""

    uses_gradients = False


class SeedVeto(nvtrain.TrainingUpdateHook):
    """Vetoes the step that ends one chosen window; seed-style, or declared as a discarding veto."""

    stages = frozenset({S.DO_OPTIMIZER_STEP})

    def __init__(self, window: int, steps: int, priority: int) -> None:
        self.last_batch = (window + 1) * steps - 1
        self.priority = priority

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        return ctx.batch_count != self.last_batch, None


class DeclaredVeto(SeedVeto):
    uses_gradients = False
    veto_discards = True


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def make_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(count)]


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs.float(), targets)


def reference(steps: int, clip: bool, vetoed: int | None, ema: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The hand-written fp32 loop: windows of ``steps`` micro-batches, mean loss, clip, SGD, EMA."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = make_batches(WINDOWS * steps)
    averaged: list[torch.Tensor] | None = None
    for window in range(WINDOWS):
        optimizer.zero_grad(set_to_none=True)
        for inputs, targets in batches[window * steps : (window + 1) * steps]:
            (loss_fn(model(inputs), targets) / steps).backward()
        if window == vetoed:
            continue
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        weights = [p.detach().clone() for p in model.parameters()]
        averaged = weights if averaged is None else [EMA_DECAY * a + (1 - EMA_DECAY) * w for a, w in zip(averaged, weights, strict=True)]
    params = [p.detach().clone() for p in model.parameters()]
    return params, (averaged if ema and averaged is not None else [])


@st.composite
def stacks(draw: st.DrawFn) -> dict[str, Any]:
    priority = st.integers(min_value=0, max_value=60)
    steps = draw(st.integers(min_value=1, max_value=4))
    spec: dict[str, Any] = {
        "steps": steps,
        "precision": draw(st.sampled_from(["fp32", "bf16", "fp16"])),
        "accumulation": draw(st.sampled_from(["builtin", "seed"])) if steps > 1 else None,
        "clip": draw(st.booleans()),
        "spike": draw(st.booleans()),
        "ema": draw(st.booleans()),
        "veto": draw(st.sampled_from([None, "seed", "declared"])),
        "vetoed_window": draw(st.integers(min_value=0, max_value=WINDOWS - 1)),
        "priorities": {name: draw(priority) for name in ("acc", "amp", "clip", "spike", "ema", "veto")},
    }
    spec["order"] = draw(st.permutations(range(7)))
    return spec


def build_hooks(spec: dict[str, Any]) -> list[Any]:
    p = spec["priorities"]
    hooks: list[Any] = []
    if spec["accumulation"] == "builtin":
        hooks.append(GradientAccumulationHook(steps=spec["steps"], priority=p["acc"]))
    elif spec["accumulation"] == "seed":
        hooks.append(SeedAccumulation(spec["steps"], p["acc"]))
    if spec["precision"] != "fp32" or spec["priorities"]["amp"] % 2:  # an fp32 amp hook sometimes too
        hooks.append(
            amp.MixedPrecisionHook(precision=spec["precision"], init_scale=2.0**8, growth_interval=10_000, priority=p["amp"])
        )
    if spec["clip"]:
        hooks.append(GradientClippingHook(max_norm=MAX_NORM, priority=p["clip"]))
    if spec["spike"]:  # judges every window; never skips finite values at this threshold
        hooks.append(SpikeSkipHook(threshold_sigmas=1e9, warmup_steps=10_000, priority=p["spike"]))
    if spec["ema"]:
        hooks.append(ema_plugin.EMAHook(decay=EMA_DECAY, priority=p["ema"]))
    if spec["veto"] is not None:
        cls = SeedVeto if spec["veto"] == "seed" else DeclaredVeto
        hooks.append(cls(spec["vetoed_window"], spec["steps"], p["veto"]))
    order = [i for i in spec["order"] if i < len(hooks)]
    return [hooks[i] for i in order]


def should_refuse(hooks: list[Any]) -> bool:
    """The rule, restated independently over the hooks that run at DO_OPTIMIZER_STEP, in call order.

    Refused: a deferring veto (accumulation, an undeclared seed veto) after a hook that
    uses the gradients; a hook that uses them before the fp16 unscale. Undeclared seed
    hooks count as users; the mixed-precision hook uses gradients only under fp16.
    """
    at_step = [(h.priority, i, h) for i, h in enumerate(hooks) if S.DO_OPTIMIZER_STEP in frozenset(h.stages)]
    at_step.sort(key=lambda item: (item[0], item[1]))
    seen_user = False
    unscaled = not any(isinstance(h, amp.MixedPrecisionHook) and h.precision == torch.float16 for h in hooks)
    for _, _, hook in at_step:
        undeclared = isinstance(hook, SeedAccumulation) or type(hook) is SeedVeto
        fp16 = isinstance(hook, amp.MixedPrecisionHook) and hook.precision == torch.float16
        defers = isinstance(hook, GradientAccumulationHook) or undeclared
        uses = fp16 or undeclared or isinstance(hook, (GradientClippingHook, SpikeSkipHook))
        if defers and seen_user:
            return True
        if fp16:
            unscaled = True
        elif uses and not unscaled:
            return True
        seen_user = seen_user or uses
    return False


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=stacks())
def test_every_composition_is_refused_up_front_or_matches_the_fp32_reference(spec: dict[str, Any]) -> None:
    hooks = build_hooks(spec)
    refuse = should_refuse(hooks)
    make = functools.partial(
        nvtrain.TrainingStrategy,
        models=make_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=LR),
        loss_fn=loss_fn,
        device=DEVICE,
        num_epochs=1,
    )
    event("refused" if refuse else f"trained {spec['precision']}")
    if refuse:
        with pytest.raises(ValueError, match=r"cannot be composed in this order: at stage DO_OPTIMIZER_STEP"):
            make(hooks=hooks)
        return
    steps = spec["steps"]
    vetoed = spec["vetoed_window"] if spec["veto"] is not None else None
    with make(hooks=hooks) as strategy:
        result = strategy.run(make_batches(WINDOWS * steps))
    assert result.step_count == WINDOWS - (vetoed is not None), "a step was lost (an fp16 overflow or a wrong veto)"
    expected, expected_ema = reference(steps, spec["clip"], vetoed, spec["ema"])
    rtol, atol = TOLERANCE[spec["precision"]]
    got = [p.detach() for p in strategy.ctx.models["main"].parameters()]
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol)
    if spec["ema"]:
        ema_hook = next(h for h in hooks if isinstance(h, ema_plugin.EMAHook))
        averaged = list(ema_hook.get_averaged_model().module.parameters())
        for ours, theirs in zip(averaged, expected_ema, strict=True):
            torch.testing.assert_close(ours.detach(), theirs, rtol=rtol, atol=atol)


def test_the_reported_compositions_are_refused_with_both_hooks_and_the_fix() -> None:
    # accumulation at priority 60 behind fp16 (the reported corruption), and a seed-style accumulation at 50
    for accumulate in (GradientAccumulationHook(steps=3, priority=60), SeedAccumulation(3, 50)):
        precision = amp.MixedPrecisionHook(precision="fp16")
        with pytest.raises(ValueError) as refused:
            nvtrain.TrainingStrategy(
                models=make_model(),
                optimizers=functools.partial(torch.optim.SGD, lr=LR),
                loss_fn=loss_fn,
                device=DEVICE,
                hooks=[accumulate, precision],
            )
        message = str(refused.value)
        assert type(accumulate).__name__ in message and "MixedPrecisionHook ('amp')" in message
        assert "DO_OPTIMIZER_STEP" in message and "priority below 20" in message


def test_a_correct_fp16_accumulation_unscales_once_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # the reported case in its legal order: 2 unscale_ calls over 6 micro-batches, not 6
    calls: list[int] = []
    unscale = torch.amp.GradScaler.unscale_

    def counting(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        calls.append(1)
        unscale(scaler, optimizer)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", counting)
    strategy = nvtrain.TrainingStrategy(
        models=make_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=LR),
        loss_fn=loss_fn,
        device=DEVICE,
        hooks=[DeclaredSeedAccumulation(3, priority=5), amp.MixedPrecisionHook(precision="fp16", init_scale=2.0**8)],
        num_epochs=1,
    )
    with strategy:
        strategy.run(make_batches(6))
    assert len(calls) == 2
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = make_batches(6)
    for window in range(2):
        optimizer.zero_grad()
        for inputs, targets in batches[window * 3 : (window + 1) * 3]:
            (loss_fn(model(inputs), targets) / 3).backward()
        optimizer.step()
    for ours, theirs in zip(strategy.ctx.models["main"].parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-2, atol=1e-3)
