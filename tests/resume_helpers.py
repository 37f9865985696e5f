"""The resume scenario the resume-without-replay tests share: a dataset that counts its reads, a
hook that grabs the whole state at one step, and a short training run that can start from it.

The model has dropout and the optimizer is AdamW, so a resume is bitwise only when the
random streams and the data order both continue exactly.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Iterator
from typing import Any

import torch
from nvtrain_checkpoint import snapshot
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import nvtrain
from nvtrain.step_scheduler import StepSchedulerConfig

__all__ = ["CountingDataset", "CountingStream", "GrabState", "RecordSamples", "make_strategy", "train"]


class CountingDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset that records every index read, also from DataLoader workers (shared memory)."""

    def __init__(self, samples: int) -> None:
        data = torch.Generator().manual_seed(3)
        self.x = torch.randn(samples, 3, generator=data)
        self.y = torch.randn(samples, 2, generator=data)
        self.reads = multiprocessing.Array("i", 4096)
        self.count = multiprocessing.Value("i", 0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.count.get_lock():
            self.reads[self.count.value] = index
            self.count.value += 1
        return self.x[index], self.y[index]

    def read(self) -> list[int]:
        return list(self.reads[: self.count.value])


class CountingStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A stream without len() whose iterator saves its place (torchdata's Stateful protocol), counting reads.

    Rank ``rank`` of ``world_size`` streams every ``world_size``-th sample from ``rank`` on; its
    DataLoader worker ``w`` of ``n`` takes every ``n``-th of those from the ``w``-th. The iterator's
    state is the next sample index, so a restored iterator never reads what came before it, and
    the states of two ranks differ.
    """

    def __init__(self, samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.counted = CountingDataset(samples)
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return _StreamIterator(self.counted, self.rank * workers + worker, self.world_size * workers)

    @property
    def x(self) -> torch.Tensor:
        return self.counted.x

    def read(self) -> list[int]:
        return self.counted.read()


class _StreamIterator(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, counted: CountingDataset, first: int, stride: int) -> None:
        self.counted, self.next_index, self.stride = counted, first, stride

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.next_index >= len(self.counted):
            raise StopIteration
        sample = self.counted[self.next_index]
        self.next_index += self.stride
        return sample

    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_index = int(state["next_index"])


class RecordSamples:
    """The dataset index of every trained sample, in training order (found from the micro-batch's inputs)."""

    def __init__(self, dataset: CountingDataset | CountingStream) -> None:
        self.inputs = dataset.x
        self.samples: list[int] = []

    @nvtrain.hookimpl
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        for row in ctx.batch[0]:
            self.samples.append(int((self.inputs == row).all(dim=1).nonzero()[0]))


class GrabState:
    """Copies the strategy's whole state at AFTER_BATCH of one step (what a checkpoint would hold)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state: dict[str, Any] | None = None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step and ctx.sync_gradients and self.state is None:
            self.state = snapshot(ctx.strategy.state_dict())  # type: ignore[union-attr]


def make_strategy(hooks: list[object], max_steps: int, **kwargs: Any) -> nvtrain.TrainingStrategy:
    """Linear-dropout-linear (3 -> 16 -> 2), AdamW, MSE, on the CPU, ``max_steps`` steps, no checkpoint cadence."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.AdamW, lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        step_scheduler=StepSchedulerConfig(max_steps=max_steps, ckpt_every_steps=None, validate_on_checkpoint=False),
        **kwargs,
    )


def train(loader: Any, hooks: list[object], max_steps: int, state: Any = None) -> dict[str, Any]:
    """Train to ``max_steps`` (from ``state`` when given); the parameters, RNG states and the samples read."""
    strategy = make_strategy(hooks, max_steps)
    torch.manual_seed(12345)  # whatever the process drew before must not matter to a resumed run
    if state is not None:
        strategy.load_state_dict(state)
    else:
        torch.manual_seed(1)
    with strategy:
        strategy.run(loader)
    return {
        "params": {k: v.clone() for k, v in strategy.ctx.models["main"].state_dict().items()},
        "rng": torch.get_rng_state(),
        "generator": None if loader.generator is None else loader.generator.get_state(),
        "reads": loader.dataset.read(),
    }
