"""Hook states in a checkpoint are keyed by who the hook is, not by where it was registered."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, read_checkpoint

import nvtrain
import nvtrain.state
from nvtrain.state import checkpointable_hooks, hook_state_key


class Tally:
    """Adds ``increment`` to a running total at every optimizer step (a state that tells hooks apart)."""

    def __init__(self, increment: float, state_key: str | None = None) -> None:
        self.increment = increment
        if state_key is not None:
            self.state_key = state_key
        self.total = torch.zeros(())

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        self.total += self.increment

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"].clone()


def _kwargs(driver: ModuleType, hooks: list[object]) -> dict[str, Any]:
    kwargs = driver.strategy_kwargs("plain", hooks)
    torch.manual_seed(2)
    kwargs["models"] = {"main": kwargs["models"], "teacher": torch.nn.Linear(3, 2)}
    return kwargs


def test_reordered_hooks_get_their_own_state_back(driver: ModuleType, tmp_path: Path) -> None:
    from nvtrain_ema import EMAHook

    saving = [Tally(1.0, "one"), Tally(10.0, "ten"), EMAHook(model_key="main", decay=0.9),
              EMAHook(model_key="teacher", decay=0.5)]
    torch.manual_seed(1)
    with nvtrain.TrainingStrategy(**_kwargs(driver, [*saving, CheckpointHook(tmp_path, step_interval=5)])) as s:
        s.run(driver.make_loader("plain"))  # 18 steps, a checkpoint every 5
    final = {key: hook.state_dict() for key, hook in checkpointable_hooks(saving).items()}
    state = read_checkpoint(tmp_path / "step_5")
    assert state["hook_keys"] == "identity"
    assert set(state["hooks"]) == {"Tally:one", "Tally:ten", "ema:main", "ema:teacher"}
    assert state["hooks"]["Tally:one"]["total"].item() == 5.0
    assert state["hooks"]["Tally:ten"]["total"].item() == 50.0

    one, ten = Tally(1.0, "one"), Tally(10.0, "ten")
    ema_main, ema_teacher = EMAHook(model_key="main", decay=0.9), EMAHook(model_key="teacher", decay=0.5)
    resumed = nvtrain.TrainingStrategy(**_kwargs(driver, [ema_teacher, ten, ema_main, one]))  # another order
    resumed.restore(tmp_path / "step_5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hook starts fresh, no saved state is left over
        resumed.run(driver.make_loader("plain"))  # steps 6 to 18
    resumed.close()
    assert one.total.item() == 18.0 and ten.total.item() == 180.0  # swapped states would end at 63 and 135
    driver.assert_same(final["ema:main"], ema_main.state_dict())
    driver.assert_same(final["ema:teacher"], ema_teacher.state_dict())


def test_two_hooks_with_one_key_are_refused_naming_both() -> None:
    first, second = Tally(1.0), Tally(2.0)
    assert hook_state_key(first) == "Tally"
    with pytest.raises(ValueError, match=r"hooks Tally and Tally would both save .* 'Tally', so a resume .*; give each a distinct `state_key`"):
        checkpointable_hooks([first, second])
    assert set(checkpointable_hooks([Tally(1.0, "a"), Tally(2.0, "b")])) == {"Tally:a", "Tally:b"}


def test_a_state_written_with_order_based_keys_still_loads_by_order(
    driver: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = Tally(1.0), Tally(2.0)  # one key under the new scheme; Tally:0 and Tally:1 under the old
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [first, second]))
    strategy.train_batch(next(iter(driver.make_loader("plain"))))
    with monkeypatch.context() as patch:  # capture as an nvtrain before identity keys did
        patch.setattr(nvtrain.state, "checkpointable_hooks", nvtrain.state._legacy_hook_keys)
        legacy = dict(strategy.state_dict())
    legacy.pop("hook_keys")
    legacy["hooks"] = {"Tally:0": {"total": torch.tensor(3.0)}, "Tally:1": {"total": torch.tensor(7.0)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.load_state_dict(legacy)
    assert (first.total.item(), second.total.item()) == (3.0, 7.0)
