"""The benchmark suite's harness: workloads, a round-robin timer, no-op plugins and hand-written loops.

The files in ``benchmarks/`` (the pytest-benchmark suites, ``gpu_check.py`` and
``peers.py``) build their workloads here, so they all measure the same way:

- a :class:`Workload` is something to time (``run``) after an untimed ``prepare``;
- :func:`measure` times several workloads round-robin with
  ``time.perf_counter_ns`` (the garbage collector off while timing), so a busy
  machine slows every candidate alike, and reports per round the time of one
  unit (one sweep, one training step);
- a figure is the median over rounds, with the min beside it; :func:`ratio`
  compares two candidates on both;
- :func:`compare_loops` adds single-step times from :class:`StampedBatches`.

``nvtrain bench dispatch`` does not import this file (it is not installed with
nvtrain); its own measurement is :mod:`nvtrain.commands.bench_stack`, which
trains the same two MLPs (``TINY_MLP``, ``LARGE_MLP``) the same way.
Import it as ``harness``: the scripts run from this folder, and
``benchmarks/conftest.py`` puts the folder on ``sys.path`` for the suite.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import pstats
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from nvtrain.bus import HookBus
from nvtrain.context import TrainingContext
from nvtrain.hook import TrainingUpdateHook
from nvtrain.hookspecs import hookimpl
from nvtrain.orchestrator import TrainingUpdateOrchestrator
from nvtrain.stages import REPLACEMENT_STAGES, UPDATE_STAGES, TrainingStage
from nvtrain.strategy import IMPLIED_STEP_SCHEDULER, TrainingStrategy

__all__ = [
    "LARGE_MLP",
    "OBSERVER_STAGES",
    "TINY_MLP",
    "MLPSpec",
    "NoopUpdateHook",
    "Ratio",
    "StampedBatches",
    "Timing",
    "Workload",
    "bare_step",
    "compare_loops",
    "dispatch_workloads",
    "hand_written_workload",
    "inert_loss",
    "make_batches",
    "make_model",
    "measure",
    "noop_observer",
    "peak_device_memory",
    "python_calls_per_unit",
    "ratio",
    "strategy_workload",
    "update_path_workloads",
]

#: Stages an observer may implement: all but the two replacement slots the orchestrator owns.
OBSERVER_STAGES: tuple[TrainingStage, ...] = tuple(s for s in TrainingStage if s not in REPLACEMENT_STAGES)
_UPDATE_ORDER: tuple[TrainingStage, ...] = tuple(s for s in TrainingStage if s in UPDATE_STAGES)


# -- timing ---------------------------------------------------------------------------------------


def _positive_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be an int >= 1 (got {value!r})")


@attrs.frozen
class Workload:
    """What to time: ``run(state)`` called ``repeats`` times after an untimed ``state = prepare()``.

    ``units`` is what one ``run`` counts for (training steps, sweeps), so timings
    come out per unit. ``cleanup(state)`` runs after the timed region.
    """

    run: Callable[[Any], object]
    prepare: Callable[[], Any] = attrs.field(default=lambda: None)
    repeats: int = attrs.field(default=1, validator=_positive_int)
    units: int = attrs.field(default=1, validator=_positive_int)
    cleanup: Callable[[Any], object] | None = None
    #: A CUDA device whose queue must drain before the clock stops (None on CPU).
    synchronize: torch.device | None = None


@attrs.frozen
class Timing:
    """Nanoseconds per unit, one figure per round."""

    name: str
    per_unit_ns: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.per_unit_ns)

    @property
    def min(self) -> float:
        return min(self.per_unit_ns)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_ns": self.median,
            "min_ns": self.min,
            "rounds": len(self.per_unit_ns),
            "per_unit_ns": list(self.per_unit_ns),
        }


@attrs.frozen
class Ratio:
    """``candidate / baseline`` on medians and on minimums (the min is steadier on a busy machine)."""

    median: float
    min: float

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.min}


def ratio(candidate: Timing, baseline: Timing) -> Ratio:
    return Ratio(median=candidate.median / baseline.median, min=candidate.min / baseline.min)


def _time_once(workload: Workload) -> float:
    state = workload.prepare()
    run, sync = workload.run, workload.synchronize
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if sync is not None:  # what prepare() queued (a warm-up step) is not this run's time
            torch.cuda.synchronize(sync)
        start = clock()
        for _ in range(workload.repeats):
            run(state)
        if sync is not None:
            torch.cuda.synchronize(sync)
        elapsed = clock() - start
    finally:
        if gc_was_enabled:
            gc.enable()
        if workload.cleanup is not None:
            workload.cleanup(state)
    return elapsed / (workload.repeats * workload.units)


def measure(workloads: Mapping[str, Workload], *, rounds: int = 5, warmup: int = 1) -> dict[str, Timing]:
    """Time every workload ``rounds`` times, round-robin, after ``warmup`` untimed rounds.

    The order rotates each round, so no candidate always follows the same one.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"measure(): rounds must be >= 1 and warmup >= 0 (got rounds={rounds}, warmup={warmup})")
    names = list(workloads)
    results: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        shift = index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            per_unit = _time_once(workloads[name])
            if index >= warmup:
                results[name].append(per_unit)
    return {name: Timing(name, tuple(values)) for name, values in results.items()}


def python_calls_per_unit(workload: Workload) -> float:
    """Python-level calls (builtins included) per unit of one ``run``, counted by cProfile.

    A proxy for host work that no noise moves: two loops whose times differ by less than
    a busy machine's jitter still differ exactly in this count. It says nothing about the
    cost of each call, so it sits next to the timings, not in place of them.
    """
    state = workload.prepare()
    profile = cProfile.Profile()
    try:
        profile.enable()
        try:
            workload.run(state)
        finally:
            profile.disable()
    finally:
        if workload.cleanup is not None:
            workload.cleanup(state)
    return pstats.Stats(profile).total_calls / (workload.repeats * workload.units)  # type: ignore[attr-defined]


def peak_device_memory(workload: Workload, device: torch.device) -> int | None:
    """Bytes of CUDA memory a ``run`` allocates at its peak above what was allocated when it began (the model,
    its optimizer and the batches, made by ``prepare``); None off CUDA, where torch keeps no such count.

    Two loops doing the same work differ here only by what one of them keeps alive longer: a loop that
    holds a micro-batch's outputs through the next forward shows them once more at its peak.
    """
    if device.type != "cuda":
        return None
    state = workload.prepare()
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        workload.run(state)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    finally:
        if workload.cleanup is not None:
            workload.cleanup(state)


# -- no-op plugins ----------------------------------------------------------------------------------


def _noop(self: object, ctx: Any) -> None:
    return None


_NoopObserver = type(
    "NoopObserver",
    (),
    {
        "__doc__": "Implements every stage an observer may, doing nothing: the cost of dispatch alone.",
        "__slots__": (),
        **{stage.hook_name: hookimpl(_noop) for stage in OBSERVER_STAGES},
    },
)


def noop_observer() -> object:
    """A fresh plugin with a no-op implementation of each of the 16 observer stages."""
    return _NoopObserver()


class NoopUpdateHook(TrainingUpdateHook):
    """An update hook on all four update stages that proceeds and passes the loss through."""

    plugin_name = "noop_update"
    vetoes = frozenset()
    uses_gradients = False


class _InertLoss(torch.Tensor):
    """A scalar whose ``backward()`` does nothing: the update path timed without autograd."""

    def backward(self, *args: Any, **kwargs: Any) -> None:
        return None


def inert_loss() -> torch.Tensor:
    return torch.Tensor._make_subclass(_InertLoss, torch.zeros(()))


# -- dispatch sweeps ----------------------------------------------------------------------------------


def _sweep_nvtrain(callers: tuple[Callable[[Any], Any], ...], ctx: Any) -> Callable[[Any], None]:
    def sweep(_: Any) -> None:
        for caller in callers:
            caller(ctx)

    return sweep


def _sweep_pluggy(callers: tuple[Any, ...], ctx: Any) -> Callable[[Any], None]:
    def sweep(_: Any) -> None:
        for caller in callers:
            caller(ctx=ctx)

    return sweep


def _bound_implementations(bus: HookBus, stages: Sequence[TrainingStage]) -> tuple[Callable[[Any], Any], ...]:
    return tuple(impl.function for stage in stages for impl in bus.implementations(stage))


def dispatch_workloads(observers: int, *, repeats: int = 2000) -> dict[str, Workload]:
    """One sweep of all 18 stages with ``observers`` no-op observers on each of the 16 observer stages.

    ``nvtrain``: the bus's compiled stage callers; ``pluggy``: the same plugins'
    pluggy hook callers, called directly; ``plain``: a Python loop over the same
    bound implementations (the floor: calling them at all). Stage callers are
    looked up once, as the loop does through the bus's slots.
    """
    bus = HookBus(trace=False)
    for _ in range(observers):
        bus.register(noop_observer())
    ctx = TrainingContext()
    names = [stage.hook_name for stage in TrainingStage]
    nvtrain_callers = tuple(getattr(bus, name) for name in names)
    pluggy_callers = tuple(getattr(bus.pluggy.hook, name) for name in names)
    functions = _bound_implementations(bus, list(TrainingStage))
    plain = functools.partial(_plain_loop, functions, ctx)
    return {
        "nvtrain": Workload(_sweep_nvtrain(nvtrain_callers, ctx), repeats=repeats),
        "pluggy": Workload(_sweep_pluggy(pluggy_callers, ctx), repeats=repeats),
        "plain": Workload(plain, repeats=repeats),
    }


def _plain_loop(functions: tuple[Callable[[Any], Any], ...], ctx: Any, _: Any) -> None:
    for function in functions:
        function(ctx)


def update_path_workloads(update_hooks: int, *, repeats: int = 2000) -> dict[str, Workload]:
    """The four update stages through the orchestrator with ``update_hooks`` no-op update hooks.

    No optimizer is bound and the loss is :func:`inert_loss`, so what is timed is
    the dispatch: ``nvtrain`` (the bus), ``pluggy`` (the orchestrator's hook
    implementations through pluggy) and ``plain`` (a loop calling each update hook
    on each of its stages, the floor).
    """
    hooks = [NoopUpdateHook() for _ in range(update_hooks)]
    orchestrator = TrainingUpdateOrchestrator(hooks)
    orchestrator.bind({}, {})
    bus = HookBus(trace=False)
    bus.register(orchestrator, TrainingUpdateOrchestrator.plugin_name)
    ctx = TrainingContext()
    ctx.loss = inert_loss()
    names = [stage.hook_name for stage in _UPDATE_ORDER]
    nvtrain_callers = tuple(getattr(bus, name) for name in names)
    pluggy_callers = tuple(getattr(bus.pluggy.hook, name) for name in names)
    calls = tuple((hook, stage) for stage in _UPDATE_ORDER for hook in orchestrator.hooks_for(stage))

    def plain(_: Any) -> None:
        for hook, stage in calls:
            hook(ctx, stage, False)

    return {
        "nvtrain": Workload(_sweep_nvtrain(nvtrain_callers, ctx), repeats=repeats),
        "pluggy": Workload(_sweep_pluggy(pluggy_callers, ctx), repeats=repeats),
        "plain": Workload(plain, repeats=repeats),
    }


# -- training loops ----------------------------------------------------------------------------------


@attrs.frozen
class MLPSpec:
    """A two-layer MLP ``inputs -> hidden -> outputs`` (ReLU) trained with SGD on random batches."""

    inputs: int = attrs.field(validator=_positive_int)
    hidden: int = attrs.field(validator=_positive_int)
    outputs: int = attrs.field(validator=_positive_int)
    batch: int = attrs.field(validator=_positive_int)

    @property
    def label(self) -> str:
        return f"{self.inputs}->{self.hidden}->{self.outputs}, batch {self.batch}"


TINY_MLP = MLPSpec(32, 64, 1, 8)
LARGE_MLP = MLPSpec(512, 2048, 512, 64)


def make_model(spec: MLPSpec, *, seed: int = 0, device: torch.device | str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(spec.inputs, spec.hidden), torch.nn.ReLU(), torch.nn.Linear(spec.hidden, spec.outputs)
    )
    return model.to(device)


def make_batches(
    spec: MLPSpec, steps: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(spec.batch, spec.inputs, generator=generator).to(device),
            torch.randn(spec.batch, spec.outputs, generator=generator).to(device),
        )
        for _ in range(steps)
    ]


class StampedBatches(Sequence[Any]):
    """Batches that stamp ``perf_counter_ns`` as each one is handed out, for per-step times.

    A hand-written loop and ``TrainingStrategy.run()`` read the same object, so each
    step is timed the same way: from one hand-out to the next (the step's own work,
    the loop's and, for the strategy, the step scheduler's). The first interval of
    each pass is dropped. Indexing (the warm-up step) stamps nothing. On a busy
    machine single steps are the least disturbed samples there are: their low
    percentiles move far less with the load than whole-run times.
    """

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches
        self.intervals: list[int] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: Any) -> Any:  # an int, or a slice for the warm-up batches
        return self.batches[index]

    def __iter__(self) -> Iterator[Any]:
        clock, intervals = time.perf_counter_ns, self.intervals
        previous = None
        for index, batch in enumerate(self.batches):
            now = clock()
            if index >= 2:
                intervals.append(now - previous)  # type: ignore[operator]
            previous = now
            yield batch

    def step_figures(self) -> dict[str, float]:
        """Median, 10th percentile and min of the recorded steps, in nanoseconds."""
        if not self.intervals:
            raise ValueError("StampedBatches: no step was timed (a pass needs at least 3 batches)")
        ordered = sorted(self.intervals)
        return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10], "min": ordered[0]}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


#: Builds the body of a hand-written loop for a fresh model and optimizer:
#: ``make(model, optimizer) -> step(inputs, targets, step_number)``.
StepFactory = Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[Any, Any, int], None]]


def _mlp_strategy(spec: MLPSpec, hooks: Sequence[object], device: torch.device | str) -> TrainingStrategy:
    """The strategy every nvtrain workload times: the MLP, SGD, MSE, one epoch, ``hooks``.

    Its runs catch no signal (``preemption_signal=None``; otherwise the strategy's defaults): a time
    limit's SIGTERM ends the benchmark, rather than stopping one run early that is then timed as whole.
    """
    return TrainingStrategy(
        models=make_model(spec, device=device),
        optimizers=_sgd,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        num_epochs=1,
        device=device,
        step_scheduler=attrs.evolve(IMPLIED_STEP_SCHEDULER, preemption_signal=None),
    )


def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Any, Any, int], None]:
    """The hand-written step every loop figure is compared with: zero, forward, loss, backward, step."""
    mse_loss = torch.nn.functional.mse_loss

    def step(inputs: Any, targets: Any, number: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

    return step


def hand_written_workload(
    spec: MLPSpec,
    batches: Sequence[Any],
    *,
    make_step: StepFactory = bare_step,
    device: torch.device | str = "cpu",
) -> Workload:
    """A hand-written loop over ``batches`` on a fresh model and SGD, after one untimed warm-up step.

    ``make_step(model, optimizer)`` builds the loop body (see :data:`StepFactory`);
    step numbers start at 2, the warm-up step being 1, as in :func:`strategy_workload`.
    """
    device = torch.device(device)

    def prepare() -> Callable[[Any, Any, int], None]:
        model = make_model(spec, device=device)
        step = make_step(model, _sgd(model.parameters()))
        inputs, targets = batches[0]
        step(inputs, targets, 1)
        return step

    def run(step: Callable[[Any, Any, int], None]) -> None:
        number = 2
        for inputs, targets in batches:
            step(inputs, targets, number)
            number += 1

    return Workload(run, prepare, units=len(batches), synchronize=device if device.type == "cuda" else None)


def strategy_workload(
    spec: MLPSpec,
    batches: Sequence[Any],
    hooks: Callable[[], Sequence[object]] = tuple,
    *,
    device: torch.device | str = "cpu",
) -> Workload:
    """``TrainingStrategy.run(batches)`` (one epoch) with fresh ``hooks()`` on a fresh model.

    The strategy is built and set up (one warm-up ``train_batch``) before timing, as
    the hand-written loop builds its optimizer and takes a warm-up step; the timed
    region is ``run()``: every step plus the run's own start and end (the step
    scheduler, BEFORE_/AFTER_TRAINING), which over a few hundred steps is a small share.
    """
    device = torch.device(device)

    def prepare() -> TrainingStrategy:
        strategy = _mlp_strategy(spec, hooks(), device)
        strategy.train_batch(batches[0])
        return strategy

    def run(strategy: TrainingStrategy) -> None:
        strategy.run(batches)

    return Workload(
        run,
        prepare,
        units=len(batches),
        cleanup=TrainingStrategy.close,
        synchronize=device if device.type == "cuda" else None,
    )


def compare_loops(
    workloads: Mapping[str, Callable[[StampedBatches], Workload]],
    batches: Sequence[Any],
    *,
    rounds: int,
    warmup: int = 1,
) -> dict[str, Any]:
    """Per-step times of several loops over the same batches, measured round-robin.

    ``workloads`` maps a name to a function building the workload from a
    :class:`StampedBatches`; the first entry is the baseline of the ratios. For each
    loop: whole-run time per step (median and min over rounds) and single-step
    times (median, 10th percentile, min over every step of every round). Returns
    a JSON-ready dict.
    """
    stamped = {name: StampedBatches(batches) for name in workloads}
    timings = measure({name: build(stamped[name]) for name, build in workloads.items()}, rounds=rounds, warmup=warmup)
    for batches_of_one in stamped.values():  # drop the warm-up rounds' steps
        per_round = len(batches_of_one.intervals) // (rounds + warmup)
        del batches_of_one.intervals[: per_round * warmup]
    loops = {
        name: {
            "run_us": {"median": timings[name].median / 1e3, "min": timings[name].min / 1e3},
            "step_us": {key: ns / 1e3 for key, ns in stamped[name].step_figures().items()},
        }
        for name in workloads
    }
    base = loops[next(iter(workloads))]
    ratios = {
        name: {
            "run_median": figures["run_us"]["median"] / base["run_us"]["median"],
            "run_min": figures["run_us"]["min"] / base["run_us"]["min"],
            "step_median": figures["step_us"]["median"] / base["step_us"]["median"],
            "step_p10": figures["step_us"]["p10"] / base["step_us"]["p10"],
        }
        for name, figures in loops.items()
    }
    baseline = next(iter(workloads))
    return {"baseline": baseline, "steps": len(batches), "rounds": rounds, "loops": loops, "ratios": ratios}
