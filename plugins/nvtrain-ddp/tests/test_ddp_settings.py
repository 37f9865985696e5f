"""DDPHook.backend: the process group the hook initialises from torchrun's variables uses that backend.

torchrun's variables say two ranks, but no second process exists here, so the real
``init_process_group`` is called with an in-memory store and a world of one: the group and its
backend are real, only the rendezvous is skipped.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from nvtrain_ddp import DDPHook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import nvtrain


def make_strategy(hook: DDPHook) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )


def make_loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator))
    return DataLoader(data, batch_size=4)


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("cpu:gloo", "cpu:gloo"),  # gloo for CPU tensors only: not what the default would give
        (None, "gloo"),  # None: gloo, as for every CPU device
    ],
)
def test_the_process_group_the_hook_initialises_uses_its_backend(
    init_calls: list[dict[str, Any]], backend: str | None, expected: str
) -> None:
    assert not dist.is_initialized()
    hook = DDPHook(backend=backend)
    with make_strategy(hook) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert dist.get_backend() == expected  # the real default group's backend
        assert isinstance(strategy.ctx.models["main"], DistributedDataParallel)
    assert init_calls == [{"backend": expected, "init_method": "env://", "rank": 0, "world_size": 2}]
    assert not dist.is_initialized()  # the hook created the group, so close() destroyed it
