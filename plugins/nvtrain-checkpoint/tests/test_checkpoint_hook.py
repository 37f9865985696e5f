"""CheckpointHook in a run: configuration, cadence, async saving, resume options, errors."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import nvtrain_checkpoint.hook as hook_module
import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, list_checkpoints, read_checkpoint, storage

import nvtrain
from nvtrain import TrainingStage
from nvtrain.step_scheduler import StepSchedulerConfig

# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"step_interval": 0}, ValueError, r"CheckpointHook.step_interval must be an int >= 1 or None \(got 0\)"),
        ({"epoch_interval": 1.5}, ValueError, r"CheckpointHook.epoch_interval must be an int >= 1 or None"),
        ({"keep_last_n": 0}, ValueError, r"CheckpointHook.keep_last_n must be an int >= 1 or None \(got 0\)"),
        ({"async_save": "yes"}, TypeError, r"CheckpointHook.async_save must be True or False \(got 'yes'\)"),
        ({"async_writer": "fork"}, ValueError, r"CheckpointHook.async_writer must be 'process' or 'thread' \(got 'fork'\)"),
        ({"rank_zero_only": 1}, TypeError, r"CheckpointHook.rank_zero_only must be True or False"),
        ({"resume": 3}, ValueError, r"CheckpointHook.resume must be 'never', 'auto' or a checkpoint path \(got 3\)"),
        ({"checkpoint_dir": ""}, TypeError, r"CheckpointHook.checkpoint_dir must be a non-empty path"),
    ],
)
def test_bad_settings_fail_at_construction(fields: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        CheckpointHook(**{"checkpoint_dir": "ckpt", **fields})


@pytest.mark.parametrize("name", ["last_checkpoint_index", "priority"])
def test_outputs_and_fixed_orders_are_not_settings(tmp_path: Path, name: str) -> None:
    """``last_checkpoint_index`` is what the hook reports; its stages fix their own priority: neither is accepted."""
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{name}'"):
        CheckpointHook(tmp_path, **{name: 3})


def test_the_seed_example_constructs(tmp_path: Path) -> None:
    hook = CheckpointHook(str(tmp_path / "runs"), step_interval=500)
    assert hook.checkpoint_dir == tmp_path / "runs" and hook.resume == "never" and hook.last_checkpoint_index is None
    assert CheckpointHook(tmp_path, resume=str(tmp_path / "step_5")).resume == tmp_path / "step_5"


def test_the_plugin_is_discovered_and_loaded_by_name(tmp_path: Path) -> None:
    import nvtrain.plugins

    assert "checkpoint" in {info.name for info in nvtrain.plugins.available()}
    hook = nvtrain.plugins.load("checkpoint", checkpoint_dir=str(tmp_path), step_interval=3)
    assert isinstance(hook, CheckpointHook) and hook.step_interval == 3


# -- cadence -----------------------------------------------------------------------------------------


def _saved(root: Path) -> list[int]:
    return [info.step for info in list_checkpoints(root)]


def test_default_cadence_follows_the_step_scheduler(driver: ModuleType, tmp_path: Path) -> None:
    driver.straight("plain", [CheckpointHook(tmp_path / "a")])  # epoch ends and the last step
    assert _saved(tmp_path / "a") == [9, 18]
    driver.straight("plain", [CheckpointHook(tmp_path / "b")], ckpt_every_steps=4)
    assert _saved(tmp_path / "b") == [4, 8, 9, 12, 16, 18]


def test_standalone_batches_after_a_run_do_not_consult_its_scheduler(driver: ModuleType, tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path)
    with nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook])) as strategy:
        strategy.run(driver.make_loader("plain"))
        assert _saved(tmp_path) == [9, 18]
        for batch in list(driver.make_loader("plain"))[:2]:
            strategy.train_batch(batch)  # the finished run's scheduler (last step, epoch end) is not asked
    assert _saved(tmp_path) == [9, 18] and strategy.ctx.step_count == 20


def test_step_and_epoch_intervals(driver: ModuleType, tmp_path: Path) -> None:
    driver.straight("plain", [CheckpointHook(tmp_path / "a", step_interval=4, epoch_interval=1)])
    assert _saved(tmp_path / "a") == [4, 8, 9, 12, 16, 18]
    driver.straight("plain", [CheckpointHook(tmp_path / "b", epoch_interval=2)])
    assert _saved(tmp_path / "b") == [18]
    driver.straight("plain", [CheckpointHook(tmp_path / "c", step_interval=7)])
    assert _saved(tmp_path / "c") == [7, 14, 18]  # 18: the end of the run is always kept


def test_keep_last_n_in_a_run(driver: ModuleType, tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path, step_interval=2, keep_last_n=2, async_save=True)
    driver.straight("plain", [hook])
    assert _saved(tmp_path) == [16, 18] and (tmp_path / "latest").read_text() == "step_18\n"
    assert hook.last_checkpoint_index == 18


def test_a_synchronous_save_deletes_what_retention_dropped_in_the_background(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing a dropped checkpoint's files takes the writer thread, never the training thread, and the
    next save starts only after that deletion ended (so its leftover sweep never races it)."""
    events: list[tuple[str, Any]] = []
    delete, write = storage.delete_trash, storage.write_state_file

    def slow_delete(trash: list[Path]) -> None:
        assert all(path.name.startswith(".trash-step_") and path.is_dir() for path in trash)
        events.append(("delete", threading.current_thread().name))
        time.sleep(0.05)  # long enough that a racing save would start inside it
        delete(trash)
        events.append(("deleted", None))

    def recorded_write(path: Path, state: Any) -> Any:
        events.append(("write", None))
        return write(path, state)

    monkeypatch.setattr(storage, "delete_trash", slow_delete)
    monkeypatch.setattr(storage, "write_state_file", recorded_write)
    hook = CheckpointHook(tmp_path, step_interval=2, keep_last_n=2)
    driver.straight("plain", [hook])
    assert _saved(tmp_path) == [16, 18] and (tmp_path / "latest").read_text() == "step_18\n"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["latest", "step_16", "step_18"]  # nothing left
    deletions = [thread for kind, thread in events if kind == "delete"]
    assert len(deletions) == 7  # steps 2 to 14, one per save from the third on
    assert all(thread.startswith("nvtrain-checkpoint") for thread in deletions)
    kinds = [kind for kind, _ in events]
    assert kinds == ["write", "write"] + ["write", "delete", "deleted"] * 7


def test_a_failed_background_deletion_is_raised_at_the_next_save(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(trash: list[Path]) -> None:
        raise PermissionError(13, "Permission denied", str(trash[0]))

    monkeypatch.setattr(storage, "delete_trash", refused)
    hook = CheckpointHook(tmp_path, step_interval=2, keep_last_n=1)
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook]))
    with pytest.raises(PermissionError) as info, strategy:
        strategy.run(driver.make_loader("plain"))
    notes = " ".join(info.value.__notes__)
    assert "while deleting .trash-step_2-" in notes and "in the background (keep_last_n=1)" in notes
    assert strategy.ctx.step_count == 6  # raised when the step-6 save waited for the step-2 deletion
    assert _saved(tmp_path) == [4] and read_checkpoint(tmp_path)["counters"]["step_count"] == 4


def test_an_epoch_interval_checkpoint_resumes_at_the_next_epoch(driver: ModuleType, tmp_path: Path) -> None:
    reference = driver.straight("plain", [CheckpointHook(tmp_path, epoch_interval=1)])
    recorder = driver.LossRecorder()
    strategy = nvtrain.TrainingStrategy.load_checkpoint(
        tmp_path / "step_9", **driver.strategy_kwargs("plain", [recorder])
    )
    with strategy:
        strategy.run(driver.make_loader("plain"))
    assert recorder.losses[0][0] == 10
    driver.assert_same(reference["params"], driver.summary(strategy, recorder)["params"])
    assert strategy.ctx.epoch == 2


class _VetoBatches(nvtrain.TrainingUpdateHook):
    """Vetoes the optimizer step of the given 0-based micro-batches."""

    stages = frozenset({TrainingStage.DO_OPTIMIZER_STEP})

    def __init__(self, batches: set[int]) -> None:
        self.batches = batches

    def __call__(self, ctx: nvtrain.TrainingContext, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
        return ctx.batch_count not in self.batches, ctx.loss


class _CountSaves:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[int] = []
        original = storage.save_checkpoint

        def counting(root: Any, step: int, *args: Any, **kwargs: Any) -> Path:
            self.steps.append(step)
            return original(root, step, *args, **kwargs)

        monkeypatch.setattr(storage, "save_checkpoint", counting)


def test_only_real_steps_save_and_never_twice(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saves = _CountSaves(monkeypatch)
    # micro-batches 1..4 are vetoed: step_count stays at 1 while they pass
    driver.straight("plain", [_VetoBatches({1, 2, 3, 4}), CheckpointHook(tmp_path, step_interval=1)])
    assert saves.steps == list(range(1, 15))
    assert _saved(tmp_path) == list(range(1, 15))


class _SigtermAt:
    """Sends SIGTERM to this process at AFTER_BATCH of the given 1-based micro-batch."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.batch_count == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)  # caught by the run's preemption handler


def test_preemption_saves_even_when_the_step_was_skipped(driver: ModuleType, tmp_path: Path) -> None:
    hook = CheckpointHook(tmp_path, step_interval=100)
    recorder = driver.LossRecorder()
    kwargs = driver.strategy_kwargs("plain", [_SigtermAt(3), _VetoBatches({3}), hook, recorder])
    with nvtrain.TrainingStrategy(**kwargs) as strategy:
        result = strategy.run(driver.make_loader("plain"))
    assert result.preempted and result.step_count == 3 and result.batch_count == 4
    assert _saved(tmp_path) == [3]
    state = read_checkpoint(tmp_path)
    assert state["counters"]["batch_count"] == 4 and state["scheduler"]["position"] == 4
    # continuing from it skips the consumed (vetoed) micro-batch, as the uninterrupted run did
    reference = driver.straight("plain", [_VetoBatches({3})])
    again = driver.LossRecorder()
    resumed = nvtrain.TrainingStrategy(
        **driver.strategy_kwargs("plain", [_VetoBatches({3}), CheckpointHook(tmp_path, resume="auto"), again])
    )
    with resumed:
        resumed.run(driver.make_loader("plain"))
    driver.assert_same(reference["losses"], recorder.losses + again.losses)
    driver.assert_same(reference["params"], driver.summary(resumed, again)["params"])


# -- async saving --------------------------------------------------------------------------------------


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_and_sync_saves_write_identical_files(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Training moves on (and changes the live tensors) while a background save writes; what it writes is
    still, byte for byte, what a synchronous save of the same step writes."""
    driver.straight("plain", [CheckpointHook(tmp_path / "sync", step_interval=2)])
    events: list[tuple[str, int]] = []
    original = storage.save_checkpoint

    def slow(root: Any, step: int, *args: Any, **kwargs: Any) -> Path:
        events.append(("start", step))
        time.sleep(0.02)  # training moves on (and mutates the live tensors) while this writes
        path = original(root, step, *args, **kwargs)
        events.append(("end", step))
        return path

    monkeypatch.setattr(storage, "save_checkpoint", slow)  # in this process: seen by the thread writer only
    hook = CheckpointHook(tmp_path / "async", step_interval=2, async_save=True, async_writer=writer)
    driver.straight("plain", [hook])
    sync, written = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sorted(sync) == sorted(written) and len(sync) == 9 * 2 + 1
    for name in sync:
        assert sync[name] == written[name], f"{name} differs"
    if writer == "thread":  # one write at a time, in order: the next save waited for the previous one
        assert events == [(kind, step) for step in range(2, 19, 2) for kind in ("start", "end")]
    else:
        assert events == [] and hook.last_checkpoint_index == 18


def test_last_checkpoint_index_follows_completed_async_writes(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = storage.save_checkpoint

    def gated(*args: Any, **kwargs: Any) -> Path:
        assert release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(storage, "save_checkpoint", gated)
    hook = CheckpointHook(tmp_path, step_interval=1, async_save=True, async_writer="thread")
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook]))
    strategy.train_batch(next(iter(driver.make_loader("plain"))))  # standalone batches save too
    assert hook.last_checkpoint_index is None and _saved(tmp_path) == []  # still writing
    release.set()
    strategy.close()  # flushes
    assert hook.last_checkpoint_index == 1 and _saved(tmp_path) == [1]


class _FailAt:
    def __init__(self, step: int) -> None:
        self.step = step

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            raise RuntimeError("boom")


def test_an_exception_flushes_the_pending_write(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = storage.save_checkpoint

    def slow(*args: Any, **kwargs: Any) -> Path:
        time.sleep(0.2)
        return original(*args, **kwargs)

    monkeypatch.setattr(storage, "save_checkpoint", slow)
    hook = CheckpointHook(tmp_path, step_interval=2, async_save=True, async_writer="thread")
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, _FailAt(3)]))
    with pytest.raises(RuntimeError, match="boom"), strategy:
        strategy.run(driver.make_loader("plain"))
    assert _saved(tmp_path) == [2] and hook.last_checkpoint_index == 2
    assert read_checkpoint(tmp_path)["counters"]["step_count"] == 2


def test_a_failed_background_write_is_raised_not_lost(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(path: Path, state: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "write_state_file", disk_full)
    hook = CheckpointHook(tmp_path, step_interval=2, async_save=True, async_writer="thread")
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook]))
    with pytest.raises(OSError, match="No space left") as info, strategy:
        strategy.run(driver.make_loader("plain"))
    assert any("while writing step_2 in the background" in note for note in info.value.__notes__)
    assert list(tmp_path.iterdir()) == []  # no half-written temporary directory left behind


class _Unsaveable:
    plugin_name = "weird"

    @nvtrain.hookimpl
    def before_epoch(self, ctx: Any) -> None:  # a plugin must implement a stage to be registered
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"ok": torch.zeros(1), "handle": object()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("async_save", [True, False])
def test_state_a_safe_load_could_not_read_is_refused_at_save_time(
    driver: ModuleType, tmp_path: Path, async_save: bool
) -> None:
    with pytest.raises(TypeError, match=r"cannot save state\['hooks'\]\['weird'\]\['handle'\] of type builtins.object"):
        driver.straight("plain", [_Unsaveable(), CheckpointHook(tmp_path, step_interval=1, async_save=async_save)])
    assert _saved(tmp_path) == []


@pytest.mark.parametrize("async_save", [True, False])
def test_only_a_background_save_copies_host_tensors(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A synchronous save writes before training resumes, so it takes the host tensors as they are;
    a background one on a thread must copy them first (training changes them while the write runs).
    The writer process's copies are staged in shared memory instead (test_checkpoint_writer_process)."""
    calls: list[bool] = []
    real = hook_module.snapshot

    def spy(state: Any, label: str = "state", reuse: Any = None, *, copy_host: bool = True) -> Any:
        calls.append(copy_host)
        return real(state, label, reuse, copy_host=copy_host)

    monkeypatch.setattr(hook_module, "snapshot", spy)
    reference = driver.straight("plain")
    hook = CheckpointHook(tmp_path, step_interval=3, async_save=async_save, async_writer="thread")
    saved = driver.straight("plain", [hook])
    assert calls and set(calls) == {async_save}
    driver.assert_same(reference["params"], saved["params"])  # saving changed nothing in the run
    loaded = read_checkpoint(tmp_path / "step_18")
    driver.assert_same(saved["params"], loaded["models"]["main"])


# -- resuming --------------------------------------------------------------------------------------------


def test_auto_resume_with_nothing_to_resume_starts_fresh(driver: ModuleType, tmp_path: Path) -> None:
    reference = driver.straight("plain")
    fresh = driver.straight("plain", [CheckpointHook(tmp_path / "empty", resume="auto")])
    driver.assert_same(reference["params"], fresh["params"])


def test_resume_from_an_explicit_path(driver: ModuleType, tmp_path: Path) -> None:
    reference = driver.straight("plain", [CheckpointHook(tmp_path / "a", step_interval=5)])
    recorder = driver.LossRecorder()
    hook = CheckpointHook(tmp_path / "b", resume=tmp_path / "a" / "step_10")
    with nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, recorder])) as strategy:
        strategy.run(driver.make_loader("plain"))
    assert recorder.losses[0][0] == 11
    driver.assert_same(reference["params"], driver.summary(strategy, recorder)["params"])
    assert _saved(tmp_path / "b") == [18]  # the resumed step itself is not saved again


def test_resume_never_warns_about_existing_checkpoints(driver: ModuleType, tmp_path: Path) -> None:
    driver.straight("plain", [CheckpointHook(tmp_path)])
    with pytest.warns(UserWarning, match=r"already holds checkpoints and resume='never'"):
        driver.straight("plain", [CheckpointHook(tmp_path)])


def test_load_checkpoint_restores_hooks_passed_again(driver: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("nvtrain_ema")
    from nvtrain_ema import EMAHook

    ema = EMAHook(decay=0.5)
    driver.straight("plain", [ema, CheckpointHook(tmp_path)])
    again = EMAHook(decay=0.5)
    strategy = nvtrain.TrainingStrategy.load_checkpoint(
        tmp_path / "step_18", **{**driver.strategy_kwargs("plain", []), "hooks": [again]}
    )
    strategy.run(driver.make_loader("plain"))  # nothing left to train: the state is just restored
    assert again.num_updates == ema.num_updates == 18
    driver.assert_same(ema.state_dict(), again.state_dict())


def test_a_checkpoint_of_another_model_is_refused_clearly(driver: ModuleType, tmp_path: Path) -> None:
    driver.straight("plain", [CheckpointHook(tmp_path)])
    kwargs = driver.strategy_kwargs("plain", [])
    kwargs["models"] = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    # load_checkpoint restores at once, so it refuses at once (not at the next run)
    with pytest.raises(ValueError, match=r"the checkpoint's weights for model 'main' do not fit this model") as info:
        nvtrain.TrainingStrategy.load_checkpoint(tmp_path, **kwargs)
    assert any(f"while restoring checkpoint '{tmp_path}'" in note for note in info.value.__notes__)
    kwargs = driver.strategy_kwargs("plain", [])
    kwargs["models"], kwargs["optimizers"], kwargs["lr_schedulers"] = {"other": kwargs["models"]}, {"other": kwargs["optimizers"]}, {}
    with pytest.raises(ValueError, match=r"the checkpoint's models are \['main'\] but this strategy has \['other'\]"):
        nvtrain.TrainingStrategy.load_checkpoint(tmp_path, **kwargs)


@pytest.mark.filterwarnings("ignore:hook GradientAccumulationHook .* has no state in the checkpoint")
def test_a_checkpoint_with_another_batch_configuration_is_refused(driver: ModuleType, tmp_path: Path) -> None:
    driver.straight("plain", [CheckpointHook(tmp_path)])
    kwargs = driver.strategy_kwargs("plain", [])
    kwargs["step_scheduler"] = StepSchedulerConfig(num_epochs=2, global_batch_size=8)
    from nvtrain.hooks.accumulation import GradientAccumulationHook

    kwargs["hooks"] = [GradientAccumulationHook(steps=2)]
    strategy = nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_9", **kwargs)
    with pytest.raises(ValueError, match=r"different configuration"):
        strategy.run(driver.make_loader("plain"))


def test_the_mixed_precision_scaler_resumes(driver: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("nvtrain_amp")
    from nvtrain_amp import MixedPrecisionHook

    def amp() -> Any:
        return MixedPrecisionHook(precision="fp16", init_scale=2.0**10, growth_interval=3)

    first = amp()
    reference = driver.straight("plain", [first, CheckpointHook(tmp_path, step_interval=4)])
    assert read_checkpoint(tmp_path / "step_8")["hooks"]["amp"]["scaler"]["scale"] == 2.0**12  # grew twice
    again, recorder = amp(), driver.LossRecorder()
    strategy = nvtrain.TrainingStrategy.load_checkpoint(
        tmp_path / "step_8", **driver.strategy_kwargs("plain", [again, recorder])
    )
    with strategy:
        strategy.run(driver.make_loader("plain"))
    assert again.state_dict() == first.state_dict()
    driver.assert_same([e for e in reference["losses"] if e[0] > 8], recorder.losses)
    driver.assert_same(reference["params"], driver.summary(strategy, recorder)["params"])
