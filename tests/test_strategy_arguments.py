"""Mistakes in what a TrainingStrategy is given are refused where they are made, naming the argument:
at construction, or when ``run()`` starts, never half-way through training or silently."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import nvtrain


def _strategy(**fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    fields.setdefault("models", torch.nn.Linear(3, 2))
    fields.setdefault("optimizers", functools.partial(torch.optim.SGD, lr=0.1))
    return nvtrain.TrainingStrategy(loss_fn=torch.nn.functional.mse_loss, device="cpu", **fields)


def _batches(count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)) for _ in range(count)]


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"hooks": None}, TypeError, r"TrainingStrategy\.hooks must be a list of hooks \(got None\)"),
        ({"hooks": "ema"}, TypeError, r"TrainingStrategy\.hooks must be a list of hooks \(got 'ema'\)"),
        ({"forward_fn": 3}, TypeError, r"TrainingStrategy\.forward_fn must be callable"),
        (
            {"models": {"net": torch.nn.Linear(3, 2)}, "optimizers": {"net": torch.optim.SGD}},
            ValueError,
            r"TrainingStrategy\.models has no 'main' model \(got \['net'\]\) and no forward_fn",
        ),
    ],
    ids=["hooks-none", "hooks-str", "forward-fn-int", "no-main-model"],
)
def test_a_bad_argument_is_refused_at_construction(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _strategy(**fields)


def test_models_without_main_train_with_a_forward_fn() -> None:
    strategy = _strategy(
        models={"net": torch.nn.Linear(3, 2)},
        optimizers={"net": functools.partial(torch.optim.SGD, lr=0.1)},
        forward_fn=lambda ctx: ctx.models["net"](ctx.batch[0]),
        num_epochs=1,
    )
    assert strategy.run(_batches()).step_count == 2


_PLATEAU = nvtrain.LRSchedule(functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0))


@pytest.mark.parametrize(
    ("validation", "why"),
    [
        (None, "TrainingStrategy.validation has no data"),
        ("no-cadence", "no validation cadence is set"),
    ],
)
def test_a_metric_driven_schedule_in_a_run_that_never_validates_is_named(validation: Any, why: str) -> None:
    if validation == "no-cadence":
        validation = nvtrain.ValidationConfig(data=_batches(), every_n_epochs=None)
    strategy = _strategy(lr_schedulers=_PLATEAU, validation=validation, num_epochs=2)
    message = rf"lr_schedulers\['main'\]: ReduceLROnPlateau .* not set to validate: {why}.*; it keeps its learning rate"
    with pytest.warns(RuntimeWarning, match=message):
        strategy.run(_batches())


def test_a_metric_driven_schedule_steps_when_a_hook_validates_in_the_run() -> None:
    data = _batches()
    lrs: list[float] = []

    class ValidateEachEpoch:
        @nvtrain.hookimpl
        def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            ctx.strategy.validate(data)  # type: ignore[union-attr]
            lrs.append(ctx.optimizers["main"].param_groups[0]["lr"])

        @nvtrain.hookimpl
        def before_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
            for param in ctx.models["main"].parameters():  # the validation loss stalls
                param.grad = torch.zeros_like(param)

    plateau = nvtrain.LRSchedule(
        functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5, threshold=0.0)
    )
    strategy = _strategy(lr_schedulers=plateau, hooks=[ValidateEachEpoch()], num_epochs=3)
    with pytest.warns(RuntimeWarning, match="unless a hook calls validate"):
        strategy.run(data)
    assert lrs == pytest.approx([0.1, 0.05, 0.025])


def test_a_metric_driven_schedule_with_a_step_cadence_runs() -> None:
    validation = nvtrain.ValidationConfig(data=_batches(), every_n_steps=1, every_n_epochs=None)
    strategy = _strategy(lr_schedulers=_PLATEAU, validation=validation, num_epochs=1)
    assert strategy.run(_batches()).step_count == 2


def test_request_stop_after_the_run_is_refused() -> None:
    strategy = _strategy(num_epochs=1)
    strategy.run(_batches())
    with pytest.raises(RuntimeError, match=r"ctx\.request_stop\('late'\): no run is in progress"):
        strategy.ctx.request_stop("late")
