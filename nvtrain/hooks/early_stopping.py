"""Early stopping: end the run when a validation metric stops improving."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from nvtrain.hookspecs import hookimpl
from nvtrain.validators import float_in_range, int_at_least, one_of, optional_non_empty_str, satisfies

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["EarlyStoppingHook"]

logger = logging.getLogger(__name__)

_MODES = ("min", "max")


_monitor_name = satisfies(
    "a non-empty key of the validation summary, e.g. 'loss' or 'accuracy'",
    lambda value: isinstance(value, str) and bool(value.strip()),
)
_mode = one_of(_MODES, "'min' (lower is better, e.g. a loss) or 'max' (higher is better, e.g. accuracy)")


@attrs.define(eq=False)
class EarlyStoppingHook:
    """Ask the run to stop when ``ctx.validation[monitor]`` has not improved for ``patience`` validations.

    At every AFTER_VALIDATION the hook reads the monitored value (a one-element
    tensor, as the validation loop gives it, or a plain number). It improves when
    it is lower than the best so far by more than ``min_delta`` (``mode="min"``)
    or higher by more than ``min_delta`` (``mode="max"``); the first finite value
    always improves. A NaN or infinite value never improves. After ``patience``
    validations in a row without improvement the hook calls
    ``ctx.request_stop(...)``: the run ends at the next step boundary, after its
    checkpoint, and ``RunResult.stop_reason`` says why. ``patience=0`` stops at
    the first validation that does not improve.

    The best value and the count of validations without improvement are in
    ``state_dict()``, so a resumed run keeps counting where the saved one was.
    Two hooks (say one watching the loss, one the accuracy) need a ``state_key``
    on at least one of them, so that a checkpoint keeps their states apart.
    A standalone ``strategy.validate()`` outside ``run()`` is counted too, but
    there is no run to stop then.

    Under ``torch.distributed`` the hook judges the monitored value averaged over the
    ranks inside ``run()`` (one all-reduce per validation, as a metric-driven LR scheduler
    does): every rank decides alike and keeps the same state, which a rank-0 checkpoint
    then holds for all, so a resumed run stops where the straight one did. A standalone
    ``validate()`` is judged on the rank's own value.
    """

    plugin_name: ClassVar[str] = "early_stopping"

    #: Key of the validation summary to watch (``"loss"``, or a metric name such as ``"accuracy"``).
    monitor: str = attrs.field(default="loss", validator=_monitor_name)
    #: ``"min"``: lower is better; ``"max"``: higher is better.
    mode: str = attrs.field(default="min", validator=_mode)
    #: Validations in a row without improvement before the run is stopped.
    patience: int = attrs.field(default=3, validator=int_at_least(0))
    #: The smallest change that counts as an improvement (>= 0, finite).
    min_delta: float = attrs.field(default=0.0, validator=float_in_range(0.0, math.inf, include_low=True))
    #: Tells two early-stopping hooks apart in a checkpoint (key ``early_stopping:<state_key>``); None
    #: keeps the key ``early_stopping`` of a single hook, so checkpoints written before this field load.
    state_key: str | None = attrs.field(default=None, validator=optional_non_empty_str())

    #: The best value seen so far (None before the first finite one).
    best: float | None = attrs.field(init=False, default=None)
    #: Validations since the last improvement.
    wait: int = attrs.field(init=False, default=0)

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        """Say now what would make the hook a no-op or fail at the first validation: a run that never validates,
        a monitored key its validation summary lacks (unless a hook adds it at AFTER_VALIDATION)."""
        strategy = getattr(ctx, "strategy", None)
        if strategy is None:
            return
        name = type(self).__name__
        why = strategy.why_run_never_validates()
        if why is not None:
            warnings.warn(
                f"{name}(monitor={self.monitor!r}): the run is not set to validate ({why}), so it never stops the run "
                "unless a hook calls validate() during it",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        keys = strategy.validation_keys()
        if self.monitor not in keys:
            warnings.warn(
                f"{name}.monitor={self.monitor!r} is not a key of the validation summary (its keys: "
                f"{', '.join(sorted(keys))}); unless a hook adds it at AFTER_VALIDATION, the first validation "
                "raises. Set monitor to one of them, or add the metric to ValidationConfig.metrics",
                RuntimeWarning,
                stacklevel=2,
            )

    @hookimpl
    def after_validation(self, ctx: TrainingContext) -> None:
        value = self._read(ctx.validation)
        agree = getattr(getattr(ctx, "strategy", None), "mean_over_ranks", None)
        if ctx.windowed and callable(agree):  # inside run(), where every rank validates at this point
            value = agree(value)
        if self._improves(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            reason = (
                f"early stopping: {self.monitor} did not improve on {self._best_text()} "
                f"(mode={self.mode}, min_delta={self.min_delta}) for {self.wait} validation"
                f"{'' if self.wait == 1 else 's'} (patience {self.patience})"
            )
            if ctx.windowed:  # inside run(); a standalone validate() has no run to stop
                logger.info("%s at step %d", reason, ctx.step_count)
                ctx.request_stop(reason)

    def _read(self, summary: Any) -> float:
        name = type(self).__name__
        if not isinstance(summary, dict) or self.monitor not in summary:
            present = ", ".join(map(str, summary)) if isinstance(summary, dict) else "none"
            raise KeyError(
                f"{name}: the validation summary has no {self.monitor!r} to monitor (its keys: {present}); "
                f"set monitor to one of them, or add the metric to the validation metrics"
            )
        value = summary[self.monitor]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(
                    f"{name}: validation value {self.monitor!r} must hold one number (got a tensor of shape "
                    f"{tuple(value.shape)})"
                )
            return float(value.detach().float().item())  # one host read per validation
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError(
            f"{name}: validation value {self.monitor!r} must be a number or a one-element tensor "
            f"(got {type(value).__name__})"
        )

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _best_text(self) -> str:
        return "no finite value" if self.best is None else f"its best {self.best:.6g}"

    # -- resume ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The best value and the count of validations without improvement (and what they measure)."""
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        monitor, mode = state.get("monitor", self.monitor), state.get("mode", self.mode)
        if (monitor, mode) != (self.monitor, self.mode):
            warnings.warn(
                f"EarlyStoppingHook: the saved state watched {monitor!r} (mode {mode!r}), this hook watches "
                f"{self.monitor!r} (mode {self.mode!r}); it starts counting afresh",
                stacklevel=2,
            )
            self.best, self.wait = None, 0
            return
        best = state["best"]
        self.best = None if best is None else float(best)
        self.wait = int(state["wait"])
