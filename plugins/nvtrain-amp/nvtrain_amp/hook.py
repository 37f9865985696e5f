"""MixedPrecisionHook: autocast for the forward and loss, GradScaler for fp16 updates."""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.utils.hooks import RemovableHandle

import nvtrain
from nvtrain import TrainingStage
from nvtrain.validators import float_in_range, int_at_least, number_above, refused, strict_int
from nvtrain_amp.precision import (
    AUTO,
    PRECISION_NAMES,
    Precision,
    as_precision,
    is_precision,
    precision_name,
    precision_validator,
    resolve_auto,
)

__all__ = ["MixedPrecisionHook"]

#: What DTensor says of the one-element tensor the sharded scaler's inf check hands it (see create_sharded_scaler).
_REPLICATED_SCALAR_WARNING = "Found a non-scalar tensor with numel=1 and ndim!=0"
#: The modules DTensor raises it from (warnings' ``module`` filter: a regular expression matched at the start).
_DTENSOR_DISPATCH = r"torch\.distributed\._?tensor\."


def _fits_int64(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    """GradScaler keeps the growth interval in a 64-bit integer; a larger one fails at its first update."""
    if value >= 2**63:
        raise refused(type(instance).__name__, attribute.name, value, "an int below 2**63")


_BEFORE_BATCH = TrainingStage.BEFORE_BATCH
_DO_BACKWARD = TrainingStage.DO_BACKWARD
_DO_OPTIMIZER_STEP = TrainingStage.DO_OPTIMIZER_STEP
_AFTER_OPTIMIZER_STEP = TrainingStage.AFTER_OPTIMIZER_STEP
#: GradScaler's record that it stepped an optimizer this batch (``scaler.step()``), as opposed to only unscaled it.
_STEPPED = torch.amp.grad_scaler.OptState.STEPPED


def _has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optimizer`` holds a gradient: GradScaler records no inf check for one that
    has none, and its ``step()`` then refuses it. Stops at the first gradient (usually the first parameter)."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _any_overflow(scaler: torch.amp.GradScaler, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether the inf checks ``unscale_`` recorded for ``optimizers`` found an inf/NaN (one host read)."""
    flags = [flag.reshape(()) for optimizer in optimizers for flag in scaler._found_inf_per_device(optimizer).values()]
    if not flags:
        return False
    return bool(torch.stack([flag.to(flags[0].device) != 0 for flag in flags]).any())


def _skip_together(scaler: torch.amp.GradScaler, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """One decision per batch: an inf/NaN in any optimizer's gradients skips every optimizer's step.

    GradScaler alone skips each optimizer on its own check, so one model of a pair could step
    while the other did not, and ``ctx.step_skipped`` (EMA, LR schedulers, cadences) could not
    say both. Each optimizer's flag takes the union of all, on the device (no host sync).
    """
    flags = [flag for optimizer in optimizers for flag in scaler._found_inf_per_device(optimizer).values()]
    if len(flags) < 2:
        return
    device = flags[0].device
    overflowed = torch.stack([flag.to(device).reshape(()) != 0 for flag in flags]).any().float()
    for flag in flags:
        flag.copy_(overflowed)  # a sharded scaler's flag is a sum over ranks: 0 or more is all it reads


@attrs.define(eq=False)
class _StepWatcher:
    """Learns whether ``optimizer.step()`` ran, from an optimizer step post-hook (no device sync)."""

    handle: RemovableHandle | None = None
    stepped: bool = False

    def mark(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.stepped = True


@attrs.define(eq=False)
class MixedPrecisionHook(nvtrain.TrainingUpdateHook):
    """Runs the forward and loss under autocast and, for fp16, scales the loss with GradScaler.

    ``precision`` (default ``"auto"``): ``torch.float32`` (no autocast, no scaler),
    ``torch.bfloat16`` (autocast, no scaler), ``torch.float16`` (autocast and a
    GradScaler), as dtypes, as ``"float32"``/``"bfloat16"``/``"float16"`` or as
    ``"fp32"``/``"bf16"``/``"fp16"``; ``"auto"`` picks bf16 on CUDA (fp16 on a CUDA
    device without bf16) and fp32 elsewhere once the strategy's device is known. The GradScaler settings are
    used only for fp16.

    Autocast is entered at BEFORE_BATCH and left at DO_BACKWARD, before the
    orchestrator calls ``backward()``. Under fp16 the loss is scaled at
    DO_BACKWARD; gradients are unscaled at DO_OPTIMIZER_STEP only when no earlier
    hook vetoed the step (so clipping and spike detection at priorities 30/40 see
    real gradients); ``scaler.step`` runs in :meth:`step_optimizer`, and
    ``scaler.update`` at AFTER_OPTIMIZER_STEP whenever this batch unscaled. A
    GradScaler inf/NaN skip is reported as a skipped step. An optimizer whose
    parameters have no gradients on a batch is stepped as in fp32 (unless the batch
    overflowed); a batch that raises closes its autocast region (:meth:`abort_batch`).
    """

    plugin_name: ClassVar[str] = "amp"
    exclusive_key: ClassVar[str | None] = "mixed_precision"
    stages: ClassVar[frozenset[TrainingStage]] = frozenset(
        {_BEFORE_BATCH, _DO_BACKWARD, _DO_OPTIMIZER_STEP, _AFTER_OPTIMIZER_STEP}
    )
    vetoes = frozenset()

    precision: Precision = attrs.field(default=AUTO, converter=as_precision, validator=precision_validator)
    init_scale: float = attrs.field(default=2.0**16, validator=number_above(0, finite=True))
    growth_factor: float = attrs.field(default=2.0, validator=number_above(1.0, finite=True))
    backoff_factor: float = attrs.field(default=0.5, validator=float_in_range(0.0, 1.0))
    growth_interval: int = attrs.field(default=2000, validator=[int_at_least(1), _fits_int64])
    priority: int = attrs.field(default=20, validator=strict_int)

    _dtype: torch.dtype | None = attrs.field(init=False, default=None, repr=False)
    _device_type: str | None = attrs.field(init=False, default=None, repr=False)
    _scaler: torch.amp.GradScaler | None = attrs.field(init=False, default=None, repr=False)
    #: The training autocast region, built once the dtype is known (None for fp32) and entered per batch.
    _training_autocast: torch.autocast | None = attrs.field(init=False, default=None, repr=False)
    # Flags flipped on every batch: plain attribute writes (no attrs validation pipeline on the hot path).
    _autocast_open: bool = attrs.field(init=False, default=False, repr=False, on_setattr=attrs.setters.NO_OP)
    #: The optimizers this batch unscaled (those with gradients); empty: none, so no ``update()`` is due.
    _unscaled: tuple[torch.optim.Optimizer, ...] = attrs.field(
        init=False, default=(), repr=False, on_setattr=attrs.setters.NO_OP
    )
    #: Whether this batch's fp16 step happened, once a scaler step has told (None: not known yet).
    _batch_stepped: bool | None = attrs.field(init=False, default=None, repr=False, on_setattr=attrs.setters.NO_OP)
    _watchers: weakref.WeakKeyDictionary[torch.optim.Optimizer, _StepWatcher] = attrs.field(
        init=False, factory=weakref.WeakKeyDictionary, repr=False
    )
    _pending_scaler_state: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)
    _saved_precision: str | None = attrs.field(init=False, default=None, repr=False)
    _overflow_skips: torch.Tensor | None = attrs.field(init=False, default=None, repr=False)
    #: fp16 resolved and the scaler not built yet (it is, at the next BEFORE_BATCH).
    _scaler_due: bool = attrs.field(init=False, default=False, repr=False)

    # -- what the rest of the framework reads ---------------------------------------------

    @property
    def uses_gradients(self) -> bool:  # type: ignore[override]
        """Under fp16 it unscales the gradients at DO_OPTIMIZER_STEP; bf16 and fp32 leave them alone."""
        return self._may_be_fp16()

    @property
    def rescales_gradients(self) -> bool:  # type: ignore[override]
        """Under fp16 every other hook that uses gradients must run after the unscale."""
        return self._may_be_fp16()

    def _may_be_fp16(self) -> bool:
        """fp16 once resolved; before that, also ``"auto"``: it resolves to fp16 on a CUDA device without bf16,
        so a composition is checked as fp16 until the device is known (and exactly from SETUP on)."""
        if self._dtype is not None:
            return self._dtype == torch.float16
        return self.precision == torch.float16 or self.precision == AUTO

    @property
    def dtype(self) -> torch.dtype | None:
        """The precision in effect: the configured dtype, or what ``"auto"`` resolved to (else None)."""
        if self._dtype is not None:
            return self._dtype
        return None if self.precision == AUTO else self.precision  # type: ignore[return-value]

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 GradScaler once created (at the first batch, when the models are wrapped or sharded);
        None for bf16 / fp32."""
        return self._scaler

    def create_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """Build the fp16 GradScaler for ``device_type``; override to substitute another scaler.

        It must be a ``torch.amp.GradScaler`` (a subclass is fine): the hook reads the inf checks it
        recorded per optimizer (one skip decision for all optimizers, the ``overflow_skips`` metric)
        and its scale tensor (``loss_scale``) on the device, without a host sync.
        """
        return torch.amp.GradScaler(device_type, **self._scaler_settings())

    def create_sharded_scaler(self, device_type: str, process_group: Any) -> torch.amp.GradScaler:
        """Build the fp16 scaler for models sharded with FSDP (DTensor parameters): torch's
        ``ShardedGradScaler``, whose inf/NaN check is all-reduced over ``process_group``, so every rank
        skips the same steps. Override to substitute another (a ``torch.amp.GradScaler`` subclass)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # Its inf check hands a plain one-element tensor to an op over DTensor gradients; DTensor warns that it
        # treats it as replicated, which is what the scaler means (it all-reduces the result itself). One filter,
        # for DTensor's dispatch alone: entering warnings.catch_warnings() around every step would cost each step
        # and reset every call site's once-only warnings, so a user's warning would show again at every step.
        warnings.filterwarnings("ignore", message=_REPLICATED_SCALAR_WARNING, module=_DTENSOR_DISPATCH)
        return ShardedGradScaler(device_type, process_group=process_group, **self._scaler_settings())

    def _scaler_settings(self) -> dict[str, Any]:
        return {
            "init_scale": float(self.init_scale),
            "growth_factor": float(self.growth_factor),
            "backoff_factor": float(self.backoff_factor),
            "growth_interval": self.growth_interval,
        }

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A fresh autocast context for this precision (validation uses it); a no-op for fp32.

        The device type is the strategy's once the hook has seen it (SETUP); before
        that, CUDA when available, else CPU, which is the strategy's own default.
        """
        device_type = self._device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = self.dtype or resolve_auto(torch.device(device_type))
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=dtype)

    # -- lifecycle ---------------------------------------------------------------------------

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Learn the device early, so ``autocast()`` is right for a validation before training."""
        self._resolve(ctx.device)

    def abort_batch(self) -> None:
        """The batch raised: leave its autocast region now, not at the next batch (the caller's code, or a
        ``validate()`` in full precision, would run under it), and settle a scaler the batch unscaled
        (``update()`` when an optimizer stepped, as the step would have; else the unscale is forgotten, the
        batch running again whole), so a state saved now resumes as the run goes on."""
        self._close_autocast()
        self._batch_stepped = None
        self._settle_scaler()

    def close(self) -> None:
        """Leave an autocast region an exception left open; drop the optimizer step watchers."""
        self._close_autocast()
        for watcher in list(self._watchers.values()):
            if watcher.handle is not None:
                watcher.handle.remove()
        self._watchers.clear()

    # -- the update stages -------------------------------------------------------------------

    def __call__(
        self, ctx: nvtrain.TrainingContext, stage: TrainingStage, will_skip: bool
    ) -> tuple[bool, torch.Tensor | None]:
        if stage == _BEFORE_BATCH:
            self._before_batch(ctx)
        elif stage == _DO_BACKWARD:
            return True, self._do_backward(ctx)
        elif stage == _DO_OPTIMIZER_STEP:
            if not will_skip and self._scaler is not None:
                self._unscale(self._scaler, ctx.optimizers.values())
        elif stage == _AFTER_OPTIMIZER_STEP and self._unscaled:
            # Also after a later hook vetoed the step: update() consumes the inf checks
            # unscale_ recorded and resets the per-optimizer state, so the next unscale_ works.
            self._publish_metrics(ctx)
            self._unscaled = ()
            self._scaler.update()  # type: ignore[union-attr]
        return True, None

    def _unscale(self, scaler: torch.amp.GradScaler, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Unscale the optimizers that have gradients (an optimizer without any has nothing to check and is
        stepped as in fp32, see :meth:`step_optimizer`); an inf/NaN in any of them skips them all."""
        unscaled = tuple(optimizer for optimizer in optimizers if _has_gradients(optimizer))
        done = 0
        try:
            for optimizer in unscaled:
                scaler.unscale_(optimizer)
                done += 1
        finally:  # also when one raises: those unscaled before it are settled (see _settle_scaler)
            self._unscaled = unscaled[:done]  # the tuple itself when all were
        if len(unscaled) > 1:
            _skip_together(scaler, unscaled)
        self._batch_stepped = None

    def _publish_metrics(self, ctx: nvtrain.TrainingContext) -> None:
        """fp16: ``loss_scale`` and ``overflow_skips`` (steps GradScaler skipped for inf/NaN gradients) in
        ``ctx.metrics``, as device tensors the loggers read on logging steps only (no per-step host sync)."""
        scaler = self._scaler
        assert scaler is not None
        found = [
            flag.reshape(()).float()
            for optimizer in self._unscaled
            for flag in scaler._found_inf_per_device(optimizer).values()
        ]
        if not found:
            return
        # any(), not the flags' value: a sharded scaler's flag is the sum of the ranks' (2.0 when two found an inf)
        overflowed = torch.stack([f.to(found[0].device) for f in found]).any()
        skips = self._overflow_skips
        if skips is None:
            skips = self._overflow_skips = torch.zeros((), device=overflowed.device)
        elif skips.device != overflowed.device:  # restored from a checkpoint (on the CPU): once per run
            skips = self._overflow_skips = skips.to(overflowed.device)
        skips.add_(overflowed)
        ctx.metrics["overflow_skips"] = skips
        if scaler._scale is not None:
            ctx.metrics["loss_scale"] = scaler._scale  # updated in place by scaler.update()

    def step_optimizer(self, ctx: nvtrain.TrainingContext, name: str, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` (through the scaler under fp16); return whether it really stepped.

        GradScaler already reads its inf/NaN check to the host inside ``step()`` (one
        sync per device) and calls ``optimizer.step()`` only when it is clean; a step
        post-hook on the optimizer records that call, so knowing the outcome costs no
        further sync. Optimizers that handle scaling in their own kernel
        (``_step_supports_amp_scaling``, e.g. fused Adam) are always called and skip on
        the device; for those the hook reads the inf check once.

        An optimizer none of whose parameters has a gradient (its model unused on this
        batch) is stepped as in fp32, ``optimizer.step()``, unless an inf/NaN in another
        optimizer's gradients skips this batch's step: one decision for every optimizer.
        """
        scaler = self._scaler
        if scaler is None:
            optimizer.step()
            return True
        if optimizer not in self._unscaled:  # identity: optimizers do not define ==, so this is ``is``
            return self._step_without_gradients(scaler, optimizer)
        stepped = self._scaled_step(scaler, optimizer)
        self._batch_stepped = stepped
        return stepped

    def _scaled_step(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
        """``scaler.step(optimizer)``, and whether it called ``optimizer.step()`` (see :meth:`step_optimizer`)."""
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.step(optimizer)
            found = list(scaler._found_inf_per_device(optimizer).values())
            if not found:
                return True
            device = found[0].device
            total = torch.stack([t.to(device) for t in found]).sum()
            return not bool(total)  # the one host sync this path makes
        watcher = self._watcher(optimizer)
        watcher.stepped = False
        scaler.step(optimizer)
        return watcher.stepped

    def _step_without_gradients(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
        """fp32's step for an optimizer without gradients, unless the batch overflowed. Whether it did is
        known once another optimizer stepped; before that it costs one host read (on such batches only)."""
        stepped = self._batch_stepped
        if stepped is None:
            stepped = not _any_overflow(scaler, self._unscaled)
        if stepped:
            optimizer.step()
        return stepped

    # -- checkpoint state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The precision and, for fp16, the scaler state (reading the scale syncs once) and the count of
        steps skipped for overflows so far (a copy of the device tensor: no sync), so a resumed run's
        ``overflow_skips`` metric goes on from there."""
        dtype = self.dtype
        state: dict[str, Any] = {"precision": AUTO if dtype is None else precision_name(dtype)}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        elif self._pending_scaler_state is not None:
            state["scaler"] = dict(self._pending_scaler_state)
        else:
            state["scaler"] = None
        if self._overflow_skips is not None:
            state["overflow_skips"] = self._overflow_skips.detach().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scale and the overflow count; refuse a state saved under another precision.

        Before the scaler exists (no batch yet) the state is kept and applied when
        the scaler is created.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"MixedPrecisionHook.load_state_dict(state) must be a mapping (got {type(state).__name__})")
        if "precision" not in state:
            raise ValueError(
                f"MixedPrecisionHook.load_state_dict: the state has no 'precision' entry (keys: {sorted(state)})"
            )
        skips = state.get("overflow_skips")  # absent from states saved before it was kept: counts from 0
        if skips is not None and not (isinstance(skips, torch.Tensor) and skips.numel() == 1):
            raise ValueError(
                "MixedPrecisionHook.load_state_dict: 'overflow_skips' must be a one-element tensor (the count of "
                f"steps skipped for overflows), got {type(skips).__name__}"
                + (f" of shape {tuple(skips.shape)}" if isinstance(skips, torch.Tensor) else "")
            )
        saved = state["precision"]
        if saved != AUTO:
            self._saved_precision = str(saved)
            if self.dtype is not None:
                self._check_saved_precision(self.dtype)
        self._overflow_skips = None if skips is None else skips.detach().reshape(()).to(torch.float32, copy=True)
        scaler_state = state.get("scaler")
        if scaler_state is None:
            return
        progress = _scaler_progress(scaler_state)
        if self._scaler is not None:
            _apply_progress(self._scaler, progress)
        else:
            self._pending_scaler_state = progress

    # -- internals ----------------------------------------------------------------------------

    def _resolve(self, device: torch.device) -> torch.dtype:
        """Fix the dtype and device type at first sight of the strategy's device."""
        if self._dtype is not None:
            return self._dtype
        dtype = resolve_auto(device) if self.precision == AUTO else self.precision
        assert isinstance(dtype, torch.dtype)
        if self._saved_precision is not None:
            self._check_saved_precision(dtype)
        self._device_type = device.type
        if dtype != torch.float32:
            # One autocast object, entered and left once per batch (torch.autocast keeps the state it
            # restores on the instance, so sequential reuse is exact); its checks and warnings run once.
            self._training_autocast = torch.autocast(device_type=device.type, dtype=dtype)
        if dtype == torch.float16:
            self._scaler_due = True  # created at the first batch: FSDP shards the models after this SETUP
        self._dtype = dtype
        return dtype

    def _create_scaler(self, ctx: nvtrain.TrainingContext) -> None:
        """The scaler for these models: sharded ones (DTensor parameters) need the inf check to agree across ranks."""
        self._scaler_due = False
        _refuse_half_parameters(ctx.optimizers)
        group = _sharding_group(ctx.models.values())
        device_type = ctx.device.type
        if group is None:
            scaler, method = self.create_scaler(device_type), "create_scaler"
        else:
            scaler, method = self.create_sharded_scaler(device_type, group), "create_sharded_scaler"
        _check_scaler(self, method, scaler)
        if self._pending_scaler_state is not None:
            _apply_progress(scaler, self._pending_scaler_state)
            self._pending_scaler_state = None
        self._scaler = scaler

    def _check_saved_precision(self, dtype: torch.dtype) -> None:
        saved, current = self._saved_precision, precision_name(dtype)
        if saved is None:
            return
        named = as_precision(saved.removeprefix("torch."))  # 'fp16', 'torch.float16': the same precision
        if not is_precision(named) or named == AUTO:
            raise ValueError(
                f"MixedPrecisionHook.load_state_dict: the state's precision {saved!r} is none this hook knows "
                f"(expected one of {PRECISION_NAMES})"
            )
        saved = precision_name(named)  # type: ignore[arg-type]
        if saved != current:
            raise ValueError(
                f"MixedPrecisionHook.load_state_dict: the state was saved with precision {saved!r} but this "
                f"hook uses {current!r}; build the hook with precision={saved!r} or do not restore its state"
            )

    def _before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        # Per batch: the checks are inline, the calls happen only when there is something to do.
        if self._autocast_open:  # a batch that raised between BEFORE_BATCH and DO_BACKWARD left it open
            self._close_autocast()
        if self._unscaled:  # a batch that raised after unscale_ where abort_batch() did not run (driven by hand)
            self._settle_scaler()
        if self._dtype is None:
            self._resolve(ctx.device)
        if self._scaler_due:
            self._create_scaler(ctx)
        region = self._training_autocast
        if region is not None:
            region.__enter__()  # left in _close_autocast (DO_BACKWARD, the next batch, or close())
            object.__setattr__(self, "_autocast_open", True)  # per batch: past attrs' __setattr__ (a call)

    def _do_backward(self, ctx: nvtrain.TrainingContext) -> torch.Tensor:
        if self._autocast_open:
            self._close_autocast()
        loss = ctx.loss
        assert loss is not None  # the orchestrator checked it
        if self._dtype is None:
            self._resolve(ctx.device)
        if self._scaler is not None:
            return self._scaler.scale(loss)
        return loss

    def _settle_scaler(self) -> None:
        """Ready the scaler again after a batch that unscaled and did not reach AFTER_OPTIMIZER_STEP.

        When an optimizer stepped, the step is kept (the run counts it), so ``update()`` counts it
        too. When none did, the batch runs again whole: its unscale is forgotten without an
        ``update()``, which would count a clean step and grow the scale one step early.
        """
        scaler = self._scaler
        if self._unscaled and scaler is not None:
            self._unscaled = ()
            stages = [state.get("stage") for state in scaler._per_optimizer_states.values()]
            if _STEPPED in stages:
                scaler.update()
            else:
                scaler._per_optimizer_states.clear()  # a defaultdict: what update() resets it to

    def _close_autocast(self) -> None:
        if self._autocast_open:
            object.__setattr__(self, "_autocast_open", False)
            self._training_autocast.__exit__(None, None, None)  # type: ignore[union-attr]

    def _watcher(self, optimizer: torch.optim.Optimizer) -> _StepWatcher:
        watcher = self._watchers.get(optimizer)
        if watcher is None:
            watcher = _StepWatcher()
            watcher.handle = optimizer.register_step_post_hook(watcher.mark)
            self._watchers[optimizer] = watcher
        return watcher


def _check_scaler(hook: MixedPrecisionHook, method: str, scaler: object) -> None:
    """Refuse a scaler the hook cannot read its per-optimizer inf checks and scale tensor from."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"{type(hook).__name__}.{method}() must return a torch.amp.GradScaler (or an instance of a "
            f"subclass: the hook reads the inf checks and the scale it keeps), got {type(scaler).__name__}"
        )
    if not scaler.is_enabled():
        raise ValueError(
            f"{type(hook).__name__}.{method}() returned a disabled GradScaler (enabled=False, or built for a "
            f"device this machine does not have: torch disables a 'cuda' scaler without CUDA); build it for the "
            f"strategy's device type, torch.amp.GradScaler({hook._device_type!r}, ...), or use precision='bf16'"
        )


def _scaler_progress(saved: Any) -> dict[str, Any]:
    """What a saved GradScaler state carries over: the loss scale reached and the good steps towards its next
    growth. The growth and backoff settings stay the hook's own (its settings are what this run asked for)."""
    where = "MixedPrecisionHook.load_state_dict: the state's 'scaler'"
    if not isinstance(saved, Mapping):
        raise ValueError(f"{where} must be a GradScaler state (a dict), got {type(saved).__name__}")
    scale, tracker = saved.get("scale"), saved.get("_growth_tracker", 0)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < float("inf")):
        raise ValueError(f"{where} must hold a finite positive 'scale', got {saved.get('scale')!r}")
    if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
        raise ValueError(f"{where} must hold an int '_growth_tracker' >= 0, got {tracker!r}")
    return {"scale": float(scale), "_growth_tracker": tracker}


def _apply_progress(scaler: torch.amp.GradScaler, progress: Mapping[str, Any]) -> None:
    """The saved scale and good-step count into ``scaler``, under its own settings. The count is capped below
    this growth interval: torch grows the scale only when the count reaches the interval exactly, so a count
    saved under a longer interval would never grow it again."""
    state = scaler.state_dict()
    tracker = min(int(progress["_growth_tracker"]), int(state["growth_interval"]) - 1)
    scaler.load_state_dict({**state, "scale": progress["scale"], "_growth_tracker": tracker})


def _refuse_half_parameters(optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
    """GradScaler cannot unscale float16 gradients: a model trained in float16 weights would fail at the first
    optimizer step, after its backward, with torch's bare message."""
    for name, optimizer in optimizers.items():
        for group in optimizer.param_groups:
            if any(p.dtype == torch.float16 and p.requires_grad for p in group["params"]):
                raise ValueError(
                    f"MixedPrecisionHook(precision='float16'): optimizer {name!r} trains float16 parameters, whose "
                    "float16 gradients GradScaler cannot unscale; keep the weights in float32 (autocast computes "
                    "in float16 all the same), or use precision='bf16', which needs no scaler"
                )


def _sharding_group(models: Iterable[torch.nn.Module]) -> Any:
    """The process group over which the models' DTensor parameters are sharded (None: no such parameter).

    FSDP over one mesh dimension: that dimension's group; a two-dimensional (HSDP) mesh spans the job.
    """
    tensor_module = sys.modules.get("torch.distributed.tensor")  # not loaded: nothing is sharded
    dtensor = getattr(tensor_module, "DTensor", None)
    if dtensor is None:
        return None
    for model in models:
        for parameter in model.parameters():
            if isinstance(parameter, dtensor):
                mesh = parameter.device_mesh
                return mesh.get_group() if mesh.ndim == 1 else torch.distributed.group.WORLD
    return None
