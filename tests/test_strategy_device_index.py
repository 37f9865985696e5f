"""A strategy's device carries the index its tensors report once SETUP starts (docs/writing-plugins.md).

``torch.device("cuda:0") == torch.device("cuda")`` is ``False``, so a hook comparing a tensor's device
with ``ctx.device`` needs the index; resolving it must not make a CUDA context before the run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.strategy import indexed_device


def _no_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise AssertionError("indexed_device made a tensor for a device that needs no index")


@pytest.mark.parametrize("device", ["cpu", "meta", "cuda:1", "cuda:0"])
def test_a_device_that_needs_no_index_is_returned_without_asking_the_device(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    monkeypatch.setattr(torch, "empty", _no_tensor)
    assert indexed_device(torch.device(device)) == torch.device(device)


def test_strategy_construction_leaves_the_device_as_given_until_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building a strategy must not ask CUDA anything that makes its context (a CPU-only build has none to make).
    model = torch.nn.Linear(2, 1)
    monkeypatch.setattr(torch, "empty", _no_tensor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    strategy = nvtrain.TrainingStrategy(
        model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=torch.nn.functional.mse_loss, device="cuda"
    )
    assert strategy.device == torch.device("cuda") and strategy.ctx.device == torch.device("cuda")


class _DevicesSeen:
    """Records ``ctx.device`` at SETUP and whether each micro-batch and parameter compares equal to it."""

    def __init__(self) -> None:
        self.at_setup: torch.device | None = None
        self.batch_on_ctx_device: list[bool] = []

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        self.at_setup = ctx.device

    @nvtrain.hookimpl
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        inputs, targets = ctx.batch
        self.batch_on_ctx_device.append(inputs.device == ctx.device and targets.device == ctx.device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("given", ["cuda", None])
def test_cuda_without_an_index_becomes_the_current_device_at_setup(given: str | None) -> None:
    seen = _DevicesSeen()
    model = torch.nn.Linear(2, 1)
    strategy = nvtrain.TrainingStrategy(
        model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=torch.nn.functional.mse_loss, hooks=[seen], device=given
    )
    current = torch.device("cuda", torch.cuda.current_device())
    strategy.run([(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)])
    assert seen.at_setup == current
    assert strategy.device == current and strategy.ctx.device == current
    assert next(strategy.ctx.models["main"].parameters()).device == strategy.ctx.device
    assert seen.batch_on_ctx_device == [True, True, True]
