"""LR schedule helpers: linear warmup in front of any scheduler, and short names for common ones.

:func:`warmup` turns a scheduler factory into one that first ramps the learning
rate up linearly, then hands over::

    import functools, torch, nvtrain
    cosine = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=9_900)
    strategy = nvtrain.TrainingStrategy(..., lr_schedulers=nvtrain.schedules.warmup(cosine, steps=100))

:data:`ALIASES` are the names a config's ``lr_scheduler.factory`` may use instead
of an import path (``factory: cosine``); :func:`resolve` turns one into its factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.optim.lr_scheduler import ConstantLR, LinearLR, OneCycleLR, ReduceLROnPlateau, SequentialLR

from nvtrain.validators import FieldProblem, FieldTypeError, FieldValueError, refused

__all__ = ["ALIASES", "Warmup", "constant", "linear", "resolve", "warmup"]

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

#: Short names for ``lr_scheduler.factory``, each the import path it stands for. Keyword
#: arguments are the target's own; ``T_max`` / ``total_steps`` left out are the run's length.
ALIASES: dict[str, str] = {
    "constant": "nvtrain.schedules:constant",  # the optimizer's lr throughout (useful after a warmup)
    "cosine": "torch.optim.lr_scheduler:CosineAnnealingLR",  # cosine from lr to eta_min over T_max
    "linear": "nvtrain.schedules:linear",  # linear from lr to end_factor * lr (default 0) over total_steps
    "step": "torch.optim.lr_scheduler:StepLR",  # multiply by gamma every step_size
    "exponential": "torch.optim.lr_scheduler:ExponentialLR",  # multiply by gamma at every step
    "onecycle": "torch.optim.lr_scheduler:OneCycleLR",  # the 1cycle policy up to max_lr, over total_steps
    "plateau": "torch.optim.lr_scheduler:ReduceLROnPlateau",  # metric-driven: stepped after each validation
}


def resolve(name: str) -> Any:
    """The scheduler class or function an alias names (``"cosine"`` -> ``CosineAnnealingLR``)."""
    if name not in ALIASES:
        raise KeyError(f"no LR schedule alias {name!r} (aliases: {', '.join(ALIASES)})")
    module, _, attribute = ALIASES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def constant(optimizer: torch.optim.Optimizer) -> ConstantLR:
    """Keep every parameter group at its own learning rate (``ConstantLR`` with factor 1)."""
    return ConstantLR(optimizer, factor=1.0, total_iters=0)


def linear(optimizer: torch.optim.Optimizer, total_steps: int, end_factor: float = 0.0) -> LinearLR:
    """Decay linearly from the optimizer's learning rate to ``end_factor`` times it over ``total_steps``."""
    return LinearLR(optimizer, start_factor=1.0, end_factor=end_factor, total_iters=total_steps)


def _refused(
    instance: Any,
    attribute: attrs.Attribute[Any],
    value: Any,
    expected: str,
    message: str | None = None,
    error: type[FieldProblem] = FieldValueError,
) -> FieldProblem:
    """The error of a warmup setting; messages name ``warmup``, the function users call."""
    if message is None:
        message = f"warmup: {attribute.name} must be {expected} (got {value!r})"
    return refused(type(instance).__name__, attribute.name, value, expected, message=message, error=error)


def _callable(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    expected = "callable as factory(optimizer)"
    if not callable(value):
        raise _refused(instance, attribute, value, expected, error=FieldTypeError)
    if hasattr(value, "interval") and hasattr(value, "factory"):  # an nvtrain.LRSchedule: its interval would be lost
        message = (
            "warmup: factory is an LRSchedule; wrap the warmup in it instead: "
            "nvtrain.LRSchedule(nvtrain.schedules.warmup(factory, steps=...), interval=...)"
        )
        raise _refused(instance, attribute, value, f"{expected}, not an LRSchedule", message, FieldTypeError)


def _steps(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refused(instance, attribute, value, "an int >= 1")


def _start_factor(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value <= 1.0:
        raise _refused(instance, attribute, value, "in (0.0, 1.0]")


@attrs.frozen
class Warmup:
    """A scheduler factory: linear warmup over ``steps`` scheduler steps, then ``factory``'s scheduler.

    Build it with :func:`warmup`. Called with an optimizer it returns a
    ``SequentialLR`` of ``LinearLR(start_factor, 1.0, total_iters=steps)`` and
    ``factory(optimizer)`` with the milestone at ``steps``.
    """

    factory: SchedulerFactory = attrs.field(validator=_callable)
    steps: int = attrs.field(validator=_steps)
    start_factor: float = attrs.field(default=1e-3, validator=_start_factor)

    def __call__(self, optimizer: torch.optim.Optimizer) -> SequentialLR:
        ramp = LinearLR(optimizer, start_factor=self.start_factor, end_factor=1.0, total_iters=self.steps)
        after = self.factory(optimizer)
        if isinstance(after, ReduceLROnPlateau):
            raise TypeError(
                "warmup: a ReduceLROnPlateau cannot follow a warmup (SequentialLR cannot pass it the metric); "
                "use a warmup with a step or epoch schedule, or ReduceLROnPlateau alone"
            )
        if isinstance(after, OneCycleLR):
            raise TypeError(
                "warmup: a OneCycleLR cannot follow a warmup: it ramps the LR up itself (from max_lr / div_factor "
                "over pct_start of its steps) and overwrites the rate the warmup ramps to; shape its ramp with "
                "pct_start and div_factor instead, or follow the warmup with a cosine or linear schedule"
            )
        if getattr(after, "optimizer", optimizer) is not optimizer:
            raise ValueError("warmup: factory(optimizer) built a scheduler for another optimizer")
        return SequentialLR(optimizer, [ramp, after], milestones=[self.steps])


def warmup(factory: SchedulerFactory, steps: int, start_factor: float = 1e-3) -> Warmup:
    """Linear warmup for ``steps`` scheduler steps, then the scheduler ``factory`` builds.

    Returns a factory ``optimizer -> SequentialLR``. With base learning rate ``lr``,
    after ``k`` scheduler steps the rate is:

    - ``k < steps``: ``lr * (start_factor + (1 - start_factor) * k / steps)`` (``lr * start_factor`` at 0);
    - ``k >= steps``: what ``factory``'s scheduler gives after ``k - steps`` steps of its own,
      starting from ``lr`` (a cosine schedule is at its peak at ``k == steps``).

    A scheduler step is an optimizer step, or an epoch when the result is wrapped in
    ``nvtrain.LRSchedule(..., interval="epoch")``. A horizon such as ``T_max`` given
    to ``factory`` counts from the end of the warmup. ``ReduceLROnPlateau`` cannot
    follow a warmup (``SequentialLR`` cannot pass it the metric), nor can ``OneCycleLR``
    (it ramps up itself, overwriting the rate the warmup ramps to).
    """
    return Warmup(factory, steps, start_factor)
