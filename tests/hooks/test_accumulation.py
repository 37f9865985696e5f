"""GradientAccumulationHook: K micro-batches of size b train exactly like one batch of size K*b."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import GradientAccumulationHook
from nvtrain.stages import TrainingStage

Batch = tuple[torch.Tensor, torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

# float64 keeps the only difference (the order of floating-point sums) far below these tolerances
RTOL, ATOL = 1e-9, 1e-12

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.01),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def make_batches(count: int, size: int = 4, seed: int = 1) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 3, generator=generator, dtype=torch.float64),
            torch.randn(size, 2, generator=generator, dtype=torch.float64),
        )
        for _ in range(count)
    ]


def big_batch_reference(
    model: torch.nn.Module, factory: OptimizerFactory, windows: Sequence[Sequence[Batch]]
) -> list[torch.Tensor]:
    """Plain torch: one step per window on the concatenated batch; returns the final parameters."""
    model = copy.deepcopy(model)
    optimizer = factory(list(model.parameters()))
    for window in windows:
        optimizer.zero_grad(set_to_none=True)
        inputs = torch.cat([x for x, _ in window])
        targets = torch.cat([y for _, y in window])
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def make_strategy(hooks: Sequence[object], factory: OptimizerFactory, **fields: Any) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=make_model(),
        optimizers=factory,
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
        **fields,
    )


def assert_params_close(strategy: nvtrain.TrainingStrategy, expected: list[torch.Tensor]) -> None:
    got = list(strategy.ctx.models["main"].parameters())
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.detach(), e, rtol=RTOL, atol=ATOL)


class WindowRecorder:
    """Records the window fields and the back-propagated loss of every micro-batch."""

    priority = 90

    def __init__(self) -> None:
        self.windows: list[tuple[int, int, bool]] = []
        self.scales: list[float] = []

    @nvtrain.hookimpl
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        self.windows.append((ctx.window_size, ctx.window_position, ctx.sync_gradients))

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        self.scales.append((ctx.backward_loss / ctx.loss).item())  # type: ignore[operator]


class SchedulerStandIn:
    """Plays the step scheduler's part: marks the context windowed and sets the window fields."""

    priority = 0

    def __init__(self, sizes: Sequence[int]) -> None:
        self._plan: Iterator[tuple[int, int]] = iter([(size, pos) for size in sizes for pos in range(size)])

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        size, position = next(self._plan)
        ctx.windowed = True
        ctx.window_size, ctx.window_position, ctx.sync_gradients = size, position, position == size - 1


class UnsizedLoader:
    """Re-iterable batches without ``__len__``: the epoch length is unknown."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1, 2.0, "2", True])
def test_steps_must_be_a_positive_int(steps: Any) -> None:
    with pytest.raises(ValueError, match=r"GradientAccumulationHook\.steps must be an int >= 1"):
        GradientAccumulationHook(steps=steps)


def test_declares_only_the_stages_it_uses() -> None:
    hook = GradientAccumulationHook(steps=2)
    assert hook.priority == 10
    assert hook.plugin_name == "accumulate"
    assert hook.steps == 2
    assert hook.stages == {TrainingStage.BEFORE_BATCH, TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP}


# -- equivalence with big batches ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_train_batch_windows_equal_big_batches(name: str) -> None:
    factory = OPTIMIZERS[name]
    batches = make_batches(9)
    strategy = make_strategy([GradientAccumulationHook(steps=3)], factory)
    steps_seen = []
    for batch in batches:
        strategy.train_batch(batch)
        steps_seen.append(strategy.ctx.step_count)
    assert steps_seen == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    expected = big_batch_reference(make_model(), factory, [batches[0:3], batches[3:6], batches[6:9]])
    assert_params_close(strategy, expected)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_run_trailing_partial_window_is_stepped_and_scaled_by_its_size(name: str) -> None:
    factory = OPTIMIZERS[name]
    batches = make_batches(5)
    recorder = WindowRecorder()
    strategy = make_strategy([GradientAccumulationHook(steps=2), recorder], factory, num_epochs=2)
    result = strategy.run(batches)
    assert (result.step_count, result.batch_count) == (6, 10)
    epoch = [(2, 0, False), (2, 1, True), (2, 0, False), (2, 1, True), (1, 0, True)]
    assert recorder.windows == epoch * 2
    assert recorder.scales == pytest.approx([0.5, 0.5, 0.5, 0.5, 1.0] * 2, rel=1e-12)
    windows = [batches[0:2], batches[2:4], batches[4:5]] * 2
    assert_params_close(strategy, big_batch_reference(make_model(), factory, windows))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_windows_set_by_the_scheduler_are_followed(name: str) -> None:
    # the scheduler, not the hook's own count, decides: windows of 3, 1 and 2 micro-batches
    factory = OPTIMIZERS[name]
    batches = make_batches(6)
    hook = GradientAccumulationHook(steps=3)
    recorder = WindowRecorder()
    strategy = make_strategy([hook, SchedulerStandIn([3, 1, 2]), recorder], factory)
    steps_seen = []
    for batch in batches:
        strategy.train_batch(batch)
        steps_seen.append(strategy.ctx.step_count)
    assert steps_seen == [0, 0, 1, 2, 2, 3]
    assert recorder.scales == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0, 0.5, 0.5], rel=1e-12)
    assert hook.state_dict()["position"] == 0  # its own counter stayed idle
    expected = big_batch_reference(make_model(), factory, [batches[0:3], batches[3:4], batches[4:6]])
    assert_params_close(strategy, expected)


def test_one_step_window_changes_nothing() -> None:
    batches = make_batches(3)
    factory = OPTIMIZERS["sgd"]
    strategy = make_strategy([GradientAccumulationHook(steps=1)], factory)
    for batch in batches:
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 3
    assert_params_close(strategy, big_batch_reference(make_model(), factory, [[b] for b in batches]))


# -- what it publishes and vetoes ----------------------------------------------------------------


def test_standalone_publishes_sync_gradients_and_vetoes_zeroing() -> None:
    strategy = make_strategy([GradientAccumulationHook(steps=2)], OPTIMIZERS["sgd"])
    recorder = WindowRecorder()
    strategy.register_hook(recorder)
    batch = make_batches(1)[0]
    grads = []
    for _ in range(4):
        strategy.train_batch(batch)
        grads.append(strategy.ctx.models["main"][0].bias.grad.clone())
    assert recorder.windows == [(2, 0, False), (2, 1, True)] * 2
    # the second micro-batch of a window adds to the first one's gradient instead of replacing it
    torch.testing.assert_close(grads[1], 2 * grads[0], rtol=RTOL, atol=ATOL)


def test_run_follows_the_scheduler_windows_of_an_unsized_loader() -> None:
    batches = make_batches(3)
    factory = OPTIMIZERS["sgd"]
    recorder = WindowRecorder()
    strategy = make_strategy([GradientAccumulationHook(steps=2), recorder], factory)
    result = strategy.run(UnsizedLoader(batches))
    assert result.step_count == 2
    assert recorder.windows == [(2, 0, False), (2, 1, True), (1, 0, True)]
    assert_params_close(strategy, big_batch_reference(make_model(), factory, [batches[0:2], batches[2:3]]))


def test_a_standalone_window_left_open_is_dropped_when_run_starts() -> None:
    batches = make_batches(4)
    hook = GradientAccumulationHook(steps=2)
    recorder = WindowRecorder()
    strategy = make_strategy([hook, recorder], OPTIMIZERS["sgd"])
    strategy.train_batch(batches[0])  # opens a standalone window
    strategy.run(batches[1:3])
    strategy.train_batch(batches[3])  # starts a new standalone window, not the one left open
    assert recorder.windows == [(2, 0, False), (2, 0, False), (2, 1, True), (2, 0, False)]


# -- resume ---------------------------------------------------------------------------------------


def test_state_dict_resumes_the_standalone_window() -> None:
    batches = make_batches(5)
    straight_hook = GradientAccumulationHook(steps=3)
    straight, straight_rec = make_strategy([straight_hook], OPTIMIZERS["sgd"]), WindowRecorder()
    straight.register_hook(straight_rec)
    for batch in batches:
        straight.train_batch(batch)

    first_hook = GradientAccumulationHook(steps=3)
    first = make_strategy([first_hook], OPTIMIZERS["sgd"])
    for batch in batches[:4]:
        first.train_batch(batch)
    state = first_hook.state_dict()
    assert state["position"] == 1

    resumed_hook = GradientAccumulationHook(steps=3)
    resumed_hook.load_state_dict(state)
    with pytest.raises(ValueError, match="position 3 is not in a window of 3"):
        GradientAccumulationHook(steps=3).load_state_dict({"steps": 3, "position": 3})
    resumed, resumed_rec = make_strategy([resumed_hook], OPTIMIZERS["sgd"]), WindowRecorder()
    resumed.register_hook(resumed_rec)
    resumed.train_batch(batches[4])
    assert resumed_rec.windows == straight_rec.windows[4:] == [(3, 1, False)]
    assert resumed.ctx.step_skipped


def test_load_state_dict_refuses_another_window_size_inside_a_window() -> None:
    """At a window's start nothing partial is carried, so any window size takes the state."""
    GradientAccumulationHook(steps=4).load_state_dict(GradientAccumulationHook(steps=2).state_dict())
    with pytest.raises(ValueError, match="saved inside a window of steps=2, this hook has steps=4"):
        GradientAccumulationHook(steps=4).load_state_dict({"steps": 2, "position": 1})


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cut", [1, 2, 4])
def test_a_strategy_state_captured_inside_a_window_resumes_it_bitwise(optimizer: str, cut: int) -> None:
    """The window's gradients so far are part of the state: the resumed run adds the rest to them."""
    batches = make_batches(6)
    straight = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS[optimizer])
    for batch in batches:
        straight.train_batch(batch)

    first = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS[optimizer])
    for batch in batches[:cut]:
        first.train_batch(batch)
    state = copy.deepcopy(first.state_dict())
    assert ("gradients" in state) == (cut % 3 != 0)
    resumed = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS[optimizer])
    resumed.load_state_dict(state)  # before setup: applied when train_batch() sets the strategy up
    for batch in batches[cut:]:
        resumed.train_batch(batch)
    assert resumed.ctx.step_count == straight.ctx.step_count == 2
    for mine, theirs in zip(resumed.ctx.models["main"].parameters(), straight.ctx.models["main"].parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_window_state_from_several_ranks_is_refused_naming_the_window() -> None:
    strategy = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS["sgd"])
    strategy.train_batch(make_batches(1)[0])
    strategy.ctx.world_size = 2  # as under torchrun: each rank's window gradients are its own
    with pytest.raises(RuntimeError, match=r"inside an accumulation window \(micro-batch 1 of 3\) with 2 ranks"):
        strategy.state_dict()


def test_a_run_state_captured_inside_a_window_replays_the_window_and_holds_no_gradients() -> None:
    captured: list[dict[str, Any]] = []

    class Capture:
        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            if not ctx.sync_gradients:
                captured.append(ctx.strategy.state_dict())

    strategy = make_strategy([GradientAccumulationHook(steps=3), Capture()], OPTIMIZERS["sgd"])
    strategy.run(make_batches(3))
    assert len(captured) == 2 and all("gradients" not in state for state in captured)


@pytest.mark.parametrize("priority", [1, 50, 99])
def test_every_before_batch_implementation_sees_the_standalone_window(priority: int) -> None:
    seen: list[tuple[int, int, bool]] = []

    class Early:
        @nvtrain.hookimpl
        def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
            seen.append((ctx.window_size, ctx.window_position, ctx.sync_gradients))

    observer = Early()
    observer.priority = priority  # type: ignore[attr-defined]
    hook = GradientAccumulationHook(steps=3)
    strategy = make_strategy([hook, observer], OPTIMIZERS["sgd"])
    for batch in make_batches(4):
        strategy.train_batch(batch)
    assert seen == [(3, 0, False), (3, 1, False), (3, 2, True), (3, 0, False)]
    assert hook.state_dict()["position"] == 1  # each micro-batch counted once


def test_an_orchestrator_driven_by_hand_still_counts_the_standalone_window() -> None:
    hook = GradientAccumulationHook(steps=2)
    ctx = nvtrain.TrainingContext()
    positions = []
    for _ in range(3):
        hook(ctx, TrainingStage.BEFORE_BATCH, False)
        positions.append((ctx.window_position, ctx.sync_gradients))
    assert positions == [(0, False), (1, True), (0, False)]


def test_a_run_that_fails_inside_a_window_leaves_no_window_open() -> None:
    """An emergency save after the failure is a run state (the window is replayed), not an open standalone one."""

    class FailAt:
        @nvtrain.hookimpl
        def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.batch_count == 5:  # the second micro-batch of the second window of 4
                raise RuntimeError("out of memory, say")

    strategy = make_strategy([GradientAccumulationHook(steps=4), FailAt()], OPTIMIZERS["sgd"])
    with pytest.raises(RuntimeError, match="out of memory"):
        strategy.run(make_batches(8))
    ctx = strategy.ctx
    assert (ctx.window_size, ctx.window_position, ctx.sync_gradients) == (1, 0, True)
    assert "gradients" not in strategy.state_dict()
    ctx.world_size = 2  # as on a rank of a DDP job: the emergency save must not be refused
    strategy.state_dict()


def test_window_gradients_from_one_process_are_refused_on_several_ranks_before_anything_loads() -> None:
    first = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS["sgd"])
    first.train_batch(make_batches(1)[0])
    state = copy.deepcopy(first.state_dict())
    other = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS["sgd"])
    other.setup()
    before = [p.detach().clone() for p in other.ctx.models["main"].parameters()]
    other.ctx.world_size = 2
    with pytest.raises(nvtrain.errors.ResumeError, match="inside an open accumulation window, in one process"):
        other.load_state_dict(state)
    assert all(torch.equal(p, b) for p, b in zip(other.ctx.models["main"].parameters(), before, strict=True))


def test_a_held_state_that_fails_to_apply_is_kept_for_the_retry() -> None:
    first = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS["sgd"])
    for batch in make_batches(3):
        first.train_batch(batch)
    state = copy.deepcopy(first.state_dict())
    broken = {**state, "optimizers": {"main": {"state": {}, "param_groups": []}}}  # fails after the weights load
    resumed = make_strategy([GradientAccumulationHook(steps=3)], OPTIMIZERS["sgd"])
    resumed.load_state_dict(broken)
    with pytest.raises(nvtrain.errors.ResumeError):
        resumed.train_batch(make_batches(1)[0])
    with pytest.raises(nvtrain.errors.ResumeError):  # not dropped: the retry applies it again, whole
        resumed.train_batch(make_batches(1)[0])
    assert resumed.ctx.step_count == 0


def test_a_micro_batch_that_failed_before_the_orchestrator_is_not_counted_in_the_window() -> None:
    class FailOnce:
        priority = 1  # before the orchestrator's BEFORE_BATCH

        def __init__(self) -> None:
            self.failed = False

        @nvtrain.hookimpl
        def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.batch_count == 1 and not self.failed:
                self.failed = True
                raise RuntimeError("a transient failure")

    hook = GradientAccumulationHook(steps=2)
    strategy = make_strategy([hook, FailOnce()], OPTIMIZERS["sgd"])
    batches = make_batches(3)
    strategy.train_batch(batches[0])
    with pytest.raises(RuntimeError, match="transient"):
        strategy.train_batch(batches[1])
    strategy.train_batch(batches[1])  # the retry is still the window's second micro-batch
    assert strategy.ctx.step_count == 1 and hook.state_dict()["position"] == 0


def test_only_an_update_hook_sets_the_window_and_only_one_may() -> None:
    """The strategy and nvtrain train find the accumulating hook by one rule (nvtrain.hook.accumulating_hook)."""
    from nvtrain.hook import accumulating_hook

    class CountsSteps:  # an observer that happens to have the attribute: it accumulates nothing
        accumulation_steps = 4

    class Accumulates(nvtrain.TrainingUpdateHook):
        stages = frozenset({TrainingStage.DO_BACKWARD})
        accumulation_steps = 2

        def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
            return True, ctx.loss

    real = GradientAccumulationHook(steps=3)
    assert accumulating_hook([CountsSteps(), real]) is real
    assert accumulating_hook([CountsSteps()]) is None
    with pytest.raises(ValueError, match="at most one hook may accumulate gradients, got GradientAccumulationHook"):
        accumulating_hook([real, Accumulates()])
