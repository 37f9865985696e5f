"""``RunResult.validated_at_step`` says whose weights ``RunResult.validation`` judged."""

from __future__ import annotations

import functools

import torch

import nvtrain


def _batches(count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)) for _ in range(count)]


def _strategy(**fields: object) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        **fields,
    )


def test_a_validation_before_a_run_that_does_not_validate_is_dated_before_it() -> None:
    strategy = _strategy(num_epochs=1)
    before = strategy.validate(_batches())
    result = strategy.run(_batches(3))
    assert result.validation is before and result.validated_at_step == 0 and result.step_count == 3


def test_a_run_that_validates_dates_its_validation_at_its_last_step() -> None:
    strategy = _strategy(num_epochs=2, validation=nvtrain.ValidationConfig(data=_batches()))
    result = strategy.run(_batches(3))
    assert result.validation is not None and result.validated_at_step == result.step_count == 6


def test_a_run_that_never_validated_has_no_date() -> None:
    result = _strategy(num_epochs=1).run(_batches())
    assert result.validation is None and result.validated_at_step is None
