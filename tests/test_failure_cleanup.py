"""A step that fails on a loss of the wrong type reports that, not a failure of the cleanup after it, and
the hooks are closed when the ``with strategy:`` block exits, whatever letting go of the run raises."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import nvtrain


class Closable:
    def __init__(self) -> None:
        self.closed = False

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _strategy(loss_fn: Any, hook: Closable) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=loss_fn,
        device="cpu",
        num_epochs=1,
        hooks=[hook],
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, generator=generator), torch.randn(2, 1, generator=generator)) for _ in range(2)]


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda outputs, targets: ((outputs - targets) ** 2).mean().item(),
        lambda outputs, targets: (((outputs - targets) ** 2).mean(), {"extra": 1.0}),
    ],
    ids=["float", "tuple"],
)
def test_a_loss_of_the_wrong_type_is_reported_and_the_hooks_are_closed(loss_fn: Any) -> None:
    hook = Closable()
    strategy = _strategy(loss_fn, hook)
    with pytest.raises(TypeError, match=r"DO_BACKWARD: ctx\.loss must be a torch\.Tensor"), strategy:
        strategy.run(_batches())
    assert hook.closed


def test_the_hooks_are_closed_when_letting_go_of_the_run_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = Closable()
    strategy = _strategy(torch.nn.functional.mse_loss, hook)

    def fails(self: nvtrain.TrainingStrategy) -> None:
        raise RuntimeError("releasing the run failed")

    monkeypatch.setattr(nvtrain.TrainingStrategy, "_release_run", fails)
    with pytest.raises(RuntimeError, match="releasing the run failed"), strategy:
        pass
    assert hook.closed
    hook.closed = False
    with pytest.raises(RuntimeError, match="releasing the run failed"):
        strategy.close()
    assert hook.closed
