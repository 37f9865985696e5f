"""What ``nvtrain bench dispatch`` measures: a hook stack's cost per stage and per training step.

:func:`stack_report` trains a small MLP (:data:`MODELS`) with SGD and the stack twice over:

- once with every stage call on the bus timed (``perf_counter_ns``, the timer's own
  cost taken off), for the per-stage table;
- round-robin, ``rounds`` times each, a bare hand-written loop, the strategy with no
  hooks and the strategy with the stack, the garbage collector off while timing: the
  whole run per step, and single steps from one batch hand-out to the next.

Every run trains on the same :data:`BATCH_POOL` seeded batches, in turn, so memory
does not grow with the number of steps.

The benchmark suite has its own harness (``benchmarks/harness.py``, not installed),
which trains the same two MLPs.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import attrs
import torch

from nvtrain.bus import HookBus
from nvtrain.hook import Hook, TrainingUpdateHook
from nvtrain.stages import BATCH_STAGES, UPDATE_STAGES, TrainingStage
from nvtrain.strategy import TrainingStrategy
from nvtrain.validators import FieldProblem

__all__ = ["BATCH_POOL", "MLP", "MODELS", "Batches", "StackRefused", "stack_report", "trial_step"]

Hooks = Callable[[], Sequence[object]]
Batch = tuple[torch.Tensor, torch.Tensor]
#: Builds a loop for a timed round, its warm-up step taken: (run over the batches, close or None).
Loop = Callable[[], tuple[Callable[[Any], object], Callable[[], object] | None]]


@attrs.frozen
class MLP:
    """A two-layer MLP ``inputs -> hidden -> outputs`` (ReLU) and its random batches."""

    inputs: int
    hidden: int
    outputs: int
    batch: int

    @property
    def label(self) -> str:
        return f"{self.inputs}->{self.hidden}->{self.outputs}, batch {self.batch}"

    def build(self, device: torch.device) -> torch.nn.Module:
        torch.manual_seed(0)
        first, second = torch.nn.Linear(self.inputs, self.hidden), torch.nn.Linear(self.hidden, self.outputs)
        return torch.nn.Sequential(first, torch.nn.ReLU(), second).to(device)

    def batches(self, steps: int, device: torch.device) -> Batches:
        """``steps`` seeded batches: the first :data:`BATCH_POOL` distinct, then the same ones again in turn."""
        gen = torch.Generator().manual_seed(0)
        pool = []
        for _ in range(min(steps, BATCH_POOL)):
            inputs = torch.randn(self.batch, self.inputs, generator=gen).to(device)
            pool.append((inputs, torch.randn(self.batch, self.outputs, generator=gen).to(device)))
        return Batches(pool, steps)


#: Distinct batches a run cycles through. A step's cost does not depend on the values it trains on, so a
#: fixed pool measures what fresh batches would, in memory that stays the same however long the run.
BATCH_POOL = 64


class Batches(Sequence[Batch]):
    """``steps`` batches, the ``pool`` handed out in turn (step ``i`` trains on ``pool[i % len(pool)]``)."""

    def __init__(self, pool: Sequence[Batch], steps: int) -> None:
        if steps > 0 and not pool:
            raise ValueError(f"Batches: {steps} steps need at least one batch in the pool (got none)")
        self.pool, self.steps = list(pool), steps

    def __len__(self) -> int:
        return self.steps

    @overload
    def __getitem__(self, index: int) -> Batch: ...
    @overload
    def __getitem__(self, index: slice) -> list[Batch]: ...
    def __getitem__(self, index: int | slice) -> Batch | list[Batch]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.steps))]
        if not -self.steps <= index < self.steps:
            raise IndexError(f"Batches: step {index} is outside the run's {self.steps} steps")
        return self.pool[index % self.steps % len(self.pool)]

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(itertools.cycle(self.pool), self.steps)  # as fast to walk as a list


#: ``--model``: the MLPs of the benchmark suite (TINY_MLP and LARGE_MLP there).
MODELS = {"tiny": MLP(32, 64, 1, 8), "larger": MLP(512, 2048, 512, 64)}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _strategy(mlp: MLP, hooks: Sequence[object], device: torch.device) -> TrainingStrategy:
    return TrainingStrategy(
        models=mlp.build(device),
        optimizers=_sgd,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        num_epochs=1,
        device=device,
    )


class StackRefused(Exception):
    """A hook of the stack refused the bench model at ``where`` (SETUP, the first step); ``cause`` says why.

    A ValueError or TypeError (a field check) reads as its message; other refusals name their type too, as
    a KeyError's message is only the missing key.
    """

    def __init__(self, where: str, hook: str | None, cause: Exception) -> None:
        text = " ".join(str(cause).split())
        if not text or not isinstance(cause, (FieldProblem, ValueError, TypeError)):
            text = ": ".join(part for part in (type(cause).__name__, text) if part)
        super().__init__(f"{f'hook {hook!r} ' if hook else ''}at {where}: {text}")
        self.where, self.hook, self.cause = where, hook, cause


def trial_step(hooks: Sequence[object], *, model: MLP = MODELS["tiny"], device: str = "cpu") -> None:
    """SETUP and one step of a throw-away strategy with ``hooks``, then close it.

    What a hook checks only against the model or at the first step (a trainable-parameter
    pattern that matches nothing) is refused here, as :class:`StackRefused`, before anything
    is measured rather than as a traceback in the middle of it.
    """
    where = torch.device(device)
    first = model.batches(1, where)[0]
    stages: list[tuple[str, Callable[[TrainingStrategy], object]]] = [
        ("SETUP", lambda strategy: strategy.setup()),
        ("the first step", lambda strategy: strategy.train_batch(first)),
    ]
    with _refused_as("registration", hooks):
        strategy = _strategy(model, hooks, where)
    with strategy:
        for stage, call in stages:
            with _refused_as(stage, hooks):
                call(strategy)


@contextlib.contextmanager
def _refused_as(where: str, hooks: Sequence[object]) -> Iterator[None]:
    """A refusal raised in the block as :class:`StackRefused` at ``where``, by the rule ``nvtrain train`` uses
    for a factory's refusal; out-of-memory and accelerator errors propagate with their traceback."""
    from nvtrain.app.building import NOT_REFUSALS, REFUSALS

    refused: tuple[type[Exception], ...] = (FieldProblem, *REFUSALS)
    try:
        yield
    except NOT_REFUSALS:
        raise
    except refused as err:
        raise StackRefused(where, _culprit(hooks, err), err) from err


def _culprit(hooks: Sequence[object], err: Exception) -> str | None:
    """The name of the hook whose class the error names (``owner``, or the message's first word), else of the
    hook whose method raised it (the innermost frame of the traceback with a hook as ``self``), or None."""
    owner = err.owner if isinstance(err, FieldProblem) else ""
    first_word = re.split(r"[.:\s(]", str(err).strip(), maxsplit=1)[0]
    for hook in hooks:
        if type(hook).__name__ == (owner or first_word):
            return _name(hook)
    raisers = [frame.f_locals.get("self") for frame, _ in traceback.walk_tb(err.__traceback__)]
    for raiser in reversed(raisers):
        for hook in hooks:
            if raiser is hook:
                return _name(hook)
    return None


def _bare_loop(mlp: MLP, first: Any, device: torch.device) -> Loop:
    def start() -> tuple[Callable[[Any], object], None]:
        model = mlp.build(device)
        optimizer = _sgd(model.parameters())

        def step(inputs: Any, targets: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()

        step(*first)  # the untimed warm-up step

        def run(batches: Any) -> None:
            for inputs, targets in batches:
                step(inputs, targets)

        return run, None

    return start


def _strategy_loop(mlp: MLP, hooks: Hooks, first: Any, device: torch.device) -> Loop:
    def start() -> tuple[Callable[[Any], object], Callable[[], object]]:
        strategy = _strategy(mlp, hooks(), device)
        strategy.train_batch(first)
        return strategy.run, strategy.close

    return start


class _Stamps:
    """The batches, recording the time from each hand-out to the next (the first interval of a pass dropped)."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches
        self.intervals: list[int] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        clock, intervals, previous = time.perf_counter_ns, self.intervals, 0
        for index, batch in enumerate(self.batches):
            now = clock()
            if index >= 2:
                intervals.append(now - previous)
            previous = now
            yield batch


def _timed_round(start: Loop, stamps: _Stamps, device: torch.device) -> float:
    """One round of a loop: nanoseconds per step of the whole run."""
    run, close = start()
    collecting = gc.isenabled()
    gc.disable()
    try:
        began = time.perf_counter_ns()
        run(stamps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter_ns() - began) / len(stamps)
    finally:
        if collecting:
            gc.enable()
        if close is not None:
            close()


def compare_loops(loops: dict[str, Loop], batches: Sequence[Any], rounds: int, device: torch.device) -> dict[str, Any]:
    """Per-step times of each loop, one untimed round then ``rounds``, the order rotated each round."""
    names = list(loops)
    stamps = {name: _Stamps(batches) for name in names}
    runs: dict[str, list[float]] = {name: [] for name in names}
    for index in range(1 + rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            per_step = _timed_round(loops[name], stamps[name], device)
            if index == 0:
                stamps[name].intervals.clear()
            else:
                runs[name].append(per_step)
    figures = {}
    for name in names:
        steps = sorted(stamps[name].intervals)
        step_ns = {"median": statistics.median(steps), "p10": steps[len(steps) // 10], "min": steps[0]}
        figures[name] = {
            "run_us": {"median": statistics.median(runs[name]) / 1e3, "min": min(runs[name]) / 1e3},
            "step_us": {key: ns / 1e3 for key, ns in step_ns.items()},
        }
    base_run, base_step = figures[names[0]]["run_us"], figures[names[0]]["step_us"]
    ratios = {
        name: {
            "run_median": f["run_us"]["median"] / base_run["median"],
            "run_min": f["run_us"]["min"] / base_run["min"],
            "step_median": f["step_us"]["median"] / base_step["median"],
            "step_p10": f["step_us"]["p10"] / base_step["p10"],
        }
        for name, f in figures.items()
    }
    return {"loops": figures, "ratios": ratios}


def _timed(caller: Callable[[Any], Any], recorded: list[int]) -> Callable[[Any], Any]:
    clock, append = time.perf_counter_ns, recorded.append  # local names: the least the timer can add

    def timed(ctx: Any) -> Any:
        start = clock()
        result = caller(ctx)
        append(clock() - start)
        return result

    return timed


@contextlib.contextmanager
def _timing_stages(bus: HookBus) -> Iterator[dict[TrainingStage, list[int]]]:
    """Wrap the bus's compiled stage callers (``bus.before_batch``...) with a timer while the block runs.

    Setting the bus's stage attributes is the only way to time the very callers a
    run makes: pluggy's hook-call monitoring would switch every stage to pluggy's own
    caller (a slower path than the run takes), timing plugins would join the
    implementation lists and cannot surround the one-owner DO slots, and
    :class:`~nvtrain.bus.HookBus` is final. The bus recompiles (and so drops the
    wrappers) when plugins change; the originals come back when the block ends.
    """
    recorded: dict[TrainingStage, list[int]] = {stage: [] for stage in TrainingStage}
    originals = {stage: getattr(bus, stage.hook_name) for stage in TrainingStage}
    for stage, caller in originals.items():
        setattr(bus, stage.hook_name, _timed(caller, recorded[stage]))
    try:
        yield recorded
    finally:
        for stage, caller in originals.items():
            setattr(bus, stage.hook_name, caller)


def _name(hook: object) -> str:
    name = getattr(hook, "plugin_name", None)
    return name if isinstance(name, str) else type(hook).__qualname__


def stage_costs(
    mlp: MLP, batches: Sequence[Any], stack: Sequence[object], device: torch.device
) -> list[dict[str, Any]]:
    """One epoch with ``stack``, every stage call timed; a row per stage."""
    recorded: list[int] = []
    noop = _timed(lambda ctx: None, recorded)
    for _ in range(2000):
        noop(None)
    overhead = statistics.median(recorded)  # the timer's own cost
    strategy = _strategy(mlp, stack, device)
    with strategy, _timing_stages(strategy.bus) as times:
        strategy.run(batches)
    includes = {TrainingStage.DO_BACKWARD: "backward()", TrainingStage.DO_OPTIMIZER_STEP: "optimizer step"}
    rows = []
    for stage in TrainingStage:
        samples, impls = times[stage], [impl.plugin_name for impl in strategy.bus.implementations(stage)]
        update = strategy.orchestrator.hooks_for(stage) if stage in UPDATE_STAGES else ()
        rows.append(
            {
                "stage": stage.hook_name,
                "implementations": impls,
                "update_hooks": [_name(hook) for hook in update],
                "calls": len(samples),
                "per_micro_batch": stage in BATCH_STAGES,
                "median_ns": max(0.0, statistics.median(samples) - overhead) if samples else None,
                "min_ns": max(0.0, min(samples) - overhead) if samples else None,
                "includes": includes.get(stage) if impls else None,
            }
        )
    return rows


def describe_hook(hook: object) -> dict[str, str]:
    """Name, class and kind of one hook, for the report."""
    kind = "observer (Hook)" if isinstance(hook, Hook) else "observer (pluggy)"
    kind = "update hook" if isinstance(hook, TrainingUpdateHook) else kind
    return {"name": _name(hook), "class": type(hook).__qualname__, "kind": kind}


def stack_report(
    hooks: Hooks, *, model: MLP = MODELS["tiny"], steps: int = 200, rounds: int = 5, device: str = "cpu"
) -> dict[str, Any]:
    """What the stack ``hooks()`` builds (afresh for each run) costs: per stage, and per step. JSON-ready."""
    where = torch.device(device)
    batches = model.batches(steps, where)
    _timed_round(_strategy_loop(model, hooks, batches[0], where), _Stamps(batches[:3]), where)  # one-off costs
    stack = list(hooks())
    stages = stage_costs(model, batches, stack, where)
    loops = {
        "bare loop": _bare_loop(model, batches[0], where),
        "nvtrain, no hooks": _strategy_loop(model, tuple, batches[0], where),
    }
    if stack:
        loops["nvtrain, your hooks"] = _strategy_loop(model, hooks, batches[0], where)
    comparison = compare_loops(loops, batches, rounds, where)
    per_batch = [row for row in stages if row["per_micro_batch"] and row["median_ns"] is not None]
    update = {stage.hook_name for stage in UPDATE_STAGES}
    report: dict[str, Any] = {
        "model": f"MLP {model.label}, SGD",
        "device": str(where),
        "threads": torch.get_num_threads(),
        "steps": steps,
        "rounds": rounds,
        "hooks": [describe_hook(hook) for hook in stack],
        "stages": stages,
        "sweep_ns": {
            "observer_stages": sum(r["median_ns"] for r in per_batch if r["stage"] not in update),
            "update_stages": sum(r["median_ns"] for r in per_batch if r["stage"] in update and not r["includes"]),
            "do_slots": sum(r["median_ns"] for r in per_batch if r["includes"]),
            "once_per_run": sum((r["median_ns"] or 0.0) * r["calls"] for r in stages if not r["per_micro_batch"]),
        },
        "per_step_us": comparison["loops"],
        "ratios": {name: r for name, r in comparison["ratios"].items() if name != "bare loop"},
    }
    if stack:
        framework, yours = comparison["loops"]["nvtrain, no hooks"], comparison["loops"]["nvtrain, your hooks"]
        report["hooks_overhead_us"] = {
            "run_median": yours["run_us"]["median"] - framework["run_us"]["median"],
            "step_p10": yours["step_us"]["p10"] - framework["step_us"]["p10"],
        }
    return report
