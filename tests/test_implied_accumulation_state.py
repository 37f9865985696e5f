"""The accumulation a ``global_batch_size`` implies saves no state: a resume on another number of ranks
(another window size, or none) has nothing to reconcile, and says nothing about it."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.hooks import GradientAccumulationHook
from nvtrain.hooks.accumulation import SchedulerAccumulationHook
from nvtrain.step_scheduler import StepSchedulerConfig
from tests.resume_helpers import GrabState


def make_strategy(hooks: list[object], max_steps: int) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        step_scheduler=StepSchedulerConfig(
            global_batch_size=16, max_steps=max_steps, ckpt_every_steps=None, validate_on_checkpoint=False
        ),
    )


def make_loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 3, generator=generator), torch.randn(64, 2, generator=generator))
    return DataLoader(data, batch_size=4)  # 4 micro-batches per step of 16


def train(max_steps: int, state: dict[str, Any] | None = None) -> tuple[nvtrain.TrainingStrategy, GrabState]:
    grab = GrabState(2)
    strategy = make_strategy([grab], max_steps)
    if state is not None:
        strategy.load_state_dict(state)
    with strategy:
        strategy.run(make_loader())
    return strategy, grab


def test_the_implied_hook_is_registered_and_saves_no_state() -> None:
    strategy, grab = train(2)
    implied = [h for h in strategy.registry.update_hooks() if isinstance(h, GradientAccumulationHook)]
    assert len(implied) == 1 and type(implied[0]) is SchedulerAccumulationHook and implied[0].steps == 4
    assert grab.state is not None and "accumulate" not in grab.state["hooks"]


@pytest.mark.parametrize("saved_steps", [2, 4])
def test_a_state_holding_an_accumulation_window_start_resumes_quietly(saved_steps: int) -> None:
    """As a checkpoint written before the implied hook kept no state (or by 2 ranks, accumulating over 2)."""
    straight, grab = train(4)
    assert grab.state is not None
    state = copy.deepcopy(grab.state)
    state["hooks"]["accumulate"] = {"steps": saved_steps, "position": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed, _ = train(4, state)
    assert torch.equal(resumed.ctx.models["main"].weight, straight.ctx.models["main"].weight)


def test_a_window_start_loads_into_any_window_size_and_a_window_middle_does_not() -> None:
    hook = GradientAccumulationHook(steps=4)
    hook.load_state_dict({"steps": 2, "position": 0})
    with pytest.raises(ValueError, match=r"saved inside a window of steps=2, this hook has steps=4"):
        hook.load_state_dict({"steps": 2, "position": 1})


def test_a_loader_given_a_batch_sampler_counts_its_batch_size() -> None:
    """DataLoader(batch_sampler=...) has batch_size None: the batch sampler's size is the micro-batch's."""
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 3, generator=generator), torch.randn(64, 2, generator=generator))
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), batch_size=4, drop_last=False)
    loader = DataLoader(data, batch_sampler=batches)
    assert loader.batch_size is None
    strategy = make_strategy([], 2)
    with strategy:
        result = strategy.run(loader)
    assert result.batch_count == 8  # 16 samples a step in micro-batches of 4: 4 per step, not 16
