"""The public API called in unexpected orders or from unexpected places: each is either defined (and pinned
here) or refused at once with a message that says why, never a silently corrupted run."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.hooks import GradientAccumulationHook


def _data(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, generator=generator), torch.randn(2, 1, generator=generator)) for _ in range(count)]


def _strategy(hooks: list[Any] = (), **fields: Any) -> nvtrain.TrainingStrategy:  # type: ignore[assignment]
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
        **fields,
    )


def _at(stage: str, action: Any) -> object:
    class Once:
        done = False

    def fire(self: Any, ctx: nvtrain.TrainingContext) -> None:
        if not Once.done:
            Once.done = True
            action(ctx)

    setattr(Once, stage, nvtrain.hookimpl(fire))
    return Once()


def _weights(strategy: nvtrain.TrainingStrategy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]


# -- one run() or train_batch() at a time --------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "call"),
    [
        ("before_training", lambda ctx: ctx.strategy.run(_data(2))),
        ("after_batch", lambda ctx: ctx.strategy.run(_data(2))),
        ("before_forward", lambda ctx: ctx.strategy.train_batch(_data(1)[0])),
    ],
    ids=["run-at-before-training", "run-at-after-batch", "train-batch-at-before-forward"],
)
def test_a_hook_starting_training_during_a_run_is_refused(stage: str, call: Any) -> None:
    """A nested run moved the weights and counters under the outer one (12 steps counted as 8)."""
    strategy = _strategy([_at(stage, call)], max_steps=4)
    with strategy, pytest.raises(RuntimeError, match=r"run\(\) is in progress on this strategy"):
        strategy.run(_data(8))


def _a_second_thread_calls(call: str, **fields: Any) -> tuple[nvtrain.RunResult, list[BaseException]]:
    """Run a strategy while a second thread calls ``strategy.<call>()`` in the middle of its first step; the run's
    result and what the second thread raised."""
    started, tried = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def wait_for_the_other_thread(ctx: nvtrain.TrainingContext) -> None:
        started.set()
        assert tried.wait(30)

    def second() -> None:
        assert started.wait(30)
        try:
            getattr(strategy, call)(*([_data(4)] if call == "run" else []))
        except RuntimeError as err:
            errors.append(err)
        finally:
            tried.set()

    strategy = _strategy([_at("after_batch", wait_for_the_other_thread)], **fields)
    thread = threading.Thread(target=second)
    thread.start()
    with strategy, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the other thread cannot catch preemption signals
        result = strategy.run(_data(8))
    thread.join(30)
    return result, errors


def test_a_second_thread_cannot_run_the_same_strategy() -> None:
    result, errors = _a_second_thread_calls("run", max_steps=3)
    assert result.step_count == 3
    assert len(errors) == 1 and "run() is in progress on this strategy" in str(errors[0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ctx: ctx.strategy.load_state_dict(ctx.strategy.state_dict()), r"load_state_dict\(state\): loading a state during run\(\)"),
        (lambda ctx: ctx.strategy.setup(_data(3)), r"setup\(train_loader\) during run\(\)"),
    ],
    ids=["load-state-dict", "setup-with-a-loader"],
)
def test_what_would_move_the_run_under_itself_is_refused_inside_it(call: Any, message: str) -> None:
    strategy = _strategy([_at("after_batch", call)], max_steps=4)
    with strategy, pytest.raises(RuntimeError, match=message):
        strategy.run(_data(8))


def test_a_state_loaded_at_before_training_is_still_taken() -> None:
    """Where a resume loads: the run starts from the loaded state."""
    first = _strategy(num_epochs=1)
    with first:
        first.run(_data(4))
    saved = first.state_dict()
    strategy = _strategy([_at("before_training", lambda ctx: ctx.strategy.load_state_dict(saved))], num_epochs=2)
    with strategy:
        assert strategy.run(_data(4)).step_count == 8


# -- between runs ---------------------------------------------------------------------------------------


class Steps:
    def __init__(self) -> None:
        self.seen: list[int] = []

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen.append(ctx.step_count)


def test_train_batch_steps_between_runs_count_on() -> None:
    """run(), two train_batch() steps, run() on the same loader: no step is counted twice, max_steps holds."""
    steps = Steps()
    strategy = _strategy([steps], max_steps=3)
    data = _data(8)
    with strategy:
        strategy.run(data)
        strategy.train_batch(data[0])
        strategy.train_batch(data[1])
        strategy.max_steps = 6
        assert strategy.run(data).step_count == 6
    assert steps.seen == [1, 2, 3, 4, 5, 6]


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))


def test_a_new_loader_over_the_same_data_continues_the_epoch_the_last_run_stopped_in() -> None:
    """The notebook pattern: the DataLoader made again after a stop in the middle of an epoch. It continues as
    a resume does; it restarted the epoch, training three batches twice."""
    dataset = _dataset()
    strategy = _strategy(max_steps=3)
    with strategy:
        strategy.run(DataLoader(dataset, batch_size=2))
        strategy.max_steps = None
        strategy.num_epochs = 1
        assert strategy.run(DataLoader(dataset, batch_size=2)).step_count == 8
    straight = _strategy(num_epochs=1)
    with straight:
        straight.run(DataLoader(dataset, batch_size=2))
    assert all(torch.equal(a, b) for a, b in zip(_weights(strategy), _weights(straight), strict=True))


def test_a_loader_over_other_data_starts_at_its_first_micro_batch() -> None:
    """Another data set of the same size passed every configuration check, and its first samples were skipped."""

    class Seen:
        def __init__(self) -> None:
            self.targets: list[float] = []

        @nvtrain.hookimpl
        def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
            self.targets += ctx.batch[1].flatten().tolist()

    first = TensorDataset(torch.zeros(8, 4), torch.arange(100.0, 108.0).unsqueeze(1))
    other = TensorDataset(torch.zeros(8, 4), torch.arange(500.0, 508.0).unsqueeze(1))
    seen = Seen()
    strategy = _strategy([seen], max_steps=3)
    with strategy:
        strategy.run(DataLoader(first, batch_size=1))
        strategy.max_steps = None
        strategy.num_epochs = 1
        with pytest.warns(RuntimeWarning, match=r"not over the same data set object, so the epoch starts from its fi"):
            strategy.run(DataLoader(other, batch_size=1))
    assert seen.targets == [100.0, 101.0, 102.0, *range(500, 508)]


def test_a_batch_configuration_the_stopped_epoch_cannot_take_is_said() -> None:
    dataset = _dataset()
    strategy = _strategy(max_steps=3)
    with strategy:
        strategy.run(DataLoader(dataset, batch_size=2))
        strategy.max_steps = 10
        with pytest.warns(RuntimeWarning, match=r"stopped at micro-batch 3 of epoch 1, which this run's batch config"):
            strategy.run(DataLoader(dataset, batch_size=4))


def test_a_new_loader_the_stopped_epoch_cannot_continue_on_is_said() -> None:
    strategy = _strategy(max_steps=3)
    with strategy:
        strategy.run(DataLoader(_dataset(), batch_size=2))
        strategy.max_steps = 10
        with pytest.warns(RuntimeWarning, match=r"stopped at micro-batch 3 of epoch 1; this run's loader is not over"):
            strategy.run(_data(5))


def test_a_new_generator_is_a_new_stream() -> None:
    strategy = _strategy(max_steps=3)
    with strategy, warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.run(iter(_data(8)))
        strategy.max_steps = 5
        assert strategy.run(iter(_data(8, seed=1))).step_count == 5


def test_a_retry_after_a_failure_following_the_resume_starts_where_the_resume_put_it() -> None:
    """BEFORE_TRAINING loads a finished epoch's state, a later hook raises; the retry, with the loader made
    again, trains epoch 2 only, as the straight run did (it trained epoch 1 again)."""
    saved: dict[str, Any] = {}

    class SavesAtEpochEnd:  # where the checkpoint plugin saves an epoch's last step: ctx.epoch not advanced yet
        @nvtrain.hookimpl
        def after_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            saved.update(ctx.strategy.state_dict())

    first = _strategy([SavesAtEpochEnd()], num_epochs=1)
    with first:
        first.run(_data(4))
    assert saved["counters"]["epoch"] == 0

    class RaisesOnce:
        raised = False

        @nvtrain.hookimpl(trylast=True)
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            if not RaisesOnce.raised:
                RaisesOnce.raised = True
                raise KeyboardInterrupt

    class Resumes:
        @nvtrain.hookimpl(tryfirst=True)
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 0:
                ctx.strategy.load_state_dict(saved)

    strategy = _strategy([Resumes(), RaisesOnce()], num_epochs=2)
    with strategy:
        with pytest.raises(KeyboardInterrupt):
            strategy.run(_data(4))
        assert strategy.run(list(_data(4))).step_count == 8
    straight = _strategy(num_epochs=2)
    with straight:
        straight.run(_data(4))
    assert all(torch.equal(a, b) for a, b in zip(_weights(strategy), _weights(straight), strict=True))


def test_an_accumulation_window_train_batch_left_open_is_said_at_run() -> None:
    strategy = _strategy([GradientAccumulationHook(steps=2)], num_epochs=1)
    data = _data(4)
    with strategy:
        strategy.train_batch(data[0])
        with pytest.warns(RuntimeWarning, match=r"train_batch\(\) left an accumulation window open \(micro-batch 1 of 2"):
            strategy.run(data)


# -- validate() and stop requests ----------------------------------------------------------------------------


def test_a_hook_validating_after_every_validation_is_refused_with_a_message() -> None:
    """It recursed until Python's limit, with a thousand-frame traceback."""

    class ValidatesAgain:
        @nvtrain.hookimpl
        def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
            ctx.strategy.validate()

    strategy = _strategy([ValidatesAgain()], validation=nvtrain.ValidationConfig(data=_data(1)))
    with strategy, pytest.raises(RuntimeError, match=r"validate\(\) nested 16 deep: an AFTER_VALIDATION hook"):
        strategy.validate()


@pytest.mark.parametrize("stage", ["setup", "after_training"])
def test_a_stop_request_where_no_run_can_stop_is_refused_naming_the_stage(stage: str) -> None:
    strategy = _strategy([_at(stage, lambda ctx: ctx.request_stop("now"))], num_epochs=1)
    with strategy, pytest.raises(
        RuntimeError, match=rf"request_stop\('now'\): no run is in progress to stop \(asked at {stage.upper()}\)"
    ):
        strategy.run(_data(2))


def test_a_loader_with_a_generator_of_its_own_made_again_goes_on_shuffling_as_the_straight_run() -> None:
    """Its generator starts from its seed: the next epoch repeated the first one's order."""
    dataset = _dataset()

    def loader() -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))

    class Order:
        def __init__(self) -> None:
            self.seen: list[list[float]] = []

        @nvtrain.hookimpl
        def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
            self.seen.append(ctx.batch[1].flatten().tolist())

    straight, continued = Order(), Order()
    with _strategy([straight], num_epochs=2) as strategy:
        strategy.run(loader())
    with _strategy([continued], max_steps=2) as strategy:
        strategy.run(loader())
        strategy.max_steps, strategy.num_epochs = None, 2
        strategy.run(loader())
    assert continued.seen == straight.seen


def test_a_checkpoint_loaded_by_a_hook_inside_a_run_is_refused(tmp_path: Any) -> None:
    """CheckpointHook.load_into() at AFTER_BATCH rewound the counters while the run's data position went on."""
    checkpoint = pytest.importorskip("nvtrain_checkpoint")
    hook = checkpoint.CheckpointHook(tmp_path, step_interval=2)

    def load_step_2(ctx: nvtrain.TrainingContext) -> None:
        hook.load_into(ctx.strategy, tmp_path / "step_2")

    class LoadsAtStep4:
        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 4:
                load_step_2(ctx)

    strategy = _strategy([hook, LoadsAtStep4()], max_steps=6)
    with strategy, pytest.raises(RuntimeError, match=r"checkpoint '.*step_2': loading a state during run\(\) \(at AFTER_BATCH\)"):
        strategy.run(_data(8))


def test_a_failing_after_validation_of_an_epochs_last_step_is_not_computed_twice() -> None:
    """The step's validation was computed (a plateau scheduler stepped with it), then AFTER_VALIDATION raised:
    the retry fired it again and computed the summary again, stepping the plateau scheduler twice."""

    class Validations:
        def __init__(self, fail_at: int | None) -> None:
            self.steps: list[int] = []
            self.fail_at = fail_at

        @nvtrain.hookimpl
        def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
            self.steps.append(ctx.step_count)
            if ctx.step_count == self.fail_at:
                self.fail_at = None
                raise RuntimeError("once")

    def plateau_steps(fail_at: int | None) -> tuple[list[int], int]:
        seen = Validations(fail_at)
        validation = nvtrain.ValidationConfig(data=_data(2, seed=1), every_n_steps=2, every_n_epochs=1)
        schedule = nvtrain.LRSchedule(functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, patience=0))
        strategy = _strategy([seen], num_epochs=2, validation=validation, lr_schedulers=schedule)
        with strategy:
            try:
                strategy.run(_data(4))
            except RuntimeError:
                strategy.run(_data(4))
        return seen.steps, strategy.ctx.lr_schedulers["main"].last_epoch

    straight_steps, straight_plateau = plateau_steps(None)
    retried_steps, retried_plateau = plateau_steps(4)
    assert retried_plateau == straight_plateau == 4
    assert retried_steps == [2, 4, 4, 6, 8]  # the stage that raised runs again whole, as documented
    assert straight_steps == [2, 4, 6, 8]


@pytest.mark.parametrize("call", ["validate", "state_dict"])
def test_another_thread_cannot_validate_or_take_the_state_during_a_run(call: str) -> None:
    """validate() from a second thread switched the models to eval mode under the training steps."""
    validation = nvtrain.ValidationConfig(data=_data(1), every_n_epochs=None)
    _, errors = _a_second_thread_calls(call, max_steps=2, validation=validation)
    assert len(errors) == 1 and f"{call}() from another thread during run()" in str(errors[0])


@pytest.mark.parametrize(("raised_max_steps", "validated"), [(None, [3]), (4, [4])], ids=["same-bound", "raised"])
def test_a_failure_after_the_runs_last_step_inside_an_epoch_leaves_its_end_to_the_next_run(
    raised_max_steps: int | None, validated: list[int]
) -> None:
    """max_steps ends the run inside an epoch: that step is validated. A failure at its AFTER_BATCH left the
    retry nothing to train and the validation undone; with max_steps raised, the step is no longer the last."""

    class Validations:
        def __init__(self) -> None:
            self.steps: list[int] = []

        @nvtrain.hookimpl
        def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
            self.steps.append(ctx.step_count)

    seen = Validations()
    validation = nvtrain.ValidationConfig(data=_data(1, seed=1))
    strategy = _strategy([seen, _FailsOnceAfterBatch(3)], max_steps=3, validation=validation)
    data = _data(4)
    with strategy:
        with pytest.raises(RuntimeError, match="once"):
            strategy.run(data)
        if raised_max_steps is not None:
            strategy.max_steps = raised_max_steps
        strategy.run(data)
    assert seen.steps == validated


class _FailsOnceAfterBatch:
    def __init__(self, step: int) -> None:
        self.step: int | None = step

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            self.step = None
            raise RuntimeError("once")
