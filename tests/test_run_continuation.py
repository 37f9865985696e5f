"""A second ``run()`` on the same strategy and loader continues where the last one stopped: on the epoch's
live iterator when the last run ended at a step boundary (a generator too), else by reopening the epoch
at its position; a position this run's batch configuration cannot take restarts the epoch with a warning;
``close()`` lets go of the epoch's iterator, so a loader's worker processes end at once."""

from __future__ import annotations

import functools
import multiprocessing
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nvtrain


class Numbered(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(index)), torch.zeros(2)


def numbered(count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for index in range(count):
        yield torch.full((1, 3), float(index)), torch.zeros(1, 2)


class Samples:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.batches.append([int(v) for v in ctx.batch[0][:, 0]])


def strategy(hooks: list[object], **fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        **fields,
    )


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_generator_is_continued_where_the_last_run_stopped(accumulate: int) -> None:
    """A loader without len() is read one micro-batch ahead; the next run starts with that one."""
    seen = Samples()
    hooks: list[object] = [seen]
    if accumulate > 1:
        hooks.append(nvtrain.hooks.GradientAccumulationHook(steps=accumulate))
    run = strategy(hooks, max_steps=2)
    loader = numbered(12)
    run.run(loader)
    run.max_steps = 4
    run.run(loader)
    assert seen.batches == [[i] for i in range(4 * accumulate)]


def test_a_reused_list_loader_is_continued_on_its_live_iterator() -> None:
    seen = Samples()
    run = strategy([seen], max_steps=3, num_epochs=2)
    loader = [(torch.full((1, 3), float(i)), torch.zeros(1, 2)) for i in range(5)]
    run.run(loader)
    run.max_steps = 7
    run.run(loader)
    assert seen.batches == [[0], [1], [2], [3], [4], [0], [1]]


def test_a_generator_the_last_run_cannot_hand_on_is_refused_not_skipped() -> None:
    """After close() the epoch's iterator is gone; a generator cannot be reopened at the position."""

    class FailAtThree:
        @nvtrain.hookimpl
        def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.batch_count == 2 and ctx.step_count == 2:  # inside step 3, before it closes
                raise RuntimeError("boom")

    seen = Samples()
    run = strategy([seen, FailAtThree()], max_steps=5)
    loader = numbered(12)
    with pytest.raises(RuntimeError, match="boom"):
        run.run(loader)
    with pytest.raises(RuntimeError, match=r"cannot continue epoch 1 at micro-batch 2 of a one-shot iterator"):
        run.run(loader)
    assert seen.batches == [[0], [1], [2]]


def test_another_batch_configuration_restarts_the_epoch_with_a_warning() -> None:
    seen = Samples()
    loader = DataLoader(Numbered(), batch_size=1)
    run = strategy([seen], step_scheduler=nvtrain.StepSchedulerConfig(max_steps=3, ckpt_every_steps=None))
    run.run(loader)
    run.step_scheduler = nvtrain.StepSchedulerConfig(global_batch_size=2, max_steps=5, ckpt_every_steps=None)
    with pytest.warns(
        RuntimeWarning, match=r"stopped at micro-batch 3 of epoch 1, which this run's batch .* starts again"
    ):
        run.run(loader)
    assert seen.batches == [[0], [1], [2], [0], [1], [2], [3]]


def test_close_ends_the_worker_processes_of_a_loader_the_run_left_inside_an_epoch() -> None:
    loader = DataLoader(Numbered(), batch_size=2, num_workers=1)
    seen = Samples()
    before = {child.pid for child in multiprocessing.active_children()}  # other tests' processes, if any
    with strategy([seen], max_steps=2) as run:
        run.run(loader)
        workers = [child for child in multiprocessing.active_children() if child.pid not in before]
        assert workers  # the epoch's iterator and its worker are alive
    assert not any(worker.is_alive() for worker in workers)  # gone at close(), no garbage collection needed
    with run:
        run.max_steps = 4
        run.run(loader)  # the epoch is reopened where the last run stopped
    assert seen.batches == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_persistent_loader_iterated_between_runs_is_reopened_not_adopted() -> None:
    """``iter(loader)`` resets a persistent-workers loader's one iterator: the next run must not read on
    from it as if it were where the last run left it."""
    loader = DataLoader(Numbered(), batch_size=2, num_workers=1, persistent_workers=True)
    seen = Samples()
    try:
        run = strategy([seen], max_steps=2)
        run.run(loader)
        next(iter(loader))  # somebody else reads the loader between the runs
        run.max_steps = 4
        run.run(loader)
    finally:
        loader._iterator._shutdown_workers()  # not left to the garbage collector (a 5 s join)
    assert seen.batches == [[0, 1], [2, 3], [4, 5], [6, 7]]


stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata's StatefulDataLoader")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_a_stateful_loader_iterated_between_runs_keeps_its_checkpointed_position_right() -> None:
    loader = stateful.StatefulDataLoader(Numbered(), batch_size=1)
    seen = Samples()
    run = strategy([seen], max_steps=2)
    run.run(loader)
    next(iter(loader))  # a new iterator of the loader's own: its state is no longer the run's
    run.max_steps = 4
    run.run(loader)
    assert seen.batches == [[0], [1], [2], [3]]
    state = run.ctx.scheduler.state_dict()
    assert state["position"] == 4 and state["loader"]["state"]["_num_yielded"] == 4


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_closing_after_a_failure_inside_a_step_keeps_a_stateful_loaders_position() -> None:
    """close() lets go of the iterator; the loader state it keeps is the closed windows' position, not the
    micro-batch the failed step had already read."""

    class FailOnce:
        done = False

        @nvtrain.hookimpl
        def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 2 and not self.done:
                self.done = True
                raise RuntimeError("boom")

    seen = Samples()
    loader = stateful.StatefulDataLoader(Numbered(), batch_size=1)
    run = strategy([seen, FailOnce()], max_steps=5)
    with pytest.raises(RuntimeError, match="boom"):
        run.run(loader)
    run.close()
    state = run.ctx.scheduler.state_dict()
    assert state["position"] == 2
    assert state["loader"] is None or state["loader"]["state"]["_num_yielded"] == 2
    run.run(loader)
    assert seen.batches == [[0], [1], [2], [2], [3], [4]]  # step 3 read [2], failed, and is trained again


def test_a_run_after_one_that_raised_inside_an_epoch_is_not_warned_about_its_end() -> None:
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]

    class FailsOnceInABatch:
        fired = False

        @nvtrain.hookimpl
        def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.batch_count == 1 and not self.fired:
                self.fired = True
                raise RuntimeError("transient")

    with strategy([FailsOnceInABatch()], num_epochs=2) as trainer:
        with pytest.raises(RuntimeError, match="transient"):
            trainer.run(data)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert trainer.run(data).step_count == 6
