"""Run control: stop requests from hooks (one process and two gloo ranks), epoch and metric-driven LR
schedules, and the seed's StepScheduler loop without finish_step()."""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import LRSchedule, StepScheduler
from nvtrain.testing import free_port

DEVICE = "cpu"


class StopAt:
    """Requests a stop at AFTER_OPTIMIZER_STEP of step ``step`` (on ``rank`` only, when given)."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step and not ctx.step_skipped and self.rank in (None, ctx.rank):
            ctx.request_stop("enough")


class Stages:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.last_steps: list[int] = []

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.sync_gradients and ctx.scheduler.is_last_step:
            self.last_steps.append(ctx.step_count)

    @nvtrain.hookimpl
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen.append(("after_epoch", ctx.step_count))

    @nvtrain.hookimpl
    def after_training(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen.append(("after_training", ctx.step_count))


def make_strategy(hooks: list[Any], **fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    fields.setdefault("optimizers", functools.partial(torch.optim.SGD, lr=0.1))
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2), loss_fn=torch.nn.functional.mse_loss, device=DEVICE, hooks=hooks, **fields
    )


def data(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(count)]


# -- request_stop ------------------------------------------------------------------------------


def test_a_hook_stops_the_run_at_the_next_step_boundary() -> None:
    stages = Stages()
    with make_strategy([StopAt(5), stages], num_epochs=3) as strategy:
        result = strategy.run(data(4))
    assert (result.step_count, result.preempted) == (5, False)
    assert result.stop_reason is not None and "enough" in result.stop_reason
    assert stages.last_steps == [5]  # is_last_step is true for the stopping step, and only for it
    assert stages.seen == [("after_epoch", 4), ("after_epoch", 5), ("after_training", 5)]


class SignalDuring:
    """Sends SIGUSR1 (the run's preemption signal) while step ``step`` trains: its boundary agrees it."""

    def __init__(self, step: int) -> None:
        self.step = step

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step - 1:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
@pytest.mark.parametrize(
    ("hooks", "max_steps", "preempted", "reason"),
    [
        ((SignalDuring(5),), None, True, "preempted by SIGUSR1"),  # cut short: a resume goes on
        ((SignalDuring(5), StopAt(5)), None, False, "enough"),  # the stop wins: the run is complete
        ((SignalDuring(5),), 5, False, None),  # the run's last step: nothing left to resume
    ],
    ids=["preempted", "stop-at-the-same-step", "at-the-last-step"],
)
def test_a_run_is_preempted_only_when_a_resume_would_go_on(
    hooks: tuple[object, ...], max_steps: int | None, preempted: bool, reason: str | None, fallback_handlers: list[int]
) -> None:
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, preemption_signal="SIGUSR1", max_steps=max_steps)
    with make_strategy([*hooks], num_epochs=3, step_scheduler=config) as strategy:
        result = strategy.run(data(4))
    assert (result.step_count, result.preempted, result.stop_reason) == (5, preempted, reason)
    assert fallback_handlers == []  # the run's own handler took the signal


def test_a_run_to_its_end_has_no_stop_reason() -> None:
    assert make_strategy([], num_epochs=1).run(data(3)).stop_reason is None


class StopOnValidation:
    """Requests a stop at every AFTER_VALIDATION (early stopping deciding at each validation)."""

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        ctx.request_stop("validated")


@pytest.mark.parametrize("where", ["last step", "final validation"])
def test_a_stop_requested_at_the_runs_end_cut_nothing_short(where: str) -> None:
    """A request at the last step, or at the validation after it (early stopping's last decision), leaves a
    run that trained all it was set to: no stop reason, as for any run that ran to its end."""
    validation = nvtrain.ValidationConfig(data=data(2, seed=1), every_n_epochs=3)
    hook = StopAt(12) if where == "last step" else StopOnValidation()
    result = make_strategy([hook], num_epochs=3, validation=validation).run(data(4))
    assert (result.step_count, result.stop_reason, result.validated_at_step) == (12, None, 12)


def test_the_stopping_step_is_checkpointed(tmp_path: Path) -> None:
    checkpoint = pytest.importorskip("nvtrain_checkpoint")
    hook = checkpoint.CheckpointHook(tmp_path, step_interval=100)
    with make_strategy([StopAt(5), hook], num_epochs=3) as strategy:
        strategy.run(data(4))
    assert (tmp_path / "step_5" / "manifest.json").is_file()


def test_a_stop_requested_during_validation_ends_the_run_after_it() -> None:
    validation = nvtrain.ValidationConfig(data=data(2, seed=1), every_n_steps=2)
    result = make_strategy([StopOnValidation()], num_epochs=3, validation=validation).run(data(4))
    assert result.step_count == 2 and result.stop_reason == "validated"


def test_request_stop_needs_a_reason_and_a_run() -> None:
    strategy = make_strategy([], num_epochs=1)
    with pytest.raises(RuntimeError, match="no run is in progress"):
        strategy.ctx.request_stop("now")
    scheduler = StepScheduler(1, 1, 1, [1, 2], preemption_signal=None)
    with pytest.raises(ValueError, match="non-empty reason"):
        scheduler.request_stop("")


class StopDuringStep:
    """Requests a stop while step ``step`` is computed (AFTER_BACKWARD), on one rank."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step - 1 and ctx.rank == self.rank:
            ctx.request_stop("enough")


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        stages = Stages()
        config = nvtrain.StepSchedulerConfig(preemption_signal=None, ckpt_every_steps=None)
        strategy = make_strategy([StopDuringStep(3, rank=1), stages], num_epochs=5, step_scheduler=config)
        result = strategy.run(data(4, seed=rank))
        report = {"step_count": result.step_count, "reason": result.stop_reason, "last": stages.last_steps}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_stop_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    context = torch.multiprocessing.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two ranks did not finish within 120 s")
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["step_count"] for r in reports] == [3, 3]
    assert reports[1]["reason"] == "enough" and reports[0]["reason"] == "another rank requested a stop"
    assert [r["last"] for r in reports] == [[3], [3]]


# -- LR schedules -------------------------------------------------------------------------------


def test_an_epoch_interval_schedule_steps_once_per_epoch() -> None:
    schedule = LRSchedule(functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5), interval="epoch")
    strategy = make_strategy([], num_epochs=3, lr_schedulers=schedule)
    strategy.run(data(10))
    assert strategy.ctx.step_count == 30
    assert strategy.ctx.optimizers["main"].param_groups[0]["lr"] == pytest.approx(0.1 / 8)


def test_a_step_interval_schedule_steps_per_real_step() -> None:
    schedule = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    strategy = make_strategy([], num_epochs=1, lr_schedulers=schedule)
    strategy.run(data(3))
    assert strategy.ctx.optimizers["main"].param_groups[0]["lr"] == pytest.approx(0.1 / 8)


def test_reduce_lr_on_plateau_halves_a_stalled_learning_rate() -> None:
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5, threshold=0.0)
    validation = nvtrain.ValidationConfig(data=data(2, seed=1))
    lrs: list[float] = []

    class FreezeWeights:  # the optimizer steps, but the weights never change: the validation loss stalls
        @nvtrain.hookimpl
        def before_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
            for param in ctx.models["main"].parameters():
                param.grad = torch.zeros_like(param)

        @nvtrain.hookimpl
        def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            lrs.append(ctx.optimizers["main"].param_groups[0]["lr"])

    strategy = make_strategy([FreezeWeights()], num_epochs=3, lr_schedulers=plateau, validation=validation)
    strategy.run(data(4))
    assert lrs == pytest.approx([0.1, 0.05, 0.025])


def test_a_metric_schedule_naming_a_missing_metric_is_refused_before_the_first_step() -> None:
    schedule = LRSchedule(functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau), monitor="accuracy")
    validation = nvtrain.ValidationConfig(data=data(2, seed=1))
    strategy = make_strategy([], num_epochs=1, lr_schedulers=schedule, validation=validation)
    with pytest.raises(
        ValueError,
        match=r"lr_schedulers\['main'\]: LRSchedule\(monitor='accuracy'\) steps with a key the validation summary "
        r"does not have \(its keys: loss, num_samples\)",
    ):
        strategy.run(data(2))
    assert strategy.ctx.step_count == 0


def test_a_metric_schedule_with_an_epoch_interval_is_refused() -> None:
    schedule = LRSchedule(torch.optim.lr_scheduler.ReduceLROnPlateau, interval="epoch")
    with pytest.raises(ValueError, match="interval='epoch' does not apply"):
        make_strategy([], num_epochs=1, lr_schedulers=schedule).run(data(2))


def test_monitor_on_a_scheduler_whose_step_takes_no_metric_is_refused() -> None:
    """ExponentialLR.step(epoch): the validation loss passed there would set the rate from the loss."""
    schedule = LRSchedule(functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5), monitor="loss")
    validation = nvtrain.ValidationConfig(data=data(2, seed=1))
    with pytest.raises(ValueError, match=r"ExponentialLR\.step\(\) takes no metric"):
        make_strategy([], num_epochs=1, lr_schedulers=schedule, validation=validation).run(data(2))


class StepsWithTheLoss(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler of one's own whose ``step(metrics)`` takes the validation value: halves the rate when it rises."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.best = math.inf
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, metrics: float | None = None) -> None:  # type: ignore[override]
        if metrics is None:
            super().step()
            return
        if metrics > self.best:
            for group in self.optimizer.param_groups:
                group["lr"] /= 2
        self.best = min(self.best, metrics)


def test_monitor_on_a_scheduler_whose_step_takes_a_metric_steps_it_with_the_value() -> None:
    seen: list[float] = []

    class Recording(StepsWithTheLoss):
        def step(self, metrics: float | None = None) -> None:  # type: ignore[override]
            if metrics is not None:
                seen.append(metrics)
            super().step(metrics)

    validation = nvtrain.ValidationConfig(data=data(2, seed=1))
    strategy = make_strategy([], num_epochs=2, lr_schedulers=LRSchedule(Recording, monitor="loss"), validation=validation)
    result = strategy.run(data(2))
    assert len(seen) == 2 and seen[-1] == pytest.approx(float(result.validation["loss"]))  # type: ignore[index]


# -- the seed's StepScheduler loop ----------------------------------------------------------------


def _loop(explicit: bool, **kwargs: Any) -> tuple[list[Any], list[int], list[dict[str, Any]], StepScheduler]:
    scheduler = StepScheduler(2, 1, 1, list(range(7)), preemption_signal=None, **kwargs)
    windows, last, rows = [], [], []
    for _epoch in scheduler.epochs:
        for window in scheduler:
            if explicit:
                scheduler.finish_step()
            windows.append(list(window))
            rows.append({"step": scheduler.step, "epoch": scheduler.epoch, "ckpt": scheduler.is_ckpt_step})
            if scheduler.is_last_step:
                last.append(scheduler.step)
    return windows, last, rows, scheduler


def test_the_seed_loop_without_finish_step_counts_like_the_precise_one() -> None:
    precise = _loop(True, num_epochs=2, ckpt_every_steps=3)
    seed = _loop(False, num_epochs=2, ckpt_every_steps=3)
    assert seed[0] == precise[0]  # the same windows
    assert seed[1] == precise[1] == [8]  # is_last_step exactly once
    assert seed[2] == precise[2]  # the same counters and predicates in the loop body
    assert (seed[3].step, seed[3].epoch) == (precise[3].step, precise[3].epoch) == (8, 2)


def test_the_seed_loop_saves_a_state_that_resumes_after_the_step() -> None:
    scheduler = StepScheduler(1, 1, 1, list(range(6)), preemption_signal=None, max_steps=4)
    saved = None
    for _ in scheduler.epochs:
        for _window in scheduler:
            if scheduler.step == 2:
                saved = scheduler.state_dict()
    resumed = StepScheduler(1, 1, 1, list(range(6)), preemption_signal=None, max_steps=4)
    resumed.load_state_dict(saved)  # type: ignore[arg-type]
    rest = [window for _ in resumed.epochs for window in resumed]
    assert rest == [[2], [3]] and resumed.step == 4


def test_load_state_dict_takes_the_seed_state() -> None:
    scheduler = StepScheduler(1, 1, 1, list(range(5)), preemption_signal=None, num_epochs=3)
    scheduler.load_state_dict({"step": 3, "epoch": 1})
    assert (scheduler.step, scheduler.epoch, scheduler.position) == (3, 1, 0)
    windows = [window for _ in scheduler.epochs for window in scheduler]
    assert len(windows) == 10 and scheduler.step == 13


def test_num_epochs_is_derived_from_max_steps() -> None:
    scheduler = StepScheduler(1, 1, 1, list(range(10)), preemption_signal=None, max_steps=15)
    assert scheduler.num_epochs == 2 and scheduler.total_steps == 15
    assert StepScheduler(1, 1, 1, list(range(10)), preemption_signal=None).num_epochs == 1


def test_a_loader_whose_len_raises_not_implemented_is_unsized() -> None:
    class Stream:
        def __iter__(self) -> Any:
            return iter(range(3))

        def __len__(self) -> int:
            raise NotImplementedError

    scheduler = StepScheduler(1, 1, 1, Stream(), preemption_signal=None, max_steps=10)
    assert scheduler.epoch_len is None and scheduler.num_epochs is None
    assert [w for _ in scheduler.epochs for w in scheduler] == [[0], [1], [2]] * 3 + [[0]]


# -- a checkpoint of a validated step holds what validation changed ------------------------------


def test_the_default_checkpoint_waits_for_the_steps_validation(tmp_path: Path) -> None:
    checkpoint = pytest.importorskip("nvtrain_checkpoint")
    from nvtrain.hooks import EarlyStoppingHook

    early = EarlyStoppingHook(monitor="loss", patience=10)
    plateau = functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0, factor=0.5, threshold=0.0)
    hook = checkpoint.CheckpointHook(tmp_path)  # the scheduler's cadence: every epoch end
    validation = nvtrain.ValidationConfig(data=data(2, seed=1))  # every epoch
    with make_strategy(
        [early, hook], num_epochs=3, validation=validation, lr_schedulers=plateau,
        optimizers=functools.partial(torch.optim.SGD, lr=0.0),
    ) as strategy:
        strategy.run(data(2))
    saved = hook.read_checkpoint(tmp_path / "step_6")
    (early_state,) = [state for key, state in saved["hooks"].items() if key.startswith("early_stopping")]
    assert early_state["wait"] == early.wait == 2  # validations 2 and 3 did not improve: both are in the checkpoint
    plateau_state = saved["lr_schedulers"]["main"]
    live = strategy.ctx.lr_schedulers["main"].state_dict()
    assert plateau_state["num_bad_epochs"] == live["num_bad_epochs"] and plateau_state["best"] == live["best"]


# -- early stopping says at the start what would make it a no-op or fail ---------------------------


def test_early_stopping_in_a_run_that_never_validates_warns_at_the_start() -> None:
    from nvtrain.hooks import EarlyStoppingHook

    with make_strategy([EarlyStoppingHook()], num_epochs=2) as strategy, pytest.warns(
        RuntimeWarning, match=r"EarlyStoppingHook\(monitor='loss'\): the run is not set to validate \(TrainingStrategy"
        r"\.validation has no data\), so it never stops the run"
    ):
        strategy.run(data(2))


@pytest.mark.parametrize(("monitor", "warned"), [("val_los", True), ("accuracy", False), ("loss", False)])
def test_early_stopping_on_a_key_the_summary_lacks_warns_at_the_start(monitor: str, warned: bool) -> None:
    from nvtrain.hooks import EarlyStoppingHook

    def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs.argmax(1) == targets.argmax(1)).float().mean()

    validation = nvtrain.ValidationConfig(data=data(2, seed=1), metrics={"accuracy": accuracy})
    seen: list[int] = []

    class Steps:
        @nvtrain.hookimpl
        def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
            seen.append(ctx.step_count)

    strategy = make_strategy([EarlyStoppingHook(monitor=monitor), Steps()], num_epochs=1, validation=validation)
    with strategy, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            strategy.run(data(2))
        except KeyError:
            assert warned  # the first validation: the summary has no such key
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    expected = (
        "EarlyStoppingHook.monitor='val_los' is not a key of the validation summary (its keys: accuracy, loss, "
        "num_samples); unless a hook adds it at AFTER_VALIDATION, the first validation raises"
    )
    assert any(expected in message for message in messages) == warned
    assert seen  # a warning, not a refusal: the run trained


# -- a run with nothing left to train says which bound ends it --------------------------------------


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"num_epochs": 1}, r"already at step 2 \(epoch 1\), where num_epochs=1 ends it; raise num_epochs"),
        ({"max_steps": 2, "num_epochs": 5}, r"already at step 2, where max_steps=2 ends it; raise max_steps"),
    ],
    ids=["epochs", "max-steps"],
)
def test_a_run_with_nothing_left_to_train_names_the_bound(bounds: dict[str, int], message: str) -> None:
    with make_strategy([], **bounds) as strategy:
        strategy.run(data(2))
        with pytest.warns(RuntimeWarning, match=rf"run\(\): nothing to train, the run is {message}"):
            assert strategy.run(data(2)).step_count == 2


def test_a_run_that_trains_gives_no_nothing_to_train_warning() -> None:
    with make_strategy([], num_epochs=1) as strategy, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strategy.run(data(2)).step_count == 2
