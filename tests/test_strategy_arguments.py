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


# -- what the factories build -------------------------------------------------------------------------


def test_an_optimizer_over_another_models_parameters_is_refused_at_setup() -> None:
    """A factory closing over another (or a rebuilt) model would step parameters the run never uses."""
    other = torch.nn.Linear(3, 2)
    strategy = _strategy(optimizers=lambda params: torch.optim.SGD(other.parameters(), lr=0.1), max_steps=2)
    with pytest.raises(ValueError, match=r"optimizers\['main'\] built a SGD over none of model 'main''s parameters"):
        strategy.run(_batches())
    assert strategy.ctx.step_count == 0


def test_an_optimizer_over_part_of_the_model_trains_that_part() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    first = model[0].weight.detach().clone()
    strategy = _strategy(models=model, optimizers=lambda params: torch.optim.SGD(model[1].parameters(), lr=0.1))
    strategy.run(_batches())
    assert torch.equal(model[0].weight, first)


@pytest.mark.parametrize(
    ("factory", "error", "message"),
    [
        (
            lambda optimizer: torch.optim.lr_scheduler.StepLR(
                torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), 1
            ),
            ValueError,
            r"lr_schedulers\['main'\] built a StepLR bound to another optimizer than optimizers\['main'\]'s",
        ),
        (lambda optimizer: None, TypeError, r"lr_schedulers\['main'\] must build a learning-rate scheduler .*NoneType"),
    ],
    ids=["another-optimizer", "none"],
)
def test_an_lr_scheduler_that_would_not_set_the_rate_is_refused_at_setup(
    factory: Any, error: type[Exception], message: str
) -> None:
    strategy = _strategy(lr_schedulers=factory, max_steps=2)
    with pytest.raises(error, match=message):
        strategy.run(_batches())
    assert strategy.ctx.step_count == 0


# -- constructor arguments ----------------------------------------------------------------------------


def test_hooks_given_as_a_mapping_are_refused() -> None:
    """Iterating a dict gives its keys: the hooks would be the names."""
    with pytest.raises(TypeError, match=r"hooks must be a list of hooks \(got a dict keyed \['clip'\]\); pass list"):
        _strategy(hooks={"clip": nvtrain.hooks.GradientClippingHook(max_norm=1.0)})


def test_a_distributed_manager_without_rank_and_world_size_is_refused() -> None:
    with pytest.raises(TypeError, match=r"distributed_manager must be a DistributedManager, .*\(got object\)"):
        _strategy(distributed_manager=object())


@pytest.mark.parametrize(("device", "count"), [("cuda", 0), ("cuda:0", 0), ("cuda:2", 2)])
def test_a_cuda_device_this_process_lacks_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch, device: str, count: int
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ValueError, match=rf"device: '{device}' asks for CUDA, but {count} CUDA device\(s\) are visible"):
        nvtrain.TrainingStrategy(
            models=torch.nn.Linear(3, 2), optimizers=torch.optim.SGD, loss_fn=torch.nn.functional.mse_loss, device=device
        )


# -- the loss ------------------------------------------------------------------------------------------


def _per_sample_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean(dim=1)


def _detached_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(outputs, targets).detach()


@pytest.mark.parametrize("transformed", [False, True], ids=["as-returned", "through-a-loss-hook"])
@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (_per_sample_loss, r"the loss must be a single value, got a tensor of shape \(2,\); check loss_fn"),
        (_detached_loss, r"the loss does not require grad, so nothing can be back-propagated; check loss_fn"),
    ],
    ids=["per-sample", "detached"],
)
def test_a_loss_that_cannot_be_back_propagated_names_loss_fn(loss_fn: Any, message: str, transformed: bool) -> None:
    hooks = [nvtrain.hooks.GradientAccumulationHook(steps=2)] if transformed else []
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=loss_fn,
        hooks=hooks,
        device="cpu",
    )
    with pytest.raises(ValueError, match=rf"stage DO_BACKWARD: {message}") as caught:
        strategy.run(_batches())
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own message stays in the chain


@pytest.mark.parametrize(
    ("hook", "error", "message"),
    [
        ("ema", TypeError, r"expected a hook instance .*got str 'ema'; build one by name with nvtrain\.plugins\.load"),
        (None, TypeError, r"expected a hook instance .*got NoneType None"),
        (42, TypeError, r"expected a hook instance .*got int 42"),
    ],
    ids=["str", "none", "int"],
)
def test_what_is_not_a_hook_is_named_with_its_index(hook: Any, error: type[Exception], message: str) -> None:
    """It said "plugin str implements no stage: give it a method named after a stage"."""
    with pytest.raises(error, match=message) as caught:
        _strategy(hooks=[nvtrain.hooks.GradientClippingHook(max_norm=1.0), hook])
    assert caught.value.__notes__ == ["(TrainingStrategy.hooks[1])"]


def test_a_hook_whose_stage_methods_all_lack_the_decorator_names_one() -> None:
    """Every method unmarked gave "implements no stage"; some unmarked, a ValueError naming the method."""

    class Unmarked:
        def after_batch(self, ctx: Any) -> None:
            pass

    with pytest.raises(ValueError, match=r"method 'after_batch' is named after a stage but is not marked"):
        _strategy(hooks=[Unmarked()])
