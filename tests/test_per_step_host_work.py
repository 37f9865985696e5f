"""The loop's host work per step, held to a budget: Python calls beyond a hand-written loop's.

On a launch-bound model (a GPU waiting for the host to issue kernels) every call the loop
makes per step is time on the critical path, so "near-zero overhead" is a number here. It
is counted, not timed (cProfile's call count does not move with machine load), per step:
the difference between a run of 60 and one of 20 steps, which leaves out what a run costs
once (its start and end). Both loops run the same torch operations (the op counts match);
the difference is nvtrain's own work: the stages, the step scheduler's window and boundary,
the orchestrator's two slots, the batch's copy, the hooks' bookkeeping.

A change that adds per-step work fails here: either it can be done when plugins change
instead (the rule), or the budget is raised on purpose, with the reason next to it.
Measured when the budgets were set (torch 2.13, CPU): 34.8 extra calls per step with no
plugins, 11.1 with the fp32 standard stack, 35.0 with the bf16 one.
"""

from __future__ import annotations

import cProfile
import importlib
import pstats
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SHORT, LONG = 20, 60


@pytest.fixture(scope="module")
def benchmarks() -> tuple[ModuleType, ModuleType]:
    """``harness`` and ``gpu_check`` imported as the benchmarks import them: with their folder on ``sys.path``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module("harness"), importlib.import_module("gpu_check")


def _calls(workload: Any) -> int:
    state = workload.prepare()
    profile = cProfile.Profile()
    try:
        profile.enable()
        workload.run(state)
        profile.disable()
    finally:
        if workload.cleanup is not None:
            workload.cleanup(state)
    return int(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]


def _per_step(harness: ModuleType, make: Callable[[Any], Any]) -> float:
    spec, device = harness.TINY_MLP, torch.device("cpu")
    short = _calls(make(harness.make_batches(spec, SHORT, device=device)))
    long = _calls(make(harness.make_batches(spec, LONG, device=device)))
    return (long - short) / (LONG - SHORT)


@pytest.mark.parametrize(
    ("stack", "budget"),
    [
        (None, 40),  # the stages, the scheduler, the orchestrator's slots, the batch's copy
        ("fp32", 15),  # amp (nothing to do in fp32), EMA, clipping: the hand-written stack pays for an autocast
        ("bf16", 40),  # the same with bf16 autocast entered and left per micro-batch
    ],
)
def test_nvtrain_adds_at_most_its_budget_of_python_calls_per_step(
    benchmarks: tuple[ModuleType, ModuleType], stack: str | None, budget: int
) -> None:
    harness, gpu_check = benchmarks
    spec, device = harness.TINY_MLP, torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 autocast on the CPU: beside the point here
        if stack is None:
            hand = _per_step(harness, lambda batches: harness.hand_written_workload(spec, batches, device=device))
            ours = _per_step(harness, lambda batches: harness.strategy_workload(spec, batches, device=device))
        else:
            dtype = torch.bfloat16 if stack == "bf16" else torch.float32
            step = gpu_check.hand_written_stack(device, dtype)
            hand = _per_step(
                harness, lambda batches: harness.hand_written_workload(spec, batches, make_step=step, device=device)
            )
            ours = _per_step(
                harness,
                lambda batches: harness.strategy_workload(
                    spec, batches, lambda: gpu_check.standard_stack(stack), device=device
                ),
            )
    extra = ours - hand
    assert 0 < extra <= budget, (
        f"{stack or 'no plugins'}: nvtrain makes {ours:.1f} Python calls per step, a hand-written loop {hand:.1f}: "
        f"{extra:.1f} more, over the budget of {budget} (see this file's docstring)"
    )
