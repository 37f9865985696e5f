"""Registration refuses an implementation the loop could not call as written, in one line.

pluggy passes a stage's ``ctx`` by position, only to a parameter named ``ctx`` without
a default, and never complains about an ``optionalhook`` that names no hook: each of
those would fail mid-run or never run, so the bus names the plugin, the stage and
what it expected instead.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import nvtrain
from nvtrain.bus import HookBus


class DefaultCtx:
    @nvtrain.hookimpl
    def after_batch(self, ctx: Any = None) -> None:
        return None


class KeywordOnlyCtx:
    @nvtrain.hookimpl
    def after_batch(self, *, ctx: Any) -> None:
        return None


class OtherName:
    @nvtrain.hookimpl
    def before_batch(self, context: Any) -> None:
        return None


class Extra:
    @nvtrain.hookimpl
    def after_batch(self, ctx: Any, extra: Any = 1) -> None:
        return None


class VarArgs:
    @nvtrain.hookimpl
    def after_batch(self, *args: Any, **kwargs: Any) -> None:
        return None


class RenamedKeywordOnly:
    @nvtrain.hookimpl(specname="after_loss")
    def record(self, *, ctx: Any) -> None:
        return None


class OptionalTypo:
    @nvtrain.hookimpl(optionalhook=True)
    def befor_batch(self, ctx: Any) -> None:
        return None


class SpecnameTypo:
    @nvtrain.hookimpl(specname="after_bach")
    def record(self, ctx: Any) -> None:
        return None


class WrapperWithoutYield:
    @nvtrain.hookimpl(wrapper=True)
    def after_batch(self, ctx: Any) -> None:
        return None


class OldWrapperWithoutYield:
    @nvtrain.hookimpl(hookwrapper=True)
    def do_backward(self, ctx: Any) -> None:
        return None


REFUSED = [
    (DefaultCtx(), r"after_batch\(ctx=None\) cannot be called as stage 'after_batch': ctx has a default"),
    (KeywordOnlyCtx(), r"after_batch\(\*, ctx\) cannot be called as stage 'after_batch': ctx is keyword-only"),
    (OtherName(), r"before_batch\(context\) cannot be called as stage 'before_batch': 'context' is not an argument"),
    (Extra(), r"after_batch\(ctx, extra=1\) cannot be called as stage 'after_batch': 'extra' is not an argument"),
    (VarArgs(), r"after_batch\(\*args, \*\*kwargs\) cannot be called .*: \*args gets nothing; \*\*kwargs gets nothing"),
    (RenamedKeywordOnly(), r"record \(for after_loss\)\(\*, ctx\) cannot be called as stage 'after_loss'"),
    (OptionalTypo(), r"unknown hook 'befor_batch' is not a stage \(did you mean 'before_batch'\?\); optionalhook=True"),
    (SpecnameTypo(), r"unknown hook 'after_bach', named by specname on method 'record', is not a stage"),
    (WrapperWithoutYield(), r"after_batch is marked wrapper=True but is not a generator function: .* yield once"),
    (OldWrapperWithoutYield(), r"do_backward is marked hookwrapper=True but is not a generator function"),
]


@pytest.mark.parametrize(("plugin", "message"), REFUSED, ids=[type(plugin).__name__ for plugin, _ in REFUSED])
def test_an_implementation_the_loop_could_not_call_is_refused_in_one_line(
    make_strategy: Any, plugin: object, message: str
) -> None:
    label = type(plugin).__name__
    with pytest.raises(ValueError, match=rf"^plugin {label}: {message}") as caught:
        make_strategy([plugin])
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=message):
        make_strategy().bus.pluggy.register(plugin)
    bus = HookBus(trace=False)
    with pytest.raises(ValueError, match=message):
        bus.register(plugin, "named")
    assert bus.plugins() == []


def test_a_signature_refusal_says_what_was_expected(make_strategy: Any) -> None:
    with pytest.raises(ValueError, match=r"expected ctx as its one parameter, positional and without a default"):
        make_strategy([KeywordOnlyCtx()])


def test_what_pluggy_can_call_is_accepted(make_strategy: Any, batches: Any) -> None:
    seen: list[str] = []

    class Callable:
        @nvtrain.hookimpl
        def before_batch(self) -> None:  # no parameter: pluggy passes nothing
            seen.append("before_batch")

        @nvtrain.hookimpl
        def after_loss(self, ctx: Any, /) -> None:  # positional-only ctx
            seen.append("after_loss")

        @nvtrain.hookimpl(specname="after_batch")
        def record(self, ctx: Any) -> None:
            seen.append("after_batch")

        @nvtrain.hookimpl(wrapper=True)
        def do_backward(self, ctx: Any) -> Any:
            seen.append("do_backward")
            return (yield)

        @nvtrain.hookimpl(hookwrapper=True)
        def do_optimizer_step(self, ctx: Any) -> Any:
            seen.append("do_optimizer_step")
            yield

    strategy = make_strategy([Callable()])
    strategy.train_batch(batches(1)[0])
    assert seen == ["before_batch", "after_loss", "do_backward", "do_optimizer_step", "after_batch"]


# -- a marked attribute pluggy would skip ----------------------------------------------------------


def _record(log: list[str], ctx: Any) -> None:
    log.append("called")


class MarkedPartial:
    """pluggy takes only functions and methods: a marked partial passed for an implementation, never called."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.after_batch = nvtrain.hookimpl(functools.partial(_record, self.log))


class _CallableObject:
    def __call__(self, ctx: Any) -> None:
        return None


class MarkedCallableObject:
    before_batch = nvtrain.hookimpl(_CallableObject())

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        return None


SKIPPED = [
    (MarkedPartial, r"attribute 'after_batch' is marked @nvtrain.hookimpl but is a functools.partial"),
    (MarkedCallableObject, r"attribute 'before_batch' is marked @nvtrain.hookimpl but is a .*_CallableObject"),
]


@pytest.mark.parametrize(("cls", "message"), SKIPPED, ids=[cls.__name__ for cls, _ in SKIPPED])
def test_a_marked_attribute_pluggy_would_never_call_is_refused_on_every_path(
    make_strategy: Any, cls: type, message: str
) -> None:
    label = cls.__name__
    expected = rf"^plugin {label}: {message}, not a function or method, so pluggy would never call it; expected a"
    with pytest.raises(TypeError, match=expected) as caught:
        make_strategy([cls()])
    assert "\n" not in str(caught.value)
    strategy = make_strategy()
    with pytest.raises(TypeError, match=expected):
        strategy.register_hook(cls())
    with pytest.raises(TypeError, match=message):
        strategy.bus.pluggy.register(cls())
    assert strategy.registry.hooks() == []
    bus = HookBus(trace=False)
    with pytest.raises(TypeError, match=message):
        bus.register(cls(), "named")
    assert bus.plugins() == []
