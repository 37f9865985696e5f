"""Gradient clipping, by total norm or by value, on the steps that really run."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import attrs
import torch
import torch.distributed as dist

from nvtrain.distributed import dtensor_type
from nvtrain.hook import TrainingUpdateHook
from nvtrain.hookspecs import hookimpl
from nvtrain.stages import TrainingStage
from nvtrain.stash import Stash, StashKey
from nvtrain.validators import (
    as_tuple,
    number_above,
    optional_bool,
    optional_number_above,
    optional_str_tuple,
    refused,
    strict_int,
)

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = [
    "GRAD_NORM",
    "PRE_CLIP_NORMS",
    "GradientClippingHook",
    "OptimizerParameters",
    "PreClipNorm",
    "total_grad_norm",
]

_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP

#: ``(ctx.batch_count, total norm)`` of all optimizers' gradients before any clipping, published at
#: DO_OPTIMIZER_STEP by a GradientClippingHook without ``model_keys`` that clips first on this
#: micro-batch, so a later hook (spike skipping) reuses the norm of this very micro-batch instead
#: of computing it again.
GRAD_NORM: StashKey[tuple[int, torch.Tensor]] = StashKey("grad_norm")


class PreClipNorm(NamedTuple):
    """What one clipping hook measured before it clipped: its parameters' gradient norm."""

    params: list[torch.Tensor]
    norm_type: float
    norm: torch.Tensor
    #: The hook, for messages.
    owner: str


#: ``(ctx.batch_count, parts)``: each GradientClippingHook's :class:`PreClipNorm` of this micro-batch,
#: in call order. A hook that judges the gradient norm after clipping (spike skipping) builds the
#: norm of the gradients as they were from these parts and the parameters no hook clipped.
PRE_CLIP_NORMS: StashKey[tuple[int, list[PreClipNorm]]] = StashKey("pre_clip_norms")


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    foreach: bool | None = None,
    *,
    has_shards: bool | None = None,
) -> torch.Tensor:
    """Total ``norm_type`` norm of the gradients of ``parameters``, as a plain tensor (no host sync).

    Gradients that are DTensor shards (FSDP) count with their whole tensor: torch's norm
    of them is a DTensor, reduced over the shards' ranks here (one small all-reduce), so
    every rank gets the norm of the full gradient, as one process would. ``has_shards=False``
    says no parameter is a DTensor (:class:`OptimizerParameters` knows it), which spares a
    look at every gradient on every step; ``True`` or None looks.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if has_shards is False:
        return torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    dtensor = dtensor_type()
    sharded = [g for g in grads if dtensor is not None and isinstance(g, dtensor)]
    if not sharded:
        return torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
    if math.isinf(norm_type):
        norm = _sharded_max_norm(sharded, foreach)
    else:
        norm = torch.nn.utils.get_total_norm(sharded, norm_type, foreach=foreach)
        if dtensor is not None and isinstance(norm, dtensor):
            norm = norm.full_tensor()  # type: ignore[attr-defined]
    plain = [g for g in grads if not (dtensor is not None and isinstance(g, dtensor))]
    if plain:
        rest = torch.nn.utils.get_total_norm(plain, norm_type, foreach=foreach)
        norm = torch.linalg.vector_norm(torch.stack([norm, rest.to(norm.device)]), norm_type)
    return norm


def _sharded_max_norm(grads: list[Any], foreach: bool | None) -> torch.Tensor:
    """The infinity norm of DTensor gradients: each rank's largest local element, the maximum over the shards.

    torch refuses the infinity norm of an empty tensor, and FSDP leaves a rank an empty
    shard of a parameter with fewer rows than ranks (a ``Linear(h, 1)`` head on 2 ranks),
    so the local maxima are taken here, 0 for a rank without elements, and reduced with
    MAX over each mesh dimension the gradients are sharded on (every rank takes part).
    """
    groups: dict[tuple[int, tuple[Any, ...]], list[Any]] = {}
    for grad in grads:
        groups.setdefault((id(grad.device_mesh), tuple(grad.placements)), []).append(grad)
    norms = []
    for members in groups.values():
        local = [grad.to_local() for grad in members]
        filled = [tensor for tensor in local if tensor.numel()]
        if filled:
            norm = torch.nn.utils.get_total_norm(filled, math.inf, foreach=foreach)
        else:
            norm = torch.zeros((), dtype=local[0].dtype, device=local[0].device)
        mesh = members[0].device_mesh
        for dim, placement in enumerate(members[0].placements):
            if placement.is_shard():
                dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        norms.append(norm)
    return norms[0] if len(norms) == 1 else torch.stack(norms).max()


class OptimizerParameters:
    """The parameters of the optimizers built for ``model_keys`` (all when None), once each.

    The list is rebuilt only when the optimizers or their parameter groups change,
    not on every step; so is ``has_shards``, whether any of them is a DTensor (FSDP),
    which spares :func:`total_grad_norm` a look at every gradient on every step.
    """

    __slots__ = ("_groups", "_key", "_params", "has_shards", "model_keys", "owner")

    def __init__(self, model_keys: tuple[str, ...] | None, owner: str) -> None:
        self.model_keys = model_keys
        self.owner = owner
        self._key: tuple[int, ...] = ()
        #: The parameter-group lists the key names by ``id()``, held so that no other list can take one of
        #: those ids while the key stands (a hook reused in a new strategy after the old one was freed).
        self._groups: list[list[torch.Tensor]] = []
        self._params: list[torch.Tensor] = []
        self.has_shards = False

    def __call__(self, ctx: TrainingContext) -> list[torch.Tensor]:
        selected = self._select(ctx.optimizers)
        key = tuple(  # a list comprehension: one call per step, where a generator is one per item
            [
                part
                for optimizer in selected
                for group in optimizer.param_groups
                for part in (id(group["params"]), len(group["params"]))
            ]
        )
        if key != self._key:
            params: dict[torch.Tensor, None] = {}
            groups = [group["params"] for optimizer in selected for group in optimizer.param_groups]
            for group_params in groups:
                params.update(dict.fromkeys(group_params))
            self._key, self._groups, self._params = key, groups, list(params)
            dtensor = dtensor_type()  # loaded before any parameter can be one
            self.has_shards = dtensor is not None and any(isinstance(p, dtensor) for p in self._params)
        return self._params

    def check(self, optimizer_names: Iterable[str]) -> None:
        """Refuse ``model_keys`` naming a model without an optimizer (at SETUP, before the first step)."""
        keys, known = self.model_keys, sorted(optimizer_names)
        missing = [key for key in keys or () if key not in known]
        if missing:
            raise refused(
                self.owner,
                "model_keys",
                keys,
                f"names of models with an optimizer ({known})",
                message=f"{self.owner}.model_keys: no optimizer for model {', '.join(map(repr, missing))} "
                f"(models with an optimizer: {known})",
            )

    def _select(self, optimizers: dict[str, torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        keys = self.model_keys
        if keys is None:
            return list(optimizers.values())
        self.check(optimizers)
        return [optimizers[key] for key in keys]


_model_keys = optional_str_tuple("model names")


def _as_key_tuple(value: Any) -> Any:
    """A name or names as a tuple (an iterable that cannot be iterated, a 0-d tensor, is refused here); anything
    else unchanged, for the validator to refuse."""
    if isinstance(value, str):
        return (value,)
    if value is None or isinstance(value, tuple) or not isinstance(value, Iterable):
        return value
    return as_tuple(value, "GradientClippingHook", "model_keys", "a model name or names, or None")


@attrs.define(eq=False)
class GradientClippingHook(TrainingUpdateHook):
    """Clip gradients right before an optimizer step that will run.

    Give ``max_norm`` (with ``norm_type``, default 2) to rescale the gradients so
    their total norm is at most ``max_norm`` (``torch.nn.utils.clip_grad_norm_``),
    or ``max_value`` to clamp every gradient element into ``[-max_value, max_value]``
    (``torch.nn.utils.clip_grad_value_``). Exactly one of the two.

    It acts at DO_OPTIMIZER_STEP only when no earlier hook vetoed the step
    (``will_skip`` False): not on accumulating micro-batches, and after a
    mixed-precision hook (priority 20) has unscaled the gradients. It never vetoes.

    The clipped set is every optimizer's parameters, or, with ``model_keys``, the
    parameters of the optimizers built for those models (two hooks can clip two
    models with different limits). The total norm before clipping is stored as a
    tensor in ``ctx.metrics["grad_norm"]`` (``"grad_norm/<keys>"`` with
    ``model_keys``); nothing is read back to the host.
    """

    plugin_name: ClassVar[str] = "clip"
    stages: ClassVar[frozenset[TrainingStage]] = frozenset({_DO_OPTIMIZER_STEP})
    vetoes = frozenset()
    uses_gradients = True  # clips them in place

    max_norm: float | None = attrs.field(default=None, validator=optional_number_above(0))
    norm_type: float = attrs.field(default=2.0, validator=number_above(0, example="2.0 or float('inf')"))
    max_value: float | None = attrs.field(default=None, validator=optional_number_above(0))
    model_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_as_key_tuple, validator=_model_keys)
    #: Passed to the torch clipping functions; None lets torch pick the fastest implementation. A bool only:
    #: torch takes any true value (``"no"``) as True.
    foreach: bool | None = attrs.field(default=None, validator=optional_bool)
    priority: int = attrs.field(default=30, validator=strict_int)

    _metric: str = attrs.field(init=False, repr=False)
    _params: OptimizerParameters = attrs.field(init=False, repr=False)
    _label: str = attrs.field(init=False, repr=False)
    #: Where this hook left its pre-clip norms (the strategy's stash), to take them back if the batch fails.
    _stash: Stash | None = attrs.field(init=False, default=None, repr=False, on_setattr=attrs.setters.NO_OP)

    def __attrs_post_init__(self) -> None:
        if (self.max_norm is None) == (self.max_value is None):
            raise ValueError(
                "GradientClippingHook needs exactly one of max_norm (clip the total norm) or max_value "
                f"(clamp each element) (got max_norm={self.max_norm!r}, max_value={self.max_value!r})"
            )
        self._metric = "grad_norm" if self.model_keys is None else "grad_norm/" + "+".join(self.model_keys)
        self._params = OptimizerParameters(self.model_keys, "GradientClippingHook")
        self._label = "GradientClippingHook" + (f"(model_keys={self.model_keys})" if self.model_keys else "")

    @hookimpl
    def setup(self, ctx: TrainingContext) -> None:
        """A model_keys typo is refused at SETUP (``nvtrain validate`` runs it), not at the first step."""
        strategy = getattr(ctx, "strategy", None)
        if self.model_keys is not None and strategy is not None:
            self._params.check(strategy.optimizers)

    def __call__(self, ctx: TrainingContext, stage: TrainingStage, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        if stage is not _DO_OPTIMIZER_STEP or will_skip:
            return True, None
        selection = self._params
        params = selection(ctx)
        # What torch.nn.utils.clip_grad_norm_ does (the total norm, then one multiply), with the norm of
        # DTensor (FSDP) gradients taken over all their shards: clip_grad_norm_ would return it as a DTensor.
        norm = total_grad_norm(params, self.norm_type, self.foreach, has_shards=selection.has_shards)
        if self.max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm, foreach=self.foreach)
        else:
            torch.nn.utils.clip_grad_value_(params, self.max_value, foreach=self.foreach)  # type: ignore[arg-type]
        ctx.metrics[self._metric] = norm
        stash, batch = ctx.stash, ctx.batch_count
        record = stash.get(PRE_CLIP_NORMS, None)
        if record is None or record[0] != batch:  # the first clipping hook of this micro-batch
            record = (batch, [])
            stash[PRE_CLIP_NORMS] = record
            if self.model_keys is None:
                stash[GRAD_NORM] = (batch, norm)
        record[1].append(PreClipNorm(params, self.norm_type, norm, self._label))
        if self._stash is not stash:  # once per strategy, not a write per step
            self._stash = stash
        return True, None

    def abort_batch(self) -> None:
        """The micro-batch failed after clipping: its pre-clip norms go, or the next attempt at it (the same
        ``ctx.batch_count``) would be judged by them."""
        stash, self._stash = self._stash, None
        if stash is not None:
            if PRE_CLIP_NORMS in stash:
                del stash[PRE_CLIP_NORMS]
            if GRAD_NORM in stash:
                del stash[GRAD_NORM]
