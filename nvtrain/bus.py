"""The event bus: pluggy underneath, with per-stage call lists computed up front.

pluggy calls implementations last-registered-first and builds its call list on
every call. nvtrain wants one ordering everywhere (ascending ``priority``, then
registration order) and a near-free stage when nobody listens. So on every
register/unregister the bus re-registers its plugins with pluggy in the order
that makes pluggy's own call order equal nvtrain's, then compiles one callable
per stage:

- no implementation: a constant function, no pluggy call at all;
- plain implementations only: a tight loop over the bound functions, with the
  same results pluggy would return (non-``None`` results, or the first one for
  the ``firstresult`` slots);
- any wrapper, or tracing on (``NVTRAIN_TRACE=1``): pluggy's own hook caller.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from typing import Any, final

import pluggy

from nvtrain import hookspecs
from nvtrain.hook import check_priority, hook_label
from nvtrain.hookspecs import PROJECT_NAME
from nvtrain.stages import REPLACEMENT_STAGES, TrainingStage

__all__ = ["HookBus", "TRACE_ENV"]

#: Set to 1 to trace every hook call through pluggy's monitoring (to stderr).
TRACE_ENV = "NVTRAIN_TRACE"

StageCaller = Callable[[Any], Any]
_STAGE_NAMES = tuple(stage.hook_name for stage in TrainingStage)
_MARKER = PROJECT_NAME + "_impl"


def _no_results(ctx: Any) -> list[Any]:
    return []


def _no_result(ctx: Any) -> None:
    return None


def _bind(impl: pluggy.HookImpl) -> Callable[[Any], Any]:
    function = impl.function
    if tuple(impl.argnames) == ("ctx",):
        return function
    return lambda ctx: function()


def _compile_plain(functions: tuple[Callable[[Any], Any], ...], firstresult: bool) -> StageCaller:
    if firstresult and len(functions) == 1:
        return functions[0]  # its result is the first non-None result, or None: exactly pluggy's answer
    if firstresult:

        def call_first(ctx: Any) -> Any:
            for function in functions:
                result = function(ctx)
                if result is not None:
                    return result
            return None

        return call_first

    if len(functions) == 1:
        (only,) = functions

        def call_one(ctx: Any) -> list[Any]:
            result = only(ctx)
            return [] if result is None else [result]

        return call_one

    def call_all(ctx: Any) -> list[Any]:
        results = []
        for function in functions:
            result = function(ctx)
            if result is not None:
                results.append(result)
        return results

    return call_all


def _compile_pluggy(caller: pluggy.HookCaller) -> StageCaller:
    def call_pluggy(ctx: Any) -> Any:
        return caller(ctx=ctx)

    return call_pluggy


@final
class HookBus:
    """Plugins in nvtrain order, and one compiled caller per stage.

    Call a stage as ``bus.before_batch(ctx)`` (or ``bus.call(stage, ctx)``); the
    result equals ``bus.pluggy.hook.before_batch(ctx=ctx)``.
    """

    __slots__ = (*_STAGE_NAMES, "_entries", "_pm", "_seq", "_tracing", "_undo_tracing")

    def __init__(self, *, trace: bool | None = None) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._entries: list[tuple[int, int, str, object]] = []
        self._seq = itertools.count()
        self._tracing = os.environ.get(TRACE_ENV, "") not in ("", "0") if trace is None else trace
        self._undo_tracing: Callable[[], None] | None = None
        if self._tracing:
            self._pm.trace.root.setwriter(sys.stderr.write)
            self._undo_tracing = self._pm.enable_tracing()
        self._compile()

    # -- registration -------------------------------------------------------

    @property
    def pluggy(self) -> pluggy.PluginManager:
        """The underlying plugin manager (its hook callers give the same results)."""
        return self._pm

    @property
    def tracing(self) -> bool:
        return self._tracing

    def register(self, plugin: object, name: str | None = None) -> str:
        """Add a plugin; its implementations run in ascending ``priority``, then registration order.

        ``name`` labels the plugin in errors and traces (a plugin class's ``plugin_name``);
        when another plugin already holds it, a numeric suffix keeps it unique, so two
        instances of one plugin class (two loggers, one EMA per model) can coexist.
        Returns the name used.
        """
        if any(entry[3] is plugin for entry in self._entries):
            raise ValueError(f"plugin {hook_label(plugin)} is already registered on this strategy")
        priority = check_priority(plugin)
        _refuse_unmarked_stage_methods(plugin)
        _refuse_equal_twin(plugin, [entry[3] for entry in self._entries])
        name = self._unique_name(name or f"{type(plugin).__qualname__}-{id(plugin):x}")
        try:
            self._pm.register(plugin, name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as err:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            stages = ", ".join(_STAGE_NAMES)
            raise ValueError(f"plugin {name!r}: {err}. The stages are: {stages}") from err
        try:
            self._check_replacement_slots()
        except ValueError:
            self._pm.unregister(plugin)
            raise
        self._entries.append((priority, next(self._seq), name, plugin))
        self._reorder()
        return name

    def unregister(self, plugin: object) -> None:
        for index, entry in enumerate(self._entries):
            if entry[3] is plugin:
                del self._entries[index]
                self._pm.unregister(plugin)
                self._reorder()
                return
        raise ValueError(f"plugin {hook_label(plugin)} is not registered")

    def replace(self, old: object, new: object) -> None:
        """Swap a registered plugin for another, keeping its place in the order."""
        if any(entry[3] is new for entry in self._entries):
            raise ValueError(f"plugin {hook_label(new)} is already registered on this strategy")
        for index, (_, seq, name, plugin) in enumerate(self._entries):
            if plugin is old:
                new_priority = check_priority(new)
                _refuse_unmarked_stage_methods(new)
                _refuse_equal_twin(new, [entry[3] for entry in self._entries if entry[3] is not old])
                self._pm.unregister(old)
                try:
                    self._pm.register(new, name)
                    self._pm.check_pending()
                    self._check_replacement_slots()
                except Exception as err:
                    if self._pm.is_registered(new):
                        self._pm.unregister(new)
                    self._pm.register(old, name)
                    self._reorder()  # old is back, but registered last: restore pluggy's call order
                    if isinstance(err, pluggy.PluginValidationError):
                        raise ValueError(f"plugin {name!r}: {err}") from err
                    raise
                self._entries[index] = (new_priority, seq, name, new)
                self._reorder()
                return
        raise ValueError(f"plugin {hook_label(old)} is not registered")

    def _unique_name(self, name: str) -> str:
        candidate = name
        for number in itertools.count(2):
            if self._pm.get_plugin(candidate) is None and not self._pm.is_blocked(candidate):
                return candidate
            candidate = f"{name}-{number}"
        raise AssertionError("unreachable")  # pragma: no cover

    def plugins(self) -> list[object]:
        """Registered plugins in nvtrain order."""
        return [entry[3] for entry in sorted(self._entries)]

    def implementations(self, stage: TrainingStage) -> list[pluggy.HookImpl]:
        """The implementations of a stage in the order they are called (wrappers first)."""
        return list(reversed(getattr(self._pm.hook, stage.hook_name).get_hookimpls()))

    def call(self, stage: TrainingStage, ctx: Any) -> Any:
        return getattr(self, stage.hook_name)(ctx)

    def close(self) -> None:
        if self._undo_tracing is not None:
            self._undo_tracing()
            self._undo_tracing = None

    # -- compilation --------------------------------------------------------

    def _check_replacement_slots(self) -> None:
        for stage in REPLACEMENT_STAGES:
            owners = [
                impl.plugin_name
                for impl in getattr(self._pm.hook, stage.hook_name).get_hookimpls()
                if not (impl.wrapper or impl.hookwrapper)
            ]
            if len(owners) > 1:
                raise ValueError(
                    f"stage {stage.name} is a replacement slot with one owner, but "
                    f"{len(owners)} plugins implement it: {owners}. Observers use the BEFORE_/AFTER_ "
                    "stages; a pluggy wrapper (wrapper=True) may wrap the slot."
                )

    def _reorder(self) -> None:
        # pluggy calls the last registered first: register in descending nvtrain order.
        ordered = sorted(self._entries, reverse=True)
        for _, _, _, plugin in ordered:
            self._pm.unregister(plugin)
        for _, _, name, plugin in ordered:
            self._pm.register(plugin, name)
        self._compile()

    def _compile(self) -> None:
        for stage in TrainingStage:
            caller = getattr(self._pm.hook, stage.hook_name)
            impls = caller.get_hookimpls()
            firstresult = stage in REPLACEMENT_STAGES
            if not impls:
                compiled: StageCaller = _no_result if firstresult else _no_results
            elif self._tracing or any(impl.wrapper or impl.hookwrapper for impl in impls):
                compiled = _compile_pluggy(caller)
            else:
                compiled = _compile_plain(tuple(_bind(impl) for impl in reversed(impls)), firstresult)
            setattr(self, stage.hook_name, compiled)


def _refuse_equal_twin(plugin: object, registered: list[object]) -> None:
    """pluggy tells plugins apart with ``==``: a distinct but equal plugin would be refused or confused."""
    for other in registered:
        if other == plugin:
            raise ValueError(
                f"plugin {hook_label(plugin)} compares equal to the registered plugin {hook_label(other)}, "
                "and pluggy tells plugins apart with ==; give the class identity equality "
                "(for attrs classes: @attrs.define(eq=False))"
            )


def _refuse_unmarked_stage_methods(plugin: object) -> None:
    """A method named like a stage but not marked is almost always a forgotten decorator."""
    if isinstance(plugin, type):
        raise TypeError(f"register an instance, not the class {plugin.__qualname__}")
    for name in _STAGE_NAMES:
        method = getattr(plugin, name, None)
        if callable(method) and not hasattr(method, _MARKER):
            raise ValueError(
                f"plugin {hook_label(plugin)}: method {name!r} is named after a stage but is not "
                "marked with @nvtrain.hookimpl, so it would never be called"
            )
