"""Puts a seed-style :class:`~nvtrain.hook.Hook` on the pluggy bus."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from nvtrain.hook import Hook, hook_label, validate_observer_hook
from nvtrain.hookspecs import hookimpl
from nvtrain.stages import BATCH_STAGES, TrainingStage

__all__ = ["HookAdapter"]


class HookAdapter:
    """A plugin with one ``@hookimpl`` per stage the wrapped hook declares.

    Per-batch stages of a hook with ``frequency > 1`` are gated on completed steps;
    the gate is compiled in only for those hooks, so ungated hooks cost one call.
    """

    def __init__(self, hook: Hook, stages: Iterable[TrainingStage] | None = None) -> None:
        self.hook = hook
        self.stages = validate_observer_hook(hook, hook.stages if stages is None else stages)
        self.priority = getattr(hook, "priority", 50)
        self.plugin_name = getattr(hook, "plugin_name", None) or hook_label(hook)
        frequency = getattr(hook, "frequency", 1)
        for stage in self.stages:
            gated = frequency > 1 and stage in BATCH_STAGES
            impl = _gated(hook, stage, frequency) if gated else _plain(hook, stage)
            setattr(self, stage.hook_name, hookimpl(impl))

    def __repr__(self) -> str:
        return f"HookAdapter({self.hook!r})"


def _plain(hook: Hook, stage: TrainingStage) -> Callable[[Any], Any]:
    def fire(ctx: Any) -> Any:
        return hook(ctx, stage)

    fire.__name__ = stage.hook_name
    return fire


#: The stages that follow a step's optimizer step: at step S > 0 they fire on the micro-batch that took step S.
_AFTER_THE_STEP = frozenset({TrainingStage.AFTER_OPTIMIZER_STEP, TrainingStage.AFTER_BATCH})


def _gated(hook: Hook, stage: TrainingStage, frequency: int) -> Callable[[Any], Any]:
    """Fire at most once per step value that is a multiple of ``frequency``.

    A run resumed at step S has had S's post-step stages fire before its checkpoint: they
    wait for a micro-batch that takes a step, as they did in the run that never stopped. A
    restore that rewinds the counter lets its steps fire again.
    """
    last_fired: list[int] = [-1]
    after_the_step = stage in _AFTER_THE_STEP

    def fire(ctx: Any) -> Any:
        step = ctx.step_count
        if step < last_fired[0]:  # a state restored from an earlier step: its steps come again
            last_fired[0] = -1
        if step % frequency or step == last_fired[0]:
            return None
        if after_the_step and step and ctx.step_skipped:  # step S was taken before this micro-batch
            return None
        last_fired[0] = step
        return hook(ctx, stage)

    fire.__name__ = stage.hook_name
    return fire
