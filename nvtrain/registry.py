"""Who is registered on a strategy: the bus's plugins and the orchestrator's update hooks.

The ways in (the constructor's ``hooks``, :meth:`HookRegistry.register` after it,
update hooks composed with ``+``, and ``bus.pluggy.register``, which the bus routes
here) end here, so there is one place that knows every hook, the order they came in
and which of them hold resources to close. What is registered is read from the bus
and the orchestrator, so a plugin removed from the bus is neither saved nor closed.

Every hook has its own name on the bus (an update hook too, though the orchestrator
calls it), so pluggy's ``unregister(name=...)`` / ``unregister(hook)`` remove exactly
that hook: :meth:`HookRegistry._release` then rebuilds the orchestrator without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from nvtrain.adapter import HookAdapter
from nvtrain.bus import HookBus
from nvtrain.hook import AccumulatesGradients, Hook, TrainingUpdateHook, hook_label
from nvtrain.orchestrator import TrainingUpdateOrchestrator
from nvtrain.stages import TrainingStage

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["HookRegistry", "check_registration"]

StageSelection = TrainingStage | Iterable[TrainingStage] | None


class HookRegistry:
    """The hooks of one strategy: one bus, one orchestrator, the registration order.

    Update hooks (:class:`~nvtrain.TrainingUpdateHook`) go to the orchestrator, which
    owns DO_BACKWARD and DO_OPTIMIZER_STEP; everything else is a plugin on the bus (an
    :class:`~nvtrain.Hook` through its adapter). Once :meth:`bind` has given it the
    optimizers, an update hook registered later is bound before it joins.
    """

    __slots__ = ("_binding", "_orchestrator", "_order", "_run_ctx", "bus")

    def __init__(self, hooks: Iterable[object] = ()) -> None:
        hooks = tuple(hooks)
        self.bus = HookBus()
        #: Every hook given, in the order it came; :meth:`hooks` keeps those still registered.
        self._order: list[object] = []
        self._binding: tuple[dict[str, torch.optim.Optimizer], dict[str, Any]] | None = None
        #: The context of the strategy's runs (from :meth:`begin_run`): ``ctx.windowed`` says a run is on.
        self._run_ctx: TrainingContext | None = None
        orchestrators = [h for h in hooks if isinstance(h, TrainingUpdateOrchestrator)]
        if len(orchestrators) > 1:
            raise ValueError(
                f"TrainingStrategy.hooks holds {len(orchestrators)} TrainingUpdateOrchestrators; only one "
                "may own DO_BACKWARD and DO_OPTIMIZER_STEP. Compose update hooks with '+' or pass them bare."
            )
        # in list order, a composed orchestrator's hooks where it stands: registration order breaks priority ties
        update_hooks = [
            inner
            for hook in hooks
            for inner in (hook.hooks if isinstance(hook, TrainingUpdateOrchestrator) else (hook,))
            if isinstance(inner, TrainingUpdateHook)
        ]
        self._orchestrator = TrainingUpdateOrchestrator(update_hooks)
        self.bus.register(self._orchestrator, TrainingUpdateOrchestrator.plugin_name)
        for index, hook in enumerate(hooks):
            if isinstance(hook, TrainingUpdateOrchestrator):
                self._order.extend(hook.hooks)
                for inner in hook.hooks:
                    self._enrol(inner, None)
                continue
            try:
                self._add(hook, None, None)
            except (TypeError, ValueError) as err:  # which entry of the list, when it is not the first
                if len(hooks) > 1:
                    err.add_note(f"(TrainingStrategy.hooks[{index}])")
                raise
        self.bus.route_pluggy(self._route, self._release)
        self.bus.require_slot_owners(lambda stage: self._unowned_message(f"stage {stage.name}"))

    # -- what is registered ---------------------------------------------------------------------

    @property
    def orchestrator(self) -> TrainingUpdateOrchestrator:
        """The orchestrator of the update hooks (replaced, not mutated, when one is added)."""
        return self._orchestrator

    def update_hooks(self) -> tuple[TrainingUpdateHook, ...]:
        """The update hooks, in registration order (the orchestrator calls them by priority)."""
        return self._orchestrator.hooks

    def hooks(self) -> list[object]:
        """Every registered hook: the update hooks, then the others, each in registration order."""
        others = (h for h in self._registered() if not isinstance(h, TrainingUpdateHook))
        return [*self._orchestrator.hooks, *others]

    def _registered(self) -> list[object]:
        """The hooks given, in registration order, that are still registered (each once)."""
        present = {id(h) for h in self._orchestrator.hooks}
        present.update(id(p) for p in self.bus.plugins())
        seen: set[int] = set()
        kept = []
        for hook in self._order:
            if id(hook) in present and id(hook) not in seen:
                seen.add(id(hook))
                kept.append(hook)
        return kept

    def _remember(self, hook: object) -> None:
        """Note ``hook`` as registered last (a hook registered again moves to the end: it closes first),
        forgetting hooks that were unregistered since."""
        self._order = [*(h for h in self._registered() if h is not hook), hook]

    def before_batch_voters(self) -> list[str]:
        """The plugins whose BEFORE_BATCH votes are counted, for an error message."""
        return [impl.plugin_name for impl in self.bus.implementations(TrainingStage.BEFORE_BATCH)]

    # -- registering ----------------------------------------------------------------------------

    def register(self, hook: object, stage: StageSelection = None) -> None:
        """Add ``hook``; an update hook is composed into a new orchestrator, checked before anything changes."""
        self._register(hook, stage, None)

    def _route(self, plugin: object, name: str | None) -> str:
        """``bus.pluggy.register`` on this registry's bus: the path of :meth:`register`, under ``name``."""
        return self._register(plugin, None, name)

    def _register(self, hook: object, stage: StageSelection, name: str | None) -> str:
        """Add ``hook`` (see :meth:`register`); returns its own name on the bus (an update hook's too)."""
        if isinstance(hook, TrainingUpdateOrchestrator):
            current_off = not self.bus.pluggy.is_registered(self._orchestrator)
            if hook is self._orchestrator and current_off:  # put back after unregistering
                registered = self.bus.register(hook, name or TrainingUpdateOrchestrator.plugin_name)
                self.bus.move_first(hook)  # registered first, as the constructor does
                return registered
            if current_off:  # an orchestrator taken off before update hooks changed, which built a new one
                raise ValueError(
                    f"{hook!r} is not this strategy's current orchestrator (registering or unregistering an update "
                    "hook builds a new one); put the current one back with "
                    "strategy.bus.pluggy.register(strategy.orchestrator), and register update hooks one by one"
                )
            raise ValueError(
                "this strategy already has a TrainingUpdateOrchestrator; register its hooks one by one instead"
            )
        if not isinstance(hook, TrainingUpdateHook):
            return self._add(hook, stage, name)
        if stage is not None:
            raise ValueError(
                f"update hook {hook_label(hook)}: passing stage=... is not supported for update hooks, "
                "which declare their stages through the orchestrator ('stages' attribute)"
            )
        if any(h is hook for h in self._orchestrator.hooks):
            raise ValueError(f"update hook {hook_label(hook)} is already registered")
        new = self._orchestrator + hook  # composition errors surface before anything changes
        if self._binding is not None:
            new.bind(*self._binding)
        registered = self._enrol(hook, name)
        try:
            self._swap(new)
        except Exception:
            self.bus.unregister(hook)  # not in the orchestrator yet: _release leaves it alone
            raise
        self._remember(hook)
        return registered

    def _release(self, hook: object) -> None:
        """Before the bus lets ``hook`` go (pluggy's or the bus's ``unregister``): an update hook leaves the
        orchestrator, rebuilt without it, so unregistering one never takes the others' updates with it.

        It leaves the current micro-batch too: its ``abort_batch()`` closes what it opened for the batch (an
        autocast region it would have closed at DO_BACKWARD, which no longer calls it). Raising keeps the hook:
        the accumulating hook during a run's windows, or a hook whose ``abort_batch()`` fails.
        """
        if not any(h is hook for h in self._orchestrator.hooks):
            return
        assert isinstance(hook, TrainingUpdateHook)  # the orchestrator holds nothing else
        self._refuse_leaving_windows(hook)
        new = TrainingUpdateOrchestrator([h for h in self._orchestrator.hooks if h is not hook])
        if self._binding is not None:
            new.bind(*self._binding)
        try:
            hook.abort_batch()
        except Exception as err:
            raise RuntimeError(
                f"update hook {hook_label(hook)} was not unregistered: leaving the current batch, its abort_batch() "
                f"raised {type(err).__name__}: {err}"
            ) from err
        self._swap(new)

    def _refuse_leaving_windows(self, hook: TrainingUpdateHook) -> None:
        """The accumulating hook may not leave while a run's windows span several micro-batches: the run would
        step on every micro-batch of its windows (counting one step per window) without a word."""
        ctx = self._run_ctx
        if ctx is None or not ctx.windowed or not isinstance(hook, AccumulatesGradients):
            return
        scheduler = ctx.scheduler
        steps = scheduler.grad_acc_steps if scheduler is not None else hook.accumulation_steps
        if steps > 1:
            raise RuntimeError(
                f"update hook {hook_label(hook)} cannot be unregistered while run() is in progress: it accumulates "
                f"the run's windows of {steps} micro-batches (grad_acc_steps), and without it every micro-batch "
                "would step; unregister it before run() or after it returns"
            )

    def _swap(self, new: TrainingUpdateOrchestrator) -> None:
        """Make ``new`` the orchestrator, in the old one's place on the bus (kept off it if it was unregistered)."""
        if self.bus.pluggy.is_registered(self._orchestrator):
            self.bus.replace(self._orchestrator, new)
        self._orchestrator = new

    def begin_run(self, ctx: TrainingContext) -> None:
        """Before a run: refuse replacement slots nobody owns (:meth:`refuse_unowned_slots`), and keep ``ctx``,
        whose ``windowed`` tells :meth:`_release` that a run is in progress."""
        self._run_ctx = ctx
        self.refuse_unowned_slots()

    def refuse_unowned_slots(self) -> None:
        """Before a run: refuse, in one line naming them, replacement slots nobody owns (no step would happen).

        A stage call to such a slot raises the same message (the bus compiles it in), so ``train_batch()`` and
        a change during a run are refused too; this check only says so before SETUP.
        """
        if self.bus.unowned_slots():
            raise RuntimeError(self._unowned_message("TrainingStrategy.run"))

    def _unowned_message(self, where: str) -> str:
        """The one line refusing a run (or a slot's call, ``where``) without owners of the replacement slots."""
        unowned = self.bus.unowned_slots()
        slots = " and ".join(stage.name for stage in unowned)
        methods = " and ".join(stage.hook_name for stage in unowned)
        name = TrainingUpdateOrchestrator.plugin_name
        if self.bus.pluggy.is_blocked(name):
            cause = f"{name!r} is blocked on this bus"
            back = f"strategy.bus.pluggy.unblock({name!r}), then register strategy.orchestrator back"
        else:
            cause = f"was {name!r} unregistered from the bus?"
            back = "register strategy.orchestrator (the current one) back"
        return (
            f"{where}: no plugin owns {slots}, so training would never update the weights ({cause}); {back} with "
            f"strategy.bus.pluggy.register, or a plugin implementing {methods}"
        )

    def bind(self, optimizers: dict[str, torch.optim.Optimizer], per_step_schedulers: dict[str, Any]) -> None:
        """Give the orchestrator the optimizers and the schedulers it steps (also to later update hooks)."""
        self._binding = (optimizers, per_step_schedulers)
        self._orchestrator.bind(optimizers, per_step_schedulers)

    def _add(self, hook: object, stage: StageSelection, name: str | None) -> str:
        """Put an observer on the bus (an nvtrain.Hook through its adapter); returns the name it got."""
        name = name or getattr(hook, "plugin_name", None)
        if isinstance(hook, TrainingUpdateHook):  # the constructor's bare update hooks: already composed
            if stage is not None:
                raise ValueError(f"update hook {hook_label(hook)}: passing stage=... is not supported for update hooks")
            registered = self._enrol(hook, name)
        elif isinstance(hook, Hook):
            stages = None if stage is None else ([stage] if isinstance(stage, (int, TrainingStage)) else stage)
            registered = self.bus.register(HookAdapter(hook, stages), name, stands_for=hook)
        elif stage is not None:
            raise ValueError(
                f"plugin {hook_label(hook)}: stage=... applies to nvtrain.Hook instances; a pluggy plugin "
                "declares its stages through its @nvtrain.hookimpl methods"
            )
        else:
            registered = self.bus.register(hook, name)
        self._remember(hook)
        return registered

    def _enrol(self, hook: TrainingUpdateHook, name: str | None) -> str:
        """An update hook gets its own name on the bus (pluggy finds and unregisters it by that name); its
        @hookimpl methods, if any (all of them marked), observe stages as a plugin's."""
        return self.bus.enrol(hook, name or getattr(hook, "plugin_name", None))

    # -- closing --------------------------------------------------------------------------------

    def abort_run(self, error: BaseException) -> None:
        """Tell every hook with an ``abort_run(error)`` method (:class:`~nvtrain.hook.AbortsRun`) that the run
        failed with ``error``, in reverse registration order. Their own failures become notes on ``error``: the
        run's exception is the one that goes on. A KeyboardInterrupt or SystemExit in one (a second Ctrl-C while
        the profiler writes its trace) still lets the others be told, then goes on, with the run's error as its
        context."""
        interrupted: BaseException | None = None
        for hook in reversed(self._registered()):
            abort = getattr(hook, "abort_run", None)
            if callable(abort):
                try:
                    abort(error)
                except Exception as failure:  # the run's error stays the one raised; this one is told on it
                    error.add_note(f"{hook_label(hook)}.abort_run() failed too: {type(failure).__name__}: {failure}")
                except BaseException as failure:  # re-raised once every hook was told
                    if interrupted is None:
                        interrupted = failure
        if interrupted is not None:
            raise interrupted from error

    def close(self, pending: BaseException | None = None) -> None:
        """Close every hook that holds resources (reverse registration order), then the bus.

        A failure is never dropped: with ``pending`` (the exception already on its way out)
        failures become notes on it; without, the first is raised with the others as notes.
        A KeyboardInterrupt or SystemExit in one hook's ``close()`` (Ctrl-C while a checkpoint
        write is awaited) still lets the others close (a profiler left recording would grow for the
        rest of the process), then goes on, with the failures as notes.
        """
        errors: list[BaseException] = []
        interrupted: BaseException | None = None
        for hook in reversed(self._registered()):
            close = getattr(hook, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as err:  # collected and re-raised below, never dropped
                    errors.append(err)
                except BaseException as err:  # re-raised once every hook had its close()
                    if interrupted is None:
                        interrupted = err
        self.bus.close()
        if interrupted is not None:
            for failure in errors:
                interrupted.add_note(f"while closing hooks, {type(failure).__name__}: {failure}")
            raise interrupted
        if not errors:
            return
        if pending is not None:
            for failure in errors:
                pending.add_note(f"while closing hooks, {type(failure).__name__}: {failure}")
            return
        first = errors[0]
        for failure in errors[1:]:
            first.add_note(f"another hook failed to close: {type(failure).__name__}: {failure}")
        raise first


def check_registration(hook: object) -> None:
    """Refuse now, with the strategy's message, what registering ``hook`` on a strategy would refuse.

    Lets a config name the hook that is wrong (``hooks[2]``) rather than the stack; nothing is kept.
    """
    HookRegistry((hook,)).bus.close()
