"""Peak memory: what one micro-batch (or validation batch) made is freed before the next one's forward.

A loop that keeps the last outputs until the next forward has returned holds two sets of them at its
peak; for a language model that is a second copy of the logits (gigabytes). These tests follow the
outputs with weak references and look at them from inside the next forward.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import GradientAccumulationHook
from nvtrain.validation import ValidationLoop


class OutputsTracker:
    """A ``forward_fn`` recording, at each forward, whether the previous forward's outputs (and the
    previous batch it saw) are still alive."""

    def __init__(self) -> None:
        self.previous_outputs: weakref.ref[torch.Tensor] | None = None
        self.previous_batch: weakref.ref[torch.Tensor] | None = None
        self.outputs_alive: list[bool] = []
        self.batch_alive: list[bool] = []
        self.context_cleared: list[bool] = []

    def __call__(self, ctx: nvtrain.TrainingContext) -> torch.Tensor:
        if self.previous_outputs is not None and self.previous_batch is not None:
            self.outputs_alive.append(self.previous_outputs() is not None)
            self.batch_alive.append(self.previous_batch() is not None)
            self.context_cleared.append(ctx.outputs is None and ctx.loss is None and ctx.backward_loss is None)
        inputs = ctx.batch[0]
        outputs = ctx.models["main"](inputs)
        self.previous_outputs, self.previous_batch = weakref.ref(outputs), weakref.ref(inputs)
        return outputs


def _data(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 5, generator=generator)) for _ in range(count)]


def _loader(count: int) -> torch.utils.data.DataLoader[Any]:
    """Batches the loader makes anew each time: the test's list does not keep them alive."""
    inputs, targets = (torch.cat(part) for part in zip(*_data(count), strict=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=4)


def _strategy(forward_fn: OutputsTracker, **fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 5),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        forward_fn=forward_fn,
        device="cpu",
        **fields,
    )


@pytest.mark.parametrize("accumulation", [1, 3])
def test_run_frees_a_micro_batchs_outputs_and_batch_before_the_next_forward(accumulation: int) -> None:
    tracker = OutputsTracker()
    hooks = [GradientAccumulationHook(accumulation)] if accumulation > 1 else []
    with _strategy(tracker, hooks=hooks) as strategy:
        strategy.run(_loader(6))
    assert tracker.outputs_alive == [False] * 5
    if accumulation == 1:  # a window's host batches are read ahead, together; a device copy never is (CPU: same)
        assert tracker.batch_alive == [False] * 5


def test_train_batch_frees_the_last_calls_outputs_before_the_next_forward() -> None:
    tracker = OutputsTracker()
    with _strategy(tracker) as strategy:
        returned = [strategy.train_batch(batch) for batch in _data(3)]
    # train_batch() leaves detached copies on the context (sharing the storage): those go too
    assert tracker.context_cleared == [True, True]
    assert tracker.outputs_alive == [False, False]
    assert all(isinstance(loss, torch.Tensor) for loss in returned)  # what train_batch() returned stays the caller's


class SeenAtBeforeBatch:
    """What BEFORE_BATCH sees of the last micro-batch, and that its outputs are still there at AFTER_BATCH."""

    def __init__(self) -> None:
        self.before: list[tuple[Any, Any, Any, Any]] = []
        self.after: list[bool] = []

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.before.append((ctx.outputs, ctx.loss, ctx.backward_loss, ctx.batch is None))

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.after.append(isinstance(ctx.outputs, torch.Tensor) and isinstance(ctx.loss, torch.Tensor))


def test_a_micro_batch_sees_only_its_own_outputs_and_the_last_ones_stay_after_the_run() -> None:
    seen = SeenAtBeforeBatch()
    with _strategy(OutputsTracker(), hooks=[seen]) as strategy:
        strategy.run(_data(3))
        ctx = strategy.ctx
        assert seen.before == [(None, None, None, False)] * 3  # the batch is this micro-batch's, already moved
        assert seen.after == [True] * 3
        # the last micro-batch's values stay for after the run, detached (stages.md, after_batch)
        assert isinstance(ctx.loss, torch.Tensor) and ctx.loss.grad_fn is None
        assert isinstance(ctx.outputs, torch.Tensor) and ctx.outputs.grad_fn is None


def test_validation_frees_a_batchs_outputs_before_the_next_forward() -> None:
    tracker = OutputsTracker()
    validation = nvtrain.ValidationConfig(data=_data(4), every_n_epochs=None)
    with _strategy(tracker, validation=validation) as strategy:
        summary = strategy.validate()
    assert summary["num_samples"] == 16
    assert tracker.outputs_alive == [False] * 3


def test_validation_loop_frees_outputs_and_metric_values_before_the_next_forward() -> None:
    model = torch.nn.Linear(3, 5)
    alive: list[bool] = []
    previous: list[weakref.ref[torch.Tensor]] = []

    def forward(models: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        alive.extend(ref() is not None for ref in previous)
        previous.clear()
        outputs = models["main"](batch[0])
        previous.append(weakref.ref(outputs))
        return outputs, batch[1], batch[0].shape[0]

    def big_metric(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = (outputs - targets).abs().mean(dim=1)  # a per-sample tensor the loop reduces away
        previous.append(weakref.ref(value))
        return value.mean()

    loop = ValidationLoop(forward=forward, loss_fn=torch.nn.functional.mse_loss, metrics={"l1": big_metric})
    summary = loop.run({"main": model}, _data(4))
    assert summary["num_samples"] == 16
    assert alive == [False] * 6
