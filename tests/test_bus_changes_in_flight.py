"""Hooks taken off the bus while the loop runs: mid-batch, mid-run, or before ``train_batch()``.

An update hook unregistered during a batch leaves it at once (its ``abort_batch()`` closes what it
opened, an autocast region); the replacement slots without an owner raise when called (compiled in,
so ``train_batch()`` and a run that lost the orchestrator midway are refused, not silently stepless);
the accumulating hook cannot leave a run whose windows span several micro-batches; and the advice for
putting the orchestrator back works when its name is blocked or an update hook changed it since.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import TrainingStage, TrainingUpdateHook
from nvtrain.hooks import GradientAccumulationHook

S = TrainingStage
ORCHESTRATOR = "nvtrain.orchestrator"


class Region(TrainingUpdateHook):
    """Opens bf16 CPU autocast at BEFORE_BATCH and leaves it at DO_BACKWARD, as a mixed-precision hook does."""

    uses_gradients = False
    vetoes = frozenset()
    stages = frozenset({S.BEFORE_BATCH, S.DO_BACKWARD})

    def __init__(self, fail_abort: bool = False) -> None:
        self.region: Any = None
        self.aborts = 0
        self.fail_abort = fail_abort

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage is S.BEFORE_BATCH:
            self.region = torch.autocast("cpu", dtype=torch.bfloat16)
            self.region.__enter__()
        elif stage is S.DO_BACKWARD:
            self._leave()
        return True, ctx.loss

    def abort_batch(self) -> None:
        self.aborts += 1
        if self.fail_abort:
            raise RuntimeError("cannot leave")
        self._leave()

    def _leave(self) -> None:
        if self.region is not None:
            region, self.region = self.region, None
            region.__exit__(None, None, None)


class RemoveAt:
    """Unregisters ``hook`` through pluggy at ``stage`` of micro-batch ``batch`` (counted from 0)."""

    def __init__(self, strategy: nvtrain.TrainingStrategy, hook: object, batch: int) -> None:
        self.strategy, self.hook, self.batch = strategy, hook, batch
        self.autocast_at_removal: bool | None = None

    @nvtrain.hookimpl
    def after_forward(self, ctx: Any) -> None:
        if ctx.batch_count == self.batch and self.strategy.bus.pluggy.is_registered(self.hook):
            self.strategy.bus.pluggy.unregister(self.hook)
            self.autocast_at_removal = torch.is_autocast_enabled("cpu")


def weights(strategy: nvtrain.TrainingStrategy) -> torch.Tensor:
    return strategy.ctx.models["main"].weight.detach().clone()


# -- gap 1: an update hook unregistered mid-batch leaves the batch ----------------------------------------


@pytest.mark.parametrize("how", ["run", "train_batch"])
def test_an_update_hook_unregistered_mid_batch_closes_its_open_region(
    make_strategy: Any, batches: Any, how: str
) -> None:
    region = Region()
    strategy = make_strategy([region], max_steps=3)
    remover = RemoveAt(strategy, region, batch=1)
    strategy.register_hook(remover)
    with strategy:
        if how == "run":
            assert strategy.run(batches(3)).step_count == 3  # the rest of the run trains without it
        else:
            for batch in batches(3):
                strategy.train_batch(batch)
        assert remover.autocast_at_removal is False  # left at once: the forward's region is closed
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.float32  # the caller's code: full precision
    assert region.aborts == 1
    assert strategy.update_hooks() == ()


def test_a_mixed_precision_hook_unregistered_mid_batch_leaks_no_autocast(make_strategy: Any, batches: Any) -> None:
    amp = pytest.importorskip("nvtrain_amp")
    hook = amp.MixedPrecisionHook(precision=torch.bfloat16)
    strategy = make_strategy([hook], max_steps=3)
    remover = RemoveAt(strategy, hook, batch=1)
    strategy.register_hook(remover)
    with strategy:
        strategy.run(batches(3))
        assert remover.autocast_at_removal is False
        assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_an_update_hook_whose_abort_fails_stays_registered(make_strategy: Any) -> None:
    region = Region(fail_abort=True)
    strategy = make_strategy([region])
    name = strategy.bus.pluggy.get_name(region)
    with pytest.raises(
        RuntimeError, match=r"^update hook Region was not unregistered: .*abort_batch\(\) raised"
    ) as caught:
        strategy.bus.pluggy.unregister(region)
    assert "\n" not in str(caught.value)
    assert strategy.bus.pluggy.get_plugin(name) is region and strategy.update_hooks() == (region,)


# -- gap 2: replacement slots without an owner raise when called ----------------------------------------


class UnregisterOrchestratorAfter:
    def __init__(self, strategy: nvtrain.TrainingStrategy, batches: int) -> None:
        self.strategy, self.batches = strategy, batches

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        if ctx.batch_count == self.batches:
            self.strategy.bus.pluggy.unregister(name=ORCHESTRATOR)


def test_a_run_that_loses_the_orchestrator_midway_raises_instead_of_counting_empty_steps(
    make_strategy: Any, batches: Any
) -> None:
    strategy = make_strategy(max_steps=6)
    strategy.register_hook(UnregisterOrchestratorAfter(strategy, 2))
    with pytest.raises(RuntimeError) as caught:
        strategy.run(batches(6))
    message = str(caught.value)
    assert message.startswith("stage DO_BACKWARD: no plugin owns DO_BACKWARD and DO_OPTIMIZER_STEP")
    assert "strategy.bus.pluggy.register" in message and "\n" not in message
    assert strategy.ctx.step_count == 2


def test_train_batch_without_the_orchestrator_raises_and_changes_nothing(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy()
    orchestrator = strategy.bus.pluggy.unregister(name=ORCHESTRATOR)
    before = weights(strategy)
    with pytest.raises(RuntimeError, match=r"^stage DO_BACKWARD: no plugin owns DO_BACKWARD and DO_OPTIMIZER_STEP"):
        strategy.train_batch(batches(1)[0])
    assert torch.equal(before, weights(strategy)) and strategy.ctx.step_count == 0
    strategy.bus.pluggy.register(orchestrator)
    strategy.train_batch(batches(1)[0])
    assert strategy.ctx.step_count == 1 and not torch.equal(before, weights(strategy))


def test_a_wrapper_alone_does_not_own_a_slot(make_strategy: Any, batches: Any) -> None:
    class Owner:
        @nvtrain.hookimpl
        def do_backward(self, ctx: Any) -> None:
            ctx.loss.backward()

    class WrapsTheStep:
        @nvtrain.hookimpl(wrapper=True)
        def do_optimizer_step(self, ctx: Any) -> Any:
            return (yield)

    strategy = make_strategy()
    strategy.bus.pluggy.unregister(name=ORCHESTRATOR)
    strategy.bus.pluggy.register(Owner())
    strategy.bus.pluggy.register(WrapsTheStep())
    with pytest.raises(RuntimeError, match=r"^stage DO_OPTIMIZER_STEP: no plugin owns DO_OPTIMIZER_STEP, "):
        strategy.train_batch(batches(1)[0])


def test_an_owned_slot_is_still_the_owner_itself_no_cost_per_call(make_strategy: Any) -> None:
    strategy = make_strategy()
    assert strategy.bus.do_backward == strategy.orchestrator.do_backward
    assert strategy.bus.do_optimizer_step == strategy.orchestrator.do_optimizer_step


# -- gap 3: the accumulating hook cannot leave a run's windows --------------------------------------------


def test_the_accumulating_hook_cannot_leave_a_run_in_progress(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(step_scheduler=nvtrain.StepSchedulerConfig(global_batch_size=8))
    refusals: list[str] = []

    class Remover:
        @nvtrain.hookimpl
        def after_optimizer_step(self, ctx: Any) -> None:
            if ctx.batch_count == 2:
                (accumulate,) = [h for h in strategy.update_hooks() if isinstance(h, GradientAccumulationHook)]
                try:
                    strategy.bus.pluggy.unregister(accumulate)
                except RuntimeError as err:
                    refusals.append(str(err))

    strategy.register_hook(Remover())
    result = strategy.run(batches(8))
    assert result.step_count == 1 == strategy.ctx.scheduler.step  # one window of 8, one step
    (message,) = refusals
    assert message.startswith("update hook SchedulerAccumulationHook ('accumulate') cannot be unregistered while run()")
    assert "windows of 8 micro-batches" in message and "\n" not in message
    (accumulate,) = [h for h in strategy.update_hooks() if isinstance(h, GradientAccumulationHook)]
    strategy.bus.pluggy.unregister(accumulate)  # after the run it may leave
    assert strategy.update_hooks() == ()


# -- gap 6: the advice for putting the orchestrator back works -------------------------------------------


def test_a_blocked_orchestrator_name_is_named_with_the_way_out(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(max_steps=1)
    strategy.bus.pluggy.set_blocked(ORCHESTRATOR)
    with pytest.raises(RuntimeError) as caught:
        strategy.run(batches(1))
    message = str(caught.value)
    assert "'nvtrain.orchestrator' is blocked on this bus" in message
    assert "strategy.bus.pluggy.unblock('nvtrain.orchestrator'), then register strategy.orchestrator back" in message
    assert strategy.bus.pluggy.unblock(ORCHESTRATOR)  # as the message says
    assert strategy.bus.pluggy.register(strategy.orchestrator) == ORCHESTRATOR
    assert strategy.run(batches(1)).step_count == 1


def test_a_stale_orchestrator_is_refused_pointing_to_the_current_one(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(max_steps=1)
    stale = strategy.bus.pluggy.unregister(name=ORCHESTRATOR)
    strategy.register_hook(GradientAccumulationHook(steps=1))  # builds a new orchestrator
    with pytest.raises(ValueError) as caught:
        strategy.bus.pluggy.register(stale)
    message = str(caught.value)
    assert "is not this strategy's current orchestrator" in message
    assert "strategy.bus.pluggy.register(strategy.orchestrator)" in message and "\n" not in message
    assert strategy.bus.pluggy.register(strategy.orchestrator) == ORCHESTRATOR
    assert strategy.run(batches(1)).step_count == 1
