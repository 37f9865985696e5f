"""The event bus: pluggy's own plugin manager, with per-stage call lists computed up front.

The order of a stage's implementations is one rule, implemented here in
:func:`_call_order_key` and nowhere else (lower first)::

    1. wrappers (``wrapper=True`` / ``hookwrapper=True``) before plain implementations;
    2. ascending priority: ``@nvtrain.hookimpl(priority=N)``, else the plugin's
       ``priority`` attribute, else 50;
    3. pluggy's ``tryfirst``, then plain, then ``trylast``;
    4. registration order.

Every registration path, the bus's own and pluggy's (``bus.pluggy.register``,
``unregister``, ``set_blocked``, entry-point loading), goes through one
:class:`pluggy.PluginManager` subclass, and pluggy's ``register`` is routed to the
bus's owner (a strategy's registry: the path of ``strategy.register_hook``). After
each change it puts pluggy's hook callers in that order (so
``bus.pluggy.hook.<stage>(ctx=ctx)`` calls what the bus calls, in the same order)
and compiles one callable per stage:

- no implementation: a constant function, no pluggy call at all (on a strategy's
  bus, a replacement slot without a plain owner raises instead: see
  :meth:`HookBus.require_slot_owners`);
- plain implementations only: a tight loop over the bound functions, with the
  results pluggy's ``_multicall`` gives (the non-``None`` results, or the first
  one for the ``firstresult`` slots);
- a wrapper, or hook-call monitoring (``add_hookcall_monitoring``,
  ``enable_tracing``, ``NVTRAIN_TRACE=1``): pluggy's own hook caller, every
  stage, so a monitor sees every stage call.

Nothing is computed per call that could be computed at a change.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, final

import pluggy
from pluggy import HookImpl, PluginManager

from nvtrain import hookspecs
from nvtrain.hook import DEFAULT_PRIORITY, Hook, TrainingUpdateHook, check_priority, hook_label
from nvtrain.hookspecs import PRIORITY_ATTRIBUTE, PROJECT_NAME
from nvtrain.stages import REPLACEMENT_STAGES, TrainingStage
from nvtrain.validators import FieldTypeError, refused

if TYPE_CHECKING:
    from pluggy import HookimplOpts

    from nvtrain.context import TrainingContext

__all__ = ["TRACE_ENV", "HookBus", "Releaser", "Router", "UnownedExplainer", "refuse_unmarked_stage_methods"]

#: Set to 1 to trace every hook call through pluggy's monitoring (to stderr).
TRACE_ENV = "NVTRAIN_TRACE"
#: ``NVTRAIN_TRACE`` values that leave tracing off, as for ``NVTRAIN_DISABLE_PLUGIN_AUTOLOAD``.
_TRACE_OFF = frozenset({"", "0", "false", "no", "off"})


def _trace_switch() -> bool:
    """Whether ``NVTRAIN_TRACE`` asks for tracing: any value but empty, ``0``, ``false``, ``no``, ``off``."""
    return os.environ.get(TRACE_ENV, "").strip().lower() not in _TRACE_OFF


#: A compiled stage: results of the non-``firstresult`` stages are a list.
StageCaller = Callable[["TrainingContext"], list[Any]]
#: A compiled replacement slot (``firstresult``): the first non-``None`` result.
SlotCaller = Callable[["TrainingContext"], Any]
#: Where ``bus.pluggy.register(plugin, name)`` goes; returns the name the plugin got.
Router = Callable[[object, str | None], str | None]
#: Told, before the bus lets a user's object go (``unregister``, ``set_blocked``), which one: raises to keep it.
Releaser = Callable[[object], None]
#: The one-line message of a call to a replacement slot nobody owns, given that slot.
UnownedExplainer = Callable[[TrainingStage], str]

_STAGE_NAMES = tuple(stage.hook_name for stage in TrainingStage)
_STAGE_BY_NAME = {stage.hook_name: stage for stage in TrainingStage}
_MARKER = PROJECT_NAME + "_impl"
#: What an nvtrain plugin module lists its hook classes in (``nvtrain.plugins.HOOKS_ATTRIBUTE``).
_HOOKS_ATTRIBUTE = f"__{PROJECT_NAME}_hooks__"


def _no_results(ctx: Any) -> list[Any]:
    return []


def _no_result(ctx: Any) -> None:
    return None


# -- the one ordering rule ----------------------------------------------------------------


def _call_order_key(impl: pluggy.HookImpl, sequence: dict[str, int]) -> tuple[int, int, int, int]:
    """Where ``impl`` is called in its stage, lower first (see the module docstring)."""
    wrapper = 0 if (impl.wrapper or impl.hookwrapper) else 1
    priority: int | None = getattr(impl.function, PRIORITY_ATTRIBUTE, None)
    if priority is None:
        priority = int(getattr(impl.plugin, "priority", DEFAULT_PRIORITY))
    tier = 0 if impl.tryfirst else 2 if impl.trylast else 1
    return wrapper, priority, tier, sequence.get(impl.plugin_name, -1)


# -- pluggy's plugin manager, told about every change ---------------------------------------


class _BusPluginManager(pluggy.PluginManager):
    """pluggy's manager with nvtrain's registration checks and a change callback.

    Overrides only pluggy's public, documented methods; every way to add or remove
    a plugin or a monitor ends in one of them. pluggy's own way in (``register``:
    ``bus.pluggy.register``, entry-point loading) is routed to the bus's owner, so it
    gets the checks of ``strategy.register_hook``; the bus itself adds through :meth:`add`.

    Where pluggy holds a stand-in for the user's object (an ``nvtrain.Hook``'s adapter),
    the name maps to that object (``fronts``), and pluggy's queries by name or plugin
    (``get_plugin``, ``get_name``, ``is_registered``, ``unregister``, ...) answer with it,
    so ``pm.unregister(pm.register(hook))``-style code round-trips for every kind of hook.
    """

    def __init__(self, on_change: Callable[[], None], route: Router) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self._on_change = on_change
        self._sequence: dict[str, int] = {}
        self._counter = itertools.count()
        #: name -> the user's object, for names under which pluggy holds a stand-in for it.
        self._fronts: dict[str, object] = {}
        self.monitors = 0
        self.route = route
        self.release: Releaser | None = None

    def register(self, plugin: object, name: str | None = None) -> str | None:
        """pluggy's entry, with pluggy's answers about names: a blocked one registers nothing (also the name a
        plugin given without one would get, as pluggy checks its canonical name), a taken one is refused."""
        if self.is_blocked(name if name is not None else self.default_name(plugin)):
            return None
        holder = None if name is None else self.get_plugin(name)
        if holder is not None:
            raise ValueError(f"plugin name {name!r} is already registered on this bus, by {hook_label(holder)}")
        return self.route(plugin, name)

    def default_name(self, plugin: object) -> str:
        """The name a plugin registered without one asks for: its ``plugin_name``, else pluggy's canonical
        name where pluggy derives one (a module's ``__name__``), so ``set_blocked`` by that name works as in
        pluggy; else its class and id (pluggy's bare ``id()`` would name nothing a reader recognises)."""
        declared = getattr(plugin, "plugin_name", None)
        if isinstance(declared, str) and declared:
            return declared
        canonical = self.get_canonical_name(plugin)
        if isinstance(canonical, str) and canonical and canonical != str(id(plugin)):
            return canonical
        return f"{type(plugin).__qualname__}-{id(plugin):x}"

    def add(self, plugin: object, name: str, label: str, front: object | None = None) -> str | None:
        """Register ``plugin`` as ``name`` after nvtrain's checks; ``label`` names it in errors.

        ``front`` is the user's object when ``plugin`` stands in for it (an adapter): pluggy's
        queries then answer with ``front``.
        """
        if isinstance(plugin, type):
            raise TypeError(f"register an instance, not the class {plugin.__qualname__}")
        check_priority(plugin)
        refuse_unmarked_stage_methods(plugin)
        _refuse_equal_twin(plugin if front is None else front, self.registered())
        self._check_implementations(plugin, label)
        try:
            registered = super().register(plugin, name)
            self.check_pending()
        except pluggy.PluginValidationError as err:
            if self.holds(plugin):
                super().unregister(plugin)
            reason = " ".join(str(err).split())
            raise ValueError(f"plugin {label}: {reason}. The stages are: {', '.join(_STAGE_NAMES)}") from err
        if registered is None:  # a blocked name: pluggy registers nothing
            return None
        try:
            _check_replacement_slots(self)
        except ValueError:
            super().unregister(plugin)
            raise
        if front is not None:
            self._fronts[registered] = front
        self._sequence[registered] = next(self._counter)
        self._on_change()
        return registered

    def _check_implementations(self, plugin: object, label: str) -> None:
        """Before pluggy sees them: every implementation names a known hook and can take what a stage passes,
        and nothing is marked that pluggy would skip (a ``functools.partial``, a callable object: never called)."""
        for attribute in dir(plugin):
            _refuse_mark_above_decorator(plugin, label, attribute)
            opts = super().parse_hookimpl_opts(plugin, attribute)  # every implementation, active or not
            if opts is None:
                _refuse_marked_non_function(plugin, label, attribute)
                continue
            hook_name = opts.get("specname") or attribute
            _refuse_wrapper_without_yield(label, attribute, getattr(plugin, attribute), opts)
            if hook_name in _STAGE_BY_NAME:
                _check_stage_signature(label, hook_name, attribute, getattr(plugin, attribute))
            elif getattr(getattr(self.hook, hook_name, None), "spec", None) is None:
                raise ValueError(_unknown_hook(label, attribute, hook_name, opts))

    def parse_hookimpl_opts(self, plugin: object, name: str) -> HookimplOpts | None:
        """pluggy's discovery, plus ``active_stages``: a plugin that declares it implements only those.

        The built-in orchestrator declares the stages its update hooks use, so a stage
        none of them needs costs nothing per micro-batch.
        """
        opts = super().parse_hookimpl_opts(plugin, name)
        active = getattr(plugin, "active_stages", None)
        if opts is not None and active is not None and name in _STAGE_BY_NAME and _STAGE_BY_NAME[name] not in active:
            return None
        return opts

    # -- pluggy's queries, answered with the user's object ---------------------------------------

    def get_plugin(self, name: str) -> Any | None:
        """The object registered as ``name``: the user's, also where pluggy holds a stand-in for it."""
        front = self._fronts.get(name)
        return front if front is not None else super().get_plugin(name)

    def get_name(self, plugin: object) -> str | None:
        """The name ``plugin`` (the user's object, or pluggy's own plugin) is registered as, or None."""
        for name, front in self._fronts.items():
            if front is plugin:
                return name
        return super().get_name(plugin)

    def is_registered(self, plugin: object) -> bool:
        """Whether ``plugin`` is registered, also where pluggy holds a stand-in for it."""
        return self.get_name(plugin) is not None

    def list_name_plugin(self) -> list[tuple[str, Any]]:
        """pluggy's (name, plugin) pairs, each with the user's object where pluggy holds a stand-in."""
        return [(name, self._fronts.get(name, plugin)) for name, plugin in super().list_name_plugin()]

    def get_plugins(self) -> set[Any]:
        """The registered objects, the user's where pluggy holds a stand-in (pluggy hashes them)."""
        return {plugin for _, plugin in self.list_name_plugin() if plugin is not None}

    def get_hookcallers(self, plugin: object) -> list[pluggy.HookCaller] | None:
        return super().get_hookcallers(self._stored(plugin))

    def subset_hook_caller(self, name: str, remove_plugins: Iterable[object]) -> pluggy.HookCaller:
        return super().subset_hook_caller(name, [self._stored(plugin) for plugin in remove_plugins])

    def _stored(self, plugin: object) -> object:
        """What pluggy holds for ``plugin``: its stand-in where it has one, else itself."""
        for name, front in self._fronts.items():
            if front is plugin:
                return super().get_plugin(name)
        return plugin

    # -- removing --------------------------------------------------------------------------------

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        """pluggy's unregister, by the object given to ``register`` or the name it returned.

        The bus's owner hears first (:attr:`release`): an update hook leaves the orchestrator
        then, and an owner that raises keeps the plugin. Returns the user's object.
        """
        if name is None:
            name = None if plugin is None else self.get_name(plugin)
            if name is None:  # pluggy's own answer: one of them is needed, and it must be registered
                return super().unregister(plugin, None)
        if plugin is not None and self._fronts.get(name) is plugin:
            plugin = super().get_plugin(name)  # the stand-in, which pluggy checks the name against
        stored = super().get_plugin(name)
        if stored is None:  # not registered, or blocked: pluggy's answer (None, or its refusal)
            return super().unregister(plugin, name)
        if plugin is not None and stored is not plugin:
            raise ValueError(
                f"plugin name {name!r} and plugin {hook_label(plugin)} do not agree: {name!r} is registered to "
                f"{hook_label(self.get_plugin(name))}"
            )
        front = self._fronts.get(name, stored)
        if self.release is not None:
            self.release(front)
        self.remove(name)
        return front

    def remove(self, name: str) -> None:
        """Take the plugin registered as ``name`` off pluggy, without telling the owner (the bus's own swaps)."""
        super().unregister(super().get_plugin(name), name)
        self._fronts.pop(name, None)
        self._sequence.pop(name, None)
        self._on_change()

    def registered(self) -> list[object]:
        """The registered plugins, the user's objects (blocked names left out), compared by identity, never hashed."""
        return [plugin for _, plugin in self.list_name_plugin() if plugin is not None]

    def holds(self, plugin: object) -> bool:
        """Whether this very object is registered, or pluggy holds it (pluggy's ``is_registered`` compares with ==)."""
        return any(other is plugin for other in self.registered()) or any(
            other is plugin for _, other in super().list_name_plugin()
        )

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Callable[[], None]:
        undo = super().add_hookcall_monitoring(before, after)
        self.monitors += 1
        self._on_change()
        undone = False

        def undo_and_recompile() -> None:
            nonlocal undone
            undo()
            if not undone:
                undone = True
                self.monitors -= 1
                self._on_change()

        return undo_and_recompile

    def move(self, name: str, sequence: int) -> None:
        """Give the plugin registered as ``name`` another place in registration order."""
        self._sequence[name] = sequence
        self._on_change()

    def move_first(self, name: str) -> None:
        """Put the plugin registered as ``name`` before every other in registration order."""
        self.move(name, min(self._sequence.values(), default=0) - 1)

    def sequence_of(self, name: str) -> int:
        return self._sequence[name]

    def order_hook_callers(self) -> None:
        """Put every stage's implementations in nvtrain's call order (pluggy calls its list from the end)."""
        sequence = self._sequence
        for name in _STAGE_NAMES:
            caller: pluggy.HookCaller = getattr(self.hook, name)
            # pluggy keeps the implementations in this list and calls it last-to-first;
            # sorting it in place is the one write nvtrain makes into pluggy's state.
            caller._hookimpls.sort(key=lambda impl: _call_order_key(impl, sequence), reverse=True)


# -- the bus --------------------------------------------------------------------------------


@final
class HookBus:
    """The plugins of one strategy, and one compiled caller per stage.

    Call a stage as ``bus.before_batch(ctx)``; the result equals
    ``bus.pluggy.hook.before_batch(ctx=ctx)``. ``bus.pluggy`` is a real
    :class:`pluggy.PluginManager`: registering, unregistering, blocking or
    monitoring through it takes effect at the next stage call.
    """

    __slots__ = (
        "_explain_unowned",
        "_pm",
        "_tracing",
        "_undo_tracing",
        "after_backward",
        "after_batch",
        "after_epoch",
        "after_forward",
        "after_loss",
        "after_optimizer_step",
        "after_training",
        "after_validation",
        "before_backward",
        "before_batch",
        "before_epoch",
        "before_forward",
        "before_loss",
        "before_optimizer_step",
        "before_training",
        "do_backward",
        "do_optimizer_step",
        "setup",
    )

    # One typed caller per stage, rebuilt by _compile() whenever the plugins change.
    setup: StageCaller
    before_training: StageCaller
    before_epoch: StageCaller
    before_batch: StageCaller
    before_forward: StageCaller
    after_forward: StageCaller
    before_loss: StageCaller
    after_loss: StageCaller
    before_backward: StageCaller
    do_backward: SlotCaller
    after_backward: StageCaller
    before_optimizer_step: StageCaller
    do_optimizer_step: SlotCaller
    after_optimizer_step: StageCaller
    after_batch: StageCaller
    after_epoch: StageCaller
    after_training: StageCaller
    after_validation: StageCaller

    def __init__(self, *, trace: bool | None = None) -> None:
        if trace is not None and not isinstance(trace, bool):  # "no" would be true: tracing on
            raise refused("HookBus", "trace", trace, f"True, False or None ({TRACE_ENV} decides)", error=FieldTypeError)
        self._explain_unowned: UnownedExplainer | None = None
        self._pm = _BusPluginManager(self._compile, self.register)
        self._tracing = _trace_switch() if trace is None else trace
        self._undo_tracing: Callable[[], None] | None = None
        self._compile()
        if self._tracing:
            self._pm.trace.root.setwriter(sys.stderr.write)
            self._undo_tracing = self._pm.enable_tracing()

    # -- registration -------------------------------------------------------

    @property
    def pluggy(self) -> PluginManager:
        """The plugin manager: its registrations, blocks and monitors are the bus's."""
        return self._pm

    @property
    def tracing(self) -> bool:
        return self._tracing

    def route_pluggy(self, router: Router, release: Releaser | None = None) -> None:
        """Send ``bus.pluggy.register`` (and pluggy's entry-point loading) to ``router``.

        A strategy's registry routes them to ``strategy.register_hook``'s path, so an
        ``nvtrain.Hook`` or an update hook registered through pluggy joins the loop,
        with the same checks, and is closed and saved like any other hook. ``release``
        hears of each user's object before ``unregister`` (either one) removes it, so
        an update hook leaves the orchestrator too.
        """
        self._pm.route = router
        self._pm.release = release

    def require_slot_owners(self, explain: UnownedExplainer) -> None:
        """From now on a call to DO_BACKWARD or DO_OPTIMIZER_STEP while no plain implementation owns it raises
        ``RuntimeError(explain(stage))``: a strategy's loop would otherwise count steps that never update the
        weights. It is compiled in at each plugin change, so an owned slot costs nothing more per call; a bare
        bus (never told) answers an unowned slot with ``None``, as pluggy does.
        """
        self._explain_unowned = explain
        self._compile()

    def register(self, plugin: object, name: str | None = None, *, stands_for: object | None = None) -> str:
        """Add a plugin that implements at least one stage; returns the name it got.

        ``name`` labels the plugin in errors and traces; without one it is the plugin's
        ``plugin_name``, else pluggy's canonical name (a module's ``__name__``), else its class
        and id. When another plugin already holds it, a numeric suffix keeps it unique, so two
        instances of one plugin class (two loggers, one EMA per model) can coexist. A
        blocked name (``bus.pluggy.set_blocked``) is refused. This is the bus's own way
        in: a strategy's hooks come through ``strategy.register_hook`` (or ``bus.pluggy``).
        ``stands_for`` is the user's object when ``plugin`` is a stand-in for it (an
        ``nvtrain.Hook``'s adapter): pluggy's queries by name or plugin then answer with it.
        """
        user = plugin if stands_for is None else stands_for
        label = _label(user, name)
        if not isinstance(plugin, type):
            _refuse_without_stages(plugin, label)
        return self._admit(plugin, name, label, stands_for)

    def enrol(self, member: object, name: str | None = None) -> str:
        """Give a plugin the bus does not call by itself (an update hook: the orchestrator calls it) a name.

        pluggy's ``get_plugin`` / ``unregister`` / ``is_registered`` then find it like any plugin
        (unregistering it removes it from the orchestrator); its marked stage methods, if any,
        are called as a plugin's. Returns the name it got.
        """
        return self._admit(member, name, _label(member, name), None)

    def _admit(self, plugin: object, name: str | None, label: str, front: object | None) -> str:
        user = plugin if front is None else front
        if self._pm.holds(user) or self._pm.holds(plugin):
            raise ValueError(f"plugin {hook_label(user)} is already registered on this strategy")
        base = name or self._pm.default_name(user)
        if self._pm.is_blocked(base):
            raise ValueError(f"plugin {label}: the name {base!r} is blocked on this bus (bus.pluggy.set_blocked)")
        registered = self._pm.add(plugin, self._unique_name(base), label, front)
        if registered is None:
            raise ValueError(f"plugin {label}: its name is blocked on this bus (bus.pluggy.set_blocked)")
        return registered

    def move_first(self, plugin: object) -> None:
        """Put ``plugin`` first in registration order, the tie-break among equal priorities (the orchestrator,
        registered back after being unregistered, takes its original place)."""
        name = self._pm.get_name(plugin) if self._pm.holds(plugin) else None
        if name is None:
            raise ValueError(f"plugin {hook_label(plugin)} is not registered")
        self._pm.move_first(name)

    def unregister(self, plugin: object) -> None:
        """Remove ``plugin`` (the object registered: an ``nvtrain.Hook``, an update hook, a plugin), as pluggy's does."""
        if not self._pm.holds(plugin):
            raise ValueError(f"plugin {hook_label(plugin)} is not registered")
        self._pm.unregister(plugin)

    def replace(self, old: object, new: object) -> None:
        """Swap a registered plugin for another, keeping its name and place in the order.

        On any error the bus is left as it was.
        """
        if self._pm.holds(new):
            raise ValueError(f"plugin {hook_label(new)} is already registered on this strategy")
        name = self._pm.get_name(old) if self._pm.holds(old) else None
        if name is None:
            raise ValueError(f"plugin {hook_label(old)} is not registered")
        sequence = self._pm.sequence_of(name)
        self._pm.remove(name)
        try:
            self._pm.add(new, name, repr(name))
        except Exception:
            self._pm.add(old, name, repr(name))
            self._pm.move(name, sequence)
            raise
        self._pm.move(name, sequence)

    def _unique_name(self, name: str) -> str:
        candidate = name
        for number in itertools.count(2):
            if self._pm.get_plugin(candidate) is None and not self._pm.is_blocked(candidate):
                return candidate
            candidate = f"{name}-{number}"
        raise AssertionError("unreachable")  # pragma: no cover

    def plugins(self) -> list[object]:
        """Registered plugins by ascending ``priority``, then registration order.

        Each is the object registered: an ``nvtrain.Hook`` itself (not its adapter), and
        the update hooks, which the orchestrator calls.
        """
        pm = self._pm
        named = [(name, plugin) for name, plugin in pm.list_name_plugin() if plugin is not None]
        named.sort(key=lambda item: (getattr(item[1], "priority", DEFAULT_PRIORITY), pm.sequence_of(item[0])))
        return [plugin for _, plugin in named]

    def unowned_slots(self) -> list[TrainingStage]:
        """The replacement slots (DO_BACKWARD, DO_OPTIMIZER_STEP) no plain implementation owns, in loop order."""
        return [
            stage
            for stage in TrainingStage
            if stage in REPLACEMENT_STAGES
            and not any(not (impl.wrapper or impl.hookwrapper) for impl in self.implementations(stage))
        ]

    def implementations(self, stage: TrainingStage) -> list[HookImpl]:
        """The implementations of a stage in the order they are called (wrappers first)."""
        return list(reversed(getattr(self._pm.hook, stage.hook_name).get_hookimpls()))

    def call(self, stage: TrainingStage, ctx: Any) -> Any:
        """Call ``stage`` by value (the loop calls the typed attributes directly)."""
        caller: Callable[[Any], Any] = getattr(self, stage.hook_name)
        return caller(ctx)

    def close(self) -> None:
        if self._undo_tracing is not None:
            self._undo_tracing()
            self._undo_tracing = None

    # -- compilation --------------------------------------------------------

    def _compile(self) -> None:
        """Order pluggy's hook callers, then build each stage's caller from them."""
        self._pm.order_hook_callers()
        stage = self._compile_stage
        self.setup = stage(TrainingStage.SETUP)
        self.before_training = stage(TrainingStage.BEFORE_TRAINING)
        self.before_epoch = stage(TrainingStage.BEFORE_EPOCH)
        self.before_batch = stage(TrainingStage.BEFORE_BATCH)
        self.before_forward = stage(TrainingStage.BEFORE_FORWARD)
        self.after_forward = stage(TrainingStage.AFTER_FORWARD)
        self.before_loss = stage(TrainingStage.BEFORE_LOSS)
        self.after_loss = stage(TrainingStage.AFTER_LOSS)
        self.before_backward = stage(TrainingStage.BEFORE_BACKWARD)
        self.do_backward = stage(TrainingStage.DO_BACKWARD)
        self.after_backward = stage(TrainingStage.AFTER_BACKWARD)
        self.before_optimizer_step = stage(TrainingStage.BEFORE_OPTIMIZER_STEP)
        self.do_optimizer_step = stage(TrainingStage.DO_OPTIMIZER_STEP)
        self.after_optimizer_step = stage(TrainingStage.AFTER_OPTIMIZER_STEP)
        self.after_batch = stage(TrainingStage.AFTER_BATCH)
        self.after_epoch = stage(TrainingStage.AFTER_EPOCH)
        self.after_training = stage(TrainingStage.AFTER_TRAINING)
        self.after_validation = stage(TrainingStage.AFTER_VALIDATION)

    def _compile_stage(self, stage: TrainingStage) -> Callable[[Any], Any]:
        caller: pluggy.HookCaller = getattr(self._pm.hook, stage.hook_name)
        impls = caller.get_hookimpls()
        firstresult = stage in REPLACEMENT_STAGES
        explain = self._explain_unowned
        if firstresult and explain is not None and all(impl.wrapper or impl.hookwrapper for impl in impls):
            return _refuse_unowned(stage, explain)
        if self._pm.monitors or any(impl.wrapper or impl.hookwrapper for impl in impls):
            return _through_pluggy(caller)
        if not impls:
            return _no_result if firstresult else _no_results
        return _compile_plain(tuple(_bind(impl) for impl in reversed(impls)), firstresult)


def _refuse_unowned(stage: TrainingStage, explain: UnownedExplainer) -> Callable[[Any], Any]:
    """A replacement slot nobody owns: every call raises, so no step is counted that updated nothing."""

    def refuse(ctx: Any) -> Any:
        raise RuntimeError(explain(stage))

    return refuse


def _through_pluggy(caller: pluggy.HookCaller) -> Callable[[Any], Any]:
    def call_pluggy(ctx: Any) -> Any:
        return caller(ctx=ctx)

    return call_pluggy


def _bind(impl: pluggy.HookImpl) -> Callable[[Any], Any]:
    function = impl.function
    if tuple(impl.argnames) == ("ctx",):
        return function
    return lambda ctx: function()


def _compile_plain(functions: tuple[Callable[[Any], Any], ...], firstresult: bool) -> Callable[[Any], Any]:
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


# -- registration checks (both registration paths) -------------------------------------------


def _check_replacement_slots(pm: pluggy.PluginManager) -> None:
    for stage in REPLACEMENT_STAGES:
        owners = [
            hook_label(impl.plugin)
            for impl in getattr(pm.hook, stage.hook_name).get_hookimpls()
            if not (impl.wrapper or impl.hookwrapper)
        ]
        if len(owners) > 1:
            raise ValueError(
                f"stage {stage.name} is a replacement slot with one owner, but "
                f"{len(owners)} plugins implement it: {', '.join(owners)}. Observers use the BEFORE_/AFTER_ "
                "stages; a pluggy wrapper (wrapper=True) may wrap the slot."
            )


def _implements_a_stage(plugin: object) -> bool:
    """Any attribute marked with @nvtrain.hookimpl (a misspelled one too, or a mark on a classmethod or other
    object rather than a function: registration then refuses it naming the attribute)."""
    return any(
        hasattr(getattr(plugin, name, None), _MARKER) or hasattr(inspect.getattr_static(plugin, name, None), _MARKER)
        for name in dir(plugin)
        if not name.startswith("__")
    )


def _refuse_mark_above_decorator(plugin: object, label: str, attribute: str) -> None:
    """``@nvtrain.hookimpl`` above ``@classmethod`` / ``@staticmethod`` marks the wrapper, not the function:
    pluggy versions that look the method up (``getattr``) never see the mark, so the stage would go uncalled
    on them; refused on every version, naming the attribute."""
    if attribute.startswith("__"):
        return
    value = inspect.getattr_static(plugin, attribute, None)
    wrapper = isinstance(value, (classmethod, staticmethod))
    if wrapper and hasattr(value, _MARKER) and not hasattr(value.__func__, _MARKER):
        kind = type(value).__name__
        raise TypeError(
            f"plugin {label}: attribute {attribute!r} is marked @nvtrain.hookimpl above @{kind}, which marks the "
            f"{kind} object and not its function, so some pluggy versions never call it; expected "
            f"@nvtrain.hookimpl below @{kind}"
        )


def _refuse_wrapper_without_yield(label: str, attribute: str, method: Any, opts: Mapping[str, Any]) -> None:
    """A wrapper runs around the stage's other implementations from its one ``yield``: without one there is no
    "around" (pluggy's own refusal names the plugin by its internal id and lists nothing useful)."""
    kind = "wrapper=True" if opts.get("wrapper") else "hookwrapper=True" if opts.get("hookwrapper") else None
    if kind is None or inspect.isgeneratorfunction(method):
        return
    raise ValueError(
        f"plugin {label}: {attribute} is marked {kind} but is not a generator function: a wrapper must "
        "yield once (the stage's other implementations run there); drop the option for a plain implementation"
    )


def _refuse_marked_non_function(plugin: object, label: str, attribute: str) -> None:
    """pluggy takes only functions and methods as implementations: a marked ``functools.partial`` or callable
    object would pass for one and never be called."""
    if attribute.startswith("__"):
        return
    value = inspect.getattr_static(plugin, attribute, None)
    if not hasattr(value, _MARKER):
        return
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    raise TypeError(
        f"plugin {label}: attribute {attribute!r} is marked @nvtrain.hookimpl but is a {kind}, not a function or "
        f"method, so pluggy would never call it; expected a method (def {attribute}(self, ctx)) that calls it"
    )


def _label(plugin: object, name: str | None) -> str:
    """How errors name a plugin: the name it asked for, else its class (and ``plugin_name``), or a module's name."""
    if name:
        return repr(name)
    if isinstance(plugin, types.ModuleType):
        return f"module {plugin.__name__!r}"
    return hook_label(plugin)


def _refuse_without_stages(plugin: object, label: str) -> None:
    """A plugin with no marked method would never be called; say what would make it one. An update hook is
    refused even with marked methods (an observer's stage of its own): this bus alone would never call it at
    its update stages."""
    if _implements_a_stage(plugin) and not isinstance(plugin, TrainingUpdateHook):
        return
    if isinstance(plugin, (Hook, TrainingUpdateHook)):
        kind = "a seed-style nvtrain.Hook" if isinstance(plugin, Hook) else "an update hook"
        raise TypeError(
            f"plugin {label} is {kind}, which this bus cannot run by itself: register it with "
            "strategy.register_hook (or strategy.bus.pluggy.register), which puts it in the loop"
        )
    if isinstance(plugin, types.ModuleType) and hasattr(plugin, _HOOKS_ATTRIBUTE):
        raise TypeError(
            f"plugin {label} implements no stage: an nvtrain plugin module provides hook classes "
            f"({_HOOKS_ATTRIBUTE}); build one with nvtrain.plugins.load(name) and register that"
        )
    if plugin is None or isinstance(plugin, (str, bytes, int, float, type)):
        hint = (
            "; build one by name with nvtrain.plugins.load(" + repr(plugin) + ")"
            if isinstance(plugin, str)
            else "; instantiate the class first"
            if isinstance(plugin, type)
            else ""
        )
        raise TypeError(
            f"expected a hook instance (an object with @nvtrain.hookimpl stage methods, an nvtrain.Hook or a "
            f"TrainingUpdateHook), got {type(plugin).__name__} {plugin!r}{hint}"
        )
    refuse_unmarked_stage_methods(plugin)  # the usual cause: stage methods without their decorator
    raise TypeError(
        f"plugin {label} implements no stage: give it a method named after a stage "
        f"({', '.join(_STAGE_NAMES[:3])}, ...) marked @nvtrain.hookimpl, or subclass nvtrain.Hook "
        "or nvtrain.TrainingUpdateHook"
    )


def _unknown_hook(label: str, attribute: str, hook_name: str, opts: Mapping[str, Any]) -> str:
    """The one-line refusal of an implementation that names no stage (a typo, also under optionalhook)."""
    close = difflib.get_close_matches(hook_name, _STAGE_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    source = f", named by specname on method {attribute!r}," if hook_name != attribute else ""
    optional = "; optionalhook=True does not make it a stage" if opts.get("optionalhook") else ""
    return (
        f"plugin {label}: unknown hook {hook_name!r}{source} is not a stage{hint}{optional}, so it would never "
        f"be called. The stages are: {', '.join(_STAGE_NAMES)}"
    )


def _check_stage_signature(label: str, stage: str, attribute: str, function: Callable[..., Any]) -> None:
    """pluggy passes a stage's ``ctx`` by position, and nothing else: refuse what could not take it."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    problem = _signature_problem(signature)
    if problem is None:
        return
    bare = signature.replace(
        parameters=[parameter.replace(annotation=parameter.empty) for parameter in signature.parameters.values()],
        return_annotation=signature.empty,
    )
    where = attribute if attribute == stage else f"{attribute} (for {stage})"
    raise ValueError(
        f"plugin {label}: {where}{bare} cannot be called as stage {stage!r}: {problem}; "
        f"expected ctx as its one parameter, positional and without a default (def {attribute}(self, ctx)), "
        "or no parameter"
    )


def _signature_problem(signature: inspect.Signature) -> str | None:
    """Why pluggy could not hand ``ctx`` to a function of this signature, or None when it can."""
    parameters = list(signature.parameters.values())
    problems = []
    for parameter in parameters:
        if parameter.kind is parameter.VAR_POSITIONAL:
            problems.append(f"*{parameter.name} gets nothing")
        elif parameter.kind is parameter.VAR_KEYWORD:
            problems.append(f"**{parameter.name} gets nothing")
        elif parameter.name != "ctx":
            problems.append(f"{parameter.name!r} is not an argument of the stage")
        elif parameter.kind is parameter.KEYWORD_ONLY:
            problems.append("ctx is keyword-only, and pluggy passes it by position")
        elif parameter.default is not parameter.empty:
            problems.append("ctx has a default, so pluggy calls it without ctx")
    return "; ".join(problems) or None


def _refuse_equal_twin(plugin: object, registered: list[Any]) -> None:
    """pluggy tells plugins apart with ``==``: a distinct but equal plugin would be refused or confused."""
    for other in registered:
        if other is not plugin and other == plugin:
            raise ValueError(
                f"plugin {hook_label(plugin)} compares equal to the registered plugin {hook_label(other)}, "
                "and pluggy tells plugins apart with ==; give the class identity equality "
                "(for attrs classes: @attrs.define(eq=False))"
            )


def refuse_unmarked_stage_methods(plugin: object) -> None:
    """A method named like a stage but not marked is almost always a forgotten decorator."""
    for name in _STAGE_NAMES:
        method = getattr(plugin, name, None)
        if hasattr(inspect.getattr_static(plugin, name, None), _MARKER):
            continue  # marked where pluggy may not look (above @classmethod): the implementation checks name it
        if callable(method) and not hasattr(method, _MARKER):
            raise ValueError(
                f"plugin {hook_label(plugin)}: method {name!r} is named after a stage but is not "
                "marked with @nvtrain.hookimpl, so it would never be called"
            )
