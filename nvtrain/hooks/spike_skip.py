"""Skip optimizer steps whose loss or gradient norm is non-finite or an outlier."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
import torch.distributed as dist

from nvtrain.hook import TrainingUpdateHook
from nvtrain.hooks.clipping import (
    GRAD_NORM,
    PRE_CLIP_NORMS,
    GradientClippingHook,
    OptimizerParameters,
    PreClipNorm,
    total_grad_norm,
)
from nvtrain.stages import TrainingStage
from nvtrain.validators import as_tuple, int_at_least, number_above, refused, satisfies, strict_int

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["SpikeSkipHook"]

_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_SIGNALS = ("loss", "grad_norm")
#: The most values ``window`` may keep per monitored signal: each is a float held in memory and in the
#: hook's state (a checkpoint), and a deque cannot be longer than ``sys.maxsize`` at all.
_MAX_WINDOW = 1_000_000
_window_size = satisfies(
    f"an int >= 2 and <= {_MAX_WINDOW} (the last accepted steps the statistics cover)",
    lambda v: isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= _MAX_WINDOW,
)


def _as_tuple(value: Any) -> Any:
    """A name or names as a tuple (an iterable that cannot be iterated, a 0-d tensor, is refused here); anything
    else unchanged, for the validator to refuse."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        return value
    return as_tuple(value, "SpikeSkipHook", "monitor", f"one or both of {_SIGNALS}")


def _monitor(instance: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    valid = isinstance(value, tuple) and bool(value) and all(isinstance(v, str) and v in _SIGNALS for v in value)
    if not valid or len(set(value)) != len(value):
        owner, expected = type(instance).__name__, f"one or both of {_SIGNALS}, each once"
        message = f"{owner}.{attribute.name} must name {expected} (got {value!r})"
        raise refused(owner, attribute.name, value, expected, message=message)


class RollingStats:
    """Mean and standard deviation of the last ``size`` values, in O(1) per value.

    Running sums are kept relative to a shift (the mean at the last exact
    recomputation), and recomputed exactly with ``math.fsum`` every ``size``
    values, so rounding cannot drift over a long run.
    """

    __slots__ = ("_shift", "_since_exact", "_sum", "_sumsq", "values")

    def __init__(self, size: int, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque((float(v) for v in values), maxlen=size)
        self._recompute()

    def append(self, value: float) -> None:
        values = self.values
        if not values:
            self._shift = value  # sums are relative to a typical value, not to 0
        elif len(values) == values.maxlen:
            old = values[0] - self._shift
            self._sum -= old
            self._sumsq -= old * old
        values.append(value)
        new = value - self._shift
        self._sum += new
        self._sumsq += new * new
        self._since_exact += 1
        if self._since_exact >= values.maxlen:  # type: ignore[operator]
            self._recompute()

    def limit(self, sigmas: float) -> float:
        """``mean + sigmas * std`` (population std); ``inf`` with fewer than two values."""
        n = len(self.values)
        if n < 2:
            return math.inf
        mean = self._sum / n
        variance = max(self._sumsq / n - mean * mean, 0.0)
        return self._shift + mean + sigmas * math.sqrt(variance)

    def recompute(self) -> None:
        """The sums again from the values, exactly (after values were taken out)."""
        self._recompute()

    def _recompute(self) -> None:
        values = self.values
        self._shift = math.fsum(values) / len(values) if values else 0.0
        self._sum = math.fsum(v - self._shift for v in values)
        self._sumsq = math.fsum((v - self._shift) ** 2 for v in values)
        self._since_exact = 0


@attrs.define(eq=False)
class SpikeSkipHook(TrainingUpdateHook):
    """Veto the optimizer step when the loss or the gradient norm spikes.

    At the end of each window (``ctx.sync_gradients``) whose step no earlier hook
    vetoed, the step is skipped when a monitored value is non-finite, or, once
    ``warmup_steps`` steps were accepted, exceeds ``mean + threshold_sigmas * std``
    of the last ``window`` accepted values. Skipped values never enter the
    statistics. The loss is the mean of the window's micro-batch losses (before
    any loss scaling); the gradient norm is that of all optimizers' gradients
    before any clipping: what the GradientClippingHooks (priority 30) measured
    before they clipped, with the unclipped rest's norm added, or this hook's
    own ``norm_type`` norm when nothing clipped. Clipping hooks whose measures
    cannot add up (overlapping ``model_keys``, other norm types) are refused.

    Rank-consistent: under torch.distributed one ``all_reduce`` of a small
    ``world_size x signals`` table (each rank fills its own row) gives every rank
    every rank's values; each rank then takes the same decision (skip if any
    rank's value is non-finite or over the limit) and keeps the same statistics
    (of the mean over ranks). Every hook before this one must veto identically
    on all ranks.

    Cost: one host-device synchronisation per optimizer step (reading that table
    back), none on accumulating micro-batches. The other built-in update policies
    never synchronise.

    ``ctx.metrics["skipped_steps"]`` holds the number of steps this hook skipped
    (a CPU tensor). The statistics and counts are part of ``state_dict()``.
    """

    plugin_name: ClassVar[str] = "spike_skip"
    stages: ClassVar[frozenset[TrainingStage]] = frozenset({_DO_OPTIMIZER_STEP})
    exclusive_key: ClassVar[str | None] = "spike_skip"
    vetoes = frozenset({_DO_OPTIMIZER_STEP})
    uses_gradients = True  # measures their norm
    veto_discards = True  # a skipped step's gradients are dropped, never accumulated into

    #: Skip when a value exceeds mean + threshold_sigmas * std of the recent accepted values.
    threshold_sigmas: float = attrs.field(default=6.0, validator=number_above(0, finite=True))
    #: How many recent accepted steps the statistics cover.
    window: int = attrs.field(default=100, validator=_window_size)
    #: Accepted steps before the threshold applies (non-finite values are skipped from the start).
    warmup_steps: int = attrs.field(default=20, validator=int_at_least(2))
    #: Which values to watch: "loss", "grad_norm", or both.
    monitor: tuple[str, ...] = attrs.field(default=_SIGNALS, converter=_as_tuple, validator=_monitor)
    #: Norm used when no clipping hook computed the gradient norm already.
    norm_type: float = attrs.field(default=2.0, validator=number_above(0, example="2.0 or float('inf')"))
    #: Process group of the deciding collective; None is the default group.
    process_group: Any = None
    priority: int = attrs.field(default=40, validator=strict_int)

    _loss_stats: RollingStats = attrs.field(init=False, repr=False)
    _norm_stats: RollingStats = attrs.field(init=False, repr=False)
    _accepted: int = attrs.field(init=False, default=0, repr=False)
    _skipped: int = attrs.field(init=False, default=0, repr=False)
    _window_loss: torch.Tensor | None = attrs.field(init=False, default=None, repr=False)
    _window_count: int = attrs.field(init=False, default=0, repr=False)
    #: ``ctx.metrics["skipped_steps"]`` is republished only on a skip; a restored count must replace it too.
    _metric_stale: bool = attrs.field(init=False, default=False, repr=False)
    _watch_loss: bool = attrs.field(init=False, repr=False)
    _watch_norm: bool = attrs.field(init=False, repr=False)
    _params: OptimizerParameters = attrs.field(init=False, repr=False)
    #: Which clipping hooks' parameter lists ``_rest`` was worked out for.
    _parts_key: tuple[int, ...] = attrs.field(init=False, default=(), repr=False)
    #: The parameters no clipping hook measured (they are unclipped when this hook judges).
    _rest: list[torch.Tensor] = attrs.field(init=False, factory=list, repr=False)
    #: ``(ctx, ctx.batch_count, [(stats, value the append evicted)])`` of the latest accepted step, to undo.
    _accepted_here: tuple[Any, int, list[tuple[RollingStats, float | None]]] | None = attrs.field(
        init=False, default=None, repr=False, on_setattr=attrs.setters.NO_OP
    )
    #: Whether the latest decision skipped the step.
    last_skipped: bool = attrs.field(init=False, default=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._loss_stats = RollingStats(self.window)
        self._norm_stats = RollingStats(self.window)
        self._watch_loss = "loss" in self.monitor
        self._watch_norm = "grad_norm" in self.monitor
        self._params = OptimizerParameters(None, "SpikeSkipHook")

    @property
    def skipped_steps(self) -> int:
        """Steps this hook has skipped so far."""
        return self._skipped

    @property
    def accepted_steps(self) -> int:
        """Steps this hook let through (their values are in the statistics)."""
        return self._accepted

    def thresholds(self) -> tuple[float, float]:
        """Current (loss, grad_norm) limits; ``inf`` while warming up or for an unmonitored value."""
        if self._accepted < self.warmup_steps:
            return math.inf, math.inf
        sigmas = self.threshold_sigmas
        return self._loss_stats.limit(sigmas), self._norm_stats.limit(sigmas)

    def __call__(self, ctx: TrainingContext, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage is not _DO_OPTIMIZER_STEP:
            return True, None
        if self._watch_loss:
            loss = ctx.loss.detach().float()  # type: ignore[union-attr]
            if ctx.window_position == 0 or self._window_loss is None:  # a window left open is abandoned, not added
                self._window_loss, self._window_count = loss, 1
            else:
                self._window_loss, self._window_count = self._window_loss + loss, self._window_count + 1
        if not ctx.sync_gradients:
            return True, None  # inside an accumulation window: nothing to decide yet
        window_loss, count = self._window_loss, self._window_count
        self._window_loss, self._window_count = None, 0
        if will_skip:
            return True, None  # an earlier hook vetoed: no step to judge
        skip = self._decide(ctx, None if window_loss is None else window_loss / count)
        self.last_skipped = skip
        if skip:
            self._skipped += 1
        if skip or self._metric_stale or "skipped_steps" not in ctx.metrics:
            ctx.metrics["skipped_steps"] = torch.tensor(self._skipped)
            self._metric_stale = False
        return not skip, None

    def _decide(self, ctx: TrainingContext, loss: torch.Tensor | None) -> bool:
        """Gather every rank's values (one collective), read them once, decide on the host."""
        values: list[torch.Tensor] = []
        stats: list[RollingStats] = []
        if loss is not None:
            values.append(loss)
            stats.append(self._loss_stats)
        if self._watch_norm:
            norm = self._grad_norm(ctx).float()
            values.append(norm if loss is None else norm.to(loss.device))
            stats.append(self._norm_stats)
        local = torch.stack(values)
        group = self.process_group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            table = local.new_zeros(dist.get_world_size(group), local.numel())
            table[dist.get_rank(group)] = local
            dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
            rows: list[list[float]] = table.tolist()  # the one host-device sync of this step
        else:
            rows = [local.tolist()]  # the one host-device sync of this step
        if self._accepted >= self.warmup_steps:
            limits = [s.limit(self.threshold_sigmas) for s in stats]
        else:
            limits = [math.inf] * len(stats)
        for row in rows:
            for value, limit in zip(row, limits, strict=True):
                if not math.isfinite(value) or value > limit:
                    return True
        self._accepted += 1
        evicted = []
        for index, stat in enumerate(stats):
            full = len(stat.values) == stat.values.maxlen
            evicted.append((stat, stat.values[0] if full else None))
            stat.append(math.fsum(row[index] for row in rows) / len(rows))
        self._accepted_here = (ctx, ctx.batch_count, evicted)  # taken back if this micro-batch fails
        return False

    def abort_batch(self) -> None:
        """The micro-batch failed after this hook accepted its step (an optimizer step or a later hook
        raised): its step did not happen, so its values leave the statistics they entered."""
        accepted, self._accepted_here = self._accepted_here, None
        if accepted is None:
            return
        ctx, batch, evicted = accepted
        if ctx.batch_count != batch:  # the accepted micro-batch completed; a later one failed before deciding
            return
        self._accepted -= 1
        for stat, value in evicted:
            stat.values.pop()
            if value is not None:
                stat.values.appendleft(value)
            stat.recompute()

    def _grad_norm(self, ctx: TrainingContext) -> torch.Tensor:
        """The norm of the gradients as they were before any clipping hook of this micro-batch clipped them."""
        stash, batch = ctx.stash, ctx.batch_count
        published = stash.get(GRAD_NORM, None)
        if published is not None and published[0] == batch:
            return published[1]  # the first clipping hook measured every parameter: its norm, as it is
        params = self._params(ctx)
        parts = stash.get(PRE_CLIP_NORMS, None)
        if parts is None or parts[0] != batch:  # nothing clipped: the gradients as they are
            return total_grad_norm(params, self.norm_type, has_shards=self._params.has_shards)
        return self._combined_norm(parts[1], params)

    def _combined_norm(self, parts: list[PreClipNorm], params: list[torch.Tensor]) -> torch.Tensor:
        """The total norm from the clipping hooks' pre-clip norms of their parameters and the rest's own."""
        key = (id(params), len(params), *(id(part.params) for part in parts), *(len(part.params) for part in parts))
        if key != self._parts_key:
            self._rest = _unclipped_rest(parts, params)
            self._parts_key = key
        norm_type = parts[0].norm_type
        norms = [part.norm for part in parts]
        if self._rest:
            norms.append(total_grad_norm(self._rest, norm_type, has_shards=self._params.has_shards))
        if len(norms) == 1:
            return norms[0]
        device = norms[0].device
        stacked = torch.stack([norm.to(device, torch.float32) for norm in norms])
        return stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)

    def check_composition(self, ordered: Sequence[TrainingUpdateHook]) -> None:
        """Refuse clipping hooks before this one whose pre-clip norms cannot give the total norm.

        Each clipping hook measures the norm of the gradients it is given; one that clips
        parameters an earlier one clipped measures clipped gradients, and parts measured
        in different norm types do not add up to a norm.
        """
        if not self._watch_norm:
            return
        clippers = [h for h in ordered[: ordered.index(self)] if isinstance(h, GradientClippingHook)]
        if not clippers or clippers[0].model_keys is None:
            return  # nothing clipped before the judgement, or the first clipper measured every parameter
        seen: dict[str, GradientClippingHook] = {}
        for hook in clippers:
            label = _clipper_label(hook)
            if hook.norm_type != clippers[0].norm_type:
                raise ValueError(
                    f"SpikeSkipHook judges the gradient norm before clipping, from what each clipping hook "
                    f"measured, but {_clipper_label(clippers[0])} measures a {clippers[0].norm_type} norm and "
                    f"{label} a {hook.norm_type} norm, which do not add up to one norm: give them the same "
                    f"norm_type, or monitor only the loss (monitor=('loss',))"
                )
            overlap = seen.keys() if hook.model_keys is None else [k for k in hook.model_keys if k in seen]
            if overlap:
                earlier = _clipper_label(seen[next(iter(overlap))])
                raise ValueError(
                    f"SpikeSkipHook judges the gradient norm before clipping, but {label} clips gradients that "
                    f"{earlier} clipped before it, so the norm it measures is of clipped gradients and the "
                    "spike would be hidden: give each clipping hook its own model_keys, clip everything in "
                    "the first one (no model_keys), or monitor only the loss (monitor=('loss',))"
                )
            seen.update(dict.fromkeys(hook.model_keys or (), hook))

    # -- resume ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_history": list(self._loss_stats.values),
            "norm_history": list(self._norm_stats.values),
            "accepted_steps": self._accepted,
            "skipped_steps": self._skipped,
            # a window left open by standalone train_batch() calls: its losses so far (the mean is judged)
            "window_loss": None if self._window_loss is None else self._window_loss.clone(),
            "window_count": self._window_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss_stats = RollingStats(self.window, state["loss_history"])
        self._norm_stats = RollingStats(self.window, state["norm_history"])
        self._accepted = int(state["accepted_steps"])
        self._skipped = int(state["skipped_steps"])
        self._metric_stale = True
        window_loss = state.get("window_loss")  # absent from states saved before windows were kept
        self._window_loss = None if window_loss is None else torch.as_tensor(window_loss).float().clone()
        self._window_count = int(state.get("window_count", 0)) if window_loss is not None else 0


def _clipper_label(hook: GradientClippingHook) -> str:
    keys = f"model_keys={hook.model_keys}" if hook.model_keys is not None else "no model_keys"
    return f"GradientClippingHook({keys}, priority {hook.priority})"


def _unclipped_rest(parts: list[PreClipNorm], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` no part measured; refuses parts that share parameters (the later one measured clipped ones)."""
    owners: dict[int, int] = {}
    for index, part in enumerate(parts):
        for tensor in part.params:
            earlier = owners.setdefault(id(tensor), index)
            if earlier != index:
                raise ValueError(
                    f"SpikeSkipHook judges the gradient norm before clipping, but {part.owner} clipped a "
                    f"parameter that {parts[earlier].owner} had clipped before it on this micro-batch (their optimizers "
                    "share it), so the spike would be hidden: clip each parameter in one clipping hook, or "
                    "monitor only the loss (monitor=('loss',))"
                )
    return [tensor for tensor in params if id(tensor) not in owners]
