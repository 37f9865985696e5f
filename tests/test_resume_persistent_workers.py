"""Loaders with persistent workers keep one iterator for their lifetime: the first epoch's ``iter()``
draws the workers' base seed before the sampler draws the order, later epochs draw only the order.
A run resumed in a new process, or continued by a second ``run()``, must make the draws the
uninterrupted run made at that epoch, or it trains another (overlapping) sample order.
"""

from __future__ import annotations

import functools
import io
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nvtrain

SAMPLES, BATCH = 10, 3  # 4 micro-batches an epoch, the last one short


class Numbered(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(index)), torch.zeros(2)


class Samples:
    """Records the sample numbers of every micro-batch, and the strategy's state after step ``grab_at``."""

    def __init__(self, grab_at: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.grab_at, self.state = grab_at, None

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.batches.append([int(v) for v in ctx.batch[0][:, 0]])

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.grab_at and self.state is None:
            buffer = io.BytesIO()
            torch.save(ctx.strategy.state_dict(), buffer)
            buffer.seek(0)
            self.state = torch.load(buffer, weights_only=False)


#: Loaders a test made: their workers are shut down when it ends. A persistent iterator left to the garbage
#: collector (inside a dead strategy's reference cycles) waits 5 s for its worker: its queues are finalized first.
MADE: list[Any] = []


@pytest.fixture(autouse=True)
def shut_down_workers() -> Iterator[None]:
    yield
    while MADE:
        iterator = getattr(MADE.pop(), "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


def torch_loader() -> Any:
    MADE.append(DataLoader(Numbered(), batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True))
    return MADE[-1]


def stateful_loader() -> Any:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    MADE.append(
        stateful.StatefulDataLoader(Numbered(), batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True)
    )
    return MADE[-1]


LOADERS = [pytest.param(torch_loader, id="DataLoader"), pytest.param(stateful_loader, id="StatefulDataLoader")]
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


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


def uninterrupted(make_loader: Callable[[], Any], grab_at: int | None = None) -> Samples:
    torch.manual_seed(1)
    loader = make_loader()
    seen = Samples(grab_at)
    with strategy([seen], num_epochs=3) as run:
        run.run(loader)
    return seen


@pytest.mark.parametrize("make_loader", LOADERS)
@pytest.mark.parametrize("stop_at", [2, 4, 6], ids=["in-epoch-1", "epoch-1-end", "in-epoch-2"])
@pytest.mark.parametrize("closed", [False, True], ids=["live", "closed-between"])
def test_a_second_run_continues_with_the_uninterrupted_order(
    make_loader: Callable[[], Any], stop_at: int, closed: bool
) -> None:
    """Without a close() between, the next run reads on from the epoch's live iterator; after one, the
    epoch is reopened at its position, on the loader's persistent iterator."""
    straight = uninterrupted(make_loader).batches
    torch.manual_seed(1)
    loader = make_loader()
    seen = Samples()
    run = strategy([seen], num_epochs=3, max_steps=stop_at)
    with run:
        run.run(loader)
        if not closed:
            run.max_steps = None
            run.run(loader)
    if closed:
        with run:
            run.max_steps = None
            run.run(loader)
    assert seen.batches == straight
    assert len(straight) == 12 and sorted(itertools.chain.from_iterable(straight[4:8])) == list(range(SAMPLES))


@pytest.mark.parametrize("make_loader", LOADERS)
@pytest.mark.parametrize("grab_at", [2, 4, 6, 8], ids=["in-epoch-1", "epoch-1-end", "in-epoch-2", "epoch-2-end"])
def test_a_resume_in_a_fresh_strategy_trains_the_uninterrupted_order(
    make_loader: Callable[[], Any], grab_at: int
) -> None:
    straight = uninterrupted(make_loader, grab_at)
    torch.manual_seed(123)  # the resumed process starts from another random state; the checkpoint holds the run's
    loader = make_loader()
    seen = Samples()
    resumed = strategy([seen], num_epochs=3)
    resumed.load_state_dict(straight.state)
    with resumed:
        resumed.run(loader)
    assert seen.batches == straight.batches[grab_at:]
