"""nvtrain-gradnorm: the total gradient norm of every optimizer step, as a metric.

After each optimizer step that really happened, :class:`GradNormMonitor` puts the
norm of the gradients the optimizer used into ``ctx.metrics["grad_norm"]`` (a
tensor, so nothing waits for the device) and, every ``every`` steps, prints it.
Printing reads the value to the host: that synchronisation happens on those
logging steps only.

    hook = nvtrain.plugins.load("gradnorm", every=100)
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
import torch

import nvtrain

__all__ = ["GradNormMonitor"]


def _int_at_least_one(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GradNormMonitor.{attribute.name} must be an int >= 1 (got {value!r})")


def _positive_norm(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 or value == math.inf):
        raise ValueError(f"GradNormMonitor.{attribute.name} must be a number > 0 or math.inf (got {value!r})")


def _metric_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"GradNormMonitor.{attribute.name} must be a non-empty string (got {value!r})")


@attrs.define(eq=False)  # compared by identity: pluggy tells plugins apart with ==
class GradNormMonitor:
    """Records the gradient norm of each real optimizer step; prints it every ``every`` steps.

    The norm is that of the gradients the optimizer used: after loss-scale unscaling
    and clipping, when those hooks are active. Settings: ``every`` (print period in
    optimizer steps), ``norm_type`` (2.0 for the Euclidean norm, ``math.inf`` for the
    largest absolute entry), ``metric`` (the ``ctx.metrics`` key). Skipped steps (a
    veto, an fp16 overflow) record nothing: their gradients were never applied.
    """

    #: The entry-point name: errors and ``nvtrain plugins`` use it.
    plugin_name: ClassVar[str] = "gradnorm"

    every: int = attrs.field(default=100, validator=_int_at_least_one)
    norm_type: float = attrs.field(default=2.0, validator=_positive_norm)
    metric: str = attrs.field(default="grad_norm", validator=_metric_name)

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_skipped:
            return
        grads = [p.grad for model in ctx.models.values() for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads, self.norm_type)
        ctx.metrics[self.metric] = norm
        if ctx.step_count % self.every == 0:
            # A logging step: reading the value to the host is the point.
            print(f"[gradnorm] step {ctx.step_count}: {self.metric} = {norm.item():.6g}", flush=True)


#: The hook classes this plugin provides; the first is what ``load("gradnorm")`` builds.
__nvtrain_hooks__ = (GradNormMonitor,)
