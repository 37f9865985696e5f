"""Every way onto a strategy's bus gets the same checks and the same bookkeeping.

``strategy.bus.pluggy.register`` goes the way of ``strategy.register_hook`` (seed-style
and update hooks included); the registry's list of hooks is read from the bus, so a
plugin registered through pluggy is closed and saved, and one unregistered is not; a
blocked name stays blocked; a checkpoint-writing or meta-materialising seed-style hook
is recognised through its adapter.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import TrainingStage
from nvtrain.bus import HookBus
from nvtrain.hooks import GradientClippingHook

S = TrainingStage


class Counter:
    """A pluggy plugin with state and resources: counts real steps, records its close()."""

    plugin_name = "counter"

    def __init__(self, log: list[str] | None = None) -> None:
        self.steps, self.closed, self.log = 0, False, log

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: Any) -> None:
        if not ctx.step_skipped:
            self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]

    def close(self) -> None:
        self.closed = True
        if self.log is not None:
            self.log.append(f"close {type(self).__name__}")


class Seed(nvtrain.Hook):
    """A seed-style hook recording the stages it sees."""

    stages = (S.AFTER_BATCH,)

    def __init__(self) -> None:
        self.seen: list[TrainingStage] = []

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        self.seen.append(stage)


# -- gap: bus.pluggy.register takes the path of register_hook -------------------------------------


def test_a_seed_hook_registered_through_pluggy_is_called(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy()
    seed = Seed()
    assert strategy.bus.pluggy.register(seed, "seed") == "seed"
    strategy.train_batch(batches(1)[0])
    assert seed.seen == [S.AFTER_BATCH]
    assert seed in strategy.registry.hooks()


def test_an_update_hook_registered_through_pluggy_joins_the_orchestrator(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy()
    clip = GradientClippingHook(max_norm=1e-6)
    assert strategy.bus.pluggy.register(clip) == "clip"  # its own name, never the orchestrator's
    assert strategy.update_hooks() == (clip,)
    strategy.train_batch(batches(1)[0])
    assert "grad_norm" in strategy.ctx.metrics  # the clipping hook ran at DO_OPTIMIZER_STEP


class ClaimsBackward(nvtrain.Hook):
    stages = (S.DO_BACKWARD,)

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        return None


class WrongArg:
    @nvtrain.hookimpl
    def before_batch(self, context: Any) -> None:
        return None


def test_pluggy_registration_refuses_what_register_hook_refuses(make_strategy: Any) -> None:
    strategy = make_strategy()
    with pytest.raises(ValueError, match="hook ClaimsBackward: observers cannot run on DO_BACKWARD"):
        strategy.bus.pluggy.register(ClaimsBackward())
    with pytest.raises(TypeError, match="plugin object implements no stage"):
        strategy.bus.pluggy.register(object())
    assert strategy.registry.hooks() == []


def test_pluggy_keeps_its_rules_for_names_on_a_strategy(make_strategy: Any) -> None:
    strategy = make_strategy()
    strategy.bus.pluggy.set_blocked("quiet")
    assert strategy.bus.pluggy.register(Counter(), "quiet") is None
    strategy.bus.pluggy.register(Counter(), "taken")
    with pytest.raises(ValueError, match=r"plugin name 'taken' is already registered on this bus, by Counter"):
        strategy.bus.pluggy.register(Counter(), "taken")
    assert len(strategy.registry.hooks()) == 1


def test_a_bare_bus_refuses_hooks_it_cannot_run_and_points_to_register_hook() -> None:
    bus = HookBus(trace=False)
    with pytest.raises(TypeError, match=r"plugin Seed is a seed-style nvtrain.Hook.*strategy.register_hook"):
        bus.pluggy.register(Seed())
    with pytest.raises(TypeError, match=r"GradientClippingHook .* is an update hook.*strategy.register_hook"):
        bus.pluggy.register(GradientClippingHook(max_norm=1.0))
    assert bus.plugins() == []


def test_an_nvtrain_plugin_module_is_refused_with_the_way_to_build_its_hook(make_strategy: Any) -> None:
    module = types.ModuleType("nvtrain_fake_module")
    module.__nvtrain_hooks__ = (Counter,)  # type: ignore[attr-defined]
    strategy = make_strategy()
    with pytest.raises(TypeError, match=r"plugin 'fake' implements no stage: .*nvtrain.plugins.load\(name\)"):
        strategy.bus.pluggy.register(module, "fake")
    assert strategy.registry.hooks() == []


def test_pluggy_path_errors_name_the_plugin_readably(make_strategy: Any) -> None:
    plugin = WrongArg()
    with pytest.raises(ValueError) as caught:
        make_strategy().bus.pluggy.register(plugin)
    message = str(caught.value)
    assert message.startswith("plugin WrongArg: before_batch(context) cannot be called as stage 'before_batch'")
    assert str(id(plugin)) not in message and "\n" not in message


# -- gap: what is registered is read from the bus --------------------------------------------------


def test_a_plugin_registered_through_pluggy_is_saved_and_closed(make_strategy: Any, batches: Any) -> None:
    strategy = make_strategy(max_steps=3)
    counter = Counter()
    strategy.bus.pluggy.register(counter, "counter")
    with strategy:
        strategy.run(batches(4))
        state = strategy.state_dict()
    assert counter.steps == 3
    assert list(state["hooks"]) == ["counter"]
    assert counter.closed
    assert strategy.registry.hooks() == [counter]


@pytest.mark.parametrize("how", ["bus", "pluggy"])
def test_a_plugin_unregistered_from_the_bus_is_neither_saved_nor_closed(
    make_strategy: Any, batches: Any, how: str
) -> None:
    gone = Counter()
    strategy = make_strategy([gone], max_steps=2)
    if how == "bus":
        strategy.bus.unregister(gone)
    else:
        strategy.bus.pluggy.unregister(gone)
    with strategy:
        strategy.run(batches(2))
        state = strategy.state_dict()
    assert state["hooks"] == {}
    assert not gone.closed and gone.steps == 0
    assert strategy.registry.hooks() == []


def test_close_order_is_reverse_registration_across_every_path(make_strategy: Any) -> None:
    log: list[str] = []

    class First(Counter):
        plugin_name = "first"

    class Clip(GradientClippingHook):
        def close(self) -> None:
            log.append("close Clip")

    class Late(Counter):
        plugin_name = "late"

    class ViaPluggy(Counter):
        plugin_name = "via-pluggy"

    first, clip, late, via = First(log), Clip(max_norm=1.0), Late(log), ViaPluggy(log)
    strategy = make_strategy([first, clip])
    strategy.register_hook(late)
    strategy.bus.pluggy.register(via)
    assert strategy.registry.hooks() == [clip, first, late, via]
    strategy.close()
    assert log == ["close ViaPluggy", "close Late", "close Clip", "close First"]


# -- gap: a blocked name is not renamed around --------------------------------------------------------


def test_a_blocked_plugin_name_is_refused_not_renamed(make_strategy: Any) -> None:
    class Named:
        plugin_name = "mylogger"

        @nvtrain.hookimpl
        def after_batch(self, ctx: Any) -> None:
            return None

    strategy = make_strategy()
    strategy.bus.pluggy.set_blocked("mylogger")
    with pytest.raises(ValueError, match=r"plugin 'mylogger': the name 'mylogger' is blocked on this bus"):
        strategy.register_hook(Named())
    assert [name for name, plugin in strategy.bus.pluggy.list_name_plugin() if plugin is not None] == [
        "nvtrain.orchestrator"
    ]
    bus = HookBus(trace=False)
    bus.pluggy.set_blocked("mylogger")
    with pytest.raises(ValueError, match="is blocked on this bus"):
        bus.register(Named(), "mylogger")


# -- gap: seed-style hooks are recognised through their adapter ---------------------------------------


def test_a_seed_hook_that_writes_checkpoints_makes_the_loop_validate_on_checkpoints(
    make_strategy: Any, batches: Any
) -> None:
    class SeedSaver(nvtrain.Hook):
        stages = (S.AFTER_BATCH,)
        last_saved: tuple[int, Any] | None = None

        def __call__(self, ctx: Any, stage: TrainingStage) -> None:
            self.last_saved = (ctx.step_count, "somewhere")

    validated: list[int] = []

    class Watch:
        @nvtrain.hookimpl
        def after_validation(self, ctx: Any) -> None:
            validated.append(ctx.step_count)

    schedule = nvtrain.StepSchedulerConfig(max_steps=4, ckpt_every_steps=2, validate_on_checkpoint=True)
    validation = nvtrain.ValidationConfig(data=batches(1, seed=7), every_n_epochs=None)
    strategy = make_strategy([SeedSaver(), Watch()], step_scheduler=schedule, validation=validation)
    with strategy:
        strategy.run(batches(8))
    assert validated == [2, 4]


def test_a_seed_hook_that_materialises_meta_models_is_recognised(make_strategy: Any, batches: Any) -> None:
    class Materialise(nvtrain.Hook):
        stages = (S.SETUP,)
        materializes_meta_models = True

        def __call__(self, ctx: Any, stage: TrainingStage) -> None:
            model = ctx.models["main"].to_empty(device="cpu")
            model.reset_parameters()
            ctx.models["main"] = model

    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    strategy = make_strategy([Materialise()], models=model)
    strategy.train_batch(batches(1)[0])
    assert strategy.ctx.models["main"].weight.device.type == "cpu"
