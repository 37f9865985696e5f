"""Which average a validation evaluates when two EMA hooks average one model: named by state_key, never guessed."""

from __future__ import annotations

import functools

import pytest
import torch
from nvtrain_ema import EMAHook

import nvtrain
from nvtrain.cli import main


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def make_strategy(use_ema: bool | str) -> tuple[nvtrain.TrainingStrategy, EMAHook, EMAHook]:
    torch.manual_seed(0)
    fast, slow = EMAHook(decay=0.5, state_key="fast"), EMAHook(decay=0.9, state_key="slow")
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[fast, slow],
        device="cpu",
        num_epochs=1,
        validation=nvtrain.ValidationConfig(data=make_batches(2, seed=2), use_ema=use_ema),
    )
    return strategy, fast, slow


def test_two_averages_of_one_model_are_refused_at_the_start_when_use_ema_names_neither() -> None:
    strategy, _, _ = make_strategy(True)
    message = r"use_ema=True, but 2 EMA hooks average model 'main' \(EMAHook\(state_key='fast'\), EMAHook\(state_"
    with strategy, pytest.raises(ValueError, match=message):
        strategy.run(make_batches(4))
    assert strategy.ctx.step_count == 0  # refused before training, not at the first validation


@pytest.mark.parametrize("chosen", ["fast", "slow"])
def test_use_ema_given_a_state_key_evaluates_that_average(chosen: str) -> None:
    strategy, fast, slow = make_strategy(chosen)
    with strategy:
        result = strategy.run(make_batches(4))
    hook = fast if chosen == "fast" else slow
    averaged = hook.get_averaged_model()
    val = make_batches(2, seed=2)
    expected = sum(torch.nn.functional.mse_loss(averaged(x), y) for x, y in val) / len(val)
    assert result.validation is not None
    torch.testing.assert_close(result.validation["loss"], expected, rtol=1e-6, atol=0)


def test_a_state_key_no_hook_has_is_refused_naming_the_keys() -> None:
    strategy, _, _ = make_strategy("teacher")
    with strategy, pytest.raises(ValueError, match=r"use_ema='teacher' names no EMA hook .*: fast, slow\)"):
        strategy.run(make_batches(4))


def test_a_config_names_the_average_to_validate(capsys: pytest.CaptureFixture[str]) -> None:
    two = "hooks=[{name: ema, decay: 0.5, state_key: fast}, {name: ema, decay: 0.9, state_key: slow}]"
    two_on_cpu = [two, "--set", "device=cpu"]
    assert main(["validate", "--set", *two_on_cpu]) == 2
    err = capsys.readouterr().err
    assert "validation.use_ema: use_ema: auto, but 2 EMA hooks average model 'main'" in err
    assert main(["validate", "--set", *two_on_cpu, "--set", "validation.use_ema=slow"]) == 0
    assert main(["validate", "--set", *two_on_cpu, "--set", "validation.use_ema=medium"]) == 2
    assert "use_ema='medium' names no EMA hook" in capsys.readouterr().err
