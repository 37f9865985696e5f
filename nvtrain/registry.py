"""Who is registered on a strategy: the bus's plugins and the orchestrator's update hooks.

The three ways in (the constructor's ``hooks``, :meth:`HookRegistry.register` after it,
update hooks composed with ``+``) end here, so there is one place that knows every
hook, the order they came in and which of them hold resources to close.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nvtrain.adapter import HookAdapter
from nvtrain.bus import HookBus, refuse_unmarked_stage_methods
from nvtrain.hook import Hook, TrainingUpdateHook, hook_label
from nvtrain.hookspecs import PROJECT_NAME
from nvtrain.orchestrator import TrainingUpdateOrchestrator
from nvtrain.stages import TrainingStage

__all__ = ["HookRegistry"]

StageSelection = TrainingStage | Iterable[TrainingStage] | None


def _has_hookimpls(obj: object) -> bool:
    """Any attribute marked with @nvtrain.hookimpl, also a misspelled one (the bus then names it)."""
    marker = PROJECT_NAME + "_impl"
    return any(hasattr(getattr(obj, name, None), marker) for name in dir(obj) if not name.startswith("__"))


class HookRegistry:
    """The hooks of one strategy: one bus, one orchestrator, the registration order.

    Update hooks (:class:`~nvtrain.TrainingUpdateHook`) go to the orchestrator, which
    owns DO_BACKWARD and DO_OPTIMIZER_STEP; everything else is a plugin on the bus (an
    :class:`~nvtrain.Hook` through its adapter). Once :meth:`bind` has given it the
    optimizers, an update hook registered later is bound before it joins.
    """

    __slots__ = ("_binding", "_closables", "_orchestrator", "bus")

    def __init__(self, hooks: Iterable[object] = ()) -> None:
        hooks = tuple(hooks)
        self.bus = HookBus()
        self._closables: list[object] = []
        self._binding: tuple[dict[str, torch.optim.Optimizer], dict[str, Any]] | None = None
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
        for hook in hooks:
            if isinstance(hook, TrainingUpdateOrchestrator):
                self._closables.extend(hook.hooks)
                for inner in hook.hooks:
                    self._observe(inner)
            else:
                self._add(hook, None)

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
        return [*self._orchestrator.hooks, *(h for h in self._closables if not isinstance(h, TrainingUpdateHook))]

    def before_batch_voters(self) -> list[str]:
        """The plugins whose BEFORE_BATCH votes are counted, for an error message."""
        return [impl.plugin_name for impl in self.bus.implementations(TrainingStage.BEFORE_BATCH)]

    # -- registering ----------------------------------------------------------------------------

    def register(self, hook: object, stage: StageSelection = None) -> None:
        """Add ``hook``; an update hook is composed into a new orchestrator, checked before anything changes."""
        if isinstance(hook, TrainingUpdateOrchestrator):
            raise ValueError(
                "this strategy already has a TrainingUpdateOrchestrator; register its hooks one by one instead"
            )
        if not isinstance(hook, TrainingUpdateHook):
            self._add(hook, stage)
            return
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
        observing = _has_hookimpls(hook)
        if observing:
            self.bus.register(hook, getattr(hook, "plugin_name", None))
        else:
            refuse_unmarked_stage_methods(hook)
        try:
            self.bus.replace(self._orchestrator, new)
        except Exception:
            if observing:
                self.bus.unregister(hook)
            raise
        self._orchestrator = new
        self._closables.append(hook)

    def bind(self, optimizers: dict[str, torch.optim.Optimizer], per_step_schedulers: dict[str, Any]) -> None:
        """Give the orchestrator the optimizers and the schedulers it steps (also to later update hooks)."""
        self._binding = (optimizers, per_step_schedulers)
        self._orchestrator.bind(optimizers, per_step_schedulers)

    def _add(self, hook: object, stage: StageSelection) -> None:
        if isinstance(hook, TrainingUpdateHook):
            if stage is not None:
                raise ValueError(
                    f"update hook {hook_label(hook)}: passing stage=... is not supported for update hooks"
                )
            self._observe(hook)
        elif isinstance(hook, Hook):
            stages = None if stage is None else ([stage] if isinstance(stage, (int, TrainingStage)) else stage)
            self.bus.register(HookAdapter(hook, stages), getattr(hook, "plugin_name", None))
        elif stage is not None:
            raise ValueError(
                f"plugin {hook_label(hook)}: stage=... applies to nvtrain.Hook instances; a pluggy plugin "
                "declares its stages through its @nvtrain.hookimpl methods"
            )
        else:
            self.bus.register(hook, getattr(hook, "plugin_name", None))
        self._closables.append(hook)

    def _observe(self, hook: TrainingUpdateHook) -> None:
        """An update hook may also observe stages through @hookimpl methods (all of them marked)."""
        if _has_hookimpls(hook):
            self.bus.register(hook, getattr(hook, "plugin_name", None))
        else:  # the bus checks the others; one with no mark at all would otherwise never be looked at
            refuse_unmarked_stage_methods(hook)

    # -- closing --------------------------------------------------------------------------------

    def close(self, pending: BaseException | None = None) -> None:
        """Close every hook that holds resources (reverse registration order), then the bus.

        A failure is never dropped: with ``pending`` (the exception already on its way out)
        failures become notes on it; without, the first is raised with the others as notes.
        """
        errors: list[BaseException] = []
        seen: set[int] = set()
        for hook in reversed(self._closables):
            if id(hook) in seen:
                continue
            seen.add(id(hook))
            close = getattr(hook, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as err:  # collected and re-raised below, never dropped
                    errors.append(err)
        self.bus.close()
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
