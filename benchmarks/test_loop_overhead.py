"""Per-step time of TrainingStrategy against a hand-written loop on the same model.

Two MLPs trained with SGD on random batches (CPU, one intra-op thread):

- tiny: 32->64->1, batch 8, where the loop's own cost shows most;
- larger: 512->2048->512, batch 64, where the model's work dominates.

Each is run hand-written (the baseline), through ``TrainingStrategy`` with no
plugins, with 5 no-op observers on every stage that admits observers, and, for
scale, as the hand-written loop plus one direct pluggy call per batch stage.
Targets on the tiny model: no plugins <= 1.05x, 5 observers <= 1.15x.

A round builds a fresh model (and strategy), takes one untimed warm-up step, then
times a whole ``run()`` over STEPS batches: every step plus the run's own start
and end (step scheduler, BEFORE_/AFTER_TRAINING), divided by STEPS. The batches
also stamp the clock as each is handed out (``StampedBatches``), which gives
per-step figures (median, 10th percentile, min) in ``extra_info["step_us"]``:
on a busy machine their low percentiles are the steadier estimate.

    python -m pytest benchmarks/test_loop_overhead.py
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.stages import BATCH_STAGES, TrainingStage

from harness import (
    LARGE_MLP,
    TINY_MLP,
    MLPSpec,
    StampedBatches,
    Workload,
    compare_loops,
    hand_written_workload,
    make_batches,
    noop_observer,
    strategy_workload,
)

MODELS = {"tiny": TINY_MLP, "larger": LARGE_MLP}


def _steps_and_rounds(model: str, scale: Any) -> tuple[int, int]:
    if model == "tiny":
        return scale.pick(200, 50), scale.pick(30, 6)
    return scale.pick(10, 3), scale.pick(8, 2)


def _group(model: str, spec: MLPSpec) -> str:
    return f"loop: {model} MLP {spec.label}"


def _direct_pluggy_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Any, Any, int], None]:
    """The hand-written step plus one direct pluggy call per batch stage (no implementations)."""
    hooks = nvtrain.HookBus().pluggy.hook
    stage = {s: getattr(hooks, s.hook_name) for s in BATCH_STAGES}
    before = [stage[s] for s in (TrainingStage.BEFORE_BATCH,)]
    forward_loss = [
        stage[s] for s in sorted(BATCH_STAGES) if TrainingStage.BEFORE_FORWARD <= s <= TrainingStage.BEFORE_BACKWARD
    ]
    after = [stage[s] for s in sorted(BATCH_STAGES) if s >= TrainingStage.DO_BACKWARD]
    mse_loss = torch.nn.functional.mse_loss
    ctx = object()

    def step(inputs: Any, targets: Any, number: int) -> None:
        for hook in before:
            hook(ctx=ctx)
        optimizer.zero_grad(set_to_none=True)
        loss = mse_loss(model(inputs), targets)
        for hook in forward_loss:
            hook(ctx=ctx)
        loss.backward()
        for hook in after:
            hook(ctx=ctx)
        optimizer.step()

    return step


LoopBuilder = Callable[[MLPSpec, StampedBatches], Workload]

#: The loops compared: benchmark id -> (kind recorded in extra_info, label, workload builder).
#: The first is the baseline of every ratio.
LOOPS: dict[str, tuple[str, str, LoopBuilder]] = {
    "hand_written_baseline": ("hand", "hand-written loop", lambda spec, data: hand_written_workload(spec, data)),
    "strategy_no_plugins": ("nvtrain", "nvtrain, no plugins", lambda spec, data: strategy_workload(spec, data)),
    "strategy_five_noop_observers": (
        "nvtrain+5 observers",
        "nvtrain, 5 no-op observers",
        lambda spec, data: strategy_workload(spec, data, lambda: [noop_observer() for _ in range(5)]),
    ),
    "hand_written_plus_direct_pluggy_calls": (
        "hand+pluggy",
        "hand-written + direct pluggy calls",
        lambda spec, data: hand_written_workload(spec, data, make_step=_direct_pluggy_step),
    ),
}


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("model", list(MODELS))
def test_loop(benchmark: Any, time_loop: Any, scale: Any, model: str, loop: str) -> None:
    """One loop on its own: pytest-benchmark's figures per candidate, one after another."""
    steps, rounds = _steps_and_rounds(model, scale)
    spec = MODELS[model]
    kind, _, build = LOOPS[loop]
    batches = StampedBatches(make_batches(spec, steps))
    benchmark.group = _group(model, spec)
    time_loop(build(spec, batches), batches, rounds, suite="loop", model=model, kind=kind)


@pytest.mark.parametrize("model", list(MODELS))
def test_interleaved_comparison(benchmark: Any, scale: Any, model: str) -> None:
    """The loops of ``LOOPS``, round-robin in one test: ratios a drifting machine skews far less.

    pytest-benchmark's own figure here is the whole comparison; the per-loop results
    and ratios are in ``extra_info["comparison"]``.
    """
    steps, rounds = _steps_and_rounds(model, scale)
    spec = MODELS[model]
    loops = {label: functools.partial(build, spec) for _, label, build in LOOPS.values()}
    benchmark.group = "interleaved " + _group(model, spec)
    result = benchmark.pedantic(
        compare_loops, args=(loops, make_batches(spec, steps)), kwargs={"rounds": rounds}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(suite="loop-interleaved", model=model, comparison=result)
