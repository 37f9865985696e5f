"""Whether and where a validation runs never changes the training's random streams: the run's own cadence, a
hook calling ``strategy.validate()`` inside the run, and a standalone ``validate()`` all evaluate on forked
streams (a shuffling validation loader draws its base seed from the global generator; an augmenting data set
draws from ``random`` and NumPy)."""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import nvtrain


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Draws from torch's, Python's and NumPy's global streams on every sample it reads."""

    def __init__(self, samples: int) -> None:
        data = torch.Generator().manual_seed(5)
        self.x = torch.randn(samples, 3, generator=data)
        self.y = torch.randn(samples, 2, generator=data)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(3) + random.random() + float(np.random.random())
        return self.x[index] + 0.01 * noise, self.y[index]


def _loader(samples: int) -> DataLoader[Any]:
    return DataLoader(Augmented(samples), batch_size=4, shuffle=True)


class ValidatesAt:
    """Calls ``strategy.validate()`` at AFTER_BATCH of the given steps (a hook-driven evaluation)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.validated: list[int] = []

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count in self.steps:
            ctx.strategy.validate()
            self.validated.append(ctx.step_count)


def _trained_weights(validate_at: set[int]) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    hook = ValidatesAt(validate_at)
    strategy = nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        validation=nvtrain.ValidationConfig(data=_loader(8)),
        num_epochs=2,
        device="cpu",
    )
    with strategy:
        strategy.run(_loader(16))
    assert hook.validated == sorted(validate_at)
    return tuple(p.detach().clone() for p in model.parameters())


def test_a_hook_validating_inside_the_run_leaves_training_as_without() -> None:
    without = _trained_weights(set())
    with_validations = _trained_weights({2, 5})
    assert all(torch.equal(a, b) for a, b in zip(without, with_validations, strict=True))


def _streams() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_streams(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    numpy_a, numpy_b = a[2], b[2]
    same_numpy = all(np.array_equal(x, y) for x, y in zip(numpy_a, numpy_b, strict=True))
    return torch.equal(a[0], b[0]) and a[1] == b[1] and same_numpy


def test_a_standalone_validate_leaves_the_global_streams_as_it_found_them() -> None:
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        validation=nvtrain.ValidationConfig(data=_loader(8)),
        device="cpu",
    )
    with strategy:
        strategy.setup()
        before = _streams()
        summary = strategy.validate()
        assert _same_streams(before, _streams())
        assert summary["num_samples"] == 8
