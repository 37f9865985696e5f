"""The single owner of backward and the optimizer step, composing the update hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, final

import torch

from nvtrain.hook import (
    TrainingUpdateHook,
    defers_step,
    hook_label,
    may_veto,
    uses_gradients,
    validate_update_hook,
)
from nvtrain.hookspecs import hookimpl
from nvtrain.stages import TrainingStage

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["TrainingUpdateOrchestrator"]

_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP


@final
class TrainingUpdateOrchestrator:
    """Runs update hooks in one ordered path and performs the calls they may not make.

    Hooks run in ascending ``priority``, construction order breaking ties. Every
    hook is called on its stages even after an earlier veto; later hooks then see
    ``will_skip=True``. The orchestrator zeroes gradients (``set_to_none=True``)
    unless BEFORE_BATCH was vetoed, chains the DO_BACKWARD loss transforms and
    calls ``backward()`` once, steps every optimizer unless DO_OPTIMIZER_STEP was
    vetoed, and steps an LR scheduler only when its optimizer really stepped.

    Decide, then act: a composition in which a hook could veto DO_OPTIMIZER_STEP to
    keep accumulating after another hook used the gradients there (unscaled,
    clipped or measured them) is refused at construction; gradients a step used
    are never accumulated into (a BEFORE_BATCH veto of their zeroing raises).

    It is a plugin on the bus (the only implementation of the two DO slots);
    strategies build one automatically from the bare update hooks they receive.
    Pre-compose with ``hook_a + hook_b``.
    """

    plugin_name = "nvtrain.orchestrator"
    #: Among equal priorities the orchestrator is registered first.
    priority = 50

    def __init__(self, hooks: Iterable[TrainingUpdateHook] = ()) -> None:
        hooks = tuple(hooks)
        _check_composition(hooks)
        self.hooks: tuple[TrainingUpdateHook, ...] = hooks
        ordered = [h for _, h in sorted(enumerate(hooks), key=lambda item: (item[1].priority, item[0]))]
        self._by_stage = {
            stage: tuple(h for h in ordered if stage in frozenset(h.stages))
            for stage in (_BEFORE_BATCH, _DO_BACKWARD, _DO_OPTIMIZER_STEP, _AFTER_OPTIMIZER_STEP)
        }
        _check_decide_then_act(self._by_stage[_DO_OPTIMIZER_STEP])
        _let_hooks_check(self._by_stage[_DO_OPTIMIZER_STEP])
        self._before_batch_hooks = self._by_stage[_BEFORE_BATCH]
        self._backward_hooks = self._by_stage[_DO_BACKWARD]
        self._step_plan = tuple(
            (h, uses_gradients(h), defers_step(h)) for h in self._by_stage[_DO_OPTIMIZER_STEP]
        )
        self._after_step_hooks = self._by_stage[_AFTER_OPTIMIZER_STEP]
        #: The stages this orchestrator implements on the bus: the two DO slots always, BEFORE_BATCH
        #: and AFTER_OPTIMIZER_STEP only when a hook runs there (the bus reads this declaration).
        self.active_stages: frozenset[TrainingStage] = frozenset(
            {_DO_BACKWARD, _DO_OPTIMIZER_STEP}
            | ({_BEFORE_BATCH} if self._before_batch_hooks else set())
            | ({_AFTER_OPTIMIZER_STEP} if self._after_step_hooks else set())
        )
        self._may_veto = {
            stage: frozenset(id(h) for h in self._by_stage[stage] if may_veto(h, stage))
            for stage in (_BEFORE_BATCH, _DO_OPTIMIZER_STEP)
        }
        placers = [getattr(h, "place_micro_batch", None) for h in hooks]
        placers = [placer for placer in placers if callable(placer)]
        #: Standalone ``train_batch()``: the accumulating hook's ``place_micro_batch(ctx)``, which publishes the
        #: micro-batch's window fields before BEFORE_BATCH (None: every micro-batch is a window of one).
        self.window_placer: Callable[[TrainingContext], None] | None = placers[0] if placers else None
        #: Aborted in reverse call order: what a later hook opened inside an earlier one's region closes first.
        self._abort_order = tuple(reversed(ordered))
        steppers = [h for h in ordered if callable(getattr(h, "step_optimizer", None))]
        self._stepper = steppers[0] if steppers else None
        self._optimizers: tuple[tuple[str, torch.optim.Optimizer, tuple[Any, ...]], ...] = ()
        #: The first hook that used the gradients at the last DO_OPTIMIZER_STEP (None: none did).
        self._gradients_used_by: TrainingUpdateHook | None = None
        #: The update hook that vetoed zeroing at the current BEFORE_BATCH (None: none did).
        self._zeroing_vetoed_by: TrainingUpdateHook | None = None
        #: ``ctx.batch_count`` of the micro-batch at which an optimizer last stepped (-1: none yet). A failure
        #: after the step (a DO_OPTIMIZER_STEP wrapper raising after its ``yield``) must still count it.
        self.stepped_at_batch = -1

    # -- composition ---------------------------------------------------------

    def __add__(self, other: object) -> TrainingUpdateOrchestrator:
        if isinstance(other, TrainingUpdateOrchestrator):
            return TrainingUpdateOrchestrator([*self.hooks, *other.hooks])
        if isinstance(other, TrainingUpdateHook):
            return TrainingUpdateOrchestrator([*self.hooks, other])
        return NotImplemented

    def __iter__(self) -> Any:
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def __bool__(self) -> bool:
        return True  # an orchestrator without hooks still owns the DO slots: never falsy

    def hooks_for(self, stage: TrainingStage) -> tuple[TrainingUpdateHook, ...]:
        """The hooks that run on ``stage``, in call order."""
        return self._by_stage.get(TrainingStage(stage), ())

    def bind(self, optimizers: dict[str, torch.optim.Optimizer], lr_schedulers: dict[str, Any]) -> None:
        """Fix the optimizers (and the schedulers paired with each) once they are built.

        The hooks have seen the device by then (SETUP), so flags that depended on it (a
        mixed-precision hook's ``"auto"`` resolved to fp16 or not) are read again, exactly.
        """
        step_hooks = self._by_stage[_DO_OPTIMIZER_STEP]
        _check_decide_then_act(step_hooks)
        self._step_plan = tuple((h, uses_gradients(h), defers_step(h)) for h in step_hooks)
        self._optimizers = tuple(
            (name, optimizer, _as_tuple(lr_schedulers.get(name))) for name, optimizer in optimizers.items()
        )

    # -- the four stages -------------------------------------------------------

    @hookimpl
    def before_batch(self, ctx: TrainingContext) -> bool | None:
        """Ask the hooks whether to zero gradients; ``False`` is a veto on the bus."""
        vetoer = _first_veto(self._before_batch_hooks, ctx, _BEFORE_BATCH, self._may_veto[_BEFORE_BATCH])
        self._zeroing_vetoed_by = vetoer
        return False if vetoer is not None else None

    def settle_zeroing(self, votes: list[Any], voters: Callable[[], list[str]]) -> None:
        """Act on BEFORE_BATCH's final decision: zero every optimizer's gradients unless a vote vetoed.

        ``votes`` are the bus's BEFORE_BATCH results (strict bools; ``False`` vetoes);
        ``voters`` names the implementations, for an error. Gradients that the last
        DO_OPTIMIZER_STEP used (unscaled, clipped, measured) must be zeroed: keeping
        them would add this micro-batch's gradients to ones already acted on.
        """
        if votes and _vetoed(votes, voters):
            used_by = self._gradients_used_by
            if used_by is not None:
                who = self._zeroing_vetoed_by
                vetoer = f"update hook {hook_label(who)}" if who is not None else f"one of {voters()}"
                raise RuntimeError(
                    f"stage BEFORE_BATCH: {vetoer} vetoed gradient zeroing, but update hook "
                    f"{hook_label(used_by)} already used these gradients at the last DO_OPTIMIZER_STEP "
                    "(a step that was taken or discarded); accumulating into them would mix gradients "
                    "that were acted on with fresh ones. Veto DO_OPTIMIZER_STEP on the micro-batches "
                    "that keep accumulating, at a priority below the hooks that use gradients."
                )
            self._zeroing_vetoed_by = None
            return
        self._gradients_used_by = None
        self._zeroing_vetoed_by = None
        for _, optimizer, _ in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    def zero_gradients(self) -> None:
        """Zero every optimizer's gradients (``set_to_none=True``)."""
        self._gradients_used_by = None
        for _, optimizer, _ in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    @hookimpl
    def do_backward(self, ctx: TrainingContext) -> torch.Tensor:
        """Chain the loss transforms, then ``backward()`` exactly once."""
        original = ctx.loss
        if not isinstance(original, torch.Tensor):
            raise TypeError(
                f"stage DO_BACKWARD: ctx.loss must be a torch.Tensor before backward "
                f"(got {type(original).__name__}); check loss_fn"
            )
        if not self._backward_hooks:  # nothing transforms the loss: back-propagate it as it is
            try:
                original.backward()
            except RuntimeError as err:
                _raise_for_unusable_loss(original, err)
                raise
            ctx.backward_loss = original
            return original
        loss = original
        try:
            for hook in self._backward_hooks:
                result = hook(ctx, _DO_BACKWARD, False)
                try:
                    _, loss = result  # type: ignore[assignment]  # checked to be a tensor just below
                except (TypeError, ValueError):
                    raise _bad_result(hook, _DO_BACKWARD, result) from None
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(
                        f"update hook {hook_label(hook)} at stage DO_BACKWARD must return a "
                        f"torch.Tensor as loss, got {type(loss).__name__}: {loss!r}"
                    )
                ctx.loss = loss
            try:
                loss.backward()
            except RuntimeError as err:
                _raise_for_unusable_loss(loss, err)
                raise
        finally:
            ctx.loss = original
        ctx.backward_loss = loss
        return loss

    @hookimpl
    def do_optimizer_step(self, ctx: TrainingContext) -> bool:
        """Ask the hooks in order, then step optimizers and their schedulers unless vetoed."""
        will_skip = False
        used_by = None
        allowed = self._may_veto[_DO_OPTIMIZER_STEP]
        for hook, uses, defers in self._step_plan:
            result = hook(ctx, _DO_OPTIMIZER_STEP, will_skip)
            try:
                proceed, _ = result
            except (TypeError, ValueError):
                raise _bad_result(hook, _DO_OPTIMIZER_STEP, result) from None
            if proceed is True:
                if uses and not will_skip and used_by is None:
                    used_by = hook
            else:
                _check_veto(hook, _DO_OPTIMIZER_STEP, proceed, allowed)
                # a deferring veto is a decision taken before acting; any other veto may follow a use
                if uses and not will_skip and used_by is None and not defers:
                    used_by = hook
                will_skip = True
        self._gradients_used_by = used_by
        stepped = False
        if not will_skip:
            stepper = self._stepper
            for name, optimizer, schedulers in self._optimizers:
                if stepper is None:
                    optimizer.step()
                    this_stepped = True
                else:
                    this_stepped = stepper.step_optimizer(ctx, name, optimizer)  # type: ignore[attr-defined]
                    if this_stepped is not True and this_stepped is not False:
                        raise TypeError(
                            f"update hook {hook_label(stepper)}: step_optimizer() must return a bool "
                            f"(whether optimizer {name!r} stepped), got {this_stepped!r}"
                        )
                if this_stepped:
                    stepped = True
                    self.stepped_at_batch = ctx.batch_count
                    for scheduler in schedulers:
                        scheduler.step()
        ctx.step_skipped = not stepped
        return stepped

    @hookimpl
    def after_optimizer_step(self, ctx: TrainingContext) -> None:
        """Tell every hook whether the step happened."""
        will_skip = ctx.step_skipped
        for hook in self._after_step_hooks:
            hook(ctx, _AFTER_OPTIMIZER_STEP, will_skip)

    def abort_batch(self, pending: BaseException) -> None:
        """A micro-batch raised ``pending``: let every hook leave what it opened for it (an autocast region).

        The strategy calls this before the exception reaches its caller, so no per-batch
        state outlives the failed batch. Every hook is asked, in reverse call order; a hook
        whose ``abort_batch()`` fails adds a note to ``pending`` instead of hiding it.
        """
        for hook in self._abort_order:
            try:
                hook.abort_batch()
            except Exception as err:  # noted on the exception on its way out, never dropped
                pending.add_note(
                    f"while aborting the failed batch, update hook {hook_label(hook)}.abort_batch() raised "
                    f"{type(err).__name__}: {err}"
                )

    def __repr__(self) -> str:
        return f"TrainingUpdateOrchestrator({[hook_label(h) for h in self.hooks]})"


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def _first_veto(
    hooks: tuple[TrainingUpdateHook, ...], ctx: TrainingContext, stage: TrainingStage, allowed: frozenset[int]
) -> TrainingUpdateHook | None:
    """Ask every hook in order, each told whether an earlier one vetoed; return the first that vetoed."""
    vetoer = None
    for hook in hooks:
        result = hook(ctx, stage, vetoer is not None)
        try:
            proceed, _ = result
        except (TypeError, ValueError):
            raise _bad_result(hook, stage, result) from None
        if proceed is not True:
            _check_veto(hook, stage, proceed, allowed)
            if vetoer is None:
                vetoer = hook
    return vetoer


def _check_veto(hook: object, stage: TrainingStage, proceed: object, allowed: frozenset[int]) -> None:
    """A veto must be a real ``False`` from a hook that declared it may veto ``stage``."""
    if proceed is not False:
        raise TypeError(
            f"update hook {hook_label(hook)} at stage {stage.name} must return proceed as a strict "
            f"bool (True or False), got {type(proceed).__name__}: {proceed!r}"
        )
    if id(hook) not in allowed:
        raise TypeError(
            f"update hook {hook_label(hook)} vetoed stage {stage.name}, but its 'vetoes' declaration "
            f"({sorted(s.name for s in getattr(hook, 'vetoes', None) or ())}) does not include it; "
            "declare every stage a hook may veto, so compositions are checked against it"
        )


def _raise_for_unusable_loss(loss: torch.Tensor, err: RuntimeError) -> None:
    """After ``loss.backward()`` failed: a loss the run cannot back-propagate is named in the training loop's
    terms (torch's message does not name the loss function); any other failure is left to propagate."""
    if loss.numel() != 1:
        raise ValueError(
            f"stage DO_BACKWARD: the loss must be a single value, got a tensor of shape {tuple(loss.shape)}; "
            "check loss_fn (reduce per-sample losses with .mean() or reduction='mean')"
        ) from err
    if not loss.requires_grad:
        raise ValueError(
            "stage DO_BACKWARD: the loss does not require grad, so nothing can be back-propagated; check loss_fn "
            "(a loss computed under torch.no_grad(), detached, or from a model with no trainable parameters)"
        ) from err


def _bad_result(hook: object, stage: TrainingStage, result: object) -> TypeError:
    expected = "(proceed, loss) with loss a torch.Tensor" if stage is _DO_BACKWARD else "(proceed, loss)"
    return TypeError(
        f"update hook {hook_label(hook)} at stage {stage.name} must return a 2-tuple {expected}, "
        f"got {type(result).__name__}: {result!r}"
    )


def _vetoed(votes: list[Any], voters: Callable[[], list[str]]) -> bool:
    """Whether BEFORE_BATCH's bus results hold a veto; anything but True/False/None is an error."""
    vetoed = False
    for vote in votes:
        if vote is False:
            vetoed = True
        elif vote is not True:
            raise TypeError(
                f"stage BEFORE_BATCH: one of {voters()} returned {type(vote).__name__} {vote!r}; "
                "expected False (veto gradient zeroing), True or None (no veto)"
            )
    return vetoed


def _check_decide_then_act(step_hooks: Sequence[TrainingUpdateHook]) -> None:
    """Refuse a DO_OPTIMIZER_STEP order in which a hook could act on gradients it must not act on yet.

    Two orders are refused: a veto that defers the step (accumulation) after a hook
    that used the gradients (an accumulating micro-batch would leave gradients
    already acted on, and the next micro-batch's would be added at another scale);
    and a hook that uses the gradients before the hook that rescales them (it would
    clip or measure gradients multiplied by the fp16 loss scale).
    """
    first_user: TrainingUpdateHook | None = None
    rescaler = next((h for h in step_hooks if getattr(h, "rescales_gradients", False)), None)
    for hook in step_hooks:
        if first_user is not None and defers_step(hook):
            user, label = hook_label(first_user), hook_label(hook)
            raise ValueError(
                f"update hooks {label} (priority {hook.priority}) and {user} (priority "
                f"{first_user.priority}) cannot be composed in this order: at stage DO_OPTIMIZER_STEP "
                f"{user} uses the gradients (unscales, clips or measures them) before {label}, which may "
                f"veto the step to keep accumulating, so gradients acted on for a step that does not happen "
                f"would be accumulated into. Give {label} a priority below {first_user.priority} (gradient "
                f"accumulation runs at 10){_undeclared_hint(hook)}; or, if its veto abandons the step (the next "
                f"micro-batch zeroes the gradients), declare veto_discards = True on it; or, if {user} does not "
                "touch the gradients, declare uses_gradients = False on it."
            )
        if rescaler is not None and hook is rescaler:
            rescaler = None  # every hook from here on sees unscaled gradients
        elif rescaler is not None and uses_gradients(hook):
            user, label = hook_label(hook), hook_label(rescaler)
            raise ValueError(
                f"update hooks {user} (priority {hook.priority}) and {label} (priority {rescaler.priority}) "
                f"cannot be composed in this order: at stage DO_OPTIMIZER_STEP {user} uses the gradients "
                f"before {label} unscales them, so it would clip or measure gradients multiplied by the loss "
                f"scale. Give {user} a priority above {rescaler.priority} (clipping runs at 30, spike skipping "
                f"at 40){_undeclared_hint(hook)}; or, if it does not touch the gradients, declare "
                "uses_gradients = False on it."
            )
        if first_user is None and uses_gradients(hook):
            first_user = hook


def _let_hooks_check(step_hooks: Sequence[TrainingUpdateHook]) -> None:
    """Each hook's own ``check_composition(step_hooks)``: what it needs of the hooks before it (spike
    skipping: clipping hooks whose pre-clip norms add up to the total norm)."""
    for hook in step_hooks:
        check = getattr(hook, "check_composition", None)
        if callable(check):
            check(step_hooks)


def _undeclared_hint(hook: object) -> str:
    if getattr(hook, "uses_gradients", None) is not None:
        return ""
    return (
        f", and note that {hook_label(hook)} declares no uses_gradients, so it is assumed to use them: "
        "declare uses_gradients = False on it if it decides from counters alone, as an accumulation hook does"
    )


def _kind(exclusive_key: object) -> str:
    """What an exclusive key calls its hooks in a message: ``"mixed_precision"`` -> ``"mixed-precision"``."""
    return str(exclusive_key).replace("_", "-")


def _check_composition(hooks: Sequence[object]) -> None:
    seen: dict[int, object] = {}
    exclusive: dict[str, object] = {}
    steppers: list[object] = []
    for hook in hooks:
        if isinstance(hook, TrainingUpdateOrchestrator):
            raise ValueError(
                "cannot nest a TrainingUpdateOrchestrator inside another: only one orchestrator "
                "may own DO_BACKWARD and DO_OPTIMIZER_STEP; compose hooks with '+' instead"
            )
        if not isinstance(hook, TrainingUpdateHook):
            raise TypeError(
                f"TrainingUpdateOrchestrator takes TrainingUpdateHook instances, got {hook_label(hook)}"
            )
        if id(hook) in seen:
            raise ValueError(f"update hook {hook_label(hook)} was given twice; each instance may be composed once")
        seen[id(hook)] = hook
        validate_update_hook(hook)
        key = getattr(hook, "exclusive_key", None)
        if key is not None:
            if key in exclusive:
                raise ValueError(
                    f"update hooks {hook_label(exclusive[key])} and {hook_label(hook)} share the exclusive "
                    f"key {key!r}: at most one {_kind(key)} hook per strategy"
                )
            exclusive[key] = hook
        if callable(getattr(hook, "step_optimizer", None)):
            steppers.append(hook)
    if len(steppers) > 1:
        names = ", ".join(hook_label(h) for h in steppers)
        raise ValueError(f"more than one update hook performs the optimizer step itself: {names}")
