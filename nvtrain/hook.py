"""The two hook bases: seed-style observers (:class:`Hook`) and update hooks.

Observers watch and may mutate ``ctx``; update hooks take part in the weight
update and are composed by the :class:`~nvtrain.orchestrator.TrainingUpdateOrchestrator`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from nvtrain.hookspecs import PROJECT_NAME as _PROJECT
from nvtrain.stages import REPLACEMENT_STAGES, UPDATE_STAGES, TrainingStage

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext
    from nvtrain.orchestrator import TrainingUpdateOrchestrator

__all__ = [
    "DEFAULT_PRIORITY",
    "PRIORITY_FIRST",
    "PRIORITY_LAST",
    "AbortsRun",
    "AccumulatesGradients",
    "AveragesWeights",
    "CheckpointableHook",
    "Hook",
    "ProvidesAutocast",
    "TrainingUpdateHook",
    "accumulating_hook",
    "hook_label",
]

#: Priority of hooks that do not say otherwise; lower runs first.
DEFAULT_PRIORITY = 50
#: For an implementation that must see a stage before every ordinary hook (a resume).
PRIORITY_FIRST = -10_000
#: For an implementation that must see a stage after every ordinary hook (a save, a DDP wrap).
PRIORITY_LAST = 10_000
#: The stages on which an update hook's ``proceed=False`` is a veto.
VETO_STAGES: frozenset[TrainingStage] = frozenset({TrainingStage.BEFORE_BATCH, TrainingStage.DO_OPTIMIZER_STEP})


def hook_label(hook: object) -> str:
    """How errors name a hook: its class, and its plugin name when it has one."""
    name = getattr(hook, "plugin_name", None)
    cls = type(hook).__qualname__
    return f"{cls} ({name!r})" if isinstance(name, str) else cls


@runtime_checkable
class CheckpointableHook(Protocol):
    """A hook whose state must survive a resume (EMA weights, a loss scaler...).

    One that keeps its state elsewhere declares ``saves_state = False`` and is left out of
    checkpoints (the accumulation ``run()`` adds for ``global_batch_size``: its windows are
    the step scheduler's).
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class AccumulatesGradients(Protocol):
    """An update hook that accumulates gradients over windows of ``accumulation_steps`` micro-batches.

    In ``run()`` the step scheduler builds its windows from this number and publishes
    them on ``ctx`` (``window_size``, ``window_position``, ``sync_gradients``); at most
    one such hook per strategy (``GradientAccumulationHook`` is one).
    """

    @property
    def accumulation_steps(self) -> int: ...


@runtime_checkable
class AveragesWeights(Protocol):
    """A hook keeping averaged weights of ``ctx.models[model_key]`` that validation can use (EMA)."""

    model_key: str

    def get_averaged_model(self) -> torch.nn.Module: ...


@runtime_checkable
class SavesCheckpoints(Protocol):
    """A plugin that writes checkpoints; ``last_saved`` is ``(step, directory)`` of its newest complete one, or None.

    The loop asks whether one is registered: without one a run has no checkpoint
    steps to validate on (``validate_on_checkpoint``), and ``nvtrain train`` knows a
    preemption will stop the run with nothing saved.
    """

    @property
    def last_saved(self) -> tuple[int, Any] | None: ...


@runtime_checkable
class AbortsRun(Protocol):
    """A plugin told when ``run()`` ends with an exception, before it propagates: ``abort_run(error)``.

    For per-run resources a failed run would otherwise hold until the strategy is closed
    (a profiler recording every operation the process runs next, in a notebook that never
    closes it). It must not train or raise: an exception it raises becomes a note on
    ``error`` (a KeyboardInterrupt goes on once every hook was told, ``error`` as its cause).
    ``close()`` still follows when the strategy closes.
    """

    def abort_run(self, error: BaseException) -> None: ...


@runtime_checkable
class ProvidesAutocast(Protocol):
    """A hook whose precision validation should use: ``autocast()`` returns a fresh context."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...


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
    A hook that opens something for the length of a batch (a context such as
    autocast) closes it in ``abort_batch()`` too, which runs when the batch raises.
    A hook that must perform the optimizer step differently (a loss scaler) defines
    ``step_optimizer(ctx, name, optimizer) -> bool`` returning whether the step
    really happened; at most one hook per strategy may do so. A hook that needs
    something of the hooks around it defines ``check_composition(step_hooks)``,
    which the orchestrator calls with the DO_OPTIMIZER_STEP hooks in call order
    when it is built, and raises ``ValueError`` to refuse the composition.

    Class attributes: ``priority`` (lower first, default 50), ``stages`` (a subset
    of the four update stages) and ``exclusive_key`` (two hooks with the same key
    cannot be composed, e.g. two mixed-precision hooks).

    Three more declare the hook's role in the decide-then-act rule (see
    ``docs/update-hooks.md``); their defaults assume the most a seed-style hook
    could do, so an undeclared hook is never trusted more than it should be:

    - ``vetoes``: the stages on which ``proceed`` may be ``False`` (default: every
      veto stage in ``stages``);
    - ``uses_gradients``: whether, at DO_OPTIMIZER_STEP with ``will_skip=False``, it
      reads or changes the gradients (unscale, clip, a norm; default: True when it
      runs on DO_OPTIMIZER_STEP);
    - ``veto_discards``: whether its DO_OPTIMIZER_STEP veto abandons the step, so the
      next micro-batch starts from zeroed gradients (a spike skip), rather than
      deferring it to accumulate more (default: False);
    - ``rescales_gradients``: whether it changes the scale of the gradients at
      DO_OPTIMIZER_STEP (an fp16 loss scaler's unscale), so every other hook that
      uses them must run after it (default: False).

    Any of them may be a property when the answer depends on the settings (the
    mixed-precision hook uses gradients only under fp16).
    """

    priority: int = DEFAULT_PRIORITY
    stages: ClassVar[frozenset[TrainingStage]] = UPDATE_STAGES
    exclusive_key: ClassVar[str | None] = None
    vetoes: frozenset[TrainingStage] | None = None
    uses_gradients: bool | None = None
    veto_discards: bool = False
    rescales_gradients: bool = False

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

    def abort_batch(self) -> None:
        """Leave what this hook opened for the current micro-batch (an autocast region): the batch raised.

        ``run()`` and ``train_batch()`` call it on every update hook before the exception
        reaches their caller, so no per-batch state leaks into the caller's code or a later
        ``validate()``. Unlike ``close()`` the hook stays usable: the strategy may train on.
        """

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
    vetoes = getattr(hook, "vetoes", None)
    if vetoes is not None:
        try:
            veto_set = frozenset(TrainingStage(s) for s in vetoes)
        except (TypeError, ValueError):
            raise ValueError(f"update hook {label}: 'vetoes' must be TrainingStage values (got {vetoes!r})") from None
        if not veto_set <= (VETO_STAGES & stage_set):
            allowed = ", ".join(sorted(s.name for s in VETO_STAGES & stage_set)) or "none: it runs on no veto stage"
            raise ValueError(
                f"update hook {label}: 'vetoes' may name only veto stages it runs on ({allowed}); "
                f"got {sorted(s.name for s in veto_set)}"
            )
    for flag in ("uses_gradients", "veto_discards", "rescales_gradients"):
        value = getattr(hook, flag, None)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"update hook {label}: {flag!r} must be a bool (got {value!r})")
    check_priority(hook)


def may_veto(hook: object, stage: TrainingStage) -> bool:
    """Whether ``hook`` may return ``proceed=False`` on ``stage`` (its ``vetoes``, else any veto stage it runs on)."""
    declared = getattr(hook, "vetoes", None)
    stages = frozenset(getattr(hook, "stages", ()))
    if declared is None:
        return stage in VETO_STAGES and stage in stages
    return stage in frozenset(declared)


def accumulating_hook(hooks: Iterable[object], *, strict: bool = True) -> AccumulatesGradients | None:
    """The update hook among ``hooks`` that accumulates gradients (None without one): the one whose
    ``accumulation_steps`` the step scheduler builds its windows from. At most one may (``strict``:
    else ValueError; a caller whose composition check names the clash later takes the first)."""
    found = [h for h in hooks if isinstance(h, TrainingUpdateHook) and isinstance(h, AccumulatesGradients)]
    if strict and len(found) > 1:
        names = ", ".join(hook_label(h) for h in found)
        raise ValueError(f"TrainingStrategy: at most one hook may accumulate gradients, got {names}")
    return found[0] if found else None


def uses_gradients(hook: object) -> bool:
    """Whether ``hook`` reads or changes gradients at DO_OPTIMIZER_STEP (default: when it runs there)."""
    declared = getattr(hook, "uses_gradients", None)
    if declared is None:
        return TrainingStage.DO_OPTIMIZER_STEP in frozenset(getattr(hook, "stages", ()))
    return bool(declared)


def defers_step(hook: object) -> bool:
    """Whether ``hook`` may veto DO_OPTIMIZER_STEP to keep accumulating (a veto that does not discard)."""
    return may_veto(hook, TrainingStage.DO_OPTIMIZER_STEP) and not getattr(hook, "veto_discards", False)


def check_priority(hook: object) -> int:
    """Return a hook's priority, refusing anything but an int."""
    priority = getattr(hook, "priority", DEFAULT_PRIORITY)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"hook {hook_label(hook)}: 'priority' must be an int (got {priority!r})")
    return priority


#: The method names of the stages (``after_batch``...).
_STAGE_NAMES = frozenset(stage.hook_name for stage in TrainingStage)


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
    _check_call(hook, label)
    _refuse_stage_methods(hook, label, stage_set)
    return stage_set


def _check_call(hook: Hook, label: str) -> None:
    """The stages reach a Hook through ``__call__(ctx, stage)``: one missing or unable to take them is refused
    now, not at the first stage it declares (after SETUP and a step)."""
    if isinstance(hook, Hook) and type(hook).__call__ is Hook.__call__:
        raise ValueError(f"hook {label}: implements no __call__(ctx, stage), which its stages call")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read, it is tried at the first stage
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"hook {label}: __call__{signature} cannot take (ctx, stage), which its stages pass"
        ) from None


def _refuse_stage_methods(hook: Hook, label: str, stages: frozenset[TrainingStage]) -> None:
    """A Hook is called through ``__call__`` on its declared stages only: a method named after a stage, or
    marked ``@nvtrain.hookimpl``, would never run (and a plugin listing would show it as a stage)."""
    marker = f"{_PROJECT}_impl"
    for name in dir(type(hook)):
        attribute = getattr(type(hook), name, None)
        if name in _STAGE_NAMES or (callable(attribute) and hasattr(attribute, marker)):
            declared = ", ".join(sorted(s.name for s in stages))
            raise ValueError(
                f"hook {label}: its method {name}() is never called: a Hook runs __call__(ctx, stage) on the "
                f"stages it declares ({declared}). Declare the stage in 'stages' and handle it in __call__, "
                "or write the class as a plugin of @nvtrain.hookimpl methods without the Hook base"
            )
