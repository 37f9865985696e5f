"""``strategy.bus.pluggy`` round-trips for every kind of hook it accepts.

``name = pm.register(hook)`` gives a name under which pluggy's ``get_plugin``,
``unregister(name=...)``, ``unregister(hook)``, ``is_registered`` and ``get_name`` all refer
to the user's object: a plain plugin, a seed-style ``nvtrain.Hook`` (which the bus runs
through an adapter) and an update hook (which the orchestrator calls). Unregistering
removes exactly that hook; an update hook leaves the orchestrator, which is rebuilt
without it. A run refuses to start when nobody owns DO_BACKWARD or DO_OPTIMIZER_STEP.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import TrainingStage
from nvtrain.hooks import GradientClippingHook

S = TrainingStage
ORCHESTRATOR = "nvtrain.orchestrator"


class Plain:
    """A pluggy plugin."""

    def __init__(self) -> None:
        self.calls, self.closed = 0, False

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self.closed = True


class Seed(nvtrain.Hook):
    """A seed-style hook, run through an adapter."""

    stages = (S.AFTER_BATCH,)

    def __init__(self) -> None:
        self.calls, self.closed = 0, False

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        self.calls += 1

    def close(self) -> None:
        self.closed = True


class Update(nvtrain.TrainingUpdateHook):
    """An update hook that observes no stage: only the orchestrator calls it."""

    stages = frozenset({S.DO_OPTIMIZER_STEP})
    uses_gradients = False

    def __init__(self) -> None:
        self.calls, self.closed = 0, False

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        self.calls += 1
        return True, ctx.loss

    def close(self) -> None:
        self.closed = True


class ObservingUpdate(Update):
    """An update hook that also observes a stage as a plugin."""

    def __init__(self) -> None:
        super().__init__()
        self.observed = 0

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        self.observed += 1


KINDS: dict[str, Callable[[], Any]] = {
    "plain": Plain,
    "seed": Seed,
    "update": Update,
    "observing-update": ObservingUpdate,
}

#: The ways pluggy users (and the bus's own API) take a hook off again.
REMOVALS: dict[str, Callable[[Any, Any, str], Any]] = {
    "pluggy-by-plugin": lambda strategy, hook, name: strategy.bus.pluggy.unregister(hook),
    "pluggy-by-name": lambda strategy, hook, name: strategy.bus.pluggy.unregister(name=name),
    "pluggy-by-both": lambda strategy, hook, name: strategy.bus.pluggy.unregister(hook, name),
    "pluggy-set-blocked": lambda strategy, hook, name: strategy.bus.pluggy.set_blocked(name),
    "bus": lambda strategy, hook, name: strategy.bus.unregister(hook),
}


@pytest.mark.parametrize("kind", KINDS)
def test_register_returns_a_name_every_pluggy_query_answers_with_the_hook(make_strategy: Any, kind: str) -> None:
    strategy = make_strategy()
    pm = strategy.bus.pluggy
    hook = KINDS[kind]()
    name = pm.register(hook)
    assert name != ORCHESTRATOR
    assert pm.get_plugin(name) is hook
    assert pm.has_plugin(name)
    assert pm.get_name(hook) == name
    assert pm.is_registered(hook)
    assert (name, hook) in pm.list_name_plugin()
    assert hook in pm.get_plugins()
    assert hook in strategy.bus.plugins()
    assert pm.get_plugin(ORCHESTRATOR) is strategy.orchestrator


@pytest.mark.parametrize("removal", REMOVALS)
@pytest.mark.parametrize("kind", KINDS)
def test_unregistering_removes_exactly_that_hook(make_strategy: Any, batches: Any, kind: str, removal: str) -> None:
    strategy = make_strategy(max_steps=2)
    pm = strategy.bus.pluggy
    kept, hook = Update(), KINDS[kind]()
    strategy.register_hook(kept)
    name = pm.register(hook)
    returned = REMOVALS[removal](strategy, hook, name)
    if removal.startswith("pluggy-by"):
        assert returned is hook  # pluggy returns the plugin it removed: the user's object
    assert not pm.is_registered(hook)
    assert pm.get_name(hook) is None and pm.get_plugin(name) is None
    assert hook not in strategy.registry.hooks() and hook not in strategy.update_hooks()
    assert strategy.update_hooks() == (kept,)
    assert pm.get_plugin(ORCHESTRATOR) is strategy.orchestrator  # the orchestrator stays, without the hook
    model = strategy.ctx.models["main"]
    before = model.weight.detach().clone()
    with strategy:
        strategy.run(batches(2))
    assert not torch.equal(before, model.weight.detach())  # training still updates the weights
    assert hook.calls == 0 and not hook.closed
    assert kept.calls == 2 and kept.closed


def test_the_pluggy_idiom_for_an_update_hook_leaves_training_updating(make_strategy: Any, batches: Any) -> None:
    """``name = pm.register(h); pm.unregister(name=name)`` once removed the orchestrator: no step ever ran."""
    strategy = make_strategy(max_steps=3)
    pm = strategy.bus.pluggy
    clip = GradientClippingHook(max_norm=1e-6)
    name = pm.register(clip)
    assert name == "clip"
    pm.unregister(name=name)
    model = strategy.ctx.models["main"]
    before = model.weight.detach().clone()
    with strategy:
        result = strategy.run(batches(3))
    assert result.step_count == 3
    assert not torch.equal(before, model.weight.detach())
    assert "grad_norm" not in strategy.ctx.metrics  # the clipping hook is gone


def test_an_update_hook_unregistered_after_setup_leaves_a_bound_orchestrator(make_strategy: Any, batches: Any) -> None:
    update = Update()
    strategy = make_strategy([update])
    assert strategy.bus.pluggy.get_name(update) is not None  # a constructor's update hook has a name too
    first, second = batches(2)
    strategy.train_batch(first)
    assert update.calls == 1
    strategy.bus.pluggy.unregister(update)
    model = strategy.ctx.models["main"]
    before = model.weight.detach().clone()
    strategy.train_batch(second)
    assert update.calls == 1
    assert not torch.equal(before, model.weight.detach())  # the rebuilt orchestrator steps the bound optimizer


def test_an_observing_update_hook_unregistered_stops_observing_and_updating(make_strategy: Any, batches: Any) -> None:
    hook = ObservingUpdate()
    strategy = make_strategy([hook])
    strategy.train_batch(batches(1)[0])
    assert (hook.calls, hook.observed) == (1, 1)
    strategy.bus.unregister(hook)
    strategy.train_batch(batches(1)[0])
    assert (hook.calls, hook.observed) == (1, 1)


def test_a_seed_hook_is_named_after_its_class_not_its_adapter(make_strategy: Any) -> None:
    seed = Seed()
    strategy = make_strategy([seed])
    name = strategy.bus.pluggy.get_name(seed)
    assert name is not None and name.startswith("Seed-")
    assert all(type(plugin).__name__ != "HookAdapter" for plugin in strategy.bus.plugins())


def test_the_same_seed_hook_twice_is_refused(make_strategy: Any) -> None:
    seed = Seed()
    strategy = make_strategy([seed])
    with pytest.raises(ValueError, match=r"^plugin Seed is already registered on this strategy$"):
        strategy.register_hook(seed)
    with pytest.raises(ValueError, match="already registered"):
        strategy.bus.pluggy.register(seed)


def test_a_name_and_a_plugin_that_disagree_remove_nothing(make_strategy: Any) -> None:
    strategy = make_strategy()
    pm = strategy.bus.pluggy
    seed, update = Seed(), Update()
    seed_name, update_name = pm.register(seed), pm.register(update)
    with pytest.raises(ValueError, match=rf"plugin name '{seed_name}' and plugin Update do not agree"):
        pm.unregister(update, seed_name)
    assert pm.get_plugin(seed_name) is seed and pm.get_plugin(update_name) is update
    assert strategy.update_hooks() == (update,)


def test_unregistering_what_is_not_registered_answers_as_pluggy_does(make_strategy: Any) -> None:
    pm = make_strategy().bus.pluggy
    assert pm.unregister(name="nobody") is None
    with pytest.raises(AssertionError, match="plugin is not registered"):
        pm.unregister(Seed())


# -- the replacement slots need an owner ---------------------------------------------------------------


def test_a_run_without_the_orchestrator_is_refused_naming_the_slots(make_strategy: Any, batches: Any) -> None:
    observer = Plain()
    strategy = make_strategy([observer], max_steps=1)
    orchestrator = strategy.bus.pluggy.unregister(name=ORCHESTRATOR)
    assert orchestrator is strategy.orchestrator
    with pytest.raises(RuntimeError) as caught:
        strategy.run(batches(1))
    message = str(caught.value)
    assert "no plugin owns DO_BACKWARD and DO_OPTIMIZER_STEP" in message
    assert "'nvtrain.orchestrator'" in message and "\n" not in message
    assert not strategy.is_set_up  # refused before SETUP
    assert strategy.bus.pluggy.register(orchestrator) == ORCHESTRATOR  # put back, it trains again
    assert strategy.bus.plugins() == [orchestrator, observer]  # in its place: first among equal priorities
    with strategy:
        assert strategy.run(batches(1)).step_count == 1


def test_a_run_names_only_the_slot_left_without_an_owner(make_strategy: Any, batches: Any) -> None:
    class Backward:
        @nvtrain.hookimpl
        def do_backward(self, ctx: Any) -> None:
            ctx.loss.backward()

    strategy = make_strategy(max_steps=1)
    strategy.bus.pluggy.unregister(name=ORCHESTRATOR)
    strategy.bus.pluggy.register(Backward())
    with pytest.raises(RuntimeError, match=r"no plugin owns DO_OPTIMIZER_STEP, .*implementing do_optimizer_step$"):
        strategy.run(batches(1))


def test_update_hooks_registered_without_the_orchestrator_leave_it_off_the_bus(make_strategy: Any) -> None:
    strategy = make_strategy()
    strategy.bus.pluggy.unregister(name=ORCHESTRATOR)
    update = Update()
    strategy.register_hook(update)
    assert strategy.update_hooks() == (update,)
    assert strategy.bus.pluggy.get_plugin(ORCHESTRATOR) is None
    strategy.bus.unregister(update)
    assert strategy.update_hooks() == ()


# -- a hook registered again is the last registered ----------------------------------------------------


def closing(base: type, tag: str, order: list[str]) -> Any:
    """An instance of a subclass of ``base`` (named ``<base>_<tag>``) whose close() appends ``tag`` to ``order``."""
    closer = type(f"{base.__name__}_{tag}", (base,), {"close": lambda self: order.append(tag)})
    return closer()


def test_a_hook_registered_again_closes_first(make_strategy: Any) -> None:
    order: list[str] = []
    a, c = closing(Plain, "A", order), closing(Seed, "C", order)
    strategy = make_strategy([a])
    strategy.register_hook(c)
    strategy.bus.unregister(a)
    strategy.register_hook(a)  # now the last registered
    assert strategy.registry.hooks() == [c, a]
    strategy.close()
    assert order == ["A", "C"]  # reverse registration order


def test_hooks_registered_again_through_pluggy_keep_their_new_place(make_strategy: Any, batches: Any) -> None:
    order: list[str] = []
    a, b = closing(Plain, "A", order), closing(Update, "B", order)
    c, d = closing(Seed, "C", order), closing(ObservingUpdate, "D", order)
    strategy = make_strategy([a])
    pm = strategy.bus.pluggy
    strategy.register_hook(b)
    pm.register(c)
    pm.register(d)
    pm.unregister(a)
    pm.register(a)  # after D
    pm.unregister(name=pm.get_name(b))
    strategy.register_hook(b)  # after A
    assert strategy.registry.hooks() == [d, b, c, a]  # update hooks first, each kind in registration order
    with strategy:
        strategy.run(batches(2))
    assert order == ["B", "A", "D", "C"]


# -- a plugin registered without a name gets pluggy's ----------------------------------------------------


def plugin_module(name: str) -> Any:
    module = types.ModuleType(name)
    exec("import nvtrain\ncalls = []\n@nvtrain.hookimpl\ndef after_batch(ctx):\n    calls.append(1)\n", vars(module))
    return module


def test_a_module_plugin_is_named_as_pluggy_names_it(make_strategy: Any) -> None:
    strategy = make_strategy()
    pm = strategy.bus.pluggy
    module, twin = plugin_module("mymod"), plugin_module("mymod")
    assert pm.register(module) == pm.get_canonical_name(module) == "mymod"
    assert pm.get_plugin("mymod") is module
    assert pm.register(twin) == "mymod-2"  # a second one with the same name is told apart, as two instances are


def test_a_blocked_canonical_name_registers_nothing(make_strategy: Any, batches: Any) -> None:
    class Named:
        plugin_name = "mylogger"

        @nvtrain.hookimpl
        def after_batch(self, ctx: Any) -> None:
            raise AssertionError("a blocked plugin was called")

    strategy = make_strategy(max_steps=2)
    pm = strategy.bus.pluggy
    pm.set_blocked("mymod")
    pm.set_blocked("mylogger")
    module = plugin_module("mymod")
    assert pm.register(module) is None  # pluggy's answer for a blocked name
    assert pm.register(Named()) is None  # also for the name a plugin_name asks for
    assert pm.register(Update(), "mylogger") is None
    with strategy:
        strategy.run(batches(2))
    assert module.calls == []
    assert [name for name, plugin in pm.list_name_plugin() if plugin is not None] == [ORCHESTRATOR]


# -- a mark above @classmethod is refused naming the attribute ------------------------------------------


class MarkedAboveClassmethod:
    @nvtrain.hookimpl  # type: ignore[misc]  # the mistake under test
    @classmethod
    def after_batch(cls, ctx: Any) -> None:
        return None


class MarkedAboveStaticmethod:
    @nvtrain.hookimpl  # type: ignore[misc]  # the mistake under test
    @staticmethod
    def after_batch(ctx: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("plugin", "kind"), [(MarkedAboveClassmethod, "classmethod"), (MarkedAboveStaticmethod, "staticmethod")]
)
def test_a_mark_above_classmethod_or_staticmethod_is_refused_naming_the_attribute(
    make_strategy: Any, plugin: type, kind: str
) -> None:
    expected = (
        rf"^plugin {plugin.__name__}: attribute 'after_batch' is marked @nvtrain.hookimpl above @{kind}, .*"
        rf"expected @nvtrain.hookimpl below @{kind}$"
    )
    with pytest.raises(TypeError, match=expected):
        make_strategy().bus.pluggy.register(plugin())


def test_a_mark_below_classmethod_is_called(make_strategy: Any, batches: Any) -> None:
    class MarkedBelow:
        calls = 0

        @classmethod
        @nvtrain.hookimpl
        def after_batch(cls, ctx: Any) -> None:
            cls.calls += 1

    strategy = make_strategy(max_steps=2)
    strategy.bus.pluggy.register(MarkedBelow())
    with strategy:
        strategy.run(batches(2))
    assert MarkedBelow.calls == 2
