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
