"""The two hook bases: seed-style observers (:class:`Hook`) and update hooks.

Observers watch and may mutate ``ctx``; update hooks take part in the weight
update and are composed by the :class:`~nvtrain.orchestrator.TrainingUpdateOrchestrator`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from nvtrain.stages import REPLACEMENT_STAGES, UPDATE_STAGES, TrainingStage

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext
    from nvtrain.orchestrator import TrainingUpdateOrchestrator

__all__ = [
    "DEFAULT_PRIORITY",
    "CheckpointableHook",
    "Hook",
    "TrainingUpdateHook",
    "hook_label",
]

#: Priority of hooks that do not say otherwise; lower runs first.
DEFAULT_PRIORITY = 50


def hook_label(hook: object) -> str:
    """How errors name a hook: its class, and its plugin name when it has one."""
    name = getattr(hook, "plugin_name", None)
    cls = type(hook).__qualname__
    return f"{cls} ({name!r})" if isinstance(name, str) else cls


@runtime_checkable
class CheckpointableHook(Protocol):
    """A hook whose state must survive a resume (EMA weights, a loss scaler...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Hook:
    """Seed-style observer: declare ``stages`` and implement ``__call__(ctx, stage)``.

    ``frequency`` (default 1: every firing) gates the per-batch stages on completed
    optimizer steps: with ``frequency=N`` the hook fires on a batch stage when
    ``ctx.step_count % N == 0``, at most once per step value and stage, so a vetoed
    micro-batch that leaves ``step_count`` unchanged does not fire it again.
    Once-per-run and once-per-epoch stages always fire.

    On ``BEFORE_BATCH`` a return value of ``False`` vetoes gradient zeroing, as
    for any observer. Observers cannot claim the DO_BACKWARD / DO_OPTIMIZER_STEP
    slots: those belong to the update orchestrator.
    """

    stages: ClassVar[Iterable[TrainingStage]] = ()
    frequency: int = 1
    priority: int = DEFAULT_PRIORITY

    def __call__(self, ctx: TrainingContext, stage: TrainingStage) -> bool | None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement __call__(ctx, stage)")

    def close(self) -> None:
        """Release resources; called when the strategy's context exits (also on error)."""


class TrainingUpdateHook:
    """A policy that takes part in the weight update (accumulation, precision, clipping...).

    ``__call__(ctx, stage, will_skip)`` returns ``(proceed, loss)``; what they mean
    depends on the stage (see ``docs/update-hooks.md``):

    - ``BEFORE_BATCH``: ``proceed`` (strict bool) ``False`` vetoes gradient zeroing.
    - ``DO_BACKWARD``: ``loss`` (a tensor) is the transformed loss the next hook sees.
    - ``DO_OPTIMIZER_STEP``: ``proceed`` (strict bool) ``False`` vetoes the step.
    - ``AFTER_OPTIMIZER_STEP``: both ignored; ``will_skip`` says whether the step was skipped.

    Hooks never call ``backward()`` or ``step()`` themselves; the orchestrator does.
    A hook that must perform the optimizer step differently (a loss scaler) defines
    ``step_optimizer(ctx, name, optimizer) -> bool`` returning whether the step
    really happened; at most one hook per strategy may do so.

    Class attributes: ``priority`` (lower first, default 50), ``stages`` (a subset
    of the four update stages) and ``exclusive_key`` (two hooks with the same key
    cannot be composed, e.g. two mixed-precision hooks).
    """

    priority: int = DEFAULT_PRIORITY
    stages: ClassVar[frozenset[TrainingStage]] = UPDATE_STAGES
    exclusive_key: ClassVar[str | None] = None

    def __call__(
        self, ctx: TrainingContext, stage: TrainingStage, will_skip: bool
    ) -> tuple[bool, torch.Tensor | None]:
        return True, ctx.loss

    def __add__(self, other: object) -> TrainingUpdateOrchestrator:
        from nvtrain.orchestrator import TrainingUpdateOrchestrator

        if isinstance(other, TrainingUpdateOrchestrator):
            return TrainingUpdateOrchestrator([self, *other.hooks])
        if isinstance(other, TrainingUpdateHook):
            return TrainingUpdateOrchestrator([self, other])
        return NotImplemented

    def close(self) -> None:
        """Release resources; called when the strategy's context exits (also on error)."""


def validate_update_hook(hook: object) -> None:
    """Refuse an update hook whose declared stages or priority are malformed."""
    label = hook_label(hook)
    stages = getattr(hook, "stages", None)
    try:
        stage_set = frozenset(TrainingStage(s) for s in stages)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"update hook {label}: 'stages' must be TrainingStage values (got {stages!r})") from None
    extra = stage_set - UPDATE_STAGES
    if extra or not stage_set:
        allowed = ", ".join(s.name for s in sorted(UPDATE_STAGES))
        raise ValueError(
            f"update hook {label}: 'stages' must be a non-empty subset of {{{allowed}}} "
            f"(got {sorted(s.name for s in stage_set) or 'nothing'})"
        )
    check_priority(hook)


def check_priority(hook: object) -> int:
    """Return a hook's priority, refusing anything but an int."""
    priority = getattr(hook, "priority", DEFAULT_PRIORITY)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"hook {hook_label(hook)}: 'priority' must be an int (got {priority!r})")
    return priority


def validate_observer_hook(hook: Hook, stages: Iterable[TrainingStage]) -> frozenset[TrainingStage]:
    """Check a seed-style Hook's stages and frequency; return its stage set."""
    label = hook_label(hook)
    try:
        stage_set = frozenset(TrainingStage(s) for s in stages)
    except (TypeError, ValueError):
        raise ValueError(f"hook {label}: 'stages' must be TrainingStage values (got {stages!r})") from None
    if not stage_set:
        raise ValueError(f"hook {label}: declares no stages; set 'stages' or register it with stage=...")
    claimed = stage_set & REPLACEMENT_STAGES
    if claimed:
        names = ", ".join(s.name for s in sorted(claimed))
        raise ValueError(
            f"hook {label}: observers cannot run on {names}; that slot belongs to the update "
            "orchestrator. Use BEFORE_/AFTER_BACKWARD or BEFORE_/AFTER_OPTIMIZER_STEP, or write a "
            "TrainingUpdateHook."
        )
    freq = getattr(hook, "frequency", 1)
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(f"hook {label}: 'frequency' must be an int >= 1 (got {freq!r})")
    check_priority(hook)
    return stage_set
