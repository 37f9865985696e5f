"""Validation leaves every module's mode as it found it, and ValidationConfig refuses bad settings when it is
built, not mid-run."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.validation import ValidationLoop
from nvtrain.validators import FieldProblem


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _loader() -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _forward(models: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    inputs, targets = batch
    return models["main"](inputs), targets, len(inputs)


def test_the_loop_restores_each_submodules_own_mode() -> None:
    model = Net()
    model.backbone.eval()  # frozen while the rest trains
    ValidationLoop(forward=_forward, loss_fn=torch.nn.functional.mse_loss).run({"main": model}, _loader())
    assert model.training and model.head.training
    assert not model.backbone.training and not model.backbone[1].training


class FreezeBackbone:
    """Freezes the backbone at SETUP: no gradients, BatchNorm statistics fixed (a fine-tuning pattern)."""

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        backbone = ctx.models["main"].backbone
        backbone.requires_grad_(False)
        backbone.eval()


def test_a_backbone_frozen_in_eval_mode_stays_frozen_across_validations() -> None:
    strategy = nvtrain.TrainingStrategy(
        models=Net(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        num_epochs=3,
        hooks=[FreezeBackbone()],
        validation=nvtrain.ValidationConfig(data=_loader()),
    )
    strategy.run(_loader())
    norm = strategy.ctx.models["main"].backbone[1]
    assert not norm.training and int(norm.num_batches_tracked) == 0  # its statistics never moved


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"use_ema": "auto"}, r"ValidationConfig.use_ema must be True, False or the state_key .*\(got 'auto'\)"),
        ({"use_ema": 1}, r"ValidationConfig.use_ema must be True, False or the state_key .*\(got 1\)"),
        ({"use_ema": ""}, r"ValidationConfig.use_ema must be True, False or the state_key .*\(got ''\)"),
        (
            {"metrics": ["accuracy"]},
            r"ValidationConfig.metrics must be a dict of name -> callable.*\(got \['accuracy'\]\)",
        ),
        ({"metrics": {"acc": "accuracy"}}, r"ValidationConfig.metrics\['acc'\] must be callable.*\(got 'accuracy';"),
        ({"metrics": {1: torch.sub}}, r"ValidationConfig.metrics must be a dict of name -> callable"),
        ({"metrics": {"loss": torch.sub}}, r"metrics\['loss'\]: 'loss' is the validation summary's own loss"),
        ({"metrics": {"num_samples": torch.sub}}, r"'num_samples' is the validation summary's own sample count"),
    ],
)
def test_bad_settings_are_refused_when_the_config_is_built(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(FieldProblem, match=message) as caught:
        nvtrain.ValidationConfig(**settings)
    assert "\n" not in str(caught.value)
    assert caught.value.owner == "ValidationConfig" and caught.value.field in settings


def test_metrics_take_any_mapping_of_callables() -> None:
    def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs.argmax(1) == targets).float().mean()

    assert nvtrain.ValidationConfig(metrics={"acc": accuracy}).metrics == {"acc": accuracy}
    assert nvtrain.ValidationConfig(use_ema=True).use_ema is True


class _Fusing(torch.nn.Module):
    """Fuses its two branches into one cached weight on ``eval()`` and drops the cache on ``train()``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
        self.fused: torch.Tensor | None = None

    def train(self, mode: bool = True) -> _Fusing:
        super().train(mode)
        self.fused = None if mode else (self.a.weight + self.b.weight).detach()
        return self

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return inputs @ self.fused.t()
        return self.a(inputs) + self.b(inputs)


def test_the_loop_restores_a_models_mode_through_its_train_method() -> None:
    model = _Fusing()
    loop = ValidationLoop(forward=_forward, loss_fn=torch.nn.functional.mse_loss)
    loop.run({"main": model}, [(torch.randn(2, 4), torch.randn(2, 2))])
    assert model.training and model.fused is None  # train() ran on the way back: the cache is gone
