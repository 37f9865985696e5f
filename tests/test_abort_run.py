"""``abort_run(error)``: hooks are told when ``run()`` fails, before the error propagates (nvtrain.hook.AbortsRun)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hook import AbortsRun


class Told:
    """Records each ``abort_run`` call (into a shared list, to see the order)."""

    def __init__(self, name: str, calls: list[tuple[str, BaseException]], *, fails: bool = False) -> None:
        self.name, self.calls, self.fails = name, calls, fails

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        """Any stage: the hook is a registered plugin."""

    def abort_run(self, error: BaseException) -> None:
        self.calls.append((self.name, error))
        if self.fails:
            raise OSError("disk full while writing the trace")


class RaiseAt:
    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            raise self.error


class UpdateHookTold(nvtrain.TrainingUpdateHook):
    """An update hook with ``abort_run`` is told as well."""

    stages = frozenset({nvtrain.TrainingStage.AFTER_OPTIMIZER_STEP})

    def __init__(self, calls: list[tuple[str, BaseException]]) -> None:
        self.calls = calls

    def __call__(self, ctx: Any, stage: Any, will_skip: bool) -> tuple[bool, None]:
        return True, None

    def abort_run(self, error: BaseException) -> None:
        self.calls.append(("update", error))


def _strategy(hooks: list[object]) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
    )


def _batches(count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=generator), torch.randn(2, 1, generator=generator)) for _ in range(count)]


@pytest.mark.parametrize("error", [RuntimeError("planned"), KeyboardInterrupt()])
def test_every_hook_with_abort_run_is_told_of_the_runs_error_in_reverse_order(error: BaseException) -> None:
    calls: list[tuple[str, BaseException]] = []
    hooks = [UpdateHookTold(calls), Told("first", calls), Told("second", calls), RaiseAt(2, error)]
    assert isinstance(hooks[1], AbortsRun)
    with _strategy(hooks) as strategy, pytest.raises(type(error)) as caught:
        strategy.run(_batches())
    assert caught.value is error
    assert [name for name, _ in calls] == ["second", "first", "update"]
    assert all(told is error for _, told in calls)


def test_a_failing_abort_run_becomes_a_note_and_the_others_are_still_told() -> None:
    calls: list[tuple[str, BaseException]] = []
    error = RuntimeError("planned")
    hooks = [Told("first", calls), Told("second", calls, fails=True), RaiseAt(1, error)]
    with _strategy(hooks) as strategy, pytest.raises(RuntimeError, match="planned") as caught:
        strategy.run(_batches())
    assert caught.value is error
    assert [name for name, _ in calls] == ["second", "first"]
    assert any("abort_run() failed too: OSError: disk full while writing the trace" in note for note in error.__notes__)


def test_a_run_that_ends_well_tells_nobody() -> None:
    calls: list[tuple[str, BaseException]] = []
    with _strategy([Told("only", calls)]) as strategy:
        strategy.run(_batches())
        strategy.train_batch(_batches(1)[0])
    assert calls == []


class Interrupts(Told):
    def abort_run(self, error: BaseException) -> None:
        self.calls.append((self.name, error))
        raise KeyboardInterrupt("a second Ctrl-C while writing the trace")


def test_a_ctrl_c_in_one_abort_run_lets_the_others_be_told_then_goes_on() -> None:
    calls: list[tuple[str, BaseException]] = []
    error = RuntimeError("planned")
    hooks = [Told("first", calls), Interrupts("second", calls), RaiseAt(1, error)]
    with _strategy(hooks) as strategy, pytest.raises(KeyboardInterrupt) as caught:
        strategy.run(_batches())
    assert [name for name, _ in calls] == ["second", "first"]  # the profiler behind it still stops
    assert caught.value.__cause__ is error  # the run's error stays in the report
