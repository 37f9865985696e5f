"""LRSchedule: an LR scheduler factory and when the run steps what it builds.

``TrainingStrategy(lr_schedulers=...)`` takes a factory per optimizer; wrapping it
in :class:`LRSchedule` says when to step the scheduler:

- ``interval="step"`` (the default): after every real optimizer step (never on an
  accumulating, vetoed or overflowed one), by the update orchestrator;
- ``interval="epoch"``: once at the end of every epoch whose data was used up,
  just before AFTER_EPOCH fires (so epoch hooks and checkpoints see the new rate);
- metric-driven (a ``ReduceLROnPlateau``, or a scheduler whose ``step(metrics)`` takes the
  value, given ``monitor``; others are refused):
  after every validation inside ``run()``, with ``ctx.validation[monitor]``
  (default ``"loss"``), never per optimizer step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch

from nvtrain.validators import a_callable, one_of, satisfies

__all__ = ["LRSchedule", "ScheduledLR", "plan_schedules", "steps_with_a_metric"]

Interval = Literal["step", "epoch"]


_callable = a_callable("callable as factory(optimizer)")
_interval = one_of(("step", "epoch"))
_monitor = satisfies(
    "a validation metric name such as 'loss'", lambda value: value is None or (isinstance(value, str) and bool(value))
)


@attrs.frozen
class LRSchedule:
    """A scheduler factory ``factory(optimizer)``, stepped per ``interval`` or by a validation ``monitor``."""

    factory: Callable[[torch.optim.Optimizer], Any] = attrs.field(validator=_callable)
    interval: Interval = attrs.field(default="step", validator=_interval)
    #: The ``ctx.validation`` key a metric-driven scheduler steps with (None: ``"loss"`` for a
    #: ReduceLROnPlateau; any other scheduler is then not metric-driven).
    monitor: str | None = attrs.field(default=None, validator=_monitor)

    def __call__(self, optimizer: torch.optim.Optimizer) -> Any:
        return self.factory(optimizer)


@attrs.frozen
class ScheduledLR:
    """A built scheduler and how the run steps it."""

    name: str
    scheduler: Any
    interval: Interval
    #: The validation key for a metric-driven scheduler, else None.
    metric: str | None


def plan_schedules(schedules: Mapping[str, LRSchedule], built: Mapping[str, Any]) -> tuple[ScheduledLR, ...]:
    """Pair each built scheduler with its stepping rule, refusing an impossible combination."""
    plans = []
    for name, schedule in schedules.items():
        scheduler = built[name]
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        metric = schedule.monitor if schedule.monitor is not None else ("loss" if plateau else None)
        if metric is not None and schedule.interval == "epoch":
            raise ValueError(
                f"TrainingStrategy.lr_schedulers[{name!r}]: a metric-driven scheduler "
                f"({type(scheduler).__name__}, monitor {metric!r}) steps after each validation; "
                "interval='epoch' does not apply (validate every epoch to step it once per epoch)"
            )
        if metric is not None and not steps_with_a_metric(type(scheduler)):
            raise ValueError(
                f"TrainingStrategy.lr_schedulers[{name!r}]: LRSchedule(monitor={metric!r}) makes the scheduler "
                f"step after each validation with that value, but {type(scheduler).__name__}.step() takes no "
                "metric (its argument is an epoch number, so the value would set the rate); leave monitor out "
                "and step it per 'step' or 'epoch', or use a scheduler whose step(metrics) takes the value, "
                "such as ReduceLROnPlateau"
            )
        plans.append(ScheduledLR(name=name, scheduler=scheduler, interval=schedule.interval, metric=metric))
    return tuple(plans)


def steps_with_a_metric(scheduler_class: Any) -> bool:
    """Whether ``scheduler_class.step`` takes a validation value (``ReduceLROnPlateau.step(metrics)``), not
    torch's deprecated ``step(epoch)`` nor nothing at all."""
    try:
        parameters = list(inspect.signature(scheduler_class.step).parameters.values())[1:]  # after self
    except (AttributeError, TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return bool(positional) and positional[0].name != "epoch"
