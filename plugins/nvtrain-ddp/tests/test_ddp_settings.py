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


@pytest.mark.parametrize(
    ("settings", "bucket_bytes", "as_view"),
    [
        ({}, 25 * 1024 * 1024, False),  # torch's own defaults
        ({"bucket_cap_mb": 1.5, "gradient_as_bucket_view": True}, int(1.5 * 1024 * 1024), True),
    ],
)
def test_bucket_settings_reach_distributed_data_parallel(
    init_calls: list[dict[str, Any]], settings: dict[str, Any], bucket_bytes: int, as_view: bool
) -> None:
    with make_strategy(DDPHook(**settings)) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        wrapped = strategy.ctx.models["main"]
        assert isinstance(wrapped, DistributedDataParallel)
        assert (wrapped.bucket_bytes_cap, wrapped.gradient_as_bucket_view) == (bucket_bytes, as_view)


def _train_with_the_stack(hook: DDPHook) -> tuple[list[torch.Tensor], list[bool]]:
    """Four steps of two micro-batches with clipping; the weights, and whether each gradient was a bucket view
    at the last step (a view has a base: the bucket)."""
    from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook

    views: list[bool] = []

    class Look:
        @nvtrain.hookimpl
        def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
            views[:] = [p.grad is not None and p.grad._base is not None for p in ctx.models["main"].parameters()]

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 2, generator=generator))
    strategy = nvtrain.TrainingStrategy(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)),
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        torch.nn.functional.mse_loss,
        hooks=[hook, GradientAccumulationHook(2), GradientClippingHook(max_norm=0.05), Look()],
        device="cpu",
    )
    with strategy:
        strategy.run(DataLoader(data, batch_size=4))
        weights = [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]
    return weights, views


def test_gradients_as_bucket_views_train_the_same_weights(init_calls: list[dict[str, Any]]) -> None:
    """Views into the buckets (no second copy of the gradients) with accumulation under no_sync(), zeroing to
    None at every window and clipping in place: the same weights as DDP's own gradient tensors, bit for bit."""
    plain, plain_views = _train_with_the_stack(DDPHook())
    assert not dist.is_initialized()  # the hook destroyed the group it made; the next run makes a new one
    viewed, bucket_views = _train_with_the_stack(DDPHook(gradient_as_bucket_view=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, viewed, strict=True))
    assert bucket_views == [True] * 4 and plain_views == [False] * 4

