"""The plugin is discovered through its entry point, validates its settings, and records the norm."""

from __future__ import annotations

import functools

import pytest
import torch
from nvtrain_gradnorm import GradNormMonitor

import nvtrain
import nvtrain.plugins


def _strategy(hook: object) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(count)]


def test_discovered_through_its_entry_point() -> None:
    nvtrain.plugins.refresh()
    info = {plugin.name: plugin for plugin in nvtrain.plugins.available()}["gradnorm"]
    assert info.status is nvtrain.plugins.PluginStatus.OK, info.error
    assert info.distribution == "nvtrain-gradnorm"
    assert [hook.name for hook in info.hooks] == ["GradNormMonitor"]
    assert info.hooks[0].stages == ("after_optimizer_step",)
    assert isinstance(nvtrain.plugins.load("gradnorm", every=5), GradNormMonitor)


def test_bad_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"GradNormMonitor.every must be an int >= 1 \(got 0\)"):
        GradNormMonitor(every=0)
    with pytest.raises(ValueError, match=r"GradNormMonitor.norm_type must be a number > 0"):
        GradNormMonitor(norm_type=-1.0)


def test_records_the_norm_and_prints_every_n_steps(capsys: pytest.CaptureFixture[str]) -> None:
    strategy = _strategy(GradNormMonitor(every=2))
    with strategy:
        strategy.run(_batches(5))
    grads = [p.grad for p in strategy.ctx.models["main"].parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(strategy.ctx.metrics["grad_norm"], expected, rtol=1e-6, atol=0.0)
    printed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("[gradnorm]")]
    assert printed == ["[gradnorm] step 2", "[gradnorm] step 4"]
