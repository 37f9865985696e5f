"""The core's in-memory training state (nvtrain.state) and the strategy's state / restore methods."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, read_checkpoint, snapshot

import nvtrain
import nvtrain.state
from nvtrain.state import (
    apply_rng_state,
    capture_rng_state,
    checkpointable_hooks,
    find_checkpoint_reader,
    unwrap_model,
)


def test_wrappers_are_unwrapped() -> None:
    model = torch.nn.Linear(2, 2)
    assert unwrap_model(torch.nn.DataParallel(model)) is model
    assert unwrap_model(model) is model


class _Stateful:
    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.plugin_name = name

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_hook_keys_are_plugin_name_or_class_and_an_identity() -> None:
    a, b, c, d = _Stateful("ema"), _Stateful("ema"), _Stateful(), object()
    a.model_key, b.model_key = "main", "teacher"  # type: ignore[attr-defined]
    assert checkpointable_hooks([a, d, b, c]) == {"ema:main": a, "ema:teacher": b, "_Stateful": c}
    assert checkpointable_hooks([c, b, a]) == {"ema:main": a, "ema:teacher": b, "_Stateful": c}


def test_rng_states_round_trip() -> None:
    numpy = pytest.importorskip("numpy")
    generator = torch.Generator().manual_seed(5)
    loader = torch.utils.data.DataLoader(list(range(8)), shuffle=True, generator=generator)
    state = snapshot(capture_rng_state(loader))
    expected = (random.random(), numpy.random.rand(), torch.rand(3), torch.rand(2, generator=generator))
    random.random(), numpy.random.rand(), torch.rand(5), torch.rand(4, generator=generator)  # move them all on
    apply_rng_state(state, loader)
    again = (random.random(), numpy.random.rand(), torch.rand(3), torch.rand(2, generator=generator))
    assert expected[:2] == again[:2]
    assert torch.equal(expected[2], again[2]) and torch.equal(expected[3], again[3])


class _GrabState:
    """Copies ``strategy.state_dict()`` at AFTER_BATCH of one step (what a checkpoint would hold)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.state: dict[str, Any] | None = None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step and self.state is None:
            self.state = snapshot(ctx.strategy.state_dict())  # type: ignore[union-attr]


def test_state_dict_and_load_state_dict_resume_in_memory(driver: ModuleType) -> None:
    grab = _GrabState(6)
    reference = driver.straight("plain", [grab])
    assert grab.state is not None and set(grab.state) >= {"models", "optimizers", "rng", "scheduler", "counters"}
    recorder = driver.LossRecorder()
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [recorder]))
    strategy.load_state_dict(grab.state)  # not set up yet: applied when the run starts
    strategy.run(driver.make_loader("plain"))
    assert recorder.losses[0][0] == 7
    driver.assert_same(reference["params"], driver.summary(strategy, recorder)["params"])
    driver.assert_same(reference["optimizer"], driver.summary(strategy, recorder)["optimizer"])


def test_restore_of_a_set_up_strategy_applies_the_weights_now(driver: ModuleType, tmp_path: Path) -> None:
    reference = driver.straight("plain", [CheckpointHook(tmp_path)])
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", []))
    strategy.train_batch(next(iter(driver.make_loader("plain"))))
    strategy.restore(tmp_path)  # the root: its latest checkpoint (step 18)
    assert strategy.ctx.step_count == 18
    driver.assert_same(reference["params"], {k: v for k, v in strategy.ctx.models["main"].state_dict().items()})


def test_the_reader_comes_from_a_hook_before_the_entry_point(tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path)
    assert find_checkpoint_reader([object(), hook]) == hook.read_checkpoint
    import nvtrain_checkpoint

    assert find_checkpoint_reader([]) is nvtrain_checkpoint.read_checkpoint


def test_without_the_distribution_restore_names_it(monkeypatch: pytest.MonkeyPatch, driver: ModuleType) -> None:
    monkeypatch.setattr(nvtrain.state.importlib.metadata, "entry_points", lambda **kwargs: [])
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", []))
    with pytest.raises(ImportError, match=r"needs the nvtrain-checkpoint distribution \(pip install nvtrain-checkpoint\)"):
        strategy.restore("anywhere")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_and_generators_are_saved_on_the_host() -> None:
    live = {"weight": torch.randn(4, 4, device="cuda")}
    copied = snapshot(live)
    assert copied["weight"].device.type == "cpu" and torch.equal(copied["weight"], live["weight"].cpu())
    live["weight"].add_(1)  # the snapshot does not follow the live tensor
    assert not torch.equal(copied["weight"], live["weight"].cpu())
    state = snapshot(capture_rng_state())
    assert len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(3, device="cuda")
    torch.rand(5, device="cuda")
    apply_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), expected)


def test_a_checkpoint_from_standalone_batches_keeps_its_counters_in_a_run(
    driver: ModuleType, tmp_path: Path
) -> None:
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [CheckpointHook(tmp_path, step_interval=2)]))
    for batch in list(driver.make_loader("plain"))[:4]:
        strategy.train_batch(batch)
    strategy.close()
    assert read_checkpoint(tmp_path / "step_4")["scheduler"] is None  # saved outside a run
    resumed = nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_4", **driver.strategy_kwargs("plain", []))
    result = resumed.run(driver.make_loader("plain"))
    assert (result.step_count, result.global_step_count, result.batch_count) == (22, 22, 22)  # 4 + two epochs of 9


def test_a_snapshot_copies_and_can_reuse_an_earlier_ones_buffers() -> None:
    weight = torch.randn(3, 3)
    live = {"a": weight, "tied": weight, "list": [torch.zeros(2)], "step": 1}
    first = snapshot(live)
    assert first["a"] is first["tied"] and first["a"] is not weight  # shared stays shared, nothing aliases live
    weight.add_(1.0)
    assert not torch.equal(first["a"], weight)
    second = snapshot({**live, "tied": torch.ones(3, 3)}, reuse=first)  # untied now
    assert second["a"] is first["a"] and torch.equal(second["a"], weight)  # copied into the old buffer
    assert second["tied"] is not second["a"] and torch.equal(second["tied"], torch.ones(3, 3))
    assert second["list"][0] is first["list"][0]
    resized = snapshot({"a": torch.zeros(4)}, reuse=second)
    assert resized["a"] is not second["a"] and resized["a"].shape == (4,)


def test_a_snapshot_for_a_synchronous_save_keeps_host_tensors_and_still_checks_them() -> None:
    weight = torch.randn(3, 3)
    live = {"a": weight, "tied": weight, "rng": (3, tuple(range(625)), None), "ids": [1, 2]}
    kept = snapshot(live, copy_host=False)
    assert kept["a"].data_ptr() == weight.data_ptr() and kept["a"] is kept["tied"]  # no copy, ties kept
    assert kept["rng"][1] is live["rng"][1]  # an immutable tuple of numbers is taken as it is
    assert kept["ids"] == [1, 2] and kept["ids"] is not live["ids"]  # a list is still a new list
    with pytest.raises(TypeError, match=r"cannot save state\['bad'\]\[1\] of type builtins.object"):
        snapshot({"bad": [1, object()]}, copy_host=False)


def test_a_snapshot_for_a_synchronous_save_compacts_views_of_a_larger_storage() -> None:
    """torch.save writes a tensor's whole storage: a view kept as it is would write all of ``big``."""
    big = torch.arange(1000, dtype=torch.float32)
    whole, strided = torch.arange(4.0), torch.arange(12.0).reshape(3, 4).t()  # all of their storage
    kept = snapshot({"head": big[:4], "tail": big[-4:], "whole": whole, "strided": strided}, copy_host=False)
    for key, live in (("whole", whole), ("strided", strided)):  # the common case: no copy
        assert kept[key].data_ptr() == live.data_ptr() and kept[key].stride() == live.stride()
    for key, view in (("head", big[:4]), ("tail", big[-4:])):
        copy = kept[key]
        assert copy.data_ptr() != view.data_ptr() and torch.equal(copy, view)
        assert copy.storage_offset() == 0 and copy.untyped_storage().nbytes() == 4 * copy.element_size()


def test_without_data_position_continues_the_epoch_the_scheduler_state_names() -> None:
    """A state saved at an epoch's last step points at the next epoch: that one starts, not the finished one."""
    loader_state = {"num_workers": 0, "state": {"_num_yielded": 3}}
    state = {
        "counters": {"step_count": 9, "global_step_count": 9, "batch_count": 9, "epoch": 0, "epoch_step_count": 9},
        "scheduler": {"step": 9, "epoch": 1, "position": 0},
        "rng": {"torch": torch.get_rng_state()},
        "rng_by_rank": [{"torch": torch.get_rng_state(), "loader": loader_state}],
    }
    stripped = nvtrain.state.without_data_position(state)
    assert stripped["scheduler"] is None
    assert stripped["counters"] == {**state["counters"], "epoch": 1, "epoch_step_count": 0}
    assert [sorted(rng) for rng in stripped["rng_by_rank"]] == [["torch"]]  # a loader's own position goes too
    assert state["counters"]["epoch"] == 0 and "loader" in state["rng_by_rank"][0]  # the input is left alone
    mid_epoch = {**state, "counters": {**state["counters"], "epoch_step_count": 4}, "scheduler": None}
    restarted = nvtrain.state.without_data_position(mid_epoch)["counters"]
    assert restarted == {**mid_epoch["counters"], "epoch_step_count": 0}  # the saved epoch, from its start


def test_a_snapshot_does_not_follow_later_changes_of_lists_of_numbers() -> None:
    live = {"counts": [1, 2, 3], "nested": ([4, 5], 6)}
    copied = snapshot(live)
    live["counts"].append(4)
    live["nested"][0].append(7)
    assert copied == {"counts": [1, 2, 3], "nested": ([4, 5], 6)}
