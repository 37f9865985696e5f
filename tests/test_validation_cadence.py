"""When a run validates: the epoch cadence (an int, None or "auto"), the step cadences, and
``validate_on_checkpoint``, which follows checkpoints only when a plugin saves them; the same settings
through ``nvtrain train``'s ``validation`` and ``trainer`` sections."""

from __future__ import annotations

import csv
import textwrap
import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvtrain
from nvtrain.cli import main


class ValidationSteps:
    """Records ``ctx.step_count`` at every AFTER_VALIDATION."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.steps.append(ctx.step_count)


class Saver:
    """The smallest plugin that saves checkpoints (satisfies ``SavesCheckpoints``): records the steps asked."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    @property
    def last_saved(self) -> tuple[int, Path] | None:
        return (self.saved[-1], Path("nowhere")) if self.saved else None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.sync_gradients and ctx.scheduler.is_ckpt_step:
            self.saved.append(ctx.step_count)


def _validated(make_strategy: Any, batches: Any, *hooks: object, epochs: int = 2, **settings: Any) -> list[int]:
    """Steps at which a run of ``epochs`` epochs of 4 steps validated."""
    watch = ValidationSteps()
    step_scheduler = settings.pop("step_scheduler", nvtrain.StepSchedulerConfig(ckpt_every_steps=None))
    validation = nvtrain.ValidationConfig(data=batches(2), **settings)
    strategy = make_strategy([watch, *hooks], validation=validation, step_scheduler=step_scheduler, num_epochs=epochs)
    strategy.run(batches(4))
    return watch.steps


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, [4, 8]),  # "auto" with no step cadence: every epoch
        ({"every_n_epochs": "auto", "every_n_steps": 3}, [3, 6]),  # "auto" gives way to a step cadence
        ({"every_n_epochs": None}, []),  # never at an epoch's end, and no step cadence
        ({"every_n_epochs": None, "every_n_steps": 3}, [3, 6]),
        ({"every_n_epochs": 2}, [8]),
        ({"every_n_epochs": 1, "every_n_steps": 3}, [3, 4, 6, 8]),  # both
    ],
)
def test_the_epoch_cadence_is_an_int_none_or_auto(
    make_strategy: Any, batches: Any, settings: dict[str, Any], expected: list[int]
) -> None:
    assert _validated(make_strategy, batches, **settings) == expected


@pytest.mark.parametrize(("max_steps", "expected"), [(6, [4, 6]), (4, [4]), (3, [3]), (8, [4, 8])])
def test_a_run_ending_inside_an_epoch_validates_its_last_step(
    make_strategy: Any, batches: Any, max_steps: int, expected: list[int]
) -> None:
    """The epoch cadence validates a run's last step when ``max_steps`` ends the run inside an epoch, so the
    run's result describes its final weights; once, also when the step ends an epoch too."""
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, max_steps=max_steps)
    assert _validated(make_strategy, batches, every_n_epochs=1, step_scheduler=config, epochs=3) == expected


def test_the_run_end_follows_the_epoch_interval(make_strategy: Any, batches: Any) -> None:
    """``every_n_epochs=2``: a run ending inside the first epoch does not validate, one ending inside the
    second does (as that epoch's end would have)."""
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, max_steps=6)
    assert _validated(make_strategy, batches, every_n_epochs=2, step_scheduler=config, epochs=3) == [6]
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, max_steps=3)
    with pytest.warns(RuntimeWarning, match=r"the run never validates \(every 2 epochs in a run of 1 epochs\)"):
        assert _validated(make_strategy, batches, every_n_epochs=2, step_scheduler=config, epochs=3) == []


def test_a_stop_request_inside_an_epoch_ends_the_run_without_a_validation(make_strategy: Any, batches: Any) -> None:
    class StopAtTwo:
        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 2:
                ctx.request_stop("enough")

    assert _validated(make_strategy, batches, StopAtTwo(), every_n_epochs=1) == []


@pytest.mark.parametrize("value", [0, -1, True, "always", 1.0])
def test_a_bad_epoch_cadence_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"ValidationConfig.every_n_epochs must be an int >= 1, None .* \(got"):
        nvtrain.ValidationConfig(every_n_epochs=value)


def test_the_step_schedulers_val_every_steps_validates_without_an_epoch_cadence(
    make_strategy: Any, batches: Any
) -> None:
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, val_every_steps=3)
    assert _validated(make_strategy, batches, every_n_epochs=None, step_scheduler=config) == [3, 6]


def test_validate_on_checkpoint_follows_the_checkpoints_of_a_plugin_that_saves(
    make_strategy: Any, batches: Any
) -> None:
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=3, save_checkpoint_every_epoch=False)
    saver = Saver()
    assert _validated(make_strategy, batches, saver, every_n_epochs=None, step_scheduler=config) == [3, 6, 8]
    assert saver.saved == [3, 6, 8]  # 8: the last step
    off = attrs.evolve(config, validate_on_checkpoint=False)
    assert _validated(make_strategy, batches, Saver(), every_n_epochs=None, step_scheduler=off) == []


def test_without_a_plugin_that_saves_there_is_no_checkpoint_step_to_validate_on(
    make_strategy: Any, batches: Any
) -> None:
    """``ckpt_every_steps`` (default 100) names no step a run validates on when nothing writes checkpoints."""
    watch = ValidationSteps()
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=3, save_checkpoint_every_epoch=False)
    validation = nvtrain.ValidationConfig(data=batches(2), every_n_epochs=None)
    strategy = make_strategy([watch], validation=validation, step_scheduler=config, num_epochs=2)
    strategy.run(batches(4))
    assert watch.steps == []
    assert strategy.ctx.scheduler.validate_on_checkpoint is False
    assert strategy.ctx.scheduler.is_ckpt_step  # the cadence itself still stands (the last step)


# -- through nvtrain train ---------------------------------------------------------------------------


def _validation_rows(tmp_path: Path, trainer: str, validation: str, hooks: str = "[]") -> list[int]:
    """Train a 9-step digits job; the steps of metrics.csv's validation rows."""
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / "out"}
            device: cpu
            model: {{factory: nvtrain.builtin.digits:make_classifier, kwargs: {{hidden: 16, depth: 1}}}}
            data: {{factory: nvtrain.builtin.digits:make_loaders, kwargs: {{batch_size: 64}}}}
            trainer: {trainer}
            validation: {validation}
            logging: {{log_every_n_steps: 1, tensorboard: false, plot: false, progress_bar: false}}
            hooks: {hooks}
            """
        ),
        encoding="utf-8",
    )
    assert main(["train", str(config)]) == 0
    with (tmp_path / "out" / "job" / "metrics.csv").open(newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row["val_loss"]]


def test_trainer_val_every_steps_validates_when_the_validation_section_sets_no_cadence(tmp_path: Path) -> None:
    steps = _validation_rows(tmp_path, "{max_steps: 9, val_every_steps: 4}", "{every_n_epochs: null}")
    assert steps == [4, 8]


def test_validation_every_n_epochs_null_and_no_trainer_cadence_never_validates(tmp_path: Path) -> None:
    assert _validation_rows(tmp_path, "{max_steps: 9, ckpt_every_steps: 3}", "{every_n_epochs: null}") == []


def test_the_trainers_checkpoint_steps_validate_with_the_checkpoint_hook(tmp_path: Path) -> None:
    pytest.importorskip("nvtrain_checkpoint")
    steps = _validation_rows(tmp_path, "{max_steps: 9, ckpt_every_steps: 3}", "{every_n_epochs: null}", "[checkpoint]")
    assert steps == [3, 6, 9]
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "job" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_3", "step_6", "step_9"]


def test_validation_follows_is_false_at_a_stop_requests_step(make_strategy: Any, batches: Any) -> None:
    """``ctx.validation_follows`` says whether run() validates right after the step: not at a stop request's
    step inside an epoch, which ends the run without a validation; yes at a max_steps end."""
    follows: list[tuple[int, bool]] = []

    class Watch:
        @nvtrain.hookimpl
        def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 2:  # inside step 3: its boundary agrees the stop
                ctx.request_stop("enough")

        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            follows.append((ctx.step_count, ctx.validation_follows))

    assert _validated(make_strategy, batches, Watch(), every_n_epochs=1) == []
    assert follows[-1][0] == 3 and not any(flag for _, flag in follows)
    follows.clear()
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, max_steps=3)
    assert _validated(make_strategy, batches, every_n_epochs=1, step_scheduler=config) == [3]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    epochs=st.integers(1, 4),
    max_steps=st.none() | st.integers(1, 14),
    every_n_steps=st.none() | st.integers(1, 20),
    every_n_epochs=st.none() | st.integers(1, 6),
)
def test_a_run_that_will_never_validate_says_so_and_one_that_will_does_not(
    make_strategy: Any, batches: Any, epochs: int, max_steps: int | None, every_n_steps: int | None,
    every_n_epochs: int | None,
) -> None:
    """Warned exactly when cadences are set and the run (epochs of 4 steps, maybe cut by ``max_steps``)
    validated at no step: a cadence longer than the run, never a false alarm."""
    config = nvtrain.StepSchedulerConfig(ckpt_every_steps=None, max_steps=max_steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validated = _validated(
            make_strategy,
            batches,
            epochs=epochs,
            step_scheduler=config,
            every_n_steps=every_n_steps,
            every_n_epochs=every_n_epochs,
        )
    warned = [str(w.message) for w in caught if "the run never validates" in str(w.message)]
    cadence_set = every_n_steps is not None or every_n_epochs is not None
    assert bool(warned) == (cadence_set and not validated), (warned, validated)
