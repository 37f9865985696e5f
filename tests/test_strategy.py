"""TrainingStrategy: stage order, the BEFORE_BATCH veto, seed-hook frequency, lifetime, validation, run()."""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import TrainingStage, ValidationConfig

S = TrainingStage
mse = torch.nn.functional.mse_loss


# -- stage order ---------------------------------------------------------------------------


def test_stage_order_of_one_batch(make_strategy: Any, recorder: Any, batches: Any, batch_sequence: Any) -> None:
    strategy = make_strategy([recorder])
    strategy.train_batch(batches(1)[0])
    assert recorder.calls == ["setup", *batch_sequence]
    # ctx.stage names the stage being fired
    assert all(stage is S[name.upper()] for name, stage, _, _ in recorder.entries)
    recorder.calls.clear()
    strategy.train_batch(batches(1)[0])
    assert recorder.calls == list(batch_sequence)  # SETUP fires once per strategy


def test_stage_order_of_a_whole_run(make_strategy: Any, recorder: Any, batches: Any, batch_sequence: Any) -> None:
    strategy = make_strategy([recorder], num_epochs=2, validation=ValidationConfig(data=batches(2, seed=7)))
    strategy.run(batches(3))
    epoch = ["before_epoch", *batch_sequence * 3, "after_validation", "after_epoch"]
    assert recorder.calls == ["setup", "before_training", *epoch * 2, "after_training"]
    assert all(stage is S[name.upper()] for name, stage, _, _ in recorder.entries)
    assert len(recorder.validations) == 2


def test_counters_seen_by_observers_during_a_run(make_strategy: Any, recorder: Any, batches: Any) -> None:
    strategy = make_strategy([recorder], num_epochs=2)
    strategy.run(batches(3))
    # (step_count, batch_count) at each AFTER_OPTIMIZER_STEP: both already advanced
    after_step = [(step, count) for name, _, step, count in recorder.entries if name == "after_optimizer_step"]
    assert after_step == [(n, n) for n in range(1, 7)]
    before_batch = [(step, count) for name, _, step, count in recorder.entries if name == "before_batch"]
    assert before_batch == [(n, n) for n in range(6)]


# -- the BEFORE_BATCH veto on the bus --------------------------------------------------------


class ZeroGradVote:
    """An observer answering ``answer`` at BEFORE_BATCH from the second micro-batch on."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    @nvtrain.hookimpl
    def before_batch(self, ctx: Any) -> Any:
        return self.answer if ctx.batch_count >= 1 else None


def _grads_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    reference = copy.deepcopy(model)
    reference.zero_grad()
    mse(reference(batch[0]), batch[1]).backward()
    return reference.weight.grad


@pytest.mark.parametrize("answer", [False, None], ids=["veto", "no-opinion"])
def test_plain_before_batch_false_keeps_gradients(make_strategy: Any, batches: Any, answer: Any) -> None:
    first, second = batches(2)
    # lr=0: the weights stay put, so each micro-batch's gradient can be recomputed by hand
    strategy = make_strategy([ZeroGradVote(answer)], optimizers=functools.partial(torch.optim.SGD, lr=0.0))
    model = strategy.models["main"]
    g1, g2 = _grads_of(model, first), _grads_of(model, second)
    strategy.train_batch(first)
    strategy.train_batch(second)
    grad = strategy.ctx.models["main"].weight.grad
    expected = g1 + g2 if answer is False else g2
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)


def test_seed_hook_returning_false_at_before_batch_vetoes_zeroing(make_strategy: Any, batches: Any) -> None:
    class Keep(nvtrain.Hook):
        stages = (S.BEFORE_BATCH,)

        def __call__(self, ctx: Any, stage: TrainingStage) -> bool | None:
            return False if ctx.batch_count >= 1 else None

    first, second = batches(2)
    strategy = make_strategy([Keep()], optimizers=functools.partial(torch.optim.SGD, lr=0.0))
    model = strategy.models["main"]
    expected = _grads_of(model, first) + _grads_of(model, second)
    strategy.train_batch(first)
    strategy.train_batch(second)
    torch.testing.assert_close(strategy.ctx.models["main"].weight.grad, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("answer", [0, 1, "no"])
def test_before_batch_answer_other_than_false_or_none_is_refused(make_strategy: Any, batches: Any, answer: Any) -> None:
    strategy = make_strategy([ZeroGradVote(answer)])
    strategy.train_batch(batches(1)[0])
    with pytest.raises(TypeError, match=rf"stage BEFORE_BATCH: one of \[.*\] returned {type(answer).__name__}") as err:
        strategy.train_batch(batches(1)[0])
    assert "ZeroGradVote" in str(err.value)


def test_before_batch_true_means_proceed(make_strategy: Any, batches: Any) -> None:
    first, second = batches(2)
    strategy = make_strategy([ZeroGradVote(True)], optimizers=functools.partial(torch.optim.SGD, lr=0.0))
    model = strategy.models["main"]
    expected = _grads_of(model, second)  # zeroed before the second micro-batch: only its gradients
    strategy.train_batch(first)
    strategy.train_batch(second)
    torch.testing.assert_close(strategy.ctx.models["main"].weight.grad, expected, rtol=1e-6, atol=1e-7)


# -- seed Hook frequency ----------------------------------------------------------------------


def test_seed_hook_frequency_fires_once_per_step_value(make_strategy: Any, batches: Any, veto_step: Any) -> None:
    fired: list[tuple[TrainingStage, int, int]] = []

    class EverySecondStep(nvtrain.Hook):
        stages = (S.AFTER_BATCH, S.AFTER_EPOCH)
        frequency = 2

        def __call__(self, ctx: Any, stage: TrainingStage) -> None:
            fired.append((stage, ctx.step_count, ctx.batch_count))

    # micro-batches 2 and 5 are vetoed: step_count after each batch is 1, 2, 2, 3, 4, 4
    strategy = make_strategy([EverySecondStep(), veto_step({2, 5})], num_epochs=1)
    strategy.run(batches(6))
    assert fired == [(S.AFTER_BATCH, 2, 2), (S.AFTER_BATCH, 4, 5), (S.AFTER_EPOCH, 4, 6)]


class EverySecond(nvtrain.Hook):
    """Records (stage, step) at every firing of a frequency-2 seed hook."""

    stages = (S.BEFORE_BATCH, S.AFTER_OPTIMIZER_STEP, S.AFTER_BATCH)
    frequency = 2

    def __init__(self) -> None:
        self.fired: list[tuple[str, int]] = []

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        self.fired.append((stage.name, ctx.step_count))


def test_seed_hook_frequency_after_a_resume_fires_as_the_run_that_never_stopped(make_strategy: Any, batches: Any) -> None:
    """The post-step stages of the resume step fired before its checkpoint: a fresh hook (a new process) fired
    them again on the next window's first micro-batch, which takes no step."""
    from nvtrain.hooks import GradientAccumulationHook

    data = batches(16)
    straight = EverySecond()
    make_strategy([GradientAccumulationHook(steps=2), straight], max_steps=8).run(data)
    first = make_strategy([GradientAccumulationHook(steps=2)], max_steps=4)
    first.run(data)
    state = copy.deepcopy(first.state_dict())
    resumed_hook = EverySecond()
    resumed = make_strategy([GradientAccumulationHook(steps=2), resumed_hook], max_steps=8)
    resumed.load_state_dict(state)
    resumed.run(data)
    at_the_resume = straight.fired.index(("BEFORE_BATCH", 4))  # step 4's post-step stages fired before it
    assert resumed_hook.fired == straight.fired[at_the_resume:]
    assert resumed_hook.fired[:3] == [("BEFORE_BATCH", 4), ("AFTER_OPTIMIZER_STEP", 6), ("AFTER_BATCH", 6)]


def test_seed_hook_frequency_fires_again_for_steps_a_restore_brings_back(make_strategy: Any, batches: Any) -> None:
    """Rewound to step 2, a run takes steps 3 and 4 again: step 4's stages fire again."""
    earlier = make_strategy([], max_steps=2)
    earlier.run(batches(8))
    state = copy.deepcopy(earlier.state_dict())
    hook = EverySecond()
    strategy = make_strategy([hook], max_steps=4)
    strategy.run(batches(8))
    strategy.load_state_dict(state)
    strategy.run(batches(8))
    after_batch = [step for stage, step in hook.fired if stage == "AFTER_BATCH"]
    assert after_batch == [2, 4, 4]


# -- lifetime: the context manager ------------------------------------------------------------


class Closing:
    """An observer plugin that records its close()."""

    def __init__(self, log: list[str], label: str, fail: bool = False) -> None:
        self.log, self.label, self.fail = log, label, fail

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        return None

    def close(self) -> None:
        self.log.append(self.label)
        if self.fail:
            raise OSError(f"{self.label} could not close")


class ClosingUpdate(nvtrain.TrainingUpdateHook):
    stages = frozenset({S.AFTER_OPTIMIZER_STEP})

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def close(self) -> None:
        self.log.append("update")


class ClosingSeed(nvtrain.Hook):
    stages = (S.AFTER_BATCH,)

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        return None

    def close(self) -> None:
        self.log.append("seed")


def test_hooks_are_closed_after_an_exception_and_it_propagates(make_strategy: Any, batches: Any) -> None:
    log: list[str] = []

    def broken_loss(outputs: Any, targets: Any) -> torch.Tensor:
        raise RuntimeError("loss exploded")

    strategy = make_strategy([Closing(log, "observer"), ClosingUpdate(log), ClosingSeed(log)], loss_fn=broken_loss)
    inner = ClosingUpdate(log)
    strategy.register_hook(inner)
    with pytest.raises(RuntimeError, match="loss exploded"), strategy:
        strategy.train_batch(batches(1)[0])
    # reverse registration order, every hook once
    assert log == ["update", "seed", "update", "observer"]


def test_hooks_of_a_pre_composed_orchestrator_are_closed(make_strategy: Any) -> None:
    log: list[str] = []
    with pytest.raises(KeyError), make_strategy([ClosingUpdate(log) + ClosingUpdate(log)]):
        raise KeyError("inside")
    assert log == ["update", "update"]


def test_close_failure_during_an_exception_is_noted_not_swallowed(make_strategy: Any) -> None:
    log: list[str] = []
    strategy = make_strategy([Closing(log, "bad", fail=True), Closing(log, "good")])
    with pytest.raises(ValueError, match="original") as info, strategy:
        raise ValueError("original")
    assert log == ["good", "bad"]
    assert any("OSError: bad could not close" in note for note in info.value.__notes__)


def test_close_failure_without_a_pending_exception_is_raised(make_strategy: Any) -> None:
    log: list[str] = []
    strategy = make_strategy([Closing(log, "bad", fail=True), Closing(log, "good")])
    with pytest.raises(OSError, match="bad could not close"), strategy:
        pass
    assert log == ["good", "bad"]


def test_close_without_context_manager_closes_hooks(make_strategy: Any) -> None:
    log: list[str] = []
    strategy = make_strategy([Closing(log, "a"), ClosingUpdate(log)])
    strategy.close()
    assert log == ["update", "a"]


# -- validation ---------------------------------------------------------------------------------


def _abs_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


def test_validate_weights_loss_and_metrics_by_sample_count(make_strategy: Any, recorder: Any, batches: Any) -> None:
    data = batches(3, sizes=[4, 4, 1], seed=3)
    strategy = make_strategy([recorder], validation=ValidationConfig(data=data, metrics={"mae": _abs_error}))
    model = strategy.models["main"]
    summary = strategy.validate()
    inputs = torch.cat([x for x, _ in data])
    targets = torch.cat([y for _, y in data])
    with torch.no_grad():
        outputs = model(inputs)
        expected_loss = mse(outputs, targets)
        expected_mae = _abs_error(outputs, targets)
        unweighted = torch.stack([mse(model(x), y) for x, y in data]).mean()
    assert summary["num_samples"] == 9
    assert isinstance(summary["loss"], torch.Tensor) and isinstance(summary["mae"], torch.Tensor)
    torch.testing.assert_close(summary["loss"], expected_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(summary["mae"], expected_mae, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(unweighted, expected_loss, rtol=1e-3)  # the uneven batch matters
    # AFTER_VALIDATION fired with the summary in ctx.validation
    assert recorder.calls[-1] == "after_validation"
    assert recorder.validations == [summary]
    assert strategy.ctx.validation is summary
    assert model.training  # train mode restored


def test_validate_with_an_explicit_loader_and_without_config(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy()
    summary = strategy.validate(batches(2))
    assert summary["num_samples"] == 8
    with pytest.raises(ValueError, match="no loader given"):
        strategy.validate()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_use_mixed_precision_must_be_true_false_or_auto(value: Any) -> None:
    message = rf"ValidationConfig.use_mixed_precision must be True, False or 'auto' \(got {value!r}\)"
    with pytest.raises(ValueError, match=message):
        ValidationConfig(use_mixed_precision=value)


def test_validation_config_cadences_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"ValidationConfig.every_n_steps must be an int >= 1 or None \(got 0\)"):
        ValidationConfig(every_n_steps=0)
    with pytest.raises(
        ValueError,
        match=r"ValidationConfig.every_n_epochs must be an int >= 1, None \(never at epoch ends\) or .auto. \(got True\)",
    ):
        ValidationConfig(every_n_epochs=True)


class Precision:
    """Stands in for a mixed-precision hook: an observer exposing ``autocast()``."""

    def __init__(self) -> None:
        self.entered = 0

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        return None

    @contextlib.contextmanager
    def autocast(self) -> Any:
        self.entered += 1
        yield


@pytest.mark.parametrize(("setting", "entered"), [("auto", 2), (True, 2), (False, 0)])
def test_validation_follows_the_mixed_precision_hook(
    make_strategy: Any, batches: Any, setting: Any, entered: int
) -> None:
    precision = Precision()
    strategy = make_strategy([precision], validation=ValidationConfig(data=batches(2), use_mixed_precision=setting))
    strategy.validate()
    assert precision.entered == entered


def test_forced_mixed_precision_without_a_hook_is_refused(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(validation=ValidationConfig(data=batches(1), use_mixed_precision=True))
    with pytest.raises(ValueError, match="use_mixed_precision=True but no mixed-precision hook"):
        strategy.validate()


@pytest.mark.parametrize(("every", "expected_steps"), [(1, [1, 2, 3, 4]), (2, [2, 4])])
def test_step_cadence_validation_fires_only_on_real_steps(
    make_strategy: Any, recorder: Any, batches: Any, veto_step: Any, every: int, expected_steps: list[int]
) -> None:
    strategy = make_strategy(
        [recorder, veto_step(lambda index: index % 2 == 0)],
        num_epochs=1,
        validation=ValidationConfig(data=batches(1, seed=5), every_n_steps=every),
    )
    strategy.run(batches(8))
    steps = [step for name, _, step, _ in recorder.entries if name == "after_validation"]
    assert steps == expected_steps  # never on a vetoed micro-batch, and no extra end-of-epoch pass


def test_epoch_cadence_validation(make_strategy: Any, recorder: Any, batches: Any) -> None:
    strategy = make_strategy(
        [recorder], num_epochs=4, validation=ValidationConfig(data=batches(1, seed=5), every_n_epochs=2)
    )
    result = strategy.run(batches(2))
    epochs_done = [step // 2 for name, _, step, _ in recorder.entries if name == "after_validation"]
    assert epochs_done == [2, 4]
    assert result.validation is strategy.ctx.validation is recorder.validations[-1]


# -- run(), train_batch() and forward ------------------------------------------------------------


def test_run_returns_a_run_result_and_ctx_keeps_counters(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(num_epochs=2)
    result = strategy.run(batches(3))
    assert isinstance(result, nvtrain.RunResult)
    assert (result.step_count, result.global_step_count, result.batch_count) == (6, 6, 6)
    assert result.epoch == 2
    assert result.preempted is False
    assert result.validation is None
    ctx = strategy.ctx
    assert (ctx.step_count, ctx.global_step_count, ctx.batch_count, ctx.epoch) == (6, 6, 6, 2)
    assert ctx.epoch_step_count == 3


def test_run_trains_the_model_like_a_hand_written_loop(make_strategy: Any, batches: Any) -> None:
    data = batches(3)
    strategy = make_strategy(num_epochs=1)
    reference = copy.deepcopy(strategy.models["main"])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        mse(reference(x), y).backward()
        optimizer.step()
    strategy.run(data)
    for ours, theirs in zip(strategy.ctx.models["main"].parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_max_steps_stops_early_counting_real_steps_only(
    make_strategy: Any, recorder: Any, batches: Any, veto_step: Any
) -> None:
    strategy = make_strategy([recorder, veto_step(lambda index: index % 2 == 1)], max_steps=3)
    result = strategy.run(batches(4))
    assert result.step_count == 3
    assert result.batch_count == 5  # micro-batches 0..4, the odd ones vetoed
    assert recorder.calls[-1] == "after_training"
    assert recorder.calls.count("before_epoch") == 2


def test_without_epochs_or_max_steps_run_does_one_epoch(make_strategy: Any, batches: Any) -> None:
    result = make_strategy().run(batches(3))
    assert (result.batch_count, result.epoch) == (3, 1)


def test_run_requires_a_loader(make_strategy: Any) -> None:
    with pytest.raises(ValueError, match="a loader or iterable of batches is required"):
        make_strategy().run(None)


def test_train_batch_works_standalone(make_strategy: Any, recorder: Any, batches: Any) -> None:
    x, y = batches(1)[0]
    strategy = make_strategy([recorder])
    reference = copy.deepcopy(strategy.models["main"])
    expected_loss = mse(reference(x), y)
    expected_loss.backward()
    loss = strategy.train_batch((x, y))
    assert isinstance(loss, torch.Tensor)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0.0)
    with torch.no_grad():
        expected_weight = reference.weight - 0.1 * reference.weight.grad
    torch.testing.assert_close(strategy.ctx.models["main"].weight, expected_weight, rtol=1e-6, atol=1e-7)
    assert (strategy.ctx.step_count, strategy.ctx.batch_count) == (1, 1)
    assert "before_training" not in recorder.calls
    assert strategy.ctx.windowed is False


class _GraphProbe:
    """Records, at AFTER_BATCH, whether the step's outputs and losses are still attached to its graph."""

    def __init__(self, fail_at_after_loss: bool = False) -> None:
        self.fail_at_after_loss = fail_at_after_loss
        self.attached: list[tuple[bool, bool, bool]] = []
        self.values: list[torch.Tensor] = []

    @nvtrain.hookimpl
    def after_loss(self, ctx: Any) -> None:
        if self.fail_at_after_loss:
            raise RuntimeError("a hook failed mid-step")

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        outputs = ctx.outputs["y"][0]
        self.attached.append((outputs.grad_fn is not None, ctx.loss.grad_fn is not None, ctx.backward_loss is not None))
        self.values.append(outputs.clone())


def _nested_forward(ctx: Any) -> dict[str, Any]:
    y = ctx.models["main"](ctx.batch[0])
    return {"y": (y, 2 * y), "label": "kept"}


def _nested_loss(outputs: dict[str, Any], targets: torch.Tensor) -> torch.Tensor:
    return mse(outputs["y"][0], targets)


def _assert_detached(ctx: Any) -> None:
    tensors = [*ctx.outputs["y"], ctx.loss] + ([ctx.backward_loss] if ctx.backward_loss is not None else [])
    assert all(t.grad_fn is None and not t.requires_grad for t in tensors)
    assert ctx.outputs["label"] == "kept"  # the structure and non-tensor leaves stay


def test_a_finished_run_leaves_no_autograd_graph_on_the_context(make_strategy: Any, batches: Any) -> None:
    # The graph of the last step has no use after it, and the context would otherwise hold it as long as the
    # strategy lives (under FSDP, with the model, out of the garbage collector's reach)
    probe = _GraphProbe()
    strategy = make_strategy([probe], forward_fn=_nested_forward, loss_fn=_nested_loss, num_epochs=1)
    strategy.run(batches(3))
    assert probe.attached[-1][:2] == (True, True), "hooks must still see the graph during the step"
    _assert_detached(strategy.ctx)
    assert torch.equal(strategy.ctx.outputs["y"][0], probe.values[-1])


def test_train_batch_returns_a_detached_loss_and_leaves_no_graph(make_strategy: Any, batches: Any) -> None:
    probe = _GraphProbe()
    strategy = make_strategy([probe], forward_fn=_nested_forward, loss_fn=_nested_loss)
    loss = strategy.train_batch(batches(1)[0])
    assert probe.attached == [(True, True, True)]
    assert loss is strategy.ctx.loss and loss.grad_fn is None
    _assert_detached(strategy.ctx)


def test_a_step_that_fails_before_its_backward_leaves_no_graph(make_strategy: Any, batches: Any) -> None:
    # a failed step never ran backward: its graph still holds every saved activation
    strategy = make_strategy([_GraphProbe(fail_at_after_loss=True)], forward_fn=_nested_forward, loss_fn=_nested_loss)
    with pytest.raises(RuntimeError, match="a hook failed mid-step"):
        strategy.run(batches(2))
    _assert_detached(strategy.ctx)
    with pytest.raises(RuntimeError, match="a hook failed mid-step"):
        strategy.train_batch(batches(1)[0])
    _assert_detached(strategy.ctx)


def test_forward_fn_handles_dict_batches(make_strategy: Any) -> None:
    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 2)}
    strategy = make_strategy(
        forward_fn=lambda ctx: ctx.models["main"](ctx.batch["x"]),
        loss_fn=lambda outputs, batch: mse(outputs, batch["y"]),
        validation=ValidationConfig(data=[batch]),
    )
    reference = copy.deepcopy(strategy.models["main"])
    loss = strategy.train_batch(batch)
    torch.testing.assert_close(loss, mse(reference(batch["x"]), batch["y"]), rtol=1e-6, atol=0.0)
    summary = strategy.validate()
    assert summary["num_samples"] == 4


@pytest.mark.parametrize(
    "batch", [torch.randn(4, 3), {"x": torch.randn(4, 3)}, (torch.randn(4, 3),)], ids=["tensor", "dict", "1-tuple"]
)
def test_default_forward_refuses_non_pair_batches(make_strategy: Any, batch: Any) -> None:
    with pytest.raises(TypeError, match=r"the default forward expects batches of \(inputs, targets\).*forward_fn"):
        make_strategy().train_batch(batch)


def test_optimizers_are_built_after_setup_from_trainable_parameters(make_strategy: Any, batches: Any) -> None:
    class Freeze:
        @nvtrain.hookimpl
        def setup(self, ctx: Any) -> None:
            ctx.models["main"].bias.requires_grad_(False)

    strategy = make_strategy([Freeze()])
    strategy.train_batch(batches(1)[0])
    (group,) = strategy.ctx.optimizers["main"].param_groups
    assert group["params"] == [strategy.ctx.models["main"].weight]


# -- strategy field validation --------------------------------------------------------------------


sgd = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"models": "not a model"}, TypeError, r"TrainingStrategy.models must be a torch.nn.Module or a mapping"),
        ({"models": {"main": 3}}, TypeError, r"TrainingStrategy.models\['main'\] must be a torch.nn.Module \(got int"),
        ({"models": {}}, ValueError, r"TrainingStrategy.models is empty"),
        ({"optimizers": {"other": sgd}}, ValueError, r"TrainingStrategy.optimizers\['other'\]: no model named 'other'"),
        ({"optimizers": {"main": 3}}, TypeError, r"TrainingStrategy.optimizers\['main'\] must be callable"),
        ({"optimizers": {}}, ValueError, r"TrainingStrategy.optimizers: at least one optimizer factory is required"),
        ({"lr_schedulers": {"other": sgd}}, ValueError, r"TrainingStrategy.lr_schedulers\['other'\]: no optimizer"),
        ({"device": "not-a-device"}, ValueError, r"TrainingStrategy.device: 'not-a-device' is not a torch device"),
        ({"max_steps": 0}, ValueError, r"TrainingStrategy.max_steps must be an int >= 1 or None \(got 0\)"),
        ({"num_epochs": 1.5}, ValueError, r"TrainingStrategy.num_epochs must be an int >= 1 or None \(got 1.5\)"),
        ({"validation": {"data": []}}, TypeError, r"TrainingStrategy.validation must be a ValidationConfig \(got dict"),
        ({"loss_fn": "mse"}, TypeError, r"TrainingStrategy.loss_fn must be callable \(got 'mse'\)"),
    ],
    ids=[
        "models-type",
        "models-entry",
        "models-empty",
        "optimizers-key",
        "optimizers-factory",
        "optimizers-empty",
        "lr-schedulers-key",
        "device",
        "max-steps",
        "num-epochs",
        "validation-type",
        "loss-fn",
    ],
)
def test_bad_strategy_fields_are_refused_naming_the_field(
    make_strategy: Any, fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make_strategy(**fields)


def test_optimizer_factory_must_build_an_optimizer(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(optimizers=lambda params: "not an optimizer")
    message = r"TrainingStrategy.optimizers\['main'\] must build a torch.optim.Optimizer \(got str\)"
    with pytest.raises(TypeError, match=message):
        strategy.train_batch(batches(1)[0])


# -- registration after construction and repeated runs ------------------------------------------


class _UpdateWithObserverTypo(nvtrain.TrainingUpdateHook):
    stages = frozenset({nvtrain.TrainingStage.DO_OPTIMIZER_STEP})

    @nvtrain.hookimpl
    def after_bach(self, ctx: Any) -> None:  # misspelled stage name
        pass


class _UpdateWithUnmarkedStage(nvtrain.TrainingUpdateHook):
    stages = frozenset({nvtrain.TrainingStage.DO_OPTIMIZER_STEP})

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        pass

    def after_epoch(self, ctx: Any) -> None:  # forgot the marker
        pass


def test_misspelled_hookimpl_on_update_hook_is_refused(make_strategy: Any) -> None:
    with pytest.raises(ValueError, match="after_bach"):
        make_strategy([_UpdateWithObserverTypo()])


def test_register_hook_refused_by_the_bus_leaves_the_orchestrator_unchanged(make_strategy: Any) -> None:
    strategy = make_strategy([])
    hook = _UpdateWithUnmarkedStage()
    with pytest.raises(ValueError, match="after_epoch"):
        strategy.register_hook(hook)
    assert hook not in strategy.update_hooks()
    assert hook not in strategy.bus.plugins()


class _SwapLoader:
    """Replaces the loader at SETUP, as a DDP plugin injecting a sampler does."""

    def __init__(self, replacement: list[Any]) -> None:
        self.replacement = replacement

    @nvtrain.hookimpl
    def setup(self, ctx: Any) -> None:
        ctx.train_loader = self.replacement


def test_second_run_on_the_same_loader_keeps_the_setup_replacement(make_strategy: Any, batches: Any) -> None:
    original, replacement = batches(2), batches(3, seed=7)
    strategy = make_strategy([_SwapLoader(replacement)], num_epochs=2)
    strategy.run(original)
    assert strategy.ctx.train_loader is replacement
    strategy.run(original)  # continues the same run: the replaced loader is still used
    assert strategy.ctx.train_loader is replacement
    assert strategy.ctx.batch_count == 6


def test_batch_size_is_read_from_shapes_with_one_rule() -> None:
    from nvtrain.batching import batch_size

    assert batch_size(torch.zeros(5, 3)) == 5
    assert batch_size(torch.tensor(1.0)) == 1
    assert batch_size({"x": torch.zeros(4, 2), "y": torch.zeros(4)}) == 4
    assert batch_size({}) == 0  # an empty mapping holds no samples (the validation mean weights it 0)
    assert batch_size((torch.zeros(6, 1), torch.zeros(6))) == 6
    assert batch_size("text") == 1
