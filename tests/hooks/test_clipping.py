"""GradientClippingHook: the same result as torch's clipping applied by hand, only on real steps."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook
from nvtrain.hooks.clipping import GRAD_NORM, OptimizerParameters
from nvtrain.stages import TrainingStage

LR = 0.5


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_batch(seed: int = 1, scale: float = 10.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, generator=generator) * scale, torch.randn(4, 2, generator=generator) * scale


def make_strategy(hooks: Sequence[object], model: torch.nn.Module | None = None) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=model if model is not None else make_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=LR),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
    )


def by_hand(clip: Callable[[list[torch.nn.Parameter]], Any]) -> tuple[list[torch.Tensor], Any]:
    """One SGD step of the same model on the same batch with ``clip`` applied between backward and step."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = make_batch()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    returned = clip(list(model.parameters()))
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()], returned


def params(strategy: nvtrain.TrainingStrategy, key: str = "main") -> list[torch.Tensor]:
    return [p.detach() for p in strategy.ctx.models[key].parameters()]


def assert_equal_tensors(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs exactly one of max_norm"),
        ({"max_norm": 1.0, "max_value": 1.0}, "needs exactly one of max_norm"),
        ({"max_norm": 0.0}, r"GradientClippingHook\.max_norm must be a number > 0"),
        ({"max_norm": float("nan")}, r"GradientClippingHook\.max_norm must be a number > 0"),
        ({"max_value": -1.0}, r"GradientClippingHook\.max_value must be a number > 0"),
        ({"max_norm": 1.0, "norm_type": 0}, r"GradientClippingHook\.norm_type must be a number > 0"),
        ({"max_norm": 1.0, "model_keys": ()}, r"GradientClippingHook\.model_keys must be None or a non-empty"),
    ],
)
def test_bad_configuration_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradientClippingHook(**kwargs)


def test_declares_only_the_step_stage() -> None:
    hook = GradientClippingHook(max_norm=1.0)
    assert (hook.priority, hook.plugin_name) == (30, "clip")
    assert hook.stages == {TrainingStage.DO_OPTIMIZER_STEP}


# -- equal to torch's own clipping ---------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_norm_clipping_equals_clip_grad_norm(norm_type: float) -> None:
    expected, expected_norm = by_hand(lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.5, norm_type=norm_type))
    strategy = make_strategy([GradientClippingHook(max_norm=0.5, norm_type=norm_type)])
    strategy.train_batch(make_batch())
    assert_equal_tensors(params(strategy), expected)
    norm = strategy.ctx.metrics["grad_norm"]
    assert isinstance(norm, torch.Tensor) and torch.equal(norm, expected_norm)
    assert norm > 0.5  # the batch's gradients really were clipped


def test_value_clipping_equals_clip_grad_value_and_records_the_norm() -> None:
    recorded: list[torch.Tensor] = []

    def clip(ps: list[torch.nn.Parameter]) -> None:
        recorded.append(torch.nn.utils.get_total_norm([p.grad for p in ps]))
        torch.nn.utils.clip_grad_value_(ps, 0.05)

    expected, _ = by_hand(clip)
    strategy = make_strategy([GradientClippingHook(max_value=0.05)])
    strategy.train_batch(make_batch())
    assert_equal_tensors(params(strategy), expected)
    torch.testing.assert_close(strategy.ctx.metrics["grad_norm"], recorded[0], rtol=0, atol=0)
    grads = torch.cat([p.grad.flatten() for p in strategy.ctx.models["main"].parameters()])
    assert grads.abs().max() == pytest.approx(0.05)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("settings", [{"max_norm": 0.5}, {"max_value": 0.05}])
def test_foreach_reaches_every_torch_clipping_call(
    foreach: bool | None, settings: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``foreach`` picks torch's implementation: the norm, the rescale and the clamp all receive it."""
    seen: dict[str, Any] = {}
    utils = torch.nn.utils
    for name in ("get_total_norm", "clip_grads_with_norm_", "clip_grad_value_"):
        original = getattr(utils, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            seen[_name] = kwargs.get("foreach", "missing")
            return _original(*args, **kwargs)

        monkeypatch.setattr(utils, name, spy)
    strategy = make_strategy([GradientClippingHook(**settings, foreach=foreach)])
    strategy.train_batch(make_batch())
    clip = "clip_grads_with_norm_" if "max_norm" in settings else "clip_grad_value_"
    assert seen == {"get_total_norm": foreach, clip: foreach}


def test_publishes_the_pre_clip_norm_for_this_micro_batch() -> None:
    strategy = make_strategy([GradientClippingHook(max_norm=0.5)])
    strategy.train_batch(make_batch())
    batch_count, norm = strategy.ctx.stash[GRAD_NORM]
    assert batch_count == 0  # ctx.batch_count while DO_OPTIMIZER_STEP ran
    assert norm is strategy.ctx.metrics["grad_norm"]


def test_model_keys_clip_only_those_models() -> None:
    models = {"a": make_model(0), "b": make_model(1)}

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        inputs, _ = ctx.batch
        return ctx.models["a"](inputs) + ctx.models["b"](inputs)

    def build(hooks: Sequence[object]) -> nvtrain.TrainingStrategy:
        sgd = functools.partial(torch.optim.SGD, lr=LR)
        return nvtrain.TrainingStrategy(
            models=copy.deepcopy(models),
            optimizers={"a": sgd, "b": sgd},
            forward_fn=forward,
            loss_fn=torch.nn.functional.mse_loss,
            hooks=list(hooks),
            device="cpu",
        )

    plain = build([])
    plain.train_batch(make_batch())
    clipped = build([GradientClippingHook(max_norm=0.1, model_keys="a")])
    clipped.train_batch(make_batch())
    assert_equal_tensors(params(clipped, "b"), params(plain, "b"))
    assert not all(torch.equal(g, e) for g, e in zip(params(clipped, "a"), params(plain, "a"), strict=True))
    assert set(clipped.ctx.metrics) == {"grad_norm/a"}
    assert GRAD_NORM not in clipped.ctx.stash  # a partial norm is not the total norm

    unknown = build([GradientClippingHook(max_norm=0.1, model_keys=("a", "c"))])
    with pytest.raises(ValueError, match=r"GradientClippingHook\.model_keys: no optimizer for model 'c' \(models"):
        unknown.setup()  # at SETUP, before any step: nvtrain validate runs it


# -- only when the step will run ----------------------------------------------------------------


class VetoAll(nvtrain.TrainingUpdateHook):
    priority = 20
    stages = frozenset({TrainingStage.DO_OPTIMIZER_STEP})

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        return False, None


def raw_grads() -> list[torch.Tensor]:
    model = make_model()
    inputs, targets = make_batch()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_nothing_is_clipped_on_a_vetoed_micro_batch() -> None:
    strategy = make_strategy([GradientClippingHook(max_norm=0.01), VetoAll()])
    strategy.train_batch(make_batch())
    assert strategy.ctx.step_skipped
    assert_equal_tensors([p.grad for p in strategy.ctx.models["main"].parameters()], raw_grads())
    assert "grad_norm" not in strategy.ctx.metrics


def test_accumulating_micro_batches_are_not_clipped_the_window_end_is() -> None:
    strategy = make_strategy([GradientClippingHook(max_norm=0.01), GradientAccumulationHook(steps=2)])
    strategy.train_batch(make_batch())
    raw = raw_grads()
    # halved by the window of 2 (exact in binary floating point), not clipped to norm 0.01
    assert_equal_tensors([p.grad for p in strategy.ctx.models["main"].parameters()], [g / 2 for g in raw])
    assert "grad_norm" not in strategy.ctx.metrics
    strategy.train_batch(make_batch())
    assert strategy.ctx.step_count == 1
    full_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in raw]))
    torch.testing.assert_close(strategy.ctx.metrics["grad_norm"], full_norm, rtol=1e-6, atol=0)


def test_the_parameter_list_is_cached_until_the_optimizers_change() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([a], lr=0.1)
    ctx = nvtrain.TrainingContext(optimizers={"main": optimizer})
    params = OptimizerParameters(None, "GradientClippingHook")
    first = params(ctx)
    assert params(ctx) is first and [id(p) for p in first] == [id(a)]
    optimizer.add_param_group({"params": [b]})
    assert [id(p) for p in params(ctx)] == [id(a), id(b)]
    ctx.optimizers["other"] = torch.optim.SGD([a], lr=0.1)  # shared parameters count once
    assert [id(p) for p in params(ctx)] == [id(a), id(b)]


def test_a_hook_reused_in_new_strategies_clips_each_ones_parameters() -> None:
    """The parameter set is cached by the ids of the optimizers' parameter-group lists; a strategy freed and a
    new one built can get a list at a freed id (CPython reuses them), and the hook then clipped the old
    model's parameters, leaving the new model's gradients as they were."""
    import gc

    hook = GradientClippingHook(max_norm=1e-3)
    batch = (torch.randn(4, 3) * 100, torch.randn(4, 1) * 100)
    for round_ in range(60):
        torch.manual_seed(round_)
        strategy = nvtrain.TrainingStrategy(
            models=torch.nn.Linear(3, 1),
            optimizers=functools.partial(torch.optim.SGD, lr=0.0),
            loss_fn=torch.nn.functional.mse_loss,
            hooks=[hook],
            device="cpu",
        )
        with strategy:
            strategy.train_batch(batch)
            grads = [p.grad for p in strategy.ctx.models["main"].parameters()]
            norm = float(torch.nn.utils.get_total_norm(grads))
        assert norm <= 1e-3 * 1.0001, f"round {round_}: this model's gradients were not clipped (norm {norm:.1f})"
        del strategy, grads
        gc.collect(1)  # the young generations: where the freed strategy's cycles are
