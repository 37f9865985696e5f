"""The update orchestrator: veto composition, the loss chain, real steps, counters, contract errors."""

from __future__ import annotations

import copy
import functools
import re
import types
from typing import Any

import attrs
import pytest
import torch

import nvtrain
from nvtrain import TrainingStage, TrainingUpdateHook, TrainingUpdateOrchestrator

S = TrainingStage
ALL_UPDATE = frozenset({S.BEFORE_BATCH, S.DO_BACKWARD, S.DO_OPTIMIZER_STEP, S.AFTER_OPTIMIZER_STEP})


class Recording(TrainingUpdateHook):
    """Records ``(label, stage, will_skip)``; vetoes the stages in ``veto``."""

    uses_gradients = False  # it only records: any order of these may be composed

    def __init__(
        self,
        label: str,
        log: list[tuple[str, TrainingStage, bool]],
        priority: int = 50,
        veto: frozenset[TrainingStage] = frozenset(),
    ) -> None:
        self.label, self.log, self.priority, self.veto = label, log, priority, veto

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        self.log.append((self.label, stage, will_skip))
        return stage not in self.veto, ctx.loss


# -- veto composition and will_skip ---------------------------------------------------------


def test_later_hooks_are_called_with_will_skip_after_a_step_veto(make_strategy: Any, batches: Any) -> None:
    log: list[tuple[str, TrainingStage, bool]] = []
    hooks = [
        Recording("p30", log, 30),
        Recording("p10", log, 10, veto=frozenset({S.DO_OPTIMIZER_STEP})),
        Recording("p20", log, 20),
    ]
    strategy = make_strategy(hooks)
    strategy.train_batch(batches(1)[0])
    at = {stage: [(label, skip) for label, s, skip in log if s is stage] for stage in ALL_UPDATE}
    assert at[S.BEFORE_BATCH] == [("p10", False), ("p20", False), ("p30", False)]
    assert at[S.DO_BACKWARD] == [("p10", False), ("p20", False), ("p30", False)]
    assert at[S.DO_OPTIMIZER_STEP] == [("p10", False), ("p20", True), ("p30", True)]
    assert at[S.AFTER_OPTIMIZER_STEP] == [("p10", True), ("p20", True), ("p30", True)]
    assert strategy.ctx.step_skipped is True


def test_after_optimizer_step_gets_will_skip_false_on_a_real_step(make_strategy: Any, batches: Any) -> None:
    log: list[tuple[str, TrainingStage, bool]] = []
    strategy = make_strategy([Recording("a", log, 10), Recording("b", log, 20)])
    strategy.train_batch(batches(1)[0])
    assert [(label, skip) for label, s, skip in log if s is S.AFTER_OPTIMIZER_STEP] == [("a", False), ("b", False)]
    assert strategy.ctx.step_skipped is False


def test_before_batch_veto_composes_and_keeps_gradients(make_strategy: Any, batches: Any) -> None:
    log: list[tuple[str, TrainingStage, bool]] = []
    first, second = batches(2)
    strategy = make_strategy(
        [Recording("keep", log, 10, veto=frozenset({S.BEFORE_BATCH})), Recording("late", log, 20)],
        optimizers=functools.partial(torch.optim.SGD, lr=0.0),
    )
    strategy.train_batch(first)
    assert [(label, skip) for label, s, skip in log if s is S.BEFORE_BATCH] == [("keep", False), ("late", True)]
    grad_after_one = strategy.ctx.models["main"].weight.grad.clone()
    strategy.train_batch(second)
    # not zeroed: the second micro-batch's gradient was added to the first
    reference = copy.deepcopy(strategy.ctx.models["main"])
    reference.zero_grad()
    torch.nn.functional.mse_loss(reference(second[0]), second[1]).backward()
    expected = grad_after_one + reference.weight.grad
    torch.testing.assert_close(strategy.ctx.models["main"].weight.grad, expected, rtol=1e-6, atol=1e-7)


# -- a vetoed step changes nothing ---------------------------------------------------------


def test_vetoed_step_leaves_parameters_optimizer_and_scheduler_unchanged(
    make_strategy: Any, batches: Any, veto_step: Any
) -> None:
    strategy = make_strategy(
        [veto_step({1})],
        optimizers=functools.partial(torch.optim.Adam, lr=0.1),
        lr_schedulers=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    )
    b0, b1, b2 = batches(3)
    strategy.train_batch(b0)  # a real step: Adam state exists, LR halved once
    model, optimizer = strategy.ctx.models["main"], strategy.ctx.optimizers["main"]
    scheduler = strategy.ctx.lr_schedulers["main"]
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    sched_state = copy.deepcopy(scheduler.state_dict())
    assert scheduler.last_epoch == 1

    strategy.train_batch(b1)  # vetoed
    assert strategy.ctx.step_skipped is True
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    after_state = optimizer.state_dict()
    for key, values in state["state"].items():
        for name, value in values.items():
            assert torch.equal(value, after_state["state"][key][name]), (key, name)
    assert after_state["param_groups"] == state["param_groups"]
    assert scheduler.state_dict() == sched_state
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)

    strategy.train_batch(b2)  # real again: everything moves
    assert not torch.equal(params[0], model.weight)
    assert scheduler.last_epoch == 2


# -- the DO_BACKWARD chain -------------------------------------------------------------------


class Times2(TrainingUpdateHook):
    priority = 10
    stages = frozenset({S.DO_BACKWARD})

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        return True, ctx.loss * 2


class Plus1(TrainingUpdateHook):
    priority = 20
    stages = frozenset({S.DO_BACKWARD})

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.backward_calls = 0

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        self.seen.append(ctx.loss.detach().clone())
        out = ctx.loss + 1
        out.register_hook(self._count)
        return True, out

    def _count(self, grad: torch.Tensor) -> None:
        self.backward_calls += 1


class KeepLoss:
    """Keeps ``ctx.loss`` as AFTER_LOSS and AFTER_BATCH see it (the step's graph is released after the step)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.final: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    @nvtrain.hookimpl
    def after_loss(self, ctx: Any) -> None:
        self.losses.append(ctx.loss)

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        self.final.append((ctx.loss, ctx.backward_loss))


def test_do_backward_chains_transforms_and_calls_backward_once(make_strategy: Any, batches: Any) -> None:
    plus1, keep = Plus1(), KeepLoss()
    # registered out of priority order: the chain still runs x2 first, then +1
    strategy = make_strategy([plus1, Times2(), keep], optimizers=functools.partial(torch.optim.SGD, lr=0.0))
    x, y = batches(1)[0]
    reference = copy.deepcopy(strategy.models["main"])
    ref_loss = torch.nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()

    strategy.train_batch((x, y))
    ctx = strategy.ctx
    (original,) = keep.losses
    assert keep.final[0][0] is original  # the transforms applied to what was back-propagated only
    torch.testing.assert_close(plus1.seen[0], 2 * ref_loss.detach(), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(ctx.backward_loss.detach(), 2 * ref_loss.detach() + 1, rtol=1e-6, atol=0.0)
    assert plus1.backward_calls == 1
    model = ctx.models["main"]
    torch.testing.assert_close(model.weight.grad, 2 * reference.weight.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.bias.grad, 2 * reference.bias.grad, rtol=1e-6, atol=1e-7)


def test_do_backward_without_hooks_backpropagates_the_loss(make_strategy: Any, batches: Any) -> None:
    keep = KeepLoss()
    strategy = make_strategy([keep], optimizers=functools.partial(torch.optim.SGD, lr=0.0))
    x, y = batches(1)[0]
    reference = copy.deepcopy(strategy.models["main"])
    torch.nn.functional.mse_loss(reference(x), y).backward()
    strategy.train_batch((x, y))
    ((loss, backward_loss),) = keep.final
    assert backward_loss is loss
    assert torch.equal(strategy.ctx.models["main"].weight.grad, reference.weight.grad)


# -- schedulers follow their own optimizer ---------------------------------------------------


class StepOnly(TrainingUpdateHook):
    """Performs the optimizer step itself, only for the optimizers named in ``allowed``."""

    stages = frozenset({S.DO_OPTIMIZER_STEP})

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed

    def step_optimizer(self, ctx: Any, name: str, optimizer: torch.optim.Optimizer) -> bool:
        if name not in self.allowed:
            return False
        optimizer.step()
        return True


def _two_model_strategy(make_strategy: Any, hooks: list[object]) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    models = {"a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(3, 2)}
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    return make_strategy(
        hooks,
        models=models,
        optimizers={"a": sgd, "b": sgd},
        lr_schedulers={"a": step_lr, "b": step_lr},
        forward_fn=lambda ctx: ctx.models["a"](ctx.batch[0]) + ctx.models["b"](ctx.batch[0]),
    )


def test_scheduler_steps_only_when_its_optimizer_stepped(make_strategy: Any, batches: Any) -> None:
    strategy = _two_model_strategy(make_strategy, [StepOnly({"a"})])
    b_before = strategy.models["b"].weight.detach().clone()
    a_before = strategy.models["a"].weight.detach().clone()
    strategy.train_batch(batches(1)[0])
    ctx = strategy.ctx
    assert ctx.lr_schedulers["a"].last_epoch == 1
    assert ctx.lr_schedulers["b"].last_epoch == 0
    assert ctx.optimizers["a"].param_groups[0]["lr"] == pytest.approx(0.05)
    assert ctx.optimizers["b"].param_groups[0]["lr"] == pytest.approx(0.1)
    assert torch.equal(ctx.models["b"].weight, b_before)
    assert not torch.equal(ctx.models["a"].weight, a_before)
    assert ctx.step_skipped is False
    assert ctx.step_count == 1


def test_no_optimizer_stepped_means_step_skipped(make_strategy: Any, batches: Any) -> None:
    strategy = _two_model_strategy(make_strategy, [StepOnly(set())])
    strategy.train_batch(batches(1)[0])
    ctx = strategy.ctx
    assert ctx.step_skipped is True
    assert ctx.step_count == 0
    assert [ctx.lr_schedulers[n].last_epoch for n in "ab"] == [0, 0]


def test_without_a_stepper_every_optimizer_and_scheduler_steps(make_strategy: Any, batches: Any) -> None:
    strategy = _two_model_strategy(make_strategy, [])
    strategy.train_batch(batches(1)[0])
    assert [strategy.ctx.lr_schedulers[n].last_epoch for n in "ab"] == [1, 1]


# -- counters under vetoes --------------------------------------------------------------------


class CounterProbe:
    """Records the counters seen inside DO_OPTIMIZER_STEP and at AFTER_OPTIMIZER_STEP."""

    def __init__(self) -> None:
        self.during: list[tuple[int, int]] = []
        self.after: list[tuple[int, int, int, int, bool]] = []

    @nvtrain.hookimpl(wrapper=True)
    def do_optimizer_step(self, ctx: Any) -> Any:
        result = yield
        self.during.append((ctx.step_count, ctx.global_step_count))
        return result

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: Any) -> None:
        self.after.append(
            (ctx.batch_count, ctx.epoch_step_count, ctx.step_count, ctx.global_step_count, ctx.step_skipped)
        )


def test_counters_under_vetoes_with_world_size(make_strategy: Any, batches: Any, veto_step: Any) -> None:
    probe = CounterProbe()
    strategy = make_strategy(
        [veto_step({0, 2, 3}), probe],
        distributed_manager=types.SimpleNamespace(rank=0, world_size=4),
        num_epochs=1,
    )
    result = strategy.run(batches(5))
    # batch, epoch-step, step, global-step, skipped -- as seen at AFTER_OPTIMIZER_STEP
    assert probe.after == [
        (1, 1, 0, 0, True),
        (2, 2, 1, 4, False),
        (3, 3, 1, 4, True),
        (4, 4, 1, 4, True),
        (5, 5, 2, 8, False),
    ]
    # the step counters advance after DO_OPTIMIZER_STEP returns, not inside it
    assert probe.during == [(0, 0), (0, 0), (1, 4), (1, 4), (1, 4)]
    ctx = strategy.ctx
    assert (ctx.rank, ctx.world_size) == (0, 4)
    assert (ctx.batch_count, ctx.step_count, ctx.global_step_count) == (5, 2, 8)
    assert (result.batch_count, result.step_count, result.global_step_count) == (5, 2, 8)


# -- update-hook ordering --------------------------------------------------------------------


def test_update_hooks_run_by_priority_then_registration(make_strategy: Any, batches: Any) -> None:
    log: list[tuple[str, TrainingStage, bool]] = []
    strategy = make_strategy([Recording("c30", log, 30), Recording("a10", log, 10), Recording("d50", log)])
    strategy.register_hook(Recording("b10", log, 10))
    strategy.register_hook(Recording("e30", log, 30))
    strategy.train_batch(batches(1)[0])
    expected = ["a10", "b10", "c30", "e30", "d50"]
    for stage in ALL_UPDATE:
        assert [label for label, s, _ in log if s is stage] == expected, stage
    assert [h.label for h in strategy.orchestrator.hooks_for(S.DO_BACKWARD)] == expected


def test_pre_composed_orchestrator_keeps_order_and_adds_bare_hooks(make_strategy: Any, batches: Any) -> None:
    log: list[tuple[str, TrainingStage, bool]] = []
    composed = Recording("x50", log) + Recording("y20", log, 20) + Recording("z50", log)
    assert isinstance(composed, TrainingUpdateOrchestrator)
    assert len(composed) == 3
    strategy = make_strategy([composed, Recording("w20", log, 20)])
    strategy.train_batch(batches(1)[0])
    assert [label for label, s, _ in log if s is S.BEFORE_BATCH] == ["y20", "w20", "x50", "z50"]


@attrs.define
class AttrsHook(TrainingUpdateHook):
    """An attrs update hook with ``priority`` as a field."""

    log: list[str]
    priority: int = 50
    stages = frozenset({S.DO_OPTIMIZER_STEP})
    uses_gradients = False

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        self.log.append(f"attrs{self.priority}")
        return True, ctx.loss


def test_attrs_update_hooks_use_their_priority_field(make_strategy: Any, batches: Any) -> None:
    log: list[str] = []
    strategy = make_strategy([AttrsHook(log, priority=40), AttrsHook(log, priority=5)])
    strategy.train_batch(batches(1)[0])
    assert log == ["attrs5", "attrs40"]


class Observing(TrainingUpdateHook):
    """An update hook that also observes a stage through @hookimpl."""

    stages = frozenset({S.AFTER_OPTIMIZER_STEP})

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        self.calls.append("update")
        return True, ctx.loss

    @nvtrain.hookimpl
    def after_forward(self, ctx: Any) -> None:
        self.calls.append("after_forward")


def test_update_hook_with_hookimpls_is_also_an_observer(make_strategy: Any, batches: Any) -> None:
    hook = Observing()
    strategy = make_strategy([hook])
    late = Observing()
    strategy.register_hook(late)
    strategy.train_batch(batches(1)[0])
    assert hook.calls == ["after_forward", "update"]
    assert late.calls == ["after_forward", "update"]
    composed = make_strategy([Observing() + Observing()])
    composed.train_batch(batches(1)[0])
    assert [h.calls for h in composed.update_hooks()] == [["after_forward", "update"]] * 2


def test_update_hook_registered_after_setup_is_bound_to_the_optimizers(
    make_strategy: Any, batches: Any, veto_step: Any
) -> None:
    strategy = make_strategy()
    strategy.train_batch(batches(1)[0])
    assert strategy.ctx.step_count == 1
    strategy.register_hook(veto_step(lambda index: index == 1))
    strategy.train_batch(batches(1)[0])  # batch 1: vetoed
    strategy.train_batch(batches(1)[0])  # batch 2: steps the optimizer bound before
    assert strategy.ctx.step_count == 2


# -- contract errors -------------------------------------------------------------------------


class Returns(TrainingUpdateHook):
    """Returns ``proceed`` on ``stage`` (and a loss tensor), a well-formed answer elsewhere."""

    def __init__(self, stage: TrainingStage, proceed: Any = True, loss: Any = None) -> None:
        self.stage, self.proceed, self.loss = stage, proceed, loss

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[Any, Any]:
        if stage is self.stage:
            return self.proceed, ctx.loss if self.loss is None else self.loss
        return True, ctx.loss


@pytest.mark.parametrize("stage", [S.BEFORE_BATCH, S.DO_OPTIMIZER_STEP])
@pytest.mark.parametrize("proceed", [0, 1, None, torch.tensor(True)], ids=["0", "1", "None", "tensor"])
def test_proceed_must_be_a_strict_bool(make_strategy: Any, batches: Any, stage: TrainingStage, proceed: Any) -> None:
    strategy = make_strategy([Returns(stage, proceed)])
    message = (
        rf"update hook Returns at stage {stage.name} must return proceed as a strict bool"
        rf".*got {type(proceed).__name__}"
    )
    with pytest.raises(TypeError, match=message):
        strategy.train_batch(batches(1)[0])


def test_do_backward_must_return_a_tensor(make_strategy: Any, batches: Any) -> None:
    keep = KeepLoss()
    strategy = make_strategy([Returns(S.DO_BACKWARD, loss=2.0), keep])
    with pytest.raises(TypeError, match=r"update hook Returns at stage DO_BACKWARD must return a torch.Tensor.*float"):
        strategy.train_batch(batches(1)[0])
    # restored even though the chain failed (then detached from the failed step's graph: same storage)
    assert strategy.ctx.loss.data_ptr() == keep.losses[0].data_ptr()


def test_step_optimizer_must_return_a_bool(make_strategy: Any, batches: Any) -> None:
    class Stepper(TrainingUpdateHook):
        stages = frozenset({S.DO_OPTIMIZER_STEP})

        def step_optimizer(self, ctx: Any, name: str, optimizer: Any) -> Any:
            optimizer.step()
            return 1

    strategy = make_strategy([Stepper()])
    with pytest.raises(TypeError, match=r"update hook .*Stepper: step_optimizer\(\) must return a bool.*'main'.*got 1"):
        strategy.train_batch(batches(1)[0])


def test_at_most_one_hook_performs_the_step() -> None:
    with pytest.raises(ValueError, match="more than one update hook performs the optimizer step itself: StepOnly, "):
        TrainingUpdateOrchestrator([StepOnly({"a"}), StepOnly({"b"})])


@pytest.mark.parametrize(
    "stages",
    [frozenset({S.AFTER_BATCH}), frozenset({S.BEFORE_BATCH, S.BEFORE_FORWARD}), frozenset()],
    ids=["outside", "partly-outside", "empty"],
)
def test_update_hook_stages_must_be_a_non_empty_subset(make_strategy: Any, stages: frozenset[TrainingStage]) -> None:
    class Wrong(TrainingUpdateHook):
        pass

    hook = Wrong()
    hook.stages = stages  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"update hook .*Wrong: 'stages' must be a non-empty subset of"):
        make_strategy([hook])
    with pytest.raises(ValueError, match="'stages' must be a non-empty subset"):
        TrainingUpdateOrchestrator([hook])


def test_two_orchestrators_are_refused(make_strategy: Any) -> None:
    first = TrainingUpdateOrchestrator([Recording("a", [])])
    second = TrainingUpdateOrchestrator([Recording("b", [])])
    with pytest.raises(ValueError, match=r"TrainingStrategy\.hooks holds 2 TrainingUpdateOrchestrators"):
        make_strategy([first, second])
    strategy = make_strategy([first])
    with pytest.raises(ValueError, match="already has a TrainingUpdateOrchestrator"):
        strategy.register_hook(second)
    with pytest.raises(ValueError, match="cannot nest a TrainingUpdateOrchestrator"):
        TrainingUpdateOrchestrator([first])  # type: ignore[list-item]


def test_hooks_sharing_an_exclusive_key_are_refused(make_strategy: Any) -> None:
    class Precision(TrainingUpdateHook):
        exclusive_key = "mixed_precision"

    with pytest.raises(ValueError, match=r"update hooks .*Precision and .*Precision share the exclusive key 'mixed_"):
        make_strategy([Precision(), Precision()])
    strategy = make_strategy([Precision()])
    with pytest.raises(ValueError, match="share the exclusive key"):
        strategy.register_hook(Precision())


def test_the_same_update_hook_twice_is_refused(make_strategy: Any) -> None:
    hook = Recording("once", [])
    with pytest.raises(ValueError, match="update hook Recording was given twice"):
        make_strategy([hook, hook])
    strategy = make_strategy([hook])
    with pytest.raises(ValueError, match="update hook Recording is already registered"):
        strategy.register_hook(hook)


def test_register_hook_refuses_a_stage_for_update_hooks(make_strategy: Any) -> None:
    strategy = make_strategy()
    with pytest.raises(ValueError, match=re.escape("update hook Recording: passing stage=... is not supported")):
        strategy.register_hook(Recording("a", []), stage=S.BEFORE_BATCH)
    assert strategy.update_hooks() == ()


def test_orchestrator_refuses_non_update_hooks() -> None:
    with pytest.raises(TypeError, match="TrainingUpdateOrchestrator takes TrainingUpdateHook instances, got KeepLoss"):
        TrainingUpdateOrchestrator([KeepLoss()])  # type: ignore[list-item]


def test_non_int_update_priority_is_refused() -> None:
    with pytest.raises(TypeError, match=r"hook Recording: 'priority' must be an int \(got 1.5\)"):
        TrainingUpdateOrchestrator([Recording("a", [], priority=1.5)])  # type: ignore[arg-type]


# -- decide, then act: runtime guard and malformed results --------------------------------------


class UsesGradients(TrainingUpdateHook):
    """Declares that it uses gradients at DO_OPTIMIZER_STEP (like clipping) and never vetoes."""

    stages = frozenset({S.DO_OPTIMIZER_STEP})
    vetoes = frozenset()
    uses_gradients = True

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        return True, None


def test_keeping_gradients_a_step_used_is_refused_at_the_next_batch(make_strategy: Any, batches: Any) -> None:
    class KeepGradients:
        @nvtrain.hookimpl
        def before_batch(self, ctx: Any) -> bool:
            return ctx.batch_count == 0  # veto zeroing from the second micro-batch on

    strategy = make_strategy([UsesGradients(), KeepGradients()])
    data = batches(2)
    strategy.train_batch(data[0])
    with pytest.raises(RuntimeError, match=r"BEFORE_BATCH: one of .*KeepGradients.* vetoed gradient zeroing, but update hook UsesGradients already used"):
        strategy.train_batch(data[1])


def test_keeping_gradients_is_allowed_when_no_hook_used_them(make_strategy: Any, batches: Any) -> None:
    class KeepGradients:
        @nvtrain.hookimpl
        def before_batch(self, ctx: Any) -> bool:
            return ctx.batch_count == 0

    strategy = make_strategy([KeepGradients()])
    for batch in batches(3):
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 3


@pytest.mark.parametrize(
    ("returned", "shown"),
    [(None, "NoneType: None"), (True, "bool: True"), ((True, None, 1), r"tuple: \(True, None, 1\)")],
)
@pytest.mark.parametrize("stage", [S.BEFORE_BATCH, S.DO_BACKWARD, S.DO_OPTIMIZER_STEP])
def test_a_result_that_is_not_a_pair_names_the_hook_and_stage(
    make_strategy: Any, batches: Any, returned: Any, shown: str, stage: TrainingStage
) -> None:
    class Broken(TrainingUpdateHook):
        uses_gradients = False
        stages = frozenset({stage})

        def __call__(self, ctx: Any, s: TrainingStage, will_skip: bool) -> Any:
            return returned

    strategy = make_strategy([Broken()])
    with pytest.raises(TypeError, match=rf"update hook .*Broken at stage {stage.name} must return a 2-tuple .*got {shown}"):
        strategy.train_batch(batches(1)[0])


def test_a_veto_the_hook_did_not_declare_is_an_error(make_strategy: Any, batches: Any) -> None:
    class Undeclared(TrainingUpdateHook):
        stages = frozenset({S.DO_OPTIMIZER_STEP})
        vetoes = frozenset()
        uses_gradients = False

        def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, None]:
            return False, None

    with pytest.raises(TypeError, match=r"Undeclared vetoed stage DO_OPTIMIZER_STEP, but its 'vetoes' declaration"):
        make_strategy([Undeclared()]).train_batch(batches(1)[0])


def test_a_hook_using_gradients_before_the_unscale_is_refused(make_strategy: Any) -> None:
    class Rescaler(UsesGradients):
        priority = 20
        rescales_gradients = True

    early = UsesGradients()
    early.priority = 10
    with pytest.raises(ValueError, match=r"UsesGradients \(priority 10\) and .*Rescaler \(priority 20\) cannot be composed.*priority above 20"):
        make_strategy([Rescaler(), early])


def test_an_empty_orchestrator_is_truthy() -> None:
    assert bool(TrainingUpdateOrchestrator([])) and len(TrainingUpdateOrchestrator([])) == 0
