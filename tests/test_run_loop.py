"""TrainingStrategy.run() driven by the StepScheduler: windows, cadences, resume, preemption."""

from __future__ import annotations

import copy
import functools
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import StepSchedulerConfig, ValidationConfig
from nvtrain.hooks.accumulation import GradientAccumulationHook

RTOL, ATOL = 1e-9, 1e-12


def double_batches(count: int, size: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 3, generator=generator, dtype=torch.float64),
            torch.randn(size, 2, generator=generator, dtype=torch.float64),
        )
        for _ in range(count)
    ]


def double_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).double()


def probe(fn: Callable[[str, nvtrain.TrainingContext], None], *names: str) -> Any:
    """An observer implementing ``names``; each calls ``fn(name, ctx)``."""
    namespace = {name: nvtrain.hookimpl(_forward(name)) for name in names}
    namespace["__init__"] = lambda self: setattr(self, "fn", fn)
    return type("Probe", (), namespace)()


def _forward(name: str) -> Callable[[Any, nvtrain.TrainingContext], None]:
    def impl(self: Any, ctx: nvtrain.TrainingContext) -> None:
        self.fn(name, ctx)

    impl.__name__ = name
    return impl


def accumulation_hooks(strategy: nvtrain.TrainingStrategy) -> list[Any]:
    return [h for h in strategy.update_hooks() if isinstance(h, GradientAccumulationHook)]


# -- windows --------------------------------------------------------------------------------------------


def test_window_fields_are_set_before_every_before_batch(make_strategy: Any, batches: Any) -> None:
    seen: list[tuple[bool, int, int, bool]] = []
    record = probe(
        lambda name, ctx: seen.append((ctx.windowed, ctx.window_size, ctx.window_position, ctx.sync_gradients)),
        "before_batch",
    )
    strategy = make_strategy([record], step_scheduler=StepSchedulerConfig(global_batch_size=3))
    result = strategy.run(batches(7))
    assert seen == [
        (True, 3, 0, False),
        (True, 3, 1, False),
        (True, 3, 2, True),
        (True, 3, 0, False),
        (True, 3, 1, False),
        (True, 3, 2, True),
        (True, 1, 0, True),
    ]
    assert (result.step_count, result.batch_count, result.epoch) == (3, 7, 1)
    assert [h.steps for h in accumulation_hooks(strategy)] == [3]  # registered by run()
    assert strategy.ctx.windowed is False


def test_registered_accumulation_matches_one_big_batch_per_window() -> None:
    data = double_batches(7)
    strategy = nvtrain.TrainingStrategy(
        models=double_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        num_epochs=2,
        step_scheduler=StepSchedulerConfig(global_batch_size=3),
    )
    strategy.run(data)
    reference = double_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for window in [data[0:3], data[3:6], data[6:7]] * 2:  # the trailing window of one is its own step
        optimizer.zero_grad()
        inputs, targets = torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])
        torch.nn.functional.mse_loss(reference(inputs), targets).backward()
        optimizer.step()
    for ours, theirs in zip(strategy.ctx.models["main"].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_the_hook_sets_the_window_when_the_config_does_not(make_strategy: Any, batches: Any) -> None:
    sizes: list[int] = []
    record = probe(lambda name, ctx: sizes.append(ctx.window_size), "before_batch")
    strategy = make_strategy([GradientAccumulationHook(steps=2), record])
    result = strategy.run(batches(5))
    assert sizes == [2, 2, 2, 2, 1] and result.step_count == 3
    assert strategy.ctx.scheduler.grad_acc_steps == 2 and len(accumulation_hooks(strategy)) == 1


def test_hook_and_config_must_agree(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(
        [GradientAccumulationHook(steps=2)], step_scheduler=StepSchedulerConfig(global_batch_size=3)
    )
    with pytest.raises(ValueError, match=r"grad_acc_steps=3, but GradientAccumulationHook .*accumulates over 2"):
        strategy.run(batches(4))


def test_local_batch_size_comes_from_the_loader(make_strategy: Any) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    strategy = make_strategy(step_scheduler=StepSchedulerConfig(global_batch_size=4))
    assert strategy.run(loader).step_count == 2
    with pytest.raises(ValueError, match=r"global_batch_size=6 is not a multiple of local_batch_size=4 \* dp_size=1"):
        make_strategy(step_scheduler=StepSchedulerConfig(global_batch_size=6)).run(
            torch.utils.data.DataLoader(data, batch_size=4)
        )


def test_step_scheduler_field_is_type_checked(make_strategy: Any) -> None:
    with pytest.raises(TypeError, match=r"TrainingStrategy.step_scheduler must be a StepSchedulerConfig \(got dict\)"):
        make_strategy(step_scheduler={"max_steps": 3})


# -- bounds ---------------------------------------------------------------------------------------------


def test_config_max_steps_alone_trains_exactly_that_many_steps(make_strategy: Any, batches: Any) -> None:
    result = make_strategy(step_scheduler=StepSchedulerConfig(max_steps=7)).run(batches(3))
    assert (result.step_count, result.epoch) == (7, 2)  # the third epoch is not finished


def test_strategy_and_config_bounds_must_not_disagree(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(max_steps=5, step_scheduler=StepSchedulerConfig(max_steps=6))
    with pytest.raises(
        ValueError, match=r"TrainingStrategy.max_steps=5 and TrainingStrategy.step_scheduler.max_steps=6"
    ):
        strategy.run(batches(3))
    assert make_strategy(max_steps=5, step_scheduler=StepSchedulerConfig()).run(batches(3)).step_count == 5


def test_a_second_run_continues_where_the_first_stopped(make_strategy: Any) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.randn(10, 2))
    seen: list[torch.Tensor] = []
    record = probe(lambda name, ctx: seen.append(ctx.batch[0]), "before_batch")

    torch.manual_seed(5)
    straight = make_strategy([record], max_steps=7)
    straight.run(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    expected, seen[:] = list(seen), []

    torch.manual_seed(5)
    twice = make_strategy([record], max_steps=3)
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    twice.run(loader)
    twice.max_steps = 7
    result = twice.run(loader)
    assert result.step_count == 7
    assert len(seen) == len(expected) and all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))


# -- predicates at the step boundary --------------------------------------------------------------------


def test_predicates_describe_the_step_that_just_completed(make_strategy: Any, batches: Any) -> None:
    rows: list[tuple[Any, ...]] = []
    order: list[str] = []

    def look(name: str, ctx: nvtrain.TrainingContext) -> None:
        order.append(name)
        if name == "after_batch" and ctx.sync_gradients:
            s = ctx.scheduler
            rows.append((ctx.step_count, s.step, s.is_ckpt_step, s.is_val_step, s.is_last_step))
        if name == "before_training":
            rows.append(("scheduler set", isinstance(ctx.scheduler, nvtrain.StepScheduler)))

    strategy = make_strategy(
        [probe(look, "before_training", "after_batch", "after_validation")],
        num_epochs=2,
        validation=ValidationConfig(data=batches(1, seed=9), every_n_steps=3),
        step_scheduler=StepSchedulerConfig(ckpt_every_steps=2, val_every_steps=2, validate_on_checkpoint=False),
    )
    strategy.run(batches(3))
    assert rows == [
        ("scheduler set", True),
        (1, 1, False, False, False),
        (2, 2, True, True, False),
        (3, 3, True, True, False),  # epoch end checkpoint; validation from ValidationConfig.every_n_steps=3
        (4, 4, True, True, False),
        (5, 5, False, False, False),
        (6, 6, True, True, True),
    ]
    # validation follows the AFTER_BATCH of its step
    assert order.count("after_validation") == 4
    assert order[order.index("after_validation") - 1] == "after_batch"


def test_epoch_end_validation_is_not_repeated_after_a_validated_last_step(
    make_strategy: Any, batches: Any, recorder: Any
) -> None:
    strategy = make_strategy(
        [recorder],
        num_epochs=2,
        validation=ValidationConfig(data=batches(1, seed=9)),
        step_scheduler=StepSchedulerConfig(ckpt_every_steps=None),  # validate_on_checkpoint: epoch-end checkpoints
    )
    strategy.run(batches(3))
    assert [entry[2] for entry in recorder.entries if entry[0] == "after_validation"] == [3, 6]


# -- resume from BEFORE_TRAINING ---------------------------------------------------------------------


def dropout_forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
    inputs, _ = ctx.batch
    return ctx.models["main"](torch.nn.functional.dropout(inputs, p=0.5, training=True))


def resumable_strategy(hooks: list[Any]) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        num_epochs=3,
        forward_fn=dropout_forward,
        hooks=hooks,
        validation=ValidationConfig(
            data=torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.randn(6, 3), torch.randn(6, 2)), batch_size=3, shuffle=True
            ),
            every_n_steps=2,
        ),
        step_scheduler=StepSchedulerConfig(global_batch_size=4, ckpt_every_steps=None),
    )


def shuffled(seed: int = 3) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(
        torch.randn(14, 3, generator=generator), torch.randn(14, 2, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)


class Saver:
    """Keeps what a checkpoint keeps, at the AFTER_BATCH of step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.saved: dict[str, Any] | None = None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.sync_gradients and ctx.step_count == self.at and self.saved is None:
            self.saved = copy.deepcopy(
                {
                    "model": ctx.models["main"].state_dict(),
                    "optimizer": ctx.optimizers["main"].state_dict(),
                    "scheduler": ctx.scheduler.state_dict(),
                    "counters": {
                        n: getattr(ctx, n) for n in ("step_count", "global_step_count", "batch_count", "epoch")
                    },
                    "rng": torch.get_rng_state(),
                }
            )


class Restorer:
    """Restores a :class:`Saver` state during BEFORE_TRAINING, as a checkpoint plugin does."""

    def __init__(self, saved: dict[str, Any]) -> None:
        self.saved = saved

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        saved = self.saved
        ctx.models["main"].load_state_dict(saved["model"])
        ctx.optimizers["main"].load_state_dict(saved["optimizer"])
        for name, value in saved["counters"].items():
            setattr(ctx, name, value)
        ctx.scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])


@pytest.mark.parametrize("at", [2, 4, 5], ids=["mid-epoch", "epoch-end", "into-next-epoch"])
def test_resume_in_before_training_is_bitwise(at: int) -> None:
    seen: list[torch.Tensor] = []
    record = probe(lambda name, ctx: seen.append(ctx.batch[0].clone()), "before_batch")
    saver = Saver(at)
    torch.manual_seed(1)
    straight = resumable_strategy([saver, record])
    straight.run(shuffled())
    assert saver.saved is not None
    expected, seen[:] = seen[saver.saved["counters"]["batch_count"] :], []

    torch.manual_seed(99)  # a fresh process
    resumed = resumable_strategy([Restorer(saver.saved), record])
    result = resumed.run(shuffled())
    assert result.step_count == straight.ctx.step_count == 12
    assert len(seen) == len(expected) and all(torch.equal(a, b) for a, b in zip(seen, expected, strict=True))
    for ours, theirs in zip(resumed.ctx.models["main"].parameters(), straight.ctx.models["main"].parameters(), strict=True):
        assert torch.equal(ours, theirs)


# -- preemption -----------------------------------------------------------------------------------------


def signal_on(stage: str, when: Callable[[nvtrain.TrainingContext], bool], sig: signal.Signals) -> Any:
    def fire(name: str, ctx: nvtrain.TrainingContext) -> None:
        if when(ctx):
            os.kill(os.getpid(), sig)

    return probe(fire, stage)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_during_a_step_ends_the_run_after_that_step(
    make_strategy: Any, batches: Any, recorder: Any, sig: signal.Signals, fallback_handlers: list[int]
) -> None:
    boundary: list[tuple[str, int, bool, bool]] = []

    def look(name: str, ctx: nvtrain.TrainingContext) -> None:
        if ctx.sync_gradients:
            boundary.append((name, ctx.step_count, ctx.preempted, ctx.scheduler.is_ckpt_step))

    strategy = make_strategy(
        [
            signal_on("after_backward", lambda ctx: ctx.step_count == 2, sig),
            probe(look, "after_optimizer_step", "after_batch"),
            recorder,
        ],
        num_epochs=3,
        step_scheduler=StepSchedulerConfig(ckpt_every_steps=None, preemption_signal=["SIGTERM", "SIGUSR1"]),
    )
    result = strategy.run(batches(5))
    assert (result.step_count, result.preempted, result.epoch) == (3, True, 0)
    assert boundary[-2:] == [("after_optimizer_step", 3, True, True), ("after_batch", 3, True, True)]
    assert recorder.calls[-3:] == ["after_batch", "after_epoch", "after_training"]
    assert fallback_handlers == []


def test_a_signal_during_validation_ends_the_run_before_the_next_step(
    make_strategy: Any, batches: Any, fallback_handlers: list[int]
) -> None:
    at_end: list[tuple[bool, bool]] = []
    strategy = make_strategy(
        [
            signal_on("after_validation", lambda ctx: True, signal.SIGTERM),
            probe(lambda name, ctx: at_end.append((ctx.preempted, ctx.scheduler.is_ckpt_step)), "after_training"),
        ],
        num_epochs=2,
        validation=ValidationConfig(data=batches(1, seed=9), every_n_steps=2),
    )
    result = strategy.run(batches(5))
    assert (result.step_count, result.preempted) == (2, True)
    assert at_end == [(True, True)]
    assert fallback_handlers == []


def test_a_signal_at_an_epoch_boundary_ends_the_run_before_the_next_epoch(
    make_strategy: Any, batches: Any, recorder: Any, fallback_handlers: list[int]
) -> None:
    at_end: list[bool] = []
    strategy = make_strategy(
        [
            signal_on("after_epoch", lambda ctx: True, signal.SIGTERM),
            probe(lambda name, ctx: at_end.append(ctx.preempted), "after_training"),
            recorder,
        ],
        num_epochs=3,
    )
    result = strategy.run(batches(2))
    assert (result.step_count, result.epoch, result.preempted) == (2, 1, True)
    assert recorder.calls.count("before_epoch") == 1 and at_end == [True]
    assert fallback_handlers == []


def test_the_previous_handler_is_restored_after_run_and_after_an_error(
    make_strategy: Any, batches: Any, fallback_handlers: list[int]
) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    during: list[bool] = []
    strategy = make_strategy(
        [probe(lambda name, ctx: during.append(signal.getsignal(signal.SIGTERM) is previous), "before_batch")]
    )
    strategy.run(batches(2))
    assert during == [False, False] and signal.getsignal(signal.SIGTERM) is previous

    def boom(name: str, ctx: nvtrain.TrainingContext) -> None:
        raise RuntimeError("boom")

    failing = make_strategy([probe(boom, "after_batch")])
    with pytest.raises(RuntimeError, match="boom"):
        failing.run(batches(2))
    assert signal.getsignal(signal.SIGTERM) is previous
    assert failing.ctx.windowed is False


def test_run_off_the_main_thread_warns_and_trains(
    make_strategy: Any, batches: Any, fallback_handlers: list[int]
) -> None:
    outcome: dict[str, Any] = {}

    def train() -> None:
        with pytest.warns(RuntimeWarning, match=r"not catching SIGTERM"):
            outcome["result"] = make_strategy(num_epochs=1).run(batches(3))

    thread = threading.Thread(target=train)
    thread.start()
    thread.join(timeout=60)
    assert outcome["result"].step_count == 3 and outcome["result"].preempted is False


def test_preemption_can_be_disabled(make_strategy: Any, batches: Any, fallback_handlers: list[int]) -> None:
    strategy = make_strategy(
        [signal_on("after_backward", lambda ctx: ctx.step_count == 0, signal.SIGTERM)],
        step_scheduler=StepSchedulerConfig(preemption_signal=None),
    )
    result = strategy.run(batches(3))
    assert (result.step_count, result.preempted) == (3, False)
    assert fallback_handlers == [signal.SIGTERM]


def test_a_users_accumulation_hook_gets_the_schedulers_windows(make_strategy: Any, batches: Any) -> None:
    S = nvtrain.TrainingStage

    class FollowWindows(nvtrain.TrainingUpdateHook):
        """Implements nvtrain.hook.AccumulatesGradients: the scheduler builds its windows."""

        stages = frozenset({S.BEFORE_BATCH, S.DO_BACKWARD, S.DO_OPTIMIZER_STEP})
        vetoes = frozenset({S.BEFORE_BATCH, S.DO_OPTIMIZER_STEP})
        uses_gradients = False
        accumulation_steps = 2

        def __init__(self) -> None:
            self.windows: list[tuple[int, int]] = []

        def __call__(self, ctx: Any, stage: Any, will_skip: bool) -> tuple[bool, Any]:
            if stage is S.BEFORE_BATCH:
                self.windows.append((ctx.window_position, ctx.window_size))
                return ctx.window_position == 0, None
            if stage is S.DO_BACKWARD:
                return True, ctx.loss / ctx.window_size
            return ctx.sync_gradients, None

    hook = FollowWindows()
    strategy = make_strategy([hook], num_epochs=1)
    result = strategy.run(batches(5))
    assert hook.windows == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 1)]
    assert result.step_count == 3
    assert strategy.update_hooks() == (hook,)  # no GradientAccumulationHook was added beside it
