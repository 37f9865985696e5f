"""A data position the step scheduler refuses (another global batch size) is refused before anything of the
state is loaded, and again by a retried run(), which never trains on from a half-restored strategy."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.errors import ResumeError
from nvtrain.state import COUNTERS


class Tally:
    """A checkpointable hook whose state the saved run moved on (one per micro-batch)."""

    def __init__(self) -> None:
        self.seen = torch.zeros(())

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()


def loader() -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 3, generator=generator), torch.randn(16, 2, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)  # 4 micro-batches per epoch


def make_strategy(tally: Tally, global_batch_size: int, max_steps: int | None = None) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        lr_schedulers=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[tally],
        device="cpu",
        step_scheduler=nvtrain.StepSchedulerConfig(
            num_epochs=2, max_steps=max_steps, global_batch_size=global_batch_size, preemption_signal=None
        ),
    )


def snapshot(strategy: nvtrain.TrainingStrategy, tally: Tally) -> dict[str, Any]:
    ctx = strategy.ctx
    return {
        "weights": copy.deepcopy(ctx.models["main"].state_dict()),
        "optimizer": copy.deepcopy(ctx.optimizers["main"].state_dict()),
        "lr_scheduler": copy.deepcopy(ctx.lr_schedulers["main"].state_dict()),
        "counters": {name: getattr(ctx, name) for name in COUNTERS},
        "tally": tally.seen.clone(),
    }


def assert_same(expected: Any, actual: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual)
    elif isinstance(expected, dict):
        assert set(expected) == set(actual)
        for key, value in expected.items():
            assert_same(value, actual[key])
    elif isinstance(expected, list):
        assert len(expected) == len(actual)
        for one, other in zip(expected, actual, strict=True):
            assert_same(one, other)
    else:
        assert expected == actual


def saved_state() -> dict[str, Any]:
    saving = make_strategy(Tally(), global_batch_size=4, max_steps=3)  # stops at micro-batch 3 of epoch 1
    saving.run(loader())
    return saving.state_dict()


def fresh_snapshot() -> dict[str, Any]:
    """What a strategy built as in the tests holds once set up, before any state is loaded."""
    tally = Tally()
    fresh = make_strategy(tally, global_batch_size=8)
    fresh.setup(loader())
    return snapshot(fresh, tally)


def test_a_state_whose_data_position_is_refused_loads_nothing_and_a_retried_run_refuses_it_again() -> None:
    state = saved_state()
    tally = Tally()
    strategy = make_strategy(tally, global_batch_size=8)
    strategy.load_state_dict(state)  # not set up: held, and applied whole at the run's start
    for _ in range(2):
        with pytest.raises(ResumeError, match=r"different configuration \(global_batch_size: saved 4, now 8"):
            strategy.run(loader())
        assert_same(fresh_snapshot(), snapshot(strategy, tally))


def test_a_data_position_refused_after_the_rest_was_loaded_is_refused_again_by_a_retried_run() -> None:
    """Set up when the state came, the strategy took the rest at once; only the data position waited for the run."""
    state = saved_state()
    tally = Tally()
    strategy = make_strategy(tally, global_batch_size=8)
    strategy.setup(loader())
    strategy.load_state_dict(state)
    loaded = snapshot(strategy, tally)
    for _ in range(2):
        with pytest.raises(ResumeError, match=r"different configuration \(global_batch_size: saved 4, now 8"):
            strategy.run(loader())  # never trains on without the data position
        assert_same(loaded, snapshot(strategy, tally))


def test_a_loader_with_other_generators_is_refused_before_anything_is_loaded() -> None:
    """The saved epoch's order is replayed from its RNG states, one per generator of the loader: a loader built
    with a generator= of its own (or without one) was refused only at the epoch's first window, after the
    weights, counters and hook states were loaded."""
    state = saved_state()
    tally = Tally()
    strategy = make_strategy(tally, global_batch_size=4)
    strategy.load_state_dict(state)
    with_generator = loader()
    with_generator.generator = torch.Generator().manual_seed(5)
    with pytest.raises(ResumeError, match=r"saved epoch RNG holds 0 sampler/loader generator state\(s\) but the "
                       r"dataloader has 1"):
        strategy.run(with_generator)
    assert_same(fresh_snapshot(), snapshot(strategy, tally))
