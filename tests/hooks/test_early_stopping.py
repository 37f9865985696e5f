"""EarlyStoppingHook: stops a run whose validation metric stalls; its counters survive a resume."""

from __future__ import annotations

import functools
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.builtin.metrics import accuracy
from nvtrain.hooks import EarlyStoppingHook

Batch = tuple[torch.Tensor, torch.Tensor]

STEPS_PER_EPOCH = 4


def make_batches(count: int, seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 3, generator=generator), torch.randint(0, 2, (8,), generator=generator)) for _ in range(count)
    ]


class CountValidations:
    """Records the validation summaries the run produced."""

    def __init__(self) -> None:
        self.summaries: list[dict[str, Any]] = []

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.summaries.append(dict(ctx.validation))


def make_strategy(
    hooks: list[object], *, lr: float = 0.0, num_epochs: int = 10, val_seed: int = 2
) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=lr),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        num_epochs=num_epochs,
        device="cpu",
        validation=nvtrain.ValidationConfig(
            data=make_batches(2, seed=val_seed), every_n_epochs=1, metrics={"accuracy": accuracy}
        ),
    )


class FakeContext:
    """The two things the hook touches: the validation summary and request_stop (inside a run)."""

    def __init__(self) -> None:
        self.validation: dict[str, Any] = {}
        self.windowed = True
        self.step_count = 0
        self.requests: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.requests.append(reason)


def feed(hook: EarlyStoppingHook, values: list[Any], key: str = "loss") -> list[int]:
    """Give ``values`` to the hook one validation at a time; the 1-based validations that asked to stop."""
    ctx = FakeContext()
    stopped = []
    for index, value in enumerate(values, start=1):
        ctx.validation = {key: value, "num_samples": 16}
        before = len(ctx.requests)
        hook.after_validation(ctx)
        if len(ctx.requests) > before:
            stopped.append(index)
    return stopped


# -- in a run ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("monitor", "mode"), [("loss", "min"), ("accuracy", "max")])
@pytest.mark.parametrize("patience", [1, 2])
def test_a_run_that_cannot_improve_stops_within_patience_plus_one_validations(
    monitor: str, mode: str, patience: int
) -> None:
    seen = CountValidations()
    hook = EarlyStoppingHook(monitor=monitor, mode=mode, patience=patience)
    with make_strategy([hook, seen], lr=0.0) as strategy:  # lr 0: every validation gives the same values
        result = strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))
    assert len(seen.summaries) == patience + 1
    assert result.stop_reason is not None and "early stopping" in result.stop_reason
    assert monitor in result.stop_reason and f"patience {patience}" in result.stop_reason
    assert not result.preempted
    assert result.step_count == (patience + 1) * STEPS_PER_EPOCH  # no step after the stopping validation
    assert hook.wait == patience


def test_a_run_that_keeps_improving_runs_to_its_end() -> None:
    seen = CountValidations()
    hook = EarlyStoppingHook(monitor="loss", patience=1)
    with make_strategy([hook, seen], lr=0.05, num_epochs=4, val_seed=1) as strategy:  # validate on training data
        result = strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))
    losses = [float(s["loss"]) for s in seen.summaries]
    assert all(later < earlier for earlier, later in itertools.pairwise(losses))  # the premise: it improves
    assert result.stop_reason is None and result.step_count == 4 * STEPS_PER_EPOCH
    assert hook.best == pytest.approx(losses[-1]) and hook.wait == 0


def test_a_missing_metric_names_the_key_and_the_keys_present() -> None:
    hook = EarlyStoppingHook(monitor="f1")
    with (
        make_strategy([hook]) as strategy,
        pytest.raises(KeyError, match=r"no 'f1' to monitor \(its keys: loss, accuracy, num_samples\)"),
    ):
        strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))


def test_a_standalone_validate_is_counted_but_stops_nothing() -> None:
    hook = EarlyStoppingHook(patience=0)
    with make_strategy([hook]) as strategy:
        strategy.validate()
        strategy.validate()  # no improvement, patience 0: would stop, but no run is in progress
    assert hook.wait == 1 and hook.best is not None


# -- the decision -----------------------------------------------------------------------------


def test_min_mode_stops_after_patience_validations_without_a_new_best() -> None:
    assert feed(EarlyStoppingHook(patience=2), [1.0, 0.8, 0.9, 0.85, 0.7, 0.7, 0.75]) == [4, 7]


def test_max_mode_treats_higher_as_better() -> None:
    values = [0.5, 0.6, 0.6, 0.55]
    assert feed(EarlyStoppingHook(monitor="acc", mode="max", patience=2), values, key="acc") == [4]
    assert feed(EarlyStoppingHook(monitor="acc", mode="min", patience=2), values, key="acc") == [3, 4]


def test_patience_zero_stops_at_the_first_validation_without_improvement() -> None:
    assert feed(EarlyStoppingHook(patience=0), [1.0, 0.9, 0.9]) == [3]


def test_min_delta_is_the_smallest_change_that_counts() -> None:
    hook = EarlyStoppingHook(patience=2, min_delta=0.1)
    assert feed(hook, [1.0, 0.95, 0.92, 0.91]) == [3, 4]  # none beats 1.0 by more than 0.1
    assert hook.best == 1.0
    assert feed(hook, [0.85]) == [] and (hook.best, hook.wait) == (0.85, 0)  # this one does
    assert feed(EarlyStoppingHook(patience=2), [1.0, 0.95, 0.92, 0.91]) == []
    assert feed(EarlyStoppingHook(patience=1, min_delta=0.5), [1.0, 0.5]) == [2]  # exactly min_delta: not more
    assert feed(EarlyStoppingHook(mode="max", patience=1, min_delta=0.5), [0.0, 0.5]) == [2]
    assert feed(EarlyStoppingHook(mode="max", patience=1, min_delta=0.5), [0.0, 0.75]) == []


def test_a_non_finite_value_counts_as_no_improvement() -> None:
    hook = EarlyStoppingHook(patience=3)
    assert feed(hook, [1.0, math.nan, math.inf]) == []
    assert (hook.best, hook.wait) == (1.0, 2)
    assert feed(hook, [0.5]) == [] and (hook.best, hook.wait) == (0.5, 0)  # a finite improvement resets
    fresh = EarlyStoppingHook(mode="max", patience=2)
    assert feed(fresh, [math.nan, -math.inf]) == [2] and fresh.best is None
    assert feed(EarlyStoppingHook(mode="max", patience=1), [1.0, math.inf]) == [2]


def test_tensors_and_plain_numbers_are_read_and_other_values_refused() -> None:
    hook = EarlyStoppingHook(patience=1)
    assert feed(hook, [torch.tensor(1.0), torch.tensor([0.5]), 0.5]) == [3]
    assert hook.best == 0.5
    with pytest.raises(TypeError, match=r"'loss' must hold one number \(got a tensor of shape \(2,\)\)"):
        feed(EarlyStoppingHook(), [torch.tensor([1.0, 2.0])])
    with pytest.raises(TypeError, match=r"'loss' must be a number or a one-element tensor \(got str\)"):
        feed(EarlyStoppingHook(), ["low"])


# -- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"monitor": ""}, ValueError, r"EarlyStoppingHook.monitor must be a non-empty key"),
        ({"monitor": 3}, ValueError, r"EarlyStoppingHook.monitor must be a non-empty key .* \(got 3\)"),
        ({"mode": "maximize"}, ValueError, r"EarlyStoppingHook.mode must be 'min' .* or 'max' .*\(got 'maximize'\)"),
        ({"patience": -1}, ValueError, r"EarlyStoppingHook.patience must be an int >= 0 \(got -1\)"),
        ({"patience": 1.5}, ValueError, r"EarlyStoppingHook.patience must be an int >= 0 \(got 1.5\)"),
        ({"patience": True}, ValueError, r"EarlyStoppingHook.patience must be an int >= 0 \(got True\)"),
        ({"min_delta": -0.1}, ValueError, r"EarlyStoppingHook.min_delta must be in \[0.0, inf\) \(got -0.1\)"),
        ({"min_delta": math.nan}, ValueError, r"EarlyStoppingHook.min_delta must be in \[0.0, inf\) \(got nan\)"),
        ({"min_delta": "0.1"}, ValueError, r"EarlyStoppingHook.min_delta must be in \[0.0, inf\)"),
    ],
)
def test_bad_settings_fail_at_construction(fields: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        EarlyStoppingHook(**fields)


def test_it_is_a_built_in_hook_a_config_can_name(tmp_path: Path) -> None:
    from nvtrain.app import prepare
    from nvtrain.config import ConfigError, load_config

    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {factory: 'nvtrain.builtin.digits:make_classifier'}\n"
        "data: {factory: 'nvtrain.builtin.digits:make_loaders'}\n"
        "validation: {metrics: [accuracy]}\n"  # the monitor must be a key of the validation summary
        "hooks:\n"
        "  - {name: early_stopping, monitor: accuracy, mode: max, patience: 2}\n",
        encoding="utf-8",
    )
    plan = prepare(load_config(config), world_size=1)
    (hook,) = [h for h in plan.hooks if isinstance(h, EarlyStoppingHook)]
    assert (hook.monitor, hook.mode, hook.patience, hook.min_delta) == ("accuracy", "max", 2, 0.0)
    assert isinstance(hook, nvtrain.CheckpointableHook)
    with pytest.raises(ConfigError) as info:
        prepare(load_config(config, ["hooks.early_stopping.mode=highest"]), world_size=1)
    assert info.value.path == ("hooks", 0, "mode") and "EarlyStoppingHook.mode must be 'min'" in str(info.value)
    config.write_text(config.read_text(encoding="utf-8").replace("validation: {metrics: [accuracy]}\n", ""))
    with pytest.raises(ConfigError) as info:
        prepare(load_config(config), world_size=1)
    assert info.value.path == ("hooks", 0, "monitor") and "monitor 'accuracy' is not a key" in str(info.value)


# -- resume ------------------------------------------------------------------------------------


def test_state_round_trips_through_state_dict() -> None:
    saved = EarlyStoppingHook(patience=3)
    feed(saved, [1.0, 0.5, 0.7, 0.6])
    assert saved.state_dict() == {"monitor": "loss", "mode": "min", "best": 0.5, "wait": 2}
    restored = EarlyStoppingHook(patience=3)
    restored.load_state_dict(saved.state_dict())
    assert (restored.best, restored.wait) == (0.5, 2)
    assert feed(restored, [0.9]) == [1]  # the third validation without improvement, counted across the resume


def test_a_state_for_another_metric_is_not_applied() -> None:
    saved = EarlyStoppingHook(monitor="loss")
    feed(saved, [1.0, 2.0])
    other = EarlyStoppingHook(monitor="accuracy", mode="max")
    with pytest.warns(UserWarning, match=r"watched 'loss' \(mode 'min'\), this hook watches 'accuracy'"):
        other.load_state_dict(saved.state_dict())
    assert (other.best, other.wait) == (None, 0)


def test_state_survives_a_checkpoint_and_resume(tmp_path: Path) -> None:
    nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")
    CheckpointHook, read_checkpoint = nvtrain_checkpoint.CheckpointHook, nvtrain_checkpoint.read_checkpoint

    # Two epochs at lr 0: the first validation sets the best, the second does not beat it.
    # epoch_interval saves after the epoch's validation, so the checkpoint holds both.
    first = EarlyStoppingHook(patience=5)
    with make_strategy([first, CheckpointHook(tmp_path, epoch_interval=1)], num_epochs=2) as strategy:
        result = strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))
    assert result.stop_reason is None and first.wait == 1
    saved = read_checkpoint(tmp_path)["hooks"]["early_stopping"]
    assert saved == {"monitor": "loss", "mode": "min", "best": first.best, "wait": 1}

    # Resumed with patience 2: one more stalled validation (epoch 3) is the second in a row.
    resumed = EarlyStoppingHook(patience=2)
    hooks = [resumed, CheckpointHook(tmp_path, epoch_interval=1, resume="auto")]
    with make_strategy(hooks, num_epochs=10) as strategy:
        result = strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))
    assert result.stop_reason is not None and "early stopping" in result.stop_reason
    assert result.step_count == 3 * STEPS_PER_EPOCH  # a fresh hook would stop at epoch 5
    assert resumed.best == first.best and resumed.wait == 2


def test_two_hooks_with_their_own_state_keys_survive_a_checkpoint_and_resume(tmp_path: Path) -> None:
    nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")
    CheckpointHook, read_checkpoint = nvtrain_checkpoint.CheckpointHook, nvtrain_checkpoint.read_checkpoint

    def watchers() -> list[EarlyStoppingHook]:
        return [
            EarlyStoppingHook(monitor="loss", patience=5),
            EarlyStoppingHook(monitor="accuracy", mode="max", patience=5, state_key="accuracy"),
        ]

    first = watchers()
    with make_strategy([*first, CheckpointHook(tmp_path, epoch_interval=1)], num_epochs=2) as strategy:
        strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))
    saved = read_checkpoint(tmp_path)["hooks"]
    # the loss watcher keeps the key of a single hook, so checkpoints written before state_key still load
    assert saved["early_stopping"] == first[0].state_dict() and saved["early_stopping"]["monitor"] == "loss"
    assert saved["early_stopping:accuracy"] == first[1].state_dict()
    assert saved["early_stopping:accuracy"]["monitor"] == "accuracy"

    resumed = watchers()
    hooks = [*resumed, CheckpointHook(tmp_path, epoch_interval=1, resume="auto")]
    with make_strategy(hooks, num_epochs=2) as strategy:
        strategy.run(make_batches(STEPS_PER_EPOCH, seed=1))  # resumed at its end: nothing to train
    assert [(hook.best, hook.wait) for hook in resumed] == [(hook.best, hook.wait) for hook in first]


def test_two_hooks_without_state_keys_are_refused_naming_the_setting() -> None:
    from nvtrain.state import checkpointable_hooks

    with pytest.raises(ValueError, match="give each a distinct `state_key`"):
        checkpointable_hooks([EarlyStoppingHook(), EarlyStoppingHook(monitor="accuracy", mode="max")])


@pytest.mark.parametrize("key", ["", 3])
def test_a_state_key_must_be_a_non_empty_string(key: object) -> None:
    with pytest.raises(ValueError, match=r"EarlyStoppingHook.state_key must be a non-empty string"):
        EarlyStoppingHook(state_key=key)  # type: ignore[arg-type]
