"""CheckpointHook in a run: configuration, cadence, async saving, resume options, errors."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import nvtrain_checkpoint.hook as hook_module
import pytest
import torch
from nvtrain_checkpoint import CheckpointError, CheckpointHook, list_checkpoints, read_checkpoint, storage

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


class _FailingEpochEnd:
    """An AFTER_EPOCH hook that fails in the second epoch (a metrics upload, say)."""

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.epoch == 1:
            raise OSError("remote logger unreachable at epoch end")


def test_an_epoch_end_step_is_saved_even_when_another_after_epoch_hook_raises(
    driver: ModuleType, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The save waits for the epoch's end-of-epoch work; a failure there must not lose the epoch."""
    hooks = [_FailingEpochEnd(), CheckpointHook(tmp_path, step_interval=3)]
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", hooks))
    with pytest.raises(OSError, match="remote logger unreachable"), strategy:
        strategy.run(driver.make_loader("plain"))
    assert strategy.ctx.step_count == 18
    assert _saved(tmp_path) == [3, 6, 9, 12, 15, 18]
    assert "saving step 18 (the epoch's end) anyway" in caplog.text


def test_last_saved_step_is_set_when_the_save_is_taken_and_the_index_when_it_is_on_disk(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real_write = storage.save_checkpoint

    def held_write(*args: Any, **kwargs: Any) -> Any:  # the background write waits until told to go on
        release.wait(timeout=30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(storage, "save_checkpoint", held_write)
    hook = CheckpointHook(tmp_path, step_interval=2, async_save=True, async_writer="thread")
    seen: list[tuple[int | None, int | None]] = []

    class Watch:
        @nvtrain.hookimpl
        def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 2 and not seen:
                seen.append((hook.last_saved_step, hook.last_checkpoint_index))
                release.set()

    driver.straight("plain", [hook, Watch()])
    assert seen == [(2, None)]  # taken at step 2, not on disk yet
    assert hook.last_saved_step == hook.last_checkpoint_index == 18


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


class _Saves:
    """The steps written to disk, each with the stage the run was in."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ctx: nvtrain.TrainingContext | None = None
        self.saves: list[tuple[int, TrainingStage]] = []
        original = storage.save_checkpoint

        def recording(root: Any, step: int, *args: Any, **kwargs: Any) -> Path:
            assert self.ctx is not None
            self.saves.append((step, self.ctx.stage))
            return original(root, step, *args, **kwargs)

        monkeypatch.setattr(storage, "save_checkpoint", recording)

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        self.ctx = ctx


def test_epoch_interval_saves_completed_epochs_only(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch cut short (max_steps mid-epoch) is no completed epoch: its steps are saved at the end of the run."""
    watcher = _Saves(monkeypatch)
    kwargs = driver.strategy_kwargs("plain", [watcher, CheckpointHook(tmp_path, epoch_interval=1)])
    kwargs["step_scheduler"] = StepSchedulerConfig(
        num_epochs=2, max_steps=13, ckpt_every_steps=None, validate_on_checkpoint=False
    )
    with nvtrain.TrainingStrategy(**kwargs) as strategy:
        strategy.run(driver.make_loader("plain"))
    assert watcher.saves == [(9, TrainingStage.AFTER_EPOCH), (13, TrainingStage.AFTER_TRAINING)]


def _epoch_lr_kwargs(driver: ModuleType, hooks: list[object]) -> dict[str, Any]:
    """Three epochs of "plain" whose LR halves at every epoch's end (an epoch-interval LR schedule)."""
    kwargs = driver.strategy_kwargs("plain", hooks)
    kwargs["lr_schedulers"] = nvtrain.LRSchedule(
        functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5), interval="epoch"
    )
    kwargs["step_scheduler"] = StepSchedulerConfig(num_epochs=3, ckpt_every_steps=None, validate_on_checkpoint=False)
    return kwargs


def _epoch_lr_straight(driver: ModuleType, hooks: list[object]) -> tuple[nvtrain.TrainingStrategy, dict[str, Any]]:
    recorder = driver.LossRecorder()
    torch.manual_seed(1)
    with nvtrain.TrainingStrategy(**_epoch_lr_kwargs(driver, [*hooks, recorder])) as strategy:
        strategy.run(driver.make_loader("plain"))
    return strategy, driver.summary(strategy, recorder)


def _assert_finishes_like(driver: ModuleType, reference: dict[str, Any], resumed: dict[str, Any]) -> None:
    for key in ("params", "optimizer", "lr_scheduler", "counters"):  # the optimizer's param groups hold the LR
        driver.assert_same(reference[key], resumed[key], key)


@pytest.mark.parametrize("how", ["load_checkpoint", "load_into", "auto"])
def test_a_checkpoint_at_an_epoch_end_is_written_after_the_epochs_lr_step(
    driver: ModuleType, tmp_path: Path, how: str
) -> None:
    """An epoch-interval LR schedule steps after the epoch's last batch (and its validation); the checkpoint of
    that step is written after it, so the resumed run starts the next epoch at the LR a straight run has."""
    straight, reference = _epoch_lr_straight(driver, [CheckpointHook(tmp_path / "a")])  # default: epoch ends
    assert _saved(tmp_path / "a") == [9, 18, 27]
    step_9 = tmp_path / "a" / "step_9"
    assert read_checkpoint(step_9)["lr_schedulers"]["main"]["last_epoch"] == 1  # epoch 1's step taken
    recorder, loader = driver.LossRecorder(), driver.make_loader("plain")
    if how == "load_checkpoint":
        strategy = nvtrain.TrainingStrategy.load_checkpoint(step_9, **_epoch_lr_kwargs(driver, [recorder]))
    elif how == "load_into":
        hook = CheckpointHook(tmp_path / "b")
        strategy = nvtrain.TrainingStrategy(**_epoch_lr_kwargs(driver, [hook, recorder]))
        strategy.setup(loader)
        hook.load_into(strategy, step_9)
    else:
        shutil.copytree(step_9, tmp_path / "b" / "step_9")
        strategy = nvtrain.TrainingStrategy(
            **_epoch_lr_kwargs(driver, [CheckpointHook(tmp_path / "b", resume="auto"), recorder])
        )
    with strategy:
        strategy.run(loader)
    assert recorder.losses[0][0] == 10
    driver.assert_same([entry for entry in reference["losses"] if entry[0] > 9], recorder.losses)
    _assert_finishes_like(driver, reference, driver.summary(strategy, recorder))
    lr = strategy.ctx.optimizers["main"].param_groups[0]["lr"]
    assert lr == straight.ctx.optimizers["main"].param_groups[0]["lr"] == 0.01 * 0.5**3


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


def test_a_preemption_at_an_epoch_end_is_saved_after_the_epochs_lr_step(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal agreed at an epoch's last step: the epoch-end work runs (its LR step), then the checkpoint."""
    _, reference = _epoch_lr_straight(driver, [])
    watcher, first = _Saves(monkeypatch), driver.LossRecorder()
    torch.manual_seed(1)
    hooks = [_SigtermAt(8), watcher, CheckpointHook(tmp_path, resume="auto"), first]  # agreed at step 9's boundary
    with nvtrain.TrainingStrategy(**_epoch_lr_kwargs(driver, hooks)) as strategy:
        result = strategy.run(driver.make_loader("plain"))
    assert result.preempted and result.step_count == 9
    assert watcher.saves == [(9, TrainingStage.AFTER_EPOCH)]
    assert read_checkpoint(tmp_path)["lr_schedulers"]["main"]["last_epoch"] == 1
    again = driver.LossRecorder()
    resumed = nvtrain.TrainingStrategy(**_epoch_lr_kwargs(driver, [CheckpointHook(tmp_path, resume="auto"), again]))
    with resumed:
        resumed.run(driver.make_loader("plain"))
    driver.assert_same(reference["losses"], first.losses + again.losses)
    _assert_finishes_like(driver, reference, driver.summary(resumed, again))


# -- async saving --------------------------------------------------------------------------------------


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class _ViewState:
    """A checkpointable hook whose state holds views of a larger tensor, as running buffers often do."""

    plugin_name = "view_state"

    def __init__(self) -> None:
        self.big = torch.arange(1000, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"head": self.big[:4], "tail": self.big[-4:]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.big[:4].copy_(state["head"])
        self.big[-4:].copy_(state["tail"])

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.big.add_(1)


@pytest.mark.parametrize("views", [False, True], ids=["plain", "views"])
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_and_sync_saves_write_identical_files(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, views: bool
) -> None:
    """Training moves on (and changes the live tensors) while a background save writes; what it writes is
    still, byte for byte, what a synchronous save of the same step writes. Also when hook state holds views
    of a larger tensor: every save writes only the views' own bytes."""

    def extra() -> list[object]:
        return [_ViewState()] if views else []

    driver.straight("plain", [*extra(), CheckpointHook(tmp_path / "sync", step_interval=2)])
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
    driver.straight("plain", [*extra(), hook])
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


def test_resume_never_resumes_from_nothing_beside_existing_checkpoints(driver: ModuleType, tmp_path: Path) -> None:
    reference = driver.straight("plain", [CheckpointHook(tmp_path, step_interval=5)])
    assert CheckpointHook(tmp_path, resume="auto").resume_checkpoint() == tmp_path / "step_18"  # there is one
    hook = CheckpointHook(tmp_path, resume="never", step_interval=5)
    assert hook.resume_checkpoint() is None
    with pytest.warns(UserWarning, match=r"already holds checkpoints and resume='never'"):
        fresh = driver.straight("plain", [hook])
    assert [batch for batch, _ in fresh["losses"]] == list(range(1, 19))  # from step 0
    driver.assert_same(reference["params"], fresh["params"])


@pytest.mark.parametrize("damage", ["every_manifest_lost", "only_an_empty_step_directory"])
def test_auto_resume_over_only_incomplete_checkpoints_refuses_naming_them(
    driver: ModuleType, tmp_path: Path, damage: str
) -> None:
    """``step_<N>`` directories none of which is intact are a damaged history, not an empty one: the resume
    stops with a CheckpointError naming them rather than silently training from step 0."""
    if damage == "every_manifest_lost":
        driver.straight("plain", [CheckpointHook(tmp_path, step_interval=6)])
        for step in (6, 12, 18):
            (tmp_path / f"step_{step}" / storage.MANIFEST_NAME).unlink()
        broken = [6, 12, 18]
    else:
        (tmp_path / "step_30").mkdir()
        broken = [30]
    named = "; ".join(re.escape(f"{tmp_path / f'step_{step}'} is incomplete (no manifest.json)") for step in broken)
    pattern = rf"no intact checkpoint in {re.escape(str(tmp_path))} to resume from: {named} \(delete the broken ones"
    with pytest.raises(CheckpointError, match=pattern):
        CheckpointHook(tmp_path, resume="auto").resume_checkpoint()
    recorder = driver.LossRecorder()
    strategy = nvtrain.TrainingStrategy(
        **driver.strategy_kwargs("plain", [CheckpointHook(tmp_path, resume="auto", step_interval=6), recorder])
    )
    with pytest.raises(CheckpointError, match=pattern), strategy:
        strategy.run(driver.make_loader("plain"))
    assert recorder.losses == [] and _saved(tmp_path) == []  # nothing trained, nothing written


def test_auto_resume_over_only_an_unfinished_save_starts_fresh(tmp_path: Path) -> None:
    """A ``.tmp-`` directory is a save a kill interrupted before it was published: no checkpoint at all."""
    (tmp_path / ".tmp-step_3-3f2a").mkdir()
    assert CheckpointHook(tmp_path, resume="auto").resume_checkpoint() is None


def test_load_into_without_the_data_position_goes_on_with_the_next_epoch(driver: ModuleType, tmp_path: Path) -> None:
    """A checkpoint of an epoch's last step, loaded without its data position (as on another number of ranks),
    starts the next epoch from its first micro-batch; the finished epoch is not trained again. That is where
    the position pointed anyway, so the run finishes as a straight one."""
    reference = driver.straight("plain", [CheckpointHook(tmp_path / "a")])  # step_9 ends epoch 1 of 2
    hook, recorder, loader = CheckpointHook(tmp_path / "b"), driver.LossRecorder(), driver.make_loader("plain")
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, recorder]))
    strategy.setup(loader)
    step_9 = tmp_path / "a" / "step_9"
    assert hook.load_into(strategy, step_9, data_position=False) == step_9
    ctx = strategy.ctx
    assert (ctx.step_count, ctx.epoch, ctx.epoch_step_count) == (9, 1, 0)  # the next epoch, at its start
    with strategy:
        result = strategy.run(loader)
    assert [entry[0] for entry in recorder.losses] == list(range(10, 19))
    assert (result.step_count, result.batch_count, result.epoch) == (18, 18, 2)
    driver.assert_same([entry for entry in reference["losses"] if entry[0] > 9], recorder.losses)
    resumed = driver.summary(strategy, recorder)
    for key in ("params", "optimizer", "counters"):
        driver.assert_same(reference[key], resumed[key], key)


class _CrashOnceAt:
    """Fails the run once, at AFTER_BATCH of the given step: a transient error a retry loop gets past."""

    def __init__(self, step: int) -> None:
        self.step, self.crashed = step, False

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step and not self.crashed:
            self.crashed = True
            raise RuntimeError(f"transient failure at step {self.step}")


def test_a_reused_auto_resume_hook_resumes_from_what_the_failed_attempt_saved(
    driver: ModuleType, tmp_path: Path
) -> None:
    """A retry loop hands the same hook to a new strategy: the run takes the checkpoint on disk now, not the
    answer the hook gave before the first attempt."""
    reference = driver.straight("plain")
    hook, crash = CheckpointHook(tmp_path, resume="auto", step_interval=5), _CrashOnceAt(7)
    assert hook.resume_checkpoint() is None  # asked before the first run, as `nvtrain train` does
    torch.manual_seed(1)
    first = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [crash, hook]))
    with pytest.raises(RuntimeError, match="transient failure at step 7"), first:
        first.run(driver.make_loader("plain"))
    assert _saved(tmp_path) == [5]
    recorder = driver.LossRecorder()
    with nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [crash, hook, recorder])) as second:
        second.run(driver.make_loader("plain"))
    assert recorder.losses[0][0] == 6
    driver.assert_same(reference["params"], driver.summary(second, recorder)["params"])


def test_a_run_that_was_restored_already_consumes_the_resume_choice(driver: ModuleType, tmp_path: Path) -> None:
    """A run that starts restored (load_checkpoint) does not resume, and still uses up the hook's earlier
    answer: the next run with the hook finds what that run saved."""
    driver.straight("plain", [CheckpointHook(tmp_path / "a", step_interval=5)])
    hook = CheckpointHook(tmp_path / "b", resume="auto")
    assert hook.resume_checkpoint() is None  # nothing in tmp_path / "b" yet
    restored = nvtrain.TrainingStrategy.load_checkpoint(
        tmp_path / "a" / "step_5", **driver.strategy_kwargs("plain", [hook])
    )
    with restored:
        restored.run(driver.make_loader("plain"))  # from step 5: saves the epoch ends into tmp_path / "b"
    assert _saved(tmp_path / "b") == [9, 18]
    recorder = driver.LossRecorder()
    with nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, recorder])) as again:
        result = again.run(driver.make_loader("plain"))
    assert recorder.losses == [] and result.step_count == 18  # resumed from step_18: nothing left to train


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
    kwargs["forward_fn"] = lambda ctx: ctx.models["other"](ctx.batch[0])  # no "main": the default forward needs one
    with pytest.raises(ValueError, match=r"the checkpoint's models are \['main'\] but this strategy has \['other'\]"):
        nvtrain.TrainingStrategy.load_checkpoint(tmp_path, **kwargs)


@pytest.mark.filterwarnings("ignore:hook GradientAccumulationHook .* has no state in the checkpoint")
@pytest.mark.parametrize(("step", "refused"), [(4, True), (9, False)], ids=["mid-epoch", "epoch-end"])
def test_a_checkpoint_with_another_batch_configuration(
    driver: ModuleType, tmp_path: Path, step: int, refused: bool
) -> None:
    """Refused in the middle of an epoch (its rest would be grouped otherwise); at an epoch's end the next
    epoch starts whole under the new configuration."""
    driver.straight("plain", [CheckpointHook(tmp_path, step_interval=4, epoch_interval=1)])
    kwargs = driver.strategy_kwargs("plain", [])
    kwargs["step_scheduler"] = StepSchedulerConfig(num_epochs=2, global_batch_size=8)
    from nvtrain.hooks.accumulation import GradientAccumulationHook

    kwargs["hooks"] = [GradientAccumulationHook(steps=2)]
    strategy = nvtrain.TrainingStrategy.load_checkpoint(tmp_path / f"step_{step}", **kwargs)
    if refused:
        with pytest.raises(ValueError, match=r"different configuration"):
            strategy.run(driver.make_loader("plain"))
        return
    with strategy:
        result = strategy.run(driver.make_loader("plain"))
    assert result.step_count == 9 + 5  # epoch 2's 36 samples in steps of 8 (the last one of 4)


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


def test_two_checkpoint_hooks_on_one_directory_are_refused_at_setup(tmp_path: Path) -> None:
    def strategy(*hooks: CheckpointHook) -> nvtrain.TrainingStrategy:
        return nvtrain.TrainingStrategy(
            torch.nn.Linear(3, 1),
            functools.partial(torch.optim.SGD, lr=0.1),
            torch.nn.functional.mse_loss,
            hooks=list(hooks),
            device="cpu",
        )

    same = strategy(CheckpointHook(tmp_path / "ckpt"), CheckpointHook(tmp_path / "other" / ".." / "ckpt", keep_last_n=1))
    with pytest.raises(ValueError, match=r"two checkpoint hooks write to '.*ckpt'; each would replace the other's"):
        same.setup()
    apart = strategy(CheckpointHook(tmp_path / "every"), CheckpointHook(tmp_path / "last", keep_last_n=1))
    apart.setup()  # two directories: a full history beside the newest one is fine
    assert not list(tmp_path.iterdir())  # nothing written at SETUP
