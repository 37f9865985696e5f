"""StepScheduler: which micro-batches form a step, and what each step boundary asks for.

One object decides the accumulation windows, the checkpoint / validation /
logging / garbage-collection cadences, the last step of the run and
preemption, and records where to resume. ``TrainingStrategy.run()`` drives
one; it also works on its own::

    scheduler = StepSchedulerConfig(global_batch_size=64, max_steps=1000).build(loader, dp_size, 8)
    with scheduler:                            # catch SIGTERM for the duration of the run
        for epoch in scheduler.epochs:
            for window in scheduler:           # one list of micro-batches per optimizer step
                train(window)
                scheduler.finish_step()        # the step boundary: count it, poll preemption once
                if scheduler.is_val_step:
                    validate()
                if scheduler.is_ckpt_step:
                    save(scheduler.state_dict())

Cadence convention: a step boundary closes step number ``scheduler.step``
(1-based: the count of completed optimizer steps, like ``ctx.step_count``); a
cadence of ``every`` fires when ``scheduler.step % every == 0``, i.e. on the
0-based step indices ``i`` with ``(i + 1) % every == 0``. Only real steps
(``finish_step(stepped=True)``) fire cadences. See docs/step-scheduler.md.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import signal
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from nvtrain.data_cursor import check_rng_fits, is_one_shot, loader_generators
from nvtrain.data_resharding import global_order, order_differences, resharded_position, sampler_kind
from nvtrain.epoch_reader import NO_ITEM, EpochReader, loader_len, loader_parts
from nvtrain.preemption import PreemptionWatcher, SignalLike, collective_device, resolve_signals
from nvtrain.validators import FieldTypeError, int_at_least, optional_int_at_least, refused, strict_bool

if TYPE_CHECKING:
    from typing import Self

__all__ = ["StepScheduler", "StepSchedulerConfig", "stateful_loader_state"]

logger = logging.getLogger(__name__)

_STATE_KEYS = ("step", "epoch", "position", "config")
_CONFIG_KEYS = ("global_batch_size", "local_batch_size", "dp_size", "grad_acc_steps", "loader_len")

#: The scheduler reading each StatefulDataLoader (both held weakly), so that what a rank contributes
#: to a checkpoint (``nvtrain.state.capture_rng_state``) can hold the loader's state at the data position.
_READERS: weakref.WeakKeyDictionary[Any, weakref.ReferenceType[StepScheduler]] = weakref.WeakKeyDictionary()


def stateful_loader_state(loader: Any) -> dict[str, Any] | None:
    """The saved form of ``loader``'s own state at the data position of the scheduler reading it.

    ``{"num_workers": ..., "state": loader.state_dict()}`` for a torchdata StatefulDataLoader
    that a :class:`StepScheduler` reads, taken after the last consumed micro-batch (as
    ``StepScheduler.state_dict()["loader"]``); None at an epoch's start, for any other loader,
    or when the state at that position is not known (see :meth:`StepScheduler.state_dict`).
    """
    reference = _READERS.get(loader)
    scheduler = reference() if reference is not None else None
    if scheduler is None or scheduler.dataloader is not loader:
        return None
    return scheduler._loader_entry(scheduler._saved_position()[1])


def _check_int(owner: str, name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if optional else "")
        raise refused(owner, name, value, expected)


def _check_bool(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool; a string such as ``"no"`` would read as True."""
    if not isinstance(value, bool):
        raise refused(owner, name, value, "True or False", error=FieldTypeError)
    return value


def _val_cadences(owner: str, value: int | Sequence[int] | None) -> tuple[int, ...]:
    items = [] if value is None else ([value] if isinstance(value, int) else list(value))
    for item in items:
        _check_int(owner, "val_every_steps", item, 1)
    return tuple(sorted(set(items)))


@attrs.frozen
class _Boundary:
    """What the latest step boundary decided (fixed when ``finish_step`` ran)."""

    stepped: bool
    epoch_end: bool
    last: bool


#: The eight possible boundaries, built once: finish_step() runs on every optimizer step.
_BOUNDARIES = {
    (stepped, epoch_end, last): _Boundary(stepped=stepped, epoch_end=epoch_end, last=last)
    for stepped in (False, True)
    for epoch_end in (False, True)
    for last in (False, True)
}


class StepScheduler:
    """Groups micro-batches into optimizer steps and answers what each step boundary requires.

    ``grad_acc_steps = global_batch_size // (local_batch_size * dp_size)`` micro-batches
    form a window; a trailing partial window is its own step. Training stops at
    whichever comes first, ``max_steps`` completed steps or ``num_epochs`` epochs;
    ``None`` derives the bound from the other (neither: one epoch). Both are
    absolute: a resumed scheduler stops where an uninterrupted one would.

    Predicates (``is_ckpt_step``, ``is_val_step``, ``is_last_step``,
    ``is_remote_logging_step``, ``is_gc_step``) describe the step that the latest
    :meth:`finish_step` closed; they are False while a window is open. Reading
    them never communicates: :meth:`finish_step` polls preemption once (one
    collective under ``torch.distributed``) and the properties report its answer.
    """

    def __init__(
        self,
        global_batch_size: int,
        local_batch_size: int,
        dp_size: int,
        dataloader: Any | None,
        ckpt_every_steps: int | None = None,
        save_checkpoint_every_epoch: bool = True,
        validate_on_checkpoint: bool = True,
        val_every_steps: int | Sequence[int] | None = None,
        log_remote_every_steps: int = 10,
        loss_average_window_steps: int = 50,
        gc_every_steps: int | None = None,
        start_step: int = 0,
        start_epoch: int = 0,
        num_epochs: int | None = None,
        max_steps: int | None = None,
        preemption_signal: SignalLike | Sequence[SignalLike] | None = signal.SIGTERM,
        process_group: Any = None,
        synchronized_stream: bool = False,
        max_consecutive_skipped_steps: int | None = None,
    ) -> None:
        owner = "StepScheduler"
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("local_batch_size", local_batch_size),
            ("dp_size", dp_size),
        ):
            _check_int(owner, name, value, 1)
        if global_batch_size % (local_batch_size * dp_size):
            expected = f"a multiple of local_batch_size * dp_size (= {local_batch_size * dp_size})"
            raise refused(
                owner,
                "global_batch_size",
                global_batch_size,
                expected,
                message=f"{owner}: global_batch_size={global_batch_size} is not a multiple of "
                f"local_batch_size={local_batch_size} * dp_size={dp_size} (= {local_batch_size * dp_size}); "
                "every optimizer step must see whole micro-batches on every rank",
            )
        for name, bound in (
            ("ckpt_every_steps", ckpt_every_steps),
            ("gc_every_steps", gc_every_steps),
            ("num_epochs", num_epochs),
            ("max_steps", max_steps),
        ):
            _check_int(owner, name, bound, 1, optional=True)
        _check_int(owner, "log_remote_every_steps", log_remote_every_steps, 1)
        _check_int(owner, "loss_average_window_steps", loss_average_window_steps, 1)
        _check_int(owner, "start_step", start_step, 0)
        _check_int(owner, "start_epoch", start_epoch, 0)
        _check_int(owner, "max_consecutive_skipped_steps", max_consecutive_skipped_steps, 1, optional=True)
        #: Stop with TrainingDivergedError after this many skipped steps in a row (None: never).
        self.max_consecutive_skipped_steps = max_consecutive_skipped_steps
        #: Optimizer steps skipped in a row up to the latest boundary (vetoes, GradScaler overflows).
        self.consecutive_skipped_steps = 0
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_size = dp_size
        self.grad_acc_steps = global_batch_size // (local_batch_size * dp_size)
        self.dataloader: Any = dataloader
        self.ckpt_every_steps = ckpt_every_steps
        self.save_checkpoint_every_epoch = _check_bool(owner, "save_checkpoint_every_epoch", save_checkpoint_every_epoch)
        self.validate_on_checkpoint = _check_bool(owner, "validate_on_checkpoint", validate_on_checkpoint)
        self.val_every_steps: tuple[int, ...] = _val_cadences(owner, val_every_steps)
        self.log_remote_every_steps = log_remote_every_steps
        self.loss_average_window_steps = loss_average_window_steps
        self.gc_every_steps = gc_every_steps
        self.synchronized_stream = _check_bool(owner, "synchronized_stream", synchronized_stream)
        self.process_group = process_group
        self.max_steps = max_steps
        #: The epoch bound training stops at (None: only ``max_steps`` bounds the run).
        self.epoch_limit: int | None = num_epochs if num_epochs is not None or max_steps is not None else 1
        self._loader_len = loader_len(dataloader) if dataloader is not None else None
        if self._loader_len == 0:
            raise ValueError(f"{owner}: the dataloader is empty (len() == 0)")
        self._watcher = PreemptionWatcher(
            resolve_signals(preemption_signal, f"{owner}.preemption_signal"), process_group
        )
        #: Completed optimizer steps (like ``ctx.step_count``); the current epoch (0-based).
        self.step = start_step
        self.epoch = start_epoch
        #: ``(step, epoch, position)`` the counting started from (given, or loaded): where epoch 0's first
        #: step would have been counted, for :attr:`total_steps` (``start_step`` need not be at epoch 0).
        self._anchor = (start_step, start_epoch, 0)
        #: Set when a synchronized stream ran out on some rank: training ends there.
        self.stream_exhausted = False
        #: The last completed epoch's end-of-epoch validation was not run: a preemption stopped the run
        #: there, and the grace period is for saving. Saved; a resumed run validates before it trains.
        self.validation_owed = False
        self._position = 0  # micro-batches of this epoch consumed by closed windows
        #: Where the data stands: the epoch's iterator, what was taken, what a resume needs.
        self._reader = EpochReader(dataloader, sized=not self.synchronized_stream)
        self._replay: tuple[list[Any], bool] | None = None  # a window left open by a ``break``
        if self._reader.stateful:
            with contextlib.suppress(TypeError):  # an unhashable loader: its state is not gathered per rank
                _READERS[dataloader] = weakref.ref(self)
        #: True when every window will be closed by finish_step() (TrainingStrategy sets it); False:
        #: a loop that never calls it, as in the seed, has each window closed by the next request.
        self.finish_step_required = False
        self._provisional = False  # the open window was counted as a step when yielded (no finish_step yet)
        self._window: list[Any] | None = None
        self._window_is_last = False
        self._open = False
        self._iterating = False
        self._warned_short_len = False  # a loader yielding past its len(): said once per scheduler
        self._epoch_done = False  # the closed window ended the epoch; __iter__ advances ``epoch``
        self._boundary: _Boundary | None = None
        self._in_scope = False  # inside ``with scheduler:`` (signals caught for the whole run)

    # -- sizes ----------------------------------------------------------------------------

    @property
    def epoch_len(self) -> int | None:
        """Optimizer steps per epoch (``ceil(len(dataloader) / grad_acc_steps)``); None without ``len()``."""
        if self._loader_len is None or self.synchronized_stream:
            return None
        return math.ceil(self._loader_len / self.grad_acc_steps)

    @property
    def num_epochs(self) -> int | None:
        """The epochs the run covers: the configured number, else derived from ``max_steps``.

        As the seed's ``_calculate_num_epochs``: ``max_steps=15`` over 10 steps per epoch
        reads 2. None when neither bounds it (an unsized loader with only ``max_steps``).
        Skipped steps do not count toward ``max_steps``, so a run with skips may train
        into a further epoch: the stop is ``max_steps``, not this number.
        """
        if self.epoch_limit is not None:
            return self.epoch_limit
        epoch_len = self.epoch_len
        if self.max_steps is None or not epoch_len:
            return None
        return math.ceil(self.max_steps / epoch_len)

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps the whole run will reach (absolute), or None when unknown.

        The one owner of the run length: ``max_steps`` when it comes first, else the step
        the last epoch ends at: ``num_epochs * epoch_len`` from the step counted at epoch 0's
        start (``start_step`` and ``start_epoch``, or a loaded state, say where that was).
        Progress bars, LR schedule horizons and the CLI read it.
        """
        epoch_len = self.epoch_len
        by_epochs = None
        if self.num_epochs is not None and epoch_len is not None:
            step, epoch, position = self._anchor
            origin = step - epoch * epoch_len - position // self.grad_acc_steps
            by_epochs = origin + self.num_epochs * epoch_len
        candidates = [n for n in (self.max_steps, by_epochs) if n is not None]
        return min(candidates) if candidates else None

    @property
    def epochs(self) -> Iterator[int]:
        """The epochs still to train, starting with the current one (resumes included).

        Each epoch first reaches the sampler, the loader and its dataset / collate
        function through :meth:`set_epoch`. Between epochs preemption is polled once,
        so a signal that arrived during epoch-end work ends the run here.
        """
        return self._epochs()

    def _epochs(self) -> Iterator[int]:
        own_scope = not self._in_scope
        if own_scope:
            self._watcher.install()
        try:
            first = True
            while not self._training_done() and not self._watcher.stopping:
                if not first and self._watcher.poll():
                    return
                first = False
                self.set_epoch(self.epoch)
                yield self.epoch
        finally:
            if own_scope:
                self._watcher.restore()

    @property
    def training_done(self) -> bool:
        """The run's bounds are reached: ``max_steps``, the last epoch's data used up, or the stream's end
        (whatever else, a stop request or a signal, also ended it)."""
        return self._training_done()

    def _training_done(self) -> bool:
        if self.max_steps is not None and self.step >= self.max_steps:
            return True
        if self.epoch_limit is not None and self.epoch >= self.epoch_limit:
            return True
        return self.stream_exhausted

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[Any]]:
        """Yield the rest of the current epoch as windows (lists of micro-batches).

        Stops after the last step, after a step at which preemption was agreed, and
        at the end of the epoch (advancing :attr:`epoch`). Call :meth:`finish_step`
        once per window.
        """
        if self.dataloader is None:
            raise ValueError("StepScheduler was built without a dataloader; it can only answer cadence questions")
        if self._iterating:
            raise RuntimeError("StepScheduler: already iterating; one loop over the scheduler at a time")
        self._iterating = True
        watcher = self._watcher
        try:
            while not (watcher.preempted or watcher.stop_reason is not None) and not self._training_done():
                if self.consecutive_skipped_steps:  # only then can the skipped-step limit be reached
                    self._check_divergence()
                if self._replay is not None:
                    window, is_last = self._replay
                    self._replay = None
                else:
                    window, is_last = self._next_window()
                if not window:
                    self._advance_epoch()
                    return
                self._window, self._window_is_last = window, is_last
                self._open, self._boundary = True, None
                if not self.finish_step_required:
                    self._count_provisionally()
                try:
                    yield window
                except GeneratorExit:
                    if self._open:  # the loop broke before finish_step(): yield this window again next time
                        self._revert_provisional()
                        self._replay, self._open = (window, is_last), False
                    elif self._epoch_done:
                        self._advance_epoch()
                    raise
                if self._open and self._provisional:  # the seed's loop: asking for the next window closes this one
                    self._close(stepped=True, poll=True)
                elif self._open:
                    self._open = False
                    self._replay = (window, is_last)
                    raise RuntimeError(
                        f"StepScheduler: finish_step() was not called for step {self.step} "
                        f"(epoch {self.epoch + 1}); call it once per window, after the optimizer step"
                    )
                if self._epoch_done:
                    self._advance_epoch()
                    return
        finally:
            self._iterating = False

    def finish_step(self, stepped: bool = True) -> bool:
        """Close the open window: count the step (when ``stepped``), poll preemption once.

        ``stepped=False`` records a window whose optimizer step was skipped (a veto
        or a GradScaler overflow): its data is consumed but no step counted, so no
        step cadence fires. This is the only call that communicates across ranks.
        Returns whether preemption was agreed (:attr:`sigterm_received`).
        """
        if not self._open or self._window is None:
            raise RuntimeError("StepScheduler.finish_step(): no open window (called twice, or outside the loop)")
        self.finish_step_required = True  # a loop that calls it once calls it for every window
        return self._finish(stepped, poll=True)

    def close_failed_step(self) -> None:
        """Close the open window of a step that was taken before something raised: count it and record its
        data as consumed, so a later run does not take it again. Polls nothing: a failing rank must not
        start a collective the others may never join."""
        if self._open and self._window is not None:
            self._finish(True, poll=False)

    def _finish(self, stepped: bool, *, poll: bool) -> bool:
        if self._provisional:
            self._revert_provisional()
        if stepped:
            self.step += 1
        return self._close(stepped, poll)

    def _count_provisionally(self) -> None:
        """Seed semantics while a window is open: it counts as a step, and the predicates describe it."""
        self.step += 1
        self._provisional = True
        self._boundary = _BOUNDARIES[True, self._window_is_last, self._reaches_the_end()]

    def _revert_provisional(self) -> None:
        if self._provisional:
            self._provisional = False
            self.step -= 1
            self._boundary = None

    @property
    def reaches_the_end(self) -> bool:
        """The step just closed ends the run by its bounds (``max_steps``, or the last epoch's last window),
        whatever else (a stop request) also ended it there."""
        return self._reaches_the_end()

    def _reaches_the_end(self) -> bool:
        """Whether the window just counted ends the run (step budget, or the last epoch's last window)."""
        return (self.max_steps is not None and self.step >= self.max_steps) or (
            self._window_is_last
            and (self.synchronized_stream or (self.epoch_limit is not None and self.epoch + 1 >= self.epoch_limit))
        )

    def _close(self, stepped: bool, poll: bool) -> bool:
        """The step boundary: record the window's data as consumed and poll preemption once (unless not ``poll``)."""
        self._provisional = False
        self._open = False
        self.consecutive_skipped_steps = 0 if stepped else self.consecutive_skipped_steps + 1
        self._position = self._reader.pulled
        self._epoch_done = self._window_is_last
        if self._window_is_last and self.synchronized_stream:
            self.stream_exhausted = True  # a synchronized stream is read once: its end is the end of training
        if poll:
            self._watcher.poll()
        stop_agreed = self._watcher.stop_reason is not None  # a stop request makes this the last step
        last = stop_agreed or self._reaches_the_end()
        self._boundary = _BOUNDARIES[stepped, self._window_is_last, bool(last)]
        return self._watcher.preempted

    def _check_divergence(self) -> None:
        """Before the next window: stop a run whose optimizer has not stepped for too long.

        Checked after the previous window's stages all ran, so hooks (a GradScaler
        update, loggers) saw the last skipped step. Every rank skips the same steps
        (vetoes and overflow checks are rank-consistent), so every rank stops here.
        """
        limit = self.max_consecutive_skipped_steps
        skipped = self.consecutive_skipped_steps
        if limit is None or skipped < limit:
            return
        from nvtrain.errors import TrainingDivergedError

        raise TrainingDivergedError(
            f"training diverged: {skipped} optimizer steps in a row were skipped (none since step {self.step}, "
            f"epoch {self.epoch + 1}); the loss or the gradients are no longer finite (a spike-skip veto or a "
            "GradScaler overflow skips every step). Lower the learning rate, check the data and the loss, or "
            "raise max_consecutive_skipped_steps (null disables the check)",
            skipped=skipped,
            step=self.step,
            epoch=self.epoch,
        )

    def poll_preemption(self) -> bool:
        """Poll preemption and stop requests outside a step boundary (after validation); one collective.

        All ranks must call it at the same points. Returns whether the run stops here
        (:attr:`sigterm_received` or :attr:`stop_reason`).
        """
        return self._watcher.poll()

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary (or the next poll); any rank may ask.

        The request is agreed in the collective the boundary already makes, so every
        rank stops at the same step. That step is the last: ``is_last_step`` and
        ``is_ckpt_step`` are true for it.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"request_stop(reason): give a non-empty reason string (got {reason!r})")
        self._watcher.request_stop(reason)
        boundary = self._boundary
        if boundary is not None and not self._open and self._watcher.stop_reason is not None:
            # asked after this step's boundary (AFTER_OPTIMIZER_STEP, AFTER_BATCH, validation) in a
            # single process: this step is the last one
            self._boundary = _BOUNDARIES[boundary.stepped, boundary.epoch_end, True]

    @property
    def received_signal(self) -> int | None:
        """The preemption signal this rank caught, or None."""
        return self._watcher.received_signal

    @property
    def stop_reason(self) -> str | None:
        """The agreed stop request (this rank's reason, or a note that another rank asked); None if none."""
        return self._watcher.stop_reason

    def _advance_epoch(self) -> None:
        if not self._warned_short_len and self._reader.yields_past_its_length():
            self._warned_short_len = True
            warnings.warn(
                f"StepScheduler: the dataloader reported len() == {self._reader.items} but yields more: epoch "
                f"{self.epoch + 1} ended after its {self._reader.items} micro-batches, and what it yields after them "
                "is never trained (each epoch reads len(loader) micro-batches); fix the loader's __len__, or give a "
                "loader without one",
                RuntimeWarning,
                stacklevel=4,
            )
        self.epoch += 1
        self._position = 0
        self._epoch_done = False
        self._reader.new_epoch()

    def _next_window(self) -> tuple[list[Any], bool]:
        """The next window and whether it ends the epoch (known before it is yielded)."""
        reader = self._reader
        iterator = reader.iterator
        if iterator is None:
            iterator = reader.open(self._position, self.epoch)
        size = self.grad_acc_steps
        items = reader.items
        if size == 1 and items is not None and reader.pending is NO_ITEM and reader.pulled < items:
            item = next(iterator, NO_ITEM)  # the common case: one micro-batch per step, a sized loader
            if item is not NO_ITEM:
                reader.pulled += 1
                return [item], reader.pulled >= items
            # ran dry before len(): the general path below finds it exhausted, warns and ends the epoch
        if items is not None:
            size = min(size, items - reader.pulled)
        window: list[Any] = []
        exhausted = False
        while len(window) < size:
            item = reader.take()
            if item is NO_ITEM:
                exhausted = True
                break
            window.append(item)
        if items is not None:
            if exhausted and items > reader.pulled:
                warnings.warn(
                    f"StepScheduler: the dataloader reported len() == {items} but epoch {self.epoch + 1} ended after "
                    f"{reader.pulled} micro-batches",
                    RuntimeWarning,
                    stacklevel=3,
                )
            is_last = exhausted or reader.pulled >= items
        else:
            if not exhausted:  # peek one micro-batch: is there a next window?
                exhausted = reader.peek_exhausted()
            is_last = exhausted
        if self.synchronized_stream:
            window, is_last = self._agree_on_window(window, is_last)
        if not window and reader.pulled == self._position == 0 and not self.synchronized_stream:
            raise ValueError(f"StepScheduler: the dataloader yielded no micro-batches in epoch {self.epoch + 1}")
        return window, is_last

    def _agree_on_window(self, window: list[Any], is_last: bool) -> tuple[list[Any], bool]:
        """All ranks take the same window size; when one rank's stream ends, all stop (one collective)."""
        group = self.process_group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            votes = torch.tensor(
                [self.grad_acc_steps - len(window), int(is_last)], dtype=torch.int64, device=collective_device(group)
            )
            dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
            deficit, any_last = (int(v) for v in votes.tolist())
            size = self.grad_acc_steps - deficit
            if size < len(window):
                logger.info("StepScheduler: dropping %d micro-batch(es) another rank does not have", len(window) - size)
                window = window[:size]
            is_last = bool(any_last)
        if not window:  # some rank had nothing at all: every rank stops here
            self.stream_exhausted = True
        return window, is_last

    # -- predicates: the step the latest finish_step() closed -----------------------------------

    def _cadence(self, every: int | None) -> bool:
        boundary = self._boundary
        return boundary is not None and boundary.stepped and every is not None and self.step % every == 0

    @property
    def is_ckpt_step(self) -> bool:
        """Checkpoint now: the ``ckpt_every_steps`` cadence, an epoch's end, the last step, or preemption."""
        boundary = self._boundary
        if boundary is None:
            return False
        return (
            self._watcher.preempted
            or boundary.last
            or (self.save_checkpoint_every_epoch and boundary.epoch_end)
            or self._cadence(self.ckpt_every_steps)
        )

    @property
    def is_val_step(self) -> bool:
        """Validate now: a ``val_every_steps`` cadence, or a checkpoint step when ``validate_on_checkpoint``.

        With ``validate_on_checkpoint``, a ``ckpt_every_steps`` step validates whatever
        else happens at it; an epoch's end and the run's end do too, except when they
        are not what they seem: a checkpoint a preemption forces (also at an epoch's
        end, whose validation is then owed to the resumed run: the grace period before
        the hard kill is for saving), and the step a stop request made the last inside
        an epoch (an epoch cut short gets no epoch-end validation).
        """
        boundary = self._boundary
        if boundary is None:
            return False
        if any(self._cadence(every) for every in self.val_every_steps):
            return True
        if not self.validate_on_checkpoint:
            return False
        if self._cadence(self.ckpt_every_steps):
            return True
        natural_end = self._reaches_the_end()
        if self._watcher.preempted and not natural_end:
            return False
        # the run's last step validates when it ends the run or an epoch; a stop request's inside an epoch does not
        last = boundary.last and (natural_end or boundary.epoch_end)
        return (self.save_checkpoint_every_epoch and boundary.epoch_end) or last

    @property
    def is_remote_logging_step(self) -> bool:
        """Send metrics to remote services now (``log_remote_every_steps`` cadence)."""
        return self._cadence(self.log_remote_every_steps)

    @property
    def is_gc_step(self) -> bool:
        """Run ``gc.collect()`` now (``gc_every_steps`` cadence; never when it is None)."""
        return self._cadence(self.gc_every_steps)

    @property
    def is_last_batch(self) -> bool:
        """The current window is the last of its epoch (known from the moment it is yielded)."""
        return self._window is not None and self._window_is_last

    @property
    def is_last_step(self) -> bool:
        """The step just closed is the final one: ``max_steps`` reached or the last epoch's data used up.

        True at exactly one boundary of a complete run, also for loaders without
        ``len()`` (the scheduler looks one micro-batch ahead to know). Preemption
        does not make a step the last one: the run is resumed later.
        """
        return self._boundary is not None and self._boundary.last

    @property
    def sigterm_received(self) -> bool:
        """A preemption signal was agreed at the latest poll (any rank received one)."""
        return self._watcher.preempted

    @property
    def preemption_signals(self) -> tuple[signal.Signals, ...]:
        return self._watcher.signals

    @property
    def position(self) -> int:
        """Micro-batches of the current epoch consumed by closed windows."""
        return self._position

    # -- epochs, signals, resume -------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` current and tell the sampler, the loader, its dataset and collate function.

        Every object among them with a ``set_epoch`` method is called (a
        ``DistributedSampler`` reshuffles with it). Moving to another epoch starts
        it from its first micro-batch.
        """
        _check_int("StepScheduler.set_epoch()", "epoch", epoch, 0)
        if self._open:
            raise RuntimeError("StepScheduler.set_epoch(): a window is open; call finish_step() first")
        if epoch != self.epoch:
            self.epoch, self._position, self._epoch_done, self._replay = epoch, 0, False, None
            self._reader.new_epoch()
        if self.dataloader is not None:
            for part in loader_parts(self.dataloader):
                set_epoch = getattr(part, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)

    def __enter__(self) -> Self:
        """Catch the preemption signals until ``__exit__`` (which restores the previous handlers)."""
        self._watcher.install()
        self._in_scope = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        received = self._watcher.received_signal
        self._in_scope = False
        self._watcher.restore()
        # from the rank that caught it; not when leaving by an exception (a second Ctrl-C's did act on it)
        if received is not None and not self._watcher.preempted and exc_type is None:
            distributed = dist.is_available() and dist.is_initialized()
            where = f" on rank {dist.get_rank()}" if distributed else ""
            logger.warning(
                "StepScheduler: %s arrived%s after the last preemption poll; it was not acted on",
                signal.Signals(received).name,
                where,
            )

    def _config(self) -> dict[str, Any]:
        return {
            "global_batch_size": self.global_batch_size,
            "local_batch_size": self.local_batch_size,
            "dp_size": self.dp_size,
            "grad_acc_steps": self.grad_acc_steps,
            "loader_len": self._loader_len,
            # the samples behind the loader: another data set of the same len(loader) shuffles to another order
            "dataset_len": loader_len(getattr(self.dataloader, "dataset", None)),
            "global_order": global_order(self.dataloader),
            "sampler": sampler_kind(self.dataloader),
        }

    def _saved_position(self) -> tuple[int, int, dict[str, Any] | None]:
        """``(epoch, position, epoch_rng)`` a resume continues from (see :meth:`state_dict`)."""
        closed = not self._open or self._provisional  # the seed's loop: the open window already counts
        epoch_done = self._window_is_last if self._provisional else self._epoch_done
        if epoch_done and closed:
            return self.epoch + 1, 0, None
        if self._provisional:
            return self.epoch, self._reader.pulled, self._reader.epoch_rng
        return self.epoch, self._position, self._reader.epoch_rng

    def _loader_entry(self, position: int) -> dict[str, Any] | None:
        """A StatefulDataLoader's state after exactly ``position`` micro-batches (see EpochReader.loader_entry)."""
        return self._reader.loader_entry(position, self._position)

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: ``step``, ``epoch``, ``position`` (micro-batches into the epoch), the
        epoch's RNG states (``epoch_rng``), a StatefulDataLoader's own state at that position
        (``loader``: ``{"num_workers", "state"}``, else None) and the ``config`` a resume must match.

        Correct whenever it is called: a window counts once ``finish_step()`` closed
        it; after an epoch's last window the state points at the next epoch.
        """
        epoch, position, rng = self._saved_position()
        return {
            "step": self.step,
            "epoch": epoch,
            "position": position,
            # also at position 0 once the epoch's iterator exists (a state taken inside its first window)
            "epoch_rng": None if rng is None else copy.deepcopy(rng),
            "loader": self._loader_entry(position),
            "stream_exhausted": self.stream_exhausted,
            "validation_owed": self.validation_owed,
            "config": self._config(),
        }

    def release_data(self) -> None:
        """Let go of the epoch's live iterator (a loader's worker processes end now); the position stays,
        and the epoch is reopened there if read again."""
        self._reader.release(self._position)

    def continue_from(self, previous: StepScheduler, *, step: int | None = None) -> None:
        """Go on where ``previous`` (the last run's scheduler, over this loader or the same data) stopped.

        Its position is loaded (:meth:`load_state_dict`: a ValueError when this run's batch
        configuration cannot take it); ``step``, when given, replaces its step count (steps
        taken outside a run since, by ``train_batch()``). When ``previous`` still holds the epoch's live
        iterator right at that position, and nothing else has read from it or reset it since
        (a loader with persistent workers resets its one iterator at every ``iter()``), this
        scheduler reads on from it, so the data
        continues exactly as in one longer run, without reopening the epoch; otherwise the
        epoch is reopened at the position, which a one-shot iterator (a generator) cannot
        do: that is a RuntimeError saying so, never a silently skipped stretch of data.
        """
        state = previous.state_dict()
        if step is not None:
            state["step"] = step
        self.load_state_dict(state)
        if previous.dataloader is not self.dataloader:  # a loader made again over the data: its generators go on
            self._take_generator_states(previous.dataloader)
        reader = previous._reader
        live = reader.iterator is not None and previous.epoch == self.epoch and reader.pulled == self._position
        if live and reader.loader is self.dataloader and reader.sized == self._reader.sized and reader.untouched():
            self._reader, previous._reader = reader, EpochReader(previous.dataloader, sized=reader.sized)
            return
        if self._position and is_one_shot(self.dataloader):
            raise RuntimeError(
                f"StepScheduler: cannot continue epoch {self.epoch + 1} at micro-batch {self._position} of a one-shot "
                f"iterator ({type(self.dataloader).__qualname__}): the last run did not end at a step boundary with it "
                "(or its strategy was closed), and what it read past that point cannot be read again. Pass a loader "
                "that can be iterated again (a DataLoader, a list) to continue or resume"
            )

    def _take_generator_states(self, loader: Any) -> None:
        """Give this loader's generators (its own, its sampler's) the states ``loader``'s have now, as a resume's
        RNG states do: a loader made again starts from its seed, so its next epoch would shuffle as the first."""
        theirs = list(loader_generators(loader).values())
        mine = list(loader_generators(self.dataloader).values())
        if len(theirs) == len(mine):
            for generator, source in zip(mine, theirs, strict=True):
                generator.set_state(source.get_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`); refuses a different batch / data configuration."""
        if self._iterating or self._open:
            raise RuntimeError("StepScheduler.load_state_dict(): cannot load while iterating; load before the loop")
        state, loader_state = self._checked(state, announce=True)
        self.step, self.epoch, self._position = int(state["step"]), int(state["epoch"]), int(state["position"])
        self._anchor = (self.step, self.epoch, self._position)
        self._reader.load(state.get("epoch_rng"), loader_state, self._position)
        self.stream_exhausted = bool(state.get("stream_exhausted", False))
        self.validation_owed = bool(state.get("validation_owed", False))
        self._epoch_done, self._replay, self._window, self._window_is_last, self._boundary = (
            False,
            None,
            None,
            False,
            None,
        )

    def check_state_dict(self, state: Any) -> None:
        """Refuse what :meth:`load_state_dict` would refuse, changing nothing: a resume checks every part of a
        state before it loads any, so a refused one leaves the strategy as it was."""
        self._checked(state, announce=False)

    def _checked(self, state: Any, *, announce: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``state`` as it is to be loaded (its position carried over to this configuration) and its loader
        entry, or a ValueError saying why it cannot be."""
        if not isinstance(state, Mapping):
            raise ValueError(f"StepScheduler.load_state_dict: expected a state dict, got {type(state).__name__}")
        if set(state) <= {"step", "epoch"} and {"step", "epoch"} <= set(state):
            state = self._seed_state(state)
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"StepScheduler.load_state_dict: the state lacks {missing} (keys: {sorted(state)})")
        saved = dict(state["config"])
        mine = self._config()
        differ = {key: (saved.get(key), mine[key]) for key in _CONFIG_KEYS if saved.get(key) != mine[key]}
        for key in ("step", "epoch", "position"):
            _check_int("StepScheduler.load_state_dict", key, state[key], 0)
        # Before the batch configuration: another data set is the cause of a loader_len that differs. One process only:
        # ranks may read data sets of their own (sharded by hand), and a state holds rank 0's length; under
        # a DistributedSampler, ``global_order`` holds the length the ranks share.
        saved_samples, samples = saved.get("dataset_len"), mine["dataset_len"]
        one_process = saved.get("dp_size") == mine["dp_size"] == 1
        if one_process and saved_samples is not None and samples is not None and saved_samples != samples:
            raise ValueError(
                f"StepScheduler.load_state_dict: the state was saved reading a data set of {saved_samples} samples, "
                f"the dataloader's has {samples}: the saved position and sample order do not fit it. Resume with "
                "the same data, or restore without the data position"
            )
        if differ:
            state = self._resharded(state, saved, mine, differ, announce=announce)
        order_differ = order_differences(saved, mine)
        if order_differ and int(state["position"]):  # the same batch configuration over another permutation
            raise ValueError(
                f"StepScheduler.load_state_dict: the epoch's sample order differs ({order_differ}): the saved "
                f"position (micro-batch {int(state['position'])} of epoch {int(state['epoch']) + 1}) would read "
                "other samples of it (some twice, some never). Resume with the same data and sampler settings, "
                "or restore without the data position"
            )
        entry = self._reader.check_loader_entry(state.get("loader"), "StepScheduler.load_state_dict")
        rng = state.get("epoch_rng")
        if entry is None and isinstance(rng, Mapping) and self.dataloader is not None:  # the epoch is replayed
            check_rng_fits(rng, list(loader_generators(self.dataloader).values()))
        return state, entry

    def _resharded(
        self, state: Any, saved: dict[str, Any], mine: dict[str, Any], differ: dict[str, Any], *, announce: bool
    ) -> dict[str, Any]:
        """``state`` with its position carried over to this job's ranks and local batch size (see
        :mod:`nvtrain.data_resharding`), or a ValueError saying why it cannot be; ``announce`` logs the carry-over."""
        details = ", ".join(f"{key}: saved {was!r}, now {now!r}" for key, (was, now) in differ.items())
        try:
            position = resharded_position(saved, mine, int(state["position"]))
        except ValueError as err:
            raise ValueError(
                f"StepScheduler.load_state_dict: the checkpoint was written with a different configuration "
                f"({details}) and its data position cannot be carried over: {err}. Use the same global/local batch "
                "size, data-parallel size and dataset, or restore without the data position"
            ) from None
        if announce and not position:
            logger.info("StepScheduler: epoch %d starts with another batch configuration (%s)", int(state["epoch"]) + 1, details)
        elif announce:
            logger.info(
                "StepScheduler: continuing epoch %d at sample %d of its order (saved with %s ranks x %s samples, now "
                "%s x %s): micro-batch %d here",
                int(state["epoch"]) + 1, position * mine["local_batch_size"] * mine["dp_size"], saved["dp_size"],
                saved["local_batch_size"], mine["dp_size"], mine["local_batch_size"], position,
            )
        return {**state, "position": position, "loader": None}

    def _seed_state(self, state: Any) -> dict[str, Any]:
        """The seed's ``{"step", "epoch"}``: the start of that epoch's data, counters at ``step``."""
        return {"step": state["step"], "epoch": state["epoch"], "position": 0, "config": self._config()}

    def __repr__(self) -> str:
        return (
            f"StepScheduler(step={self.step}, epoch={self.epoch}, position={self._position}, "
            f"grad_acc_steps={self.grad_acc_steps}, max_steps={self.max_steps}, num_epochs={self.num_epochs})"
        )


# -- configuration -------------------------------------------------------------------------------


def _check_signal(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    from nvtrain.validators import refused

    owner = type(instance).__name__
    try:
        resolve_signals(value, f"{owner}.{attribute.name}")
    except ValueError as err:  # the message says which signal and why; the error also names the field
        expected = "signal names or numbers a process can catch (e.g. 'SIGTERM'), a list of them, or None"
        raise refused(owner, attribute.name, value, expected, message=str(err)) from None


def _as_signal_spec(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@attrs.frozen
class StepSchedulerConfig:
    """User-facing step scheduler configuration (what a YAML file sets).

    ``None`` for ``global_batch_size`` means one micro-batch per rank per step
    (``TrainingStrategy`` uses its accumulation hook's ``steps``); ``None`` for
    ``num_epochs`` / ``max_steps`` means "derive from the other" (neither: one
    epoch), so ``StepSchedulerConfig(max_steps=100)`` trains exactly 100 steps.
    Runtime values (dataloader, data-parallel size, local batch size) are given
    to :meth:`build`.
    """

    #: Samples per optimizer step across all data-parallel ranks.
    global_batch_size: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    num_epochs: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    max_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    #: Checkpoint every N optimizer steps (None: only epoch ends, the last step and preemption).
    ckpt_every_steps: int | None = attrs.field(default=100, validator=optional_int_at_least(1))
    save_checkpoint_every_epoch: bool = attrs.field(default=True, validator=strict_bool)
    validate_on_checkpoint: bool = attrs.field(default=True, validator=strict_bool)
    val_every_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    log_remote_every_steps: int = attrs.field(default=10, validator=int_at_least(1))
    loss_average_window_steps: int = attrs.field(default=50, validator=int_at_least(1))
    gc_every_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    start_step: int = attrs.field(default=0, validator=int_at_least(0))
    start_epoch: int = attrs.field(default=0, validator=int_at_least(0))
    #: Signal(s) that trigger a preemption checkpoint: a name ("SIGTERM"), a number, or a list; None disables.
    #: SIGINT (Ctrl-C) stops at the next step boundary like SIGTERM; a second Ctrl-C aborts at once.
    preemption_signal: int | str | tuple[int | str, ...] | None = attrs.field(
        default=("SIGTERM", "SIGINT"), converter=_as_signal_spec, validator=_check_signal
    )
    #: Stop the run (TrainingDivergedError) after this many optimizer steps in a row were skipped; None: never.
    max_consecutive_skipped_steps: int | None = attrs.field(default=100, validator=optional_int_at_least(1))

    def build(
        self,
        dataloader: Any | None,
        dp_group_size: int,
        local_batch_size: int,
        process_group: Any = None,
        synchronized_stream: bool | None = None,
    ) -> StepScheduler:
        """Build the scheduler for this rank's ``dataloader``.

        ``synchronized_stream=None`` follows the loader's own ``synchronized_stream``
        attribute (default False).
        """
        global_batch_size = self.global_batch_size
        if global_batch_size is None:
            _check_int("StepSchedulerConfig.build()", "local_batch_size", local_batch_size, 1)
            _check_int("StepSchedulerConfig.build()", "dp_group_size", dp_group_size, 1)
            global_batch_size = local_batch_size * dp_group_size
        if synchronized_stream is None:
            synchronized_stream = bool(getattr(dataloader, "synchronized_stream", False))
        return self.create(
            global_batch_size=global_batch_size,
            local_batch_size=local_batch_size,
            dp_size=dp_group_size,
            dataloader=dataloader,
            process_group=process_group,
            synchronized_stream=synchronized_stream,
        )

    def create(self, **settings: Any) -> StepScheduler:
        """A StepScheduler with every field of this configuration (each names a StepScheduler argument).

        ``settings`` gives the runtime arguments (loader, batch sizes, process group)
        and replaces fields where the caller knows better, as the strategy does for
        the run bounds and where a resumed run starts. :meth:`build` is the short form
        for a loader and its batch sizes.
        """
        return StepScheduler(**{**attrs.asdict(self, recurse=False), **settings})
