"""benchmarks/harness.py, the benchmark suite's harness: structure and semantics, never timings."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from nvtrain.bus import HookBus
from nvtrain.commands.bench_stack import MODELS
from nvtrain.hookspecs import hookimpl
from nvtrain.stages import REPLACEMENT_STAGES, UPDATE_STAGES, TrainingStage

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    """``harness`` imported as the benchmarks import it: with their folder on ``sys.path``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module("harness")


def test_nvtrain_bench_trains_the_suites_models(harness: ModuleType) -> None:
    for name, spec in {"tiny": harness.TINY_MLP, "larger": harness.LARGE_MLP}.items():
        mlp = MODELS[name]
        assert (mlp.inputs, mlp.hidden, mlp.outputs, mlp.batch) == (spec.inputs, spec.hidden, spec.outputs, spec.batch)
        assert mlp.label == spec.label
        ours, theirs = mlp.batches(2, torch.device("cpu")), harness.make_batches(spec, 2)
        assert all(torch.equal(a, b) for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=True))
        model, reference = mlp.build(torch.device("cpu")), harness.make_model(spec)
        for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_measure_reports_per_unit_and_rotates_the_order(harness: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    order: list[str] = []
    workloads = {
        name: harness.Workload(lambda state, name=name: order.append(name), repeats=4, units=5)
        for name in ("a", "b", "c")
    }
    timings = harness.measure(workloads, rounds=3, warmup=1)
    # one clock read before and one after each timed block: 1000 ns per block of 4 runs of 5 units
    assert {name: t.per_unit_ns for name, t in timings.items()} == {n: (50.0,) * 3 for n in "abc"}
    starts = [order[i] for i in range(0, len(order), 4)]
    assert starts == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_noop_observer_implements_exactly_the_observer_stages(harness: ModuleType) -> None:
    bus = HookBus()
    bus.register(harness.noop_observer())
    implemented = {stage for stage in TrainingStage if bus.implementations(stage)}
    assert implemented == set(TrainingStage) - REPLACEMENT_STAGES
    assert len(harness.OBSERVER_STAGES) == 16


def test_sweeps_call_every_implementation_once(harness: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = harness._noop

    def counting(self: object, ctx: Any) -> None:
        calls.append("x")
        return original(self, ctx)

    monkeypatch.setattr(harness._NoopObserver, "before_batch", hookimpl(counting))
    for kind, workload in harness.dispatch_workloads(3, repeats=1).items():
        calls.clear()
        workload.run(None)
        assert len(calls) == 3, kind


def test_update_path_sweeps_run_every_update_hook_on_its_stages(
    harness: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[TrainingStage] = []

    def record(self: object, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
        seen.append(stage)
        return True, ctx.loss

    monkeypatch.setattr(harness.NoopUpdateHook, "__call__", record)
    for kind, workload in harness.update_path_workloads(2, repeats=1).items():
        seen.clear()
        workload.run(None)
        assert sorted(seen) == sorted([s for s in TrainingStage if s in UPDATE_STAGES] * 2), kind


def test_stamped_batches_time_each_step_from_one_hand_out_to_the_next(
    harness: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = iter([0, 10, 30, 60, 100])
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    stamped = harness.StampedBatches(["a", "b", "c", "d", "e"])
    assert stamped[0] == "a" and len(stamped) == 5  # indexing stamps nothing
    assert list(stamped) == ["a", "b", "c", "d", "e"]
    assert stamped.intervals == [20, 30, 40]  # the first interval of the pass is dropped
    assert stamped.step_figures() == {"median": 30, "p10": 20, "min": 20}


def test_compare_loops_drops_warm_up_steps_and_divides_by_the_first_loop(harness: ModuleType) -> None:
    batches = harness.make_batches(harness.TINY_MLP, 5)
    spec = harness.TINY_MLP
    result = harness.compare_loops(
        {
            "hand": lambda data: harness.hand_written_workload(spec, data),
            "nvtrain": lambda data: harness.strategy_workload(spec, data),
        },
        batches,
        rounds=2,
        warmup=1,
    )
    assert result["baseline"] == "hand" and result["steps"] == 5
    assert result["ratios"]["hand"] == {"run_median": 1.0, "run_min": 1.0, "step_median": 1.0, "step_p10": 1.0}
    loops = result["loops"]
    assert loops["nvtrain"]["step_us"]["p10"] / loops["hand"]["step_us"]["p10"] == pytest.approx(
        result["ratios"]["nvtrain"]["step_p10"]
    )


def test_inert_loss_backward_does_nothing(harness: ModuleType) -> None:
    loss = harness.inert_loss()
    assert isinstance(loss, torch.Tensor)
    assert loss.backward() is None


def test_peak_device_memory_is_the_runs_peak_above_its_start(
    harness: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA branch with torch.cuda's counters stood in for: peak minus what the run began with, the
    counters reset after ``prepare`` (whose allocations are the model's, not the loop's), cleanup always run."""
    allocated = {"now": 0, "peak": 0}
    calls: list[str] = []

    def allocate(nbytes: int) -> None:
        allocated["now"] += nbytes
        allocated["peak"] = max(allocated["peak"], allocated["now"])

    def reset(device: Any) -> None:
        calls.append("reset")
        allocated["peak"] = allocated["now"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])

    def prepare() -> None:
        allocate(1000)  # the model: before the counters are reset

    def run(state: None) -> None:
        allocate(300)  # one micro-batch's outputs...
        allocate(200)  # ...and, kept into the next forward, the next one's too
        allocate(-500)

    workload = harness.Workload(run, prepare, cleanup=lambda state: calls.append("cleanup"))
    assert harness.peak_device_memory(workload, torch.device("cuda", 0)) == 500
    assert calls == ["synchronize", "reset", "synchronize", "cleanup"]
    assert harness.peak_device_memory(workload, torch.device("cpu")) is None  # no such counter off CUDA
