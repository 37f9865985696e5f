"""Update hooks when something fails: a batch that raises (``abort_batch``), and compositions refused by kind."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import TrainingStage, TrainingUpdateHook
from nvtrain.hooks import GradientAccumulationHook, SpikeSkipHook

S = TrainingStage


class Boom(Exception):
    pass


class OpensARegion(TrainingUpdateHook):
    """Opens a per-batch region at BEFORE_BATCH, closes it at DO_BACKWARD; logs aborts into ``log``."""

    uses_gradients = False
    vetoes = frozenset()

    def __init__(self, label: str, log: list[str], priority: int = 50, fail: bool = False) -> None:
        self.label, self.log, self.priority, self.fail = label, log, priority, fail
        self.open = False

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage is S.BEFORE_BATCH:
            self.open = True
        elif stage is S.DO_BACKWARD:
            self.open = False
        return True, ctx.loss

    def abort_batch(self) -> None:
        self.log.append(self.label)
        self.open = False
        if self.fail:
            raise RuntimeError(f"{self.label} could not abort")


def failing_forward(on_batch: int) -> Any:
    """A forward that raises once, on micro-batch ``on_batch`` (a failed batch does not advance the count)."""
    failed = []

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        if ctx.batch_count == on_batch and not failed:
            failed.append(True)
            raise Boom("forward failed")
        return ctx.models["main"](ctx.batch[0])

    return forward


def test_a_failed_train_batch_aborts_every_update_hook_in_reverse_call_order(make_strategy: Any, batches: Any) -> None:
    log: list[str] = []
    hooks = [OpensARegion("p60", log, 60), OpensARegion("p10", log, 10), OpensARegion("p30", log, 30)]
    strategy = make_strategy(hooks, forward_fn=failing_forward(0))
    with pytest.raises(Boom):
        strategy.train_batch(batches(1)[0])
    assert log == ["p60", "p30", "p10"]
    assert not any(hook.open for hook in hooks)
    strategy.train_batch(batches(1)[0])  # the hooks stay usable: the strategy trains on
    assert strategy.ctx.step_count == 1 and log == ["p60", "p30", "p10"]  # no abort when nothing raises


def test_a_failed_run_aborts_the_update_hooks_before_the_caller_sees_the_exception(
    make_strategy: Any, batches: Any
) -> None:
    log: list[str] = []
    hook = OpensARegion("only", log)
    strategy = make_strategy([hook], forward_fn=failing_forward(1), num_epochs=1)
    with pytest.raises(Boom):
        strategy.run(batches(3))
    assert log == ["only"] and not hook.open
    assert strategy.ctx.step_count == 1


def test_an_abort_that_fails_is_a_note_on_the_batchs_exception(make_strategy: Any, batches: Any) -> None:
    log: list[str] = []
    hooks = [OpensARegion("first", log, 10), OpensARegion("broken", log, 20, fail=True)]
    strategy = make_strategy(hooks, forward_fn=failing_forward(0))
    with pytest.raises(Boom) as caught:
        strategy.train_batch(batches(1)[0])
    assert log == ["broken", "first"]  # the failure did not stop the others
    assert caught.value.__notes__ == [
        "while aborting the failed batch, update hook OpensARegion.abort_batch() raised RuntimeError: "
        "broken could not abort"
    ]


def test_an_update_hook_aborts_nothing_by_default() -> None:
    assert TrainingUpdateHook().abort_batch() is None


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: GradientAccumulationHook(steps=2), "gradient-accumulation"),
        (SpikeSkipHook, "spike-skip"),
    ],
)
def test_two_hooks_of_one_exclusive_kind_are_refused_naming_that_kind(make_strategy: Any, make: Any, kind: str) -> None:
    with pytest.raises(ValueError, match=rf"exclusive key '\w+': at most one {kind} hook per strategy$"):
        make_strategy([make(), make()])


# -- a failure after the optimizers stepped ---------------------------------------------------------


class FailsAfterTheStep:
    """A DO_OPTIMIZER_STEP wrapper that raises once after its ``yield`` (the optimizers have stepped)."""

    def __init__(self, on_batch: int, before: bool = False) -> None:
        self.on_batch, self.before, self.fired = on_batch, before, False

    @nvtrain.hookimpl(wrapper=True)
    def do_optimizer_step(self, ctx: nvtrain.TrainingContext) -> Any:
        fire = ctx.batch_count == self.on_batch and not self.fired
        if fire and self.before:
            self.fired = True
            raise Boom("before the step")
        result = yield
        if fire:
            self.fired = True
            raise Boom("after the step")
        return result


def _retried_run(failing: FailsAfterTheStep | None, accumulate: int) -> nvtrain.TrainingStrategy:
    """Six micro-batches with a StepLR halving the rate every step; a failure is followed by a second run()."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    hooks: list[object] = [GradientAccumulationHook(steps=accumulate)] if accumulate > 1 else []
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 1),
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lr_schedulers=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        num_epochs=1,
        hooks=[*hooks, *([failing] if failing is not None else [])],
    )
    with strategy:
        try:
            strategy.run(data)
        except Boom:
            assert failing is not None
            strategy.run(data)
    return strategy


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("before", [False, True], ids=["after the step", "before the step"])
def test_a_second_run_after_a_step_that_raised_takes_each_step_once(accumulate: int, before: bool) -> None:
    """A wrapper raising after its ``yield`` leaves a step that happened: it is counted, and the window is not
    replayed (its LR step and momentum applied twice); raising before the step replays the window whole."""
    straight = _retried_run(None, accumulate)
    retried = _retried_run(FailsAfterTheStep(on_batch=3, before=before), accumulate)
    assert retried.ctx.step_count == straight.ctx.step_count == 6 // accumulate
    # a replayed window runs its earlier micro-batches again; batch_count counts each of the data's once
    assert (straight.ctx.batch_count, retried.ctx.batch_count) == (6, 6)
    lr = straight.ctx.optimizers["main"].param_groups[0]["lr"]
    assert retried.ctx.optimizers["main"].param_groups[0]["lr"] == lr == 0.1 * 0.5 ** (6 // accumulate)
    for name, param in straight.ctx.models["main"].named_parameters():
        assert torch.equal(param, dict(retried.ctx.models["main"].named_parameters())[name]), name


def test_a_step_that_raised_after_stepping_in_train_batch_is_counted() -> None:
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 1),
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        hooks=[FailsAfterTheStep(on_batch=0)],
    )
    batch = (torch.randn(4, 3), torch.randn(4, 1))
    before = strategy.ctx.models["main"].weight.detach().clone()
    with pytest.raises(Boom, match="after the step"):
        strategy.train_batch(batch)
    assert not torch.equal(before, strategy.ctx.models["main"].weight)  # the step happened
    assert (strategy.ctx.step_count, strategy.ctx.batch_count, strategy.ctx.step_skipped) == (1, 1, False)
