"""The hook bus: ordering, compiled dispatch equal to pluggy's, registration errors, tracing."""

from __future__ import annotations

from typing import Any

import attrs
import pluggy
import pytest

import nvtrain
from nvtrain import bus as bus_module
from nvtrain.bus import TRACE_ENV, HookBus
from nvtrain.stages import REPLACEMENT_STAGES, TrainingStage

S = TrainingStage


# -- ordering -----------------------------------------------------------------------------


class Plain:
    """A pluggy plugin recording its label at AFTER_LOSS and AFTER_BACKWARD (where it also returns it)."""

    def __init__(self, label: str, log: list[str], priority: int | None = None) -> None:
        self.label, self.log = label, log
        if priority is not None:
            self.priority = priority

    @nvtrain.hookimpl
    def after_loss(self, ctx: Any) -> None:
        self.log.append(self.label)

    @nvtrain.hookimpl
    def after_backward(self, ctx: Any) -> str:
        self.log.append(self.label)
        return self.label


class Seed(nvtrain.Hook):
    """A seed-style hook doing the same through ``__call__``."""

    stages = (S.AFTER_LOSS, S.AFTER_BACKWARD)

    def __init__(self, label: str, log: list[str], priority: int | None = None) -> None:
        self.label, self.log = label, log
        if priority is not None:
            self.priority = priority

    def __call__(self, ctx: Any, stage: TrainingStage) -> str | None:
        self.log.append(self.label)
        return self.label if stage is S.AFTER_BACKWARD else None


def _mixed_plugins(log: list[str]) -> list[object]:
    # Registration order x30, y10, z50, w30, v10. pluggy alone would call v, w, z, y, x.
    return [
        Plain("x30", log, 30),
        Seed("y10", log, 10),
        Plain("z50", log),
        Seed("w30", log, 30),
        Plain("v10", log, 10),
    ]


EXPECTED_ORDER = ["y10", "v10", "x30", "w30", "z50"]


def test_observers_run_by_priority_then_registration_on_the_bus() -> None:
    from nvtrain.adapter import HookAdapter

    log: list[str] = []
    bus = HookBus()
    for plugin in _mixed_plugins(log):
        bus.register(HookAdapter(plugin) if isinstance(plugin, nvtrain.Hook) else plugin)
    ctx = nvtrain.TrainingContext()
    bus.after_loss(ctx)
    assert log == EXPECTED_ORDER
    log.clear()
    assert bus.after_backward(ctx) == EXPECTED_ORDER
    # pluggy's own caller agrees: the bus re-registers so that LIFO equals nvtrain order.
    log.clear()
    bus.pluggy.hook.after_loss(ctx=ctx)
    assert log == EXPECTED_ORDER


def test_observers_run_by_priority_then_registration_in_a_strategy(make_strategy: Any, batches: Any) -> None:
    log: list[str] = []
    strategy = make_strategy(_mixed_plugins(log))
    strategy.train_batch(batches(1)[0])
    # each plugin fires at AFTER_LOSS and again at AFTER_BACKWARD
    assert log == EXPECTED_ORDER * 2


def test_order_survives_unregistering_and_late_registration() -> None:
    log: list[str] = []
    bus = HookBus()
    a, b, c = Plain("a20", log, 20), Plain("b10", log, 10), Plain("c20", log, 20)
    for plugin in (a, b, c):
        bus.register(plugin)
    bus.unregister(b)
    late = Plain("d10", log, 10)
    bus.register(late)
    bus.after_loss(nvtrain.TrainingContext())
    assert log == ["d10", "a20", "c20"]
    assert bus.plugins() == [late, a, c]


# -- dispatch equivalence -----------------------------------------------------------------


def _equivalence_plugins(log: list[str]) -> list[object]:
    def plain(label: str, value: Any = None, **opts: Any) -> Any:
        def impl(self: object, ctx: Any) -> Any:
            log.append(label)
            return value

        return nvtrain.hookimpl(**opts)(impl) if opts else nvtrain.hookimpl(impl)

    def no_ctx(label: str, value: Any) -> Any:
        def impl(self: object) -> Any:
            log.append(label)
            return value

        return nvtrain.hookimpl(impl)

    def wrapper(label: str) -> Any:
        def impl(self: object, ctx: Any) -> Any:
            log.append(label + ":in")
            result = yield
            log.append(label + ":out")
            return result

        return nvtrain.hookimpl(wrapper=True)(impl)

    def old_wrapper(label: str) -> Any:
        def impl(self: object, ctx: Any) -> Any:
            log.append(label + ":in")
            outcome = yield
            log.append(label + ":out")
            outcome.get_result()

        return nvtrain.hookimpl(hookwrapper=True)(impl)

    P1 = type(
        "P1",
        (),
        {
            "priority": 40,
            "before_batch": plain("p1.before_batch", False),
            "after_loss": plain("p1.after_loss", "p1"),
            "do_backward": plain("p1.do_backward", "loss-from-p1"),
            "after_batch": plain("p1.after_batch", None),
        },
    )
    P2 = type(
        "P2",
        (),
        {
            "priority": 10,
            "before_batch": plain("p2.before_batch", None),
            "after_loss": plain("p2.after_loss", "p2", trylast=True),
            "do_optimizer_step": plain("p2.do_optimizer_step", None),
            "after_batch": no_ctx("p2.after_batch", "p2-noctx"),
        },
    )
    P3 = type(
        "P3",
        (),
        {
            "before_batch": plain("p3.before_batch", True, tryfirst=True),
            "after_loss": wrapper("p3.after_loss"),
            "do_backward": wrapper("p3.do_backward"),
            "after_batch": plain("p3.after_batch", "p3"),
        },
    )
    P4 = type(
        "P4",
        (),
        {
            "priority": 10,
            "after_loss": old_wrapper("p4.after_loss"),
            "do_optimizer_step": old_wrapper("p4.do_optimizer_step"),
            "after_batch": plain("p4.after_batch", "p4"),
            "before_forward": no_ctx("p4.before_forward", None),
        },
    )
    return [P3(), P1(), P4(), P2()]


def test_compiled_stages_equal_pluggy_results_and_call_order() -> None:
    log: list[str] = []
    bus = HookBus(trace=False)
    for plugin in _equivalence_plugins(log):
        bus.register(plugin)
    ctx = nvtrain.TrainingContext()
    for stage in TrainingStage:
        log.clear()
        ours = getattr(bus, stage.hook_name)(ctx)
        our_calls = list(log)
        log.clear()
        theirs = getattr(bus.pluggy.hook, stage.hook_name)(ctx=ctx)
        assert ours == theirs, stage
        assert our_calls == log, stage
        assert bus.call(stage, ctx) == theirs, stage
    # spot-check what came back, so equality is not vacuous
    # priority first: p1 (40) before p3 (50); p3's tryfirst only breaks ties among equal priorities
    assert bus.before_batch(ctx) == [False, True]
    assert bus.do_backward(ctx) == "loss-from-p1"
    assert bus.do_optimizer_step(ctx) is None
    log.clear()
    assert bus.after_batch(ctx) == ["p4", "p2-noctx", "p3"]
    assert log == ["p4.after_batch", "p2.after_batch", "p1.after_batch", "p3.after_batch"]
    log.clear()
    assert bus.after_loss(ctx) == ["p2", "p1"]
    # wrappers nest in nvtrain order (p4 has priority 10: outermost); p2 (10, trylast) still precedes p1 (40)
    assert log == [
        "p4.after_loss:in",
        "p3.after_loss:in",
        "p2.after_loss",
        "p1.after_loss",
        "p3.after_loss:out",
        "p4.after_loss:out",
    ]


def test_compiled_firstresult_slots_equal_pluggy(monkeypatch: pytest.MonkeyPatch) -> None:
    class Owner:
        @nvtrain.hookimpl
        def do_backward(self, ctx: Any) -> str:
            return "backpropagated"

        @nvtrain.hookimpl
        def do_optimizer_step(self) -> None:
            return None

    bus = HookBus(trace=False)
    bus.register(Owner())
    ctx = nvtrain.TrainingContext()
    expected = (bus.pluggy.hook.do_backward(ctx=ctx), bus.pluggy.hook.do_optimizer_step(ctx=ctx))
    assert expected == ("backpropagated", None)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pluggy's hook caller was called")

    monkeypatch.setattr(bus.pluggy, "_inner_hookexec", forbidden)
    assert (bus.do_backward(ctx), bus.do_optimizer_step(ctx)) == expected


def test_stage_without_implementations_is_the_no_op_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    bus = HookBus(trace=False)
    bus.register(Plain("only", []))
    for stage in TrainingStage:
        if stage in (S.AFTER_LOSS, S.AFTER_BACKWARD):
            continue
        expected = bus_module._no_result if stage in REPLACEMENT_STAGES else bus_module._no_results
        assert getattr(bus, stage.hook_name) is expected, stage

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pluggy's hook caller was called")

    # every HookCaller of this plugin manager executes through this one attribute
    monkeypatch.setattr(bus.pluggy, "_inner_hookexec", forbidden)
    ctx = nvtrain.TrainingContext()
    assert bus.after_epoch(ctx) == []
    assert bus.do_backward(ctx) is None
    # plain implementations are compiled too: no pluggy call on the hot path
    assert bus.after_loss(ctx) == []
    with pytest.raises(AssertionError, match="pluggy's hook caller"):
        bus.pluggy.hook.after_loss(ctx=ctx)


def test_call_lists_are_rebuilt_on_register_and_unregister() -> None:
    log: list[str] = []
    bus = HookBus(trace=False)
    ctx = nvtrain.TrainingContext()
    assert bus.after_backward(ctx) == []
    first = Plain("first", log)
    bus.register(first)
    assert bus.after_backward(ctx) == ["first"]
    second = Plain("second", log, priority=1)
    bus.register(second)
    assert bus.after_backward(ctx) == ["second", "first"]
    bus.unregister(second)
    assert bus.after_backward(ctx) == ["first"]
    bus.unregister(first)
    assert bus.after_backward is bus_module._no_results
    assert bus.after_backward(ctx) == []
    with pytest.raises(ValueError, match="is not registered"):
        bus.unregister(first)


def test_wrapper_switches_a_stage_to_pluggy_and_back() -> None:
    class Wrap:
        @nvtrain.hookimpl(wrapper=True)
        def after_loss(self, ctx: Any) -> Any:
            result = yield
            return [*result, "wrapped"]

    bus = HookBus(trace=False)
    bus.register(Plain("p", []))
    wrap = Wrap()
    bus.register(wrap)
    assert bus.after_loss(nvtrain.TrainingContext()) == ["wrapped"]
    bus.unregister(wrap)
    assert bus.after_loss(nvtrain.TrainingContext()) == []


# -- tracing -------------------------------------------------------------------------------


def test_trace_switch_routes_calls_through_pluggy_monitoring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(TRACE_ENV, "1")
    bus = HookBus()
    try:
        assert bus.tracing
        bus.register(Plain("traced", []))
        bus.after_loss(nvtrain.TrainingContext())
        err = capsys.readouterr().err
        assert "after_loss" in err
        assert "[hook]" in err
    finally:
        bus.close()
    bus.after_loss(nvtrain.TrainingContext())
    assert "after_loss" not in capsys.readouterr().err


@pytest.mark.parametrize("value", [None, "", "0"])
def test_tracing_is_off_unless_the_switch_is_set(
    value: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if value is None:
        monkeypatch.delenv(TRACE_ENV, raising=False)
    else:
        monkeypatch.setenv(TRACE_ENV, value)
    bus = HookBus()
    assert not bus.tracing
    bus.register(Plain("quiet", []))
    # pluggy monitoring not installed: the plugin manager still runs its plain executor
    assert bus.pluggy._inner_hookexec is pluggy._callers._multicall
    bus.after_loss(nvtrain.TrainingContext())
    bus.pluggy.hook.after_loss(ctx=nvtrain.TrainingContext())
    assert capsys.readouterr().err == ""


# -- registration errors ---------------------------------------------------------------------


def test_same_plugin_instance_twice_is_refused() -> None:
    bus = HookBus()
    plugin = Plain("p", [])
    bus.register(plugin)
    with pytest.raises(ValueError, match="plugin Plain is already registered"):
        bus.register(plugin)


def test_second_claimant_of_a_do_slot_is_refused() -> None:
    class Claims:
        @nvtrain.hookimpl
        def do_backward(self, ctx: Any) -> Any:
            return None

    bus = HookBus()
    bus.register(nvtrain.TrainingUpdateOrchestrator(), "nvtrain.orchestrator")
    with pytest.raises(ValueError, match=r"DO_BACKWARD is a replacement slot with one owner.*Claims"):
        bus.register(Claims())
    # the refused plugin left no trace: the slot still has its one owner
    assert [impl.plugin_name for impl in bus.implementations(S.DO_BACKWARD)] == ["nvtrain.orchestrator"]


def test_second_claimant_of_a_do_slot_is_refused_by_the_strategy(make_strategy: Any) -> None:
    class StepsItself:
        @nvtrain.hookimpl
        def do_optimizer_step(self, ctx: Any) -> Any:
            return True

    with pytest.raises(ValueError, match="DO_OPTIMIZER_STEP is a replacement slot"):
        make_strategy([StepsItself()])


def test_wrapping_a_do_slot_is_allowed(make_strategy: Any, recorder: Any, batches: Any) -> None:
    strategy = make_strategy([recorder])
    strategy.train_batch(batches(1)[0])
    assert recorder.calls.count("do_backward") == 1
    assert recorder.calls.count("do_optimizer_step") == 1


def test_method_named_like_a_stage_but_unmarked_is_refused() -> None:
    class Forgot:
        @nvtrain.hookimpl
        def before_batch(self, ctx: Any) -> None:
            return None

        def after_batch(self, ctx: Any) -> None:
            return None

    with pytest.raises(ValueError, match=r"Forgot: method 'after_batch' is named after a stage but is not marked"):
        HookBus().register(Forgot())


def test_unknown_hookimpl_name_is_refused_naming_the_plugin(make_strategy: Any) -> None:
    class Typo:
        plugin_name = "typo-plugin"

        @nvtrain.hookimpl
        def after_bach(self, ctx: Any) -> None:
            return None

    with pytest.raises(ValueError, match=r"plugin 'typo-plugin'.*unknown hook 'after_bach'.*The stages are: setup"):
        make_strategy([Typo()])
    bus = HookBus()
    with pytest.raises(ValueError, match="unknown hook 'after_bach'"):
        bus.register(Typo())
    assert bus.plugins() == []
    assert not bus.pluggy.get_plugins()


def test_hookimpl_with_an_argument_the_spec_lacks_is_refused() -> None:
    class WrongArgs:
        @nvtrain.hookimpl
        def after_batch(self, ctx: Any, batch: Any) -> None:
            return None

    bus = HookBus()
    with pytest.raises(ValueError, match=r"plugin 'wrong'.*after_batch"):
        bus.register(WrongArgs(), "wrong")
    assert not bus.pluggy.get_plugins()


def test_registering_a_class_instead_of_an_instance_is_refused() -> None:
    with pytest.raises(TypeError, match="register an instance, not the class Plain"):
        HookBus().register(Plain)


def test_non_int_priority_is_refused() -> None:
    with pytest.raises(TypeError, match=r"hook Plain: 'priority' must be an int \(got '10'\)"):
        HookBus().register(Plain("p", [], priority="10"))  # type: ignore[arg-type]


# -- seed-style hooks on the bus -------------------------------------------------------------


class Declares(nvtrain.Hook):
    def __init__(self, stages: Any, frequency: int = 1) -> None:
        self.stages = stages
        self.frequency = frequency

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        return None


@pytest.mark.parametrize("stage", [S.DO_BACKWARD, S.DO_OPTIMIZER_STEP])
def test_seed_hook_declaring_a_do_slot_is_refused(make_strategy: Any, stage: TrainingStage) -> None:
    with pytest.raises(ValueError, match=rf"hook Declares: observers cannot run on {stage.name}"):
        make_strategy([Declares((S.AFTER_BATCH, stage))])
    strategy = make_strategy()
    with pytest.raises(ValueError, match=rf"observers cannot run on {stage.name}"):
        strategy.register_hook(Declares((S.AFTER_BATCH,)), stage=stage)


def test_seed_hook_without_stages_or_with_bad_frequency_is_refused(make_strategy: Any) -> None:
    with pytest.raises(ValueError, match="hook Declares: declares no stages"):
        make_strategy([Declares(())])
    with pytest.raises(ValueError, match=r"hook Declares: 'frequency' must be an int >= 1 \(got 0\)"):
        make_strategy([Declares((S.AFTER_BATCH,), frequency=0)])
    with pytest.raises(ValueError, match="'stages' must be TrainingStage values"):
        make_strategy([Declares(("after_batch",))])


class NoCall(nvtrain.Hook):
    stages = (S.AFTER_BATCH,)


class CallWithoutStage(nvtrain.Hook):
    stages = (S.AFTER_BATCH,)

    def __call__(self, ctx: Any) -> None:  # type: ignore[override]
        return None


class StageMethod(nvtrain.Hook):
    stages = (S.AFTER_EPOCH,)

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        return None

    def after_batch(self, ctx: Any) -> None:  # never called: a Hook is called through __call__
        return None


class MarkedTypo(nvtrain.Hook):
    stages = (S.AFTER_EPOCH,)

    def __call__(self, ctx: Any, stage: TrainingStage) -> None:
        return None

    @nvtrain.hookimpl
    def after_bach(self, ctx: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (NoCall(), r"hook NoCall: implements no __call__\(ctx, stage\), which its stages call"),
        (CallWithoutStage(), r"hook CallWithoutStage: __call__\(ctx: 'Any'\) -> 'None' cannot take \(ctx, stage\)"),
        (StageMethod(), r"hook StageMethod: its method after_batch\(\) is never called: a Hook runs __call__"),
        (MarkedTypo(), r"hook MarkedTypo: its method after_bach\(\) is never called"),
    ],
    ids=["no __call__", "__call__ without stage", "stage method", "marked method"],
)
def test_a_seed_hook_the_loop_could_not_call_as_written_is_refused_at_registration(
    make_strategy: Any, hook: object, message: str
) -> None:
    """Each registered, then failed mid-run after SETUP and a step (a missing or narrow __call__), or was never
    called at all while a plugin listing showed its stage (a method of its own)."""
    with pytest.raises(ValueError, match=message):
        make_strategy([hook])


def test_seed_hook_registered_with_stage_argument_fires_there(make_strategy: Any, batches: Any) -> None:
    seen: list[TrainingStage] = []

    class Watch(nvtrain.Hook):
        def __call__(self, ctx: Any, stage: TrainingStage) -> None:
            seen.append(stage)

    strategy = make_strategy()
    strategy.register_hook(Watch(), stage=S.AFTER_LOSS)
    strategy.register_hook(Watch(), stage=[S.BEFORE_FORWARD, S.AFTER_BATCH])
    strategy.train_batch(batches(1)[0])
    assert seen == [S.BEFORE_FORWARD, S.AFTER_LOSS, S.AFTER_BATCH]


def test_stage_argument_for_a_pluggy_plugin_is_refused(make_strategy: Any) -> None:
    with pytest.raises(ValueError, match=r"plugin Plain: stage=\.\.\. applies to nvtrain.Hook instances"):
        make_strategy().register_hook(Plain("p", []), stage=S.AFTER_BATCH)


def test_two_instances_of_one_named_plugin_class_coexist(make_strategy: Any, batches: Any) -> None:
    class Logger:
        plugin_name = "logger"

        def __init__(self) -> None:
            self.calls = 0

        @nvtrain.hookimpl
        def after_batch(self, ctx: Any) -> None:
            self.calls += 1

    class Every(nvtrain.Hook):
        plugin_name = "every"
        stages = (S.AFTER_BATCH,)

        def __call__(self, ctx: Any, stage: TrainingStage) -> None:
            return None

    first, second = Logger(), Logger()
    strategy = make_strategy([first, second, Every(), Every()])
    strategy.train_batch(batches(1)[0])
    assert (first.calls, second.calls) == (1, 1)
    bus = HookBus()
    assert bus.register(Logger(), "logger") == "logger"
    assert bus.register(Logger(), "logger") == "logger-2"


# -- replace ----------------------------------------------------------------------------------


def test_replace_keeps_the_place_in_the_order() -> None:
    log: list[str] = []
    bus = HookBus()
    a, b, c = Plain("a", log), Plain("b", log), Plain("c", log)
    for plugin in (a, b, c):
        bus.register(plugin)
    bus.replace(b, Plain("b2", log))
    bus.after_loss(nvtrain.TrainingContext())
    assert log == ["a", "b2", "c"]


def test_failed_replace_leaves_the_bus_as_it_was() -> None:
    class Typo:
        @nvtrain.hookimpl
        def after_los(self, ctx: Any) -> None:
            return None

    class Wrap:
        @nvtrain.hookimpl(wrapper=True)
        def after_loss(self, ctx: Any) -> Any:
            return (yield)

    log: list[str] = []
    bus = HookBus()
    a, b, c = Plain("a", log), Plain("b", log), Plain("c", log)
    for plugin in (a, b, c, Wrap()):
        bus.register(plugin)
    with pytest.raises(ValueError, match="unknown hook 'after_los'"):
        bus.replace(a, Typo())
    with pytest.raises(ValueError, match="already registered"):
        bus.replace(a, b)
    ctx = nvtrain.TrainingContext()
    bus.after_loss(ctx)  # a wrapper is present: this is pluggy's own call order
    assert log == ["a", "b", "c"]
    assert bus.plugins()[:3] == [a, b, c]


def test_equal_but_distinct_plugins_are_refused_with_the_fix(make_strategy: Any) -> None:
    @attrs.define  # eq=True: two instances with equal fields compare equal
    class Logger:
        every: int = 1

        @nvtrain.hookimpl
        def after_batch(self, ctx: Any) -> None:
            return None

    with pytest.raises(ValueError, match=r"compares equal to the registered plugin .*Logger.*@attrs.define\(eq=False\)"):
        make_strategy([Logger(), Logger()])
    make_strategy([Logger(1), Logger(2)])  # unequal instances are fine


# -- the bus is pluggy's own ------------------------------------------------------------------


def test_a_plugin_registered_straight_on_pluggy_is_called_until_unregistered() -> None:
    log: list[str] = []
    bus = HookBus(trace=False)
    bus.register(Plain("via-bus", log, priority=20))
    direct = Plain("via-pluggy", log, priority=10)
    bus.pluggy.register(direct, "direct")
    ctx = nvtrain.TrainingContext()
    assert bus.after_backward(ctx) == ["via-pluggy", "via-bus"]  # the priority rule applies to it too
    bus.pluggy.unregister(direct)
    assert bus.after_backward(ctx) == ["via-bus"]
    bus.pluggy.set_blocked("blocked")
    assert bus.pluggy.register(Plain("never", log), "blocked") is None
    assert bus.after_backward(ctx) == ["via-bus"]
    bus.pluggy.register(direct, "direct")
    bus.pluggy.set_blocked("direct")
    assert bus.after_backward(ctx) == ["via-bus"]


def test_pluggy_registration_gets_the_bus_checks() -> None:
    bus = HookBus(trace=False)

    class Owner:
        @nvtrain.hookimpl
        def do_backward(self, ctx: Any) -> None:
            return None

    bus.pluggy.register(Owner(), "first")
    with pytest.raises(ValueError, match="replacement slot with one owner"):
        bus.pluggy.register(Owner(), "second")
    assert bus.pluggy.get_plugin("second") is None


def test_hookcall_monitoring_sees_every_stage_call_and_stops_when_undone() -> None:
    bus = HookBus(trace=False)
    bus.register(Plain("p", []))
    seen: list[str] = []
    undo = bus.pluggy.add_hookcall_monitoring(lambda name, impls, kwargs: seen.append(name), lambda *args: None)
    ctx = nvtrain.TrainingContext()
    for stage in TrainingStage:
        bus.call(stage, ctx)
    assert seen == [stage.hook_name for stage in TrainingStage]  # also stages nothing implements
    undo()
    seen.clear()
    bus.after_loss(ctx)
    bus.after_epoch(ctx)
    assert seen == []
    assert bus.after_epoch is bus_module._no_results


def test_enable_tracing_through_pluggy_traces_stage_calls(capsys: pytest.CaptureFixture[str]) -> None:
    bus = HookBus(trace=False)
    bus.register(Plain("traced", []))
    bus.pluggy.trace.root.setwriter(lambda message: print(message, end=""))
    undo = bus.pluggy.enable_tracing()
    bus.after_loss(nvtrain.TrainingContext())
    undo()
    assert "after_loss" in capsys.readouterr().out


def test_an_implementation_priority_overrides_its_plugins() -> None:
    log: list[str] = []

    class Early:
        priority = 90

        @nvtrain.hookimpl(priority=-5)
        def after_loss(self, ctx: Any) -> None:
            log.append("early.after_loss")

        @nvtrain.hookimpl
        def after_backward(self, ctx: Any) -> None:
            log.append("early.after_backward")

    bus = HookBus(trace=False)
    bus.register(Plain("plain", log))
    bus.register(Early())
    ctx = nvtrain.TrainingContext()
    bus.after_loss(ctx)
    bus.after_backward(ctx)
    assert log == ["early.after_loss", "plain", "plain", "early.after_backward"]
    with pytest.raises(TypeError, match=r"priority=\.\.\.\) must be an int"):
        nvtrain.hookimpl(priority="high")  # type: ignore[call-overload]


def test_tryfirst_and_trylast_break_ties_among_equal_priorities() -> None:
    log: list[str] = []

    def plugin(label: str, **opts: Any) -> object:
        def impl(self: object, ctx: Any) -> None:
            log.append(label)

        return type(label, (), {"after_loss": nvtrain.hookimpl(**opts)(impl)})()

    bus = HookBus(trace=False)
    for p in (plugin("last", trylast=True), plugin("plain"), plugin("first", tryfirst=True)):
        bus.register(p)
    bus.after_loss(nvtrain.TrainingContext())
    assert log == ["first", "plain", "last"]


def test_a_plugin_that_implements_no_stage_is_refused(make_strategy: Any) -> None:
    with pytest.raises(TypeError, match="object implements no stage"):
        make_strategy([object()])


def test_active_stages_limits_what_a_plugin_implements(make_strategy: Any) -> None:
    class Partial:
        active_stages = frozenset({S.AFTER_LOSS})

        @nvtrain.hookimpl
        def after_loss(self, ctx: Any) -> str:
            return "loss"

        @nvtrain.hookimpl
        def after_backward(self, ctx: Any) -> str:
            return "backward"

    bus = HookBus(trace=False)
    bus.register(Partial())
    ctx = nvtrain.TrainingContext()
    assert bus.after_loss(ctx) == ["loss"]
    assert bus.after_backward is bus_module._no_results
    # the orchestrator of a strategy without update hooks implements the two DO slots only
    strategy = make_strategy([])
    assert strategy.bus.before_batch is bus_module._no_results
    assert strategy.bus.after_optimizer_step is bus_module._no_results
