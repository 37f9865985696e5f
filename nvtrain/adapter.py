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


def _gated(hook: Hook, stage: TrainingStage, frequency: int) -> Callable[[Any], Any]:
    last_fired: list[int] = [-1]

    def fire(ctx: Any) -> Any:
        step = ctx.step_count
        if step % frequency or step == last_fired[0]:
            return None
        last_fired[0] = step
        return hook(ctx, stage)

    fire.__name__ = stage.hook_name
    return fire
