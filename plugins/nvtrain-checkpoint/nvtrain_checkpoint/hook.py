"""CheckpointHook: saves restartable checkpoints at real steps, and resumes from them."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch

import nvtrain
from nvtrain.preemption import collective_device
from nvtrain.state import capture_rng_state, capture_state, load_state, strategy_hooks, without_data_position
from nvtrain.validators import FieldTypeError, blocking_file, one_of, optional_int_at_least, refused, strict_bool
from nvtrain_checkpoint import sharded, storage, writer_process
from nvtrain_checkpoint.export import export_weights
from nvtrain_checkpoint.snapshot import snapshot
from nvtrain_checkpoint.staging import Stager, shared_memory_supported
from nvtrain_checkpoint.writer import BackgroundWriter

__all__ = ["CheckpointHook"]

logger = logging.getLogger(__name__)

NEVER = "never"
AUTO = "auto"
#: ``async_writer`` values: where a background save serialises, hashes and fsyncs.
PROCESS = "process"
THREAD = "thread"


def _as_dir(value: Any) -> Path:
    if isinstance(value, (str, os.PathLike)) and str(value):
        _require_directory(Path(value))
        return Path(value)
    raise refused("CheckpointHook", "checkpoint_dir", value, "a non-empty path", error=FieldTypeError)


#: ``resume`` values that read as a mistyped mode unless a path of that name exists: the mode meant, and why
#: the value is none.
_MODE_LOOKALIKES = {
    NEVER: (NEVER, "modes are lower case"),
    AUTO: (AUTO, "modes are lower case"),
    "latest": (AUTO, "no mode; 'auto' continues from the checkpoint 'latest' names"),
}


def _as_resume(value: Any) -> str | Path:
    expected = "'never', 'auto' or a checkpoint path"
    if value in (NEVER, AUTO):
        return str(value)
    if isinstance(value, str) and value.lower() in _MODE_LOOKALIKES and not os.path.lexists(value):
        meant, why = _MODE_LOOKALIKES[value.lower()]
        message = (
            f"CheckpointHook.resume must be {expected} (got {value!r}: {why}, and no path of that name exists); "
            f"did you mean resume={meant!r}?"
        )
        raise refused("CheckpointHook", "resume", value, expected, message=message)
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value):
        return Path(value)
    raise refused("CheckpointHook", "resume", value, expected)


@attrs.define(eq=False)
class CheckpointHook:
    """Periodically saves restartable checkpoints; optionally resumes from one when a run starts.

    Cadence: with ``step_interval`` and/or ``epoch_interval`` set, every that many
    completed optimizer steps (checked at AFTER_BATCH of a window's last micro-batch)
    and completed epochs (at AFTER_EPOCH); with neither, whenever the step scheduler
    says ``is_ckpt_step`` (its cadence, the final step, a preemption). A preemption
    signal always saves, and a run that ends with unsaved steps saves once more at
    AFTER_TRAINING. Only real steps save, and never twice for one ``step_count``.
    A save due at an epoch's last step is written at that epoch's AFTER_EPOCH, once
    its end-of-epoch work (validation, epoch-interval LR schedules, the other
    AFTER_EPOCH hooks) is done, so a resume starts the next epoch as a straight run does.

    ``async_save`` snapshots the state (copies it off the live tensors) on the
    training thread, then writes in the background; the next save, the end of
    the run and ``close()`` wait for it. ``async_writer`` says where:
    ``"process"`` (the default on Linux) stages the snapshot in shared memory and
    has a writer process serialise, hash and fsync it, so the write takes nothing
    the training thread needs (not even the GIL); ``"thread"`` writes on a thread
    of this process (and is what other platforms get). ``rank_zero_only`` lets
    only global rank 0 write (the other ranks wait for it); otherwise every rank writes its own
    ``rank_<r>/`` tree. ``keep_last_n`` keeps that many complete checkpoints (and
    always the one ``latest`` names). ``resume``: ``"never"``, ``"auto"`` (continue
    from the latest complete checkpoint in ``checkpoint_dir`` when there is one) or
    the path of a checkpoint to start from; either applies at the start of a run
    that has not stepped yet. ``last_checkpoint_index`` is the step of the last
    checkpoint known to be on disk (async: set when the write completes);
    ``last_saved_step`` the step of the last save taken (async: at once, while it is written).
    """

    plugin_name: ClassVar[str] = "checkpoint"

    checkpoint_dir: Path = attrs.field(converter=_as_dir)
    step_interval: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    epoch_interval: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    async_save: bool = attrs.field(default=False, validator=strict_bool)
    async_writer: str = attrs.field(default=PROCESS, validator=one_of((PROCESS, THREAD)))
    rank_zero_only: bool = attrs.field(default=True, validator=strict_bool)
    keep_last_n: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    resume: str | Path = attrs.field(default=NEVER, converter=_as_resume)

    #: The step of the last checkpoint known to be on disk (async: set when the write completes); an output.
    last_checkpoint_index: int | None = attrs.field(init=False, default=None)

    #: The resolved run config (plain data) stored in each manifest, so a resume can say what changed.
    #: ``nvtrain train`` sets it; None leaves it out.
    run_config: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False)

    _writer: BackgroundWriter = attrs.field(init=False, factory=BackgroundWriter, repr=False)
    #: async_writer="process": the writer process (from the idle ones; handed back at close()), and the
    #: shared-memory arena saves are staged in.
    _process: writer_process.WriterProcess | None = attrs.field(init=False, default=None, repr=False)
    _stager: Stager = attrs.field(init=False, factory=Stager, repr=False)
    _saved_step: int | None = attrs.field(init=False, default=None, repr=False)
    _plugins: dict[str, dict[str, str]] | None = attrs.field(init=False, default=None, repr=False)
    #: async_writer="thread": the snapshot last handed to the writer thread; the next one copies into its buffers.
    _reusable: Any = attrs.field(init=False, default=None, repr=False)
    _last_saved: tuple[int, Path] | None = attrs.field(init=False, default=None, repr=False)
    #: A due save deferred from AFTER_BATCH to the AFTER_VALIDATION that follows the step.
    _after_validation_save: bool = attrs.field(init=False, default=False, repr=False)
    #: A due save at an epoch's last step (this step), deferred from AFTER_BATCH to that epoch's AFTER_EPOCH.
    #: Kept when the epoch's end work raises: the run() that finishes that work saves it then.
    _epoch_end_step: int | None = attrs.field(init=False, default=None, repr=False)
    _root: Path | None = attrs.field(init=False, default=None, repr=False)
    #: The resume decision for the run about to start (``resume_checkpoint``), so its warnings print once;
    #: that run's BEFORE_TRAINING consumes it.
    _resume_choice: tuple[Any, Path | None, frozenset[str]] | None = attrs.field(init=False, default=None, repr=False)
    #: The last resume raised while loading (the strategy may hold part of the state, its counters too): the next
    #: run resumes again instead of taking the in-memory state for a restored one.
    _resume_failed: bool = attrs.field(init=False, default=False, repr=False)
    #: Checkpoints the run's resume found corrupt and passed over: its first save sets them aside.
    _passed_over: frozenset[str] = attrs.field(init=False, default=frozenset(), repr=False)
    #: Saves of models sharded with FSDP (DTensor parameters): one DCP checkpoint written by every rank.
    _sharded: sharded.ShardedSaver = attrs.field(init=False, factory=sharded.ShardedSaver, repr=False)

    @property
    def last_saved(self) -> tuple[int, Path] | None:
        """``(step, directory)`` of the newest checkpoint this hook knows is complete on disk: one it
        wrote (async: once the write finished), the one the run resumed from, or one of ``checkpoint_dir``
        loaded by :meth:`load_into` (``TrainingStrategy.load_checkpoint``). None when there is none.

        Under ``rank_zero_only`` the other ranks learn it at the barrier after rank 0's write.
        """
        return self._last_saved

    # -- reading ---------------------------------------------------------------------------

    def read_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and verify the state at ``path`` (a ``step_<N>`` directory or a checkpoint root)."""
        return storage.read_checkpoint(path)

    def load_into(
        self,
        strategy: nvtrain.TrainingStrategy,
        checkpoint: str | os.PathLike[str] | None = None,
        *,
        data_position: bool = True,
    ) -> Path:
        """Restore ``checkpoint`` (default: the latest under ``checkpoint_dir``) into a set-up ``strategy`` now.

        A sharded checkpoint reshards its weights and optimizer state to this job's ranks.
        ``data_position=False`` leaves out the step scheduler's data position: the way to go on
        with another number of ranks (its samplers differ). The epoch the checkpoint would
        continue starts from its first micro-batch: the saved one when it was saved mid-epoch,
        the next one when it was saved at an epoch's end (a finished epoch is not trained again).
        Every rank calls it. Returns the checkpoint directory.

        ``last_saved_step`` becomes the loaded step (the step the next run starts from). A checkpoint in
        this hook's own directory (``checkpoint_dir``, or this rank's ``rank_<r>/`` tree) also sets
        ``last_checkpoint_index`` and ``last_saved``, as ``resume`` does; one loaded from elsewhere
        leaves them as they were: they name checkpoints this hook's directory holds.
        """
        if not strategy.is_set_up:
            raise RuntimeError(
                "CheckpointHook.load_into: set the strategy up first (strategy.setup(train_loader)), so the models "
                "are sharded and the optimizers exist"
            )
        root = self.checkpoint_dir if checkpoint is None else checkpoint
        directory = storage.resolve_checkpoint(root)
        storage.verify_checkpoint(directory)
        source = f"checkpoint {str(directory)!r}"
        if sharded.is_sharded_checkpoint(directory):
            sharded.load_sharded(strategy, directory, data_position=data_position, source=source)
        else:
            state = self.read_checkpoint(directory)
            load_state(strategy, state if data_position else without_data_position(state), source=source)
        self._loaded(strategy.ctx, directory)
        return directory

    def _loaded(self, ctx: nvtrain.TrainingContext, directory: Path) -> None:
        """Record an explicitly loaded checkpoint: as on disk when it lies in this hook's own directory."""
        step = ctx.step_count
        self._saved_step = step
        own_roots = {_real(self.checkpoint_dir), _real(self.checkpoint_root(ctx))}
        if _real(directory.parent) in own_roots:
            self.last_checkpoint_index = step
            self._last_saved = (step, directory)

    def export(
        self,
        path: str | os.PathLike[str],
        checkpoint: str | os.PathLike[str] | None = None,
        model_key: str | None = None,
        *,
        ema: bool | str = False,
        on_checkpoint: Callable[[Path], object] | None = None,
    ) -> Path:
        """Write one model's weights as one plain ``state_dict`` file, for inference.

        From ``checkpoint`` (a checkpoint directory or root; default: the latest under
        ``checkpoint_dir``), sharded or not: a sharded one is consolidated into full tensors
        in this process. ``model_key`` may be left out when there is one model (or ``ema`` names
        the average by its key; with ``model_key`` too, it must be that model's average).
        ``ema=True`` writes the model's EMA average instead; ``on_checkpoint`` is told the
        checkpoint directory read (see :func:`nvtrain_checkpoint.export_weights`). ``path`` may
        not lie inside the checkpoint root read. The file loads with
        ``torch.load(path, weights_only=True)`` into the plain model.
        """
        source = self.checkpoint_dir if checkpoint is None else checkpoint
        return export_weights(source, path, model_key, ema=ema, on_checkpoint=on_checkpoint)

    def saved_state(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The checkpoint's training state, mapped without reading the tensors' data, so ``nvtrain validate``
        can tell whether its weights fit the models and its data position the run (None: a sharded
        checkpoint, checked as it loads)."""
        return storage.saved_state(path)

    def read_manifest(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """The manifest of the checkpoint at ``path``: step, epoch, versions, ``healthy``, ``run_config``."""
        return storage.read_manifest(storage.resolve_checkpoint(path))

    def checkpoint_root(self, ctx: nvtrain.TrainingContext) -> Path:
        """Where this rank's checkpoints go: ``checkpoint_dir``, or ``checkpoint_dir/rank_<r>``
        when every rank of a multi-process job writes."""
        if self.rank_zero_only or ctx.world_size == 1:
            return self.checkpoint_dir
        return self.checkpoint_dir / f"rank_{ctx.rank}"

    # -- stages ----------------------------------------------------------------------------

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        """Refuse a second checkpoint hook writing to this directory (``nvtrain validate`` runs SETUP too)."""
        mine = Path(os.path.abspath(self.checkpoint_dir))
        for hook in strategy_hooks(ctx.strategy):  # type: ignore[arg-type]
            if hook is self or not isinstance(hook, CheckpointHook):
                continue
            if Path(os.path.abspath(hook.checkpoint_dir)) == mine:
                raise ValueError(
                    f"CheckpointHook.checkpoint_dir: two checkpoint hooks write to {str(mine)!r}; each would replace "
                    "the other's step_<N> directories and latest pointer and rotate the other's checkpoints out "
                    "(keep_last_n). Give each hook its own checkpoint_dir"
                )

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_FIRST)
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Resume (first, so every other hook starts from the restored state).

        The run consumes the resume decision (``resume_checkpoint``), also when it fails: a
        later run with this hook (a retry after a crash) looks at the disk again.
        """
        try:
            self._start_run(ctx)
        finally:
            self._passed_over = self._resume_choice[2] if self._resume_choice is not None else frozenset()
            self._resume_choice = None

    def _start_run(self, ctx: nvtrain.TrainingContext) -> None:
        _require_directory(self.checkpoint_dir)
        self._plugins = _active_plugins(strategy_hooks(ctx.strategy))  # type: ignore[arg-type]
        self._root = self.checkpoint_root(ctx)
        self._after_validation_save = False
        if self._epoch_end_step != ctx.step_count:  # a deferred save belongs to the state it was deferred in
            self._epoch_end_step = None
        # the step the run starts at is on disk; unless its epoch's end raised before it was saved (or was
        # saved anyway, before that end's work was done): this run finishes that work, then saves it
        self._saved_step = ctx.step_count if ctx.step_count and self._epoch_end_step is None else None
        if self.async_save and self._writes(ctx) and self._in_process_writer():
            self._writer_process().start()  # a new one imports torch while the run starts, not at the first save
        if ctx.step_count != 0 and not self._resume_failed:
            return  # restored already (load_checkpoint) or a second run(): the in-memory state is current
        path = self._resume_path(ctx)
        if path is not None:
            self._resume_failed = True  # until the whole state is in
            if sharded.is_sharded_checkpoint(path):  # written by FSDP ranks: loads on any number of ranks
                sharded.load_sharded(ctx.strategy, Path(path))  # type: ignore[arg-type]
            else:
                state = self.read_checkpoint(path)
                load_state(ctx.strategy, state, source=f"checkpoint {str(path)!r}")  # type: ignore[arg-type]
            self._resume_failed = False
            self._saved_step = ctx.step_count
            self.last_checkpoint_index = ctx.step_count
            self._last_saved = (ctx.step_count, Path(path))
            if ctx.rank == 0:  # a per-run message: once, not once per rank
                logger.info("resumed from %s at step %d (epoch %d)", path, ctx.step_count, ctx.epoch + 1)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        """Save after the last micro-batch of a window, once every other hook has finished with it.

        A step that ends its epoch, or the run inside one (``max_steps``), is saved at AFTER_EPOCH
        instead: the epoch's (or the run's final) validation and the epoch-interval LR schedules run
        after this stage, and a resumed run would not redo them.
        """
        if not ctx.sync_gradients:
            return
        scheduler = ctx.scheduler if ctx.windowed else None  # standalone train_batch(): no scheduler decides
        if not self._due(ctx, scheduler):
            return
        if scheduler is not None and (scheduler.is_last_batch or scheduler.is_last_step):
            self._epoch_end_step = ctx.step_count
        elif ctx.validation_follows:
            self._after_validation_save = True  # the checkpoint holds what this step's validation changes
        else:
            self._save(ctx)

    def _due(self, ctx: nvtrain.TrainingContext, scheduler: Any) -> bool:
        """Is the step just closed to be saved? A preemption always; otherwise a real step on the cadence."""
        if scheduler is not None and scheduler.sigterm_received:
            return True
        if ctx.step_skipped:
            return False
        if self.step_interval is not None or self.epoch_interval is not None:
            return self.step_interval is not None and ctx.step_count % self.step_interval == 0
        return scheduler is not None and bool(scheduler.is_ckpt_step)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        """Save a step whose validation followed its boundary, once every AFTER_VALIDATION hook has run.

        A validation at the step this run resumed from (the epoch-end validation a preemption left owed)
        changes what that step's checkpoint holds: it is written again, so a run that ends right there
        (early stopping, another preemption) or crashes before its next save resumes past it.
        """
        if self._after_validation_save:
            self._after_validation_save = False
            self._save(ctx)
        elif ctx.windowed and ctx.step_count == self._saved_step:
            self._save(ctx, again=True)

    @nvtrain.hookimpl(wrapper=True, priority=nvtrain.PRIORITY_LAST)  # the innermost wrapper: right after the rest
    def after_epoch(self, ctx: nvtrain.TrainingContext) -> Iterator[None]:
        """Save a due epoch-end step (or, with ``epoch_interval``, every N-th completed epoch) once the epoch's
        end-of-epoch work (validation, epoch-interval LR schedules, every AFTER_EPOCH hook) is done.

        A wrapper, so that the step is saved also when another AFTER_EPOCH hook raises: in one
        process it is written then, with a warning, rather than lost with the epoch. Across ranks
        a save is collective, and a rank that failed alone cannot make one: it is named instead.
        """
        try:
            result = yield
        except Exception as err:
            if self._epoch_end_step == ctx.step_count:
                self._rescue_epoch_end(ctx, err)
            raise
        self._epoch_end(ctx)
        return result

    def _rescue_epoch_end(self, ctx: nvtrain.TrainingContext, err: Exception) -> None:
        """AFTER_EPOCH raised before the deferred epoch-end save: write it in one process, else say it is lost.

        The save stays due: a ``run()`` of the same strategy that finishes the epoch's end work writes
        the step again, complete.
        """
        if _distributed(ctx):
            err.add_note(f"CheckpointHook: the checkpoint of step {ctx.step_count} (the epoch's end) was not written")
            return
        logger.warning(
            "an AFTER_EPOCH hook raised %s; saving step %d (the epoch's end) anyway, its end-of-epoch work may be "
            "incomplete",
            type(err).__name__,
            ctx.step_count,
        )
        try:
            self._save(ctx)
        except Exception as save_err:
            err.add_note(f"CheckpointHook: saving step {ctx.step_count} failed too: {save_err!r}")

    def _epoch_end(self, ctx: nvtrain.TrainingContext) -> None:
        deferred = self._epoch_end_step == ctx.step_count
        self._epoch_end_step = None
        # the scheduler has moved to the next epoch only when this one's data was used up
        completed = ctx.windowed and ctx.scheduler is not None and ctx.scheduler.epoch > ctx.epoch
        on_interval = self.epoch_interval is not None and (ctx.epoch + 1) % self.epoch_interval == 0
        if deferred or (completed and on_interval):
            self._save(ctx)

    @nvtrain.hookimpl(priority=nvtrain.PRIORITY_LAST)
    def after_training(self, ctx: nvtrain.TrainingContext) -> None:
        """Save unsaved progress (a preempted or finished run), then wait until it is on disk."""
        if ctx.step_count > 0:
            self._save(ctx)
        self._writer.wait()  # idle unless this rank writes (every rank does for sharded checkpoints)
        if self.rank_zero_only and _distributed(ctx):
            torch.distributed.barrier()
            if not self._writes(ctx) and self._saved_step is not None:
                self._mark_saved(self._saved_step, wrote=False)  # rank 0's write finished before the barrier

    def flush(self) -> None:
        """Wait until the write in flight (``async_save``) is on disk and the checkpoints retention dropped
        are deleted; an error of either is raised here."""
        self._writer.wait()

    def close(self) -> None:
        """Flush, stop the background thread and hand the writer process back (the strategy calls this on
        exit, also after an error). The writer is kept for a later run in this process; idle ones exit with it."""
        self._reusable = None
        try:
            self._writer.close()
        finally:
            process, self._process = self._process, None
            if process is not None:
                writer_process.release(process)  # kept for a later run in this process
            self._stager.release()
            self._sharded.close()

    def _writer_process(self) -> writer_process.WriterProcess:
        if self._process is None:
            self._process = writer_process.acquire()
        return self._process

    def _in_process_writer(self) -> bool:
        """Does a background save go to the writer process (``async_writer="process"`` where it can)?"""
        if self.async_writer != PROCESS:
            return False
        if shared_memory_supported():
            return True
        _warn_no_process_writer()
        return False

    # -- saving ----------------------------------------------------------------------------

    @property
    def last_saved_step(self) -> int | None:
        """The step whose state this hook last took for a checkpoint, on disk or (``async_save``) still being
        written; before the run's first save, the step it started from (None for a fresh start)."""
        return self._saved_step

    def _writes(self, ctx: nvtrain.TrainingContext) -> bool:
        return not self.rank_zero_only or ctx.rank == 0

    def _save(self, ctx: nvtrain.TrainingContext, *, again: bool = False) -> None:
        step = ctx.step_count
        if step == self._saved_step and not again:
            return
        self._saved_step = step
        # the run's first save sets aside what its resume found corrupt; later ones must not (a step
        # saved again since, replacing the corrupt one, is intact)
        passed_over, self._passed_over = self._passed_over, frozenset()
        if sharded.models_are_sharded(ctx):
            self._writer.wait()  # this rank's part of the previous save is complete before the next
            self._sharded.save(
                ctx,
                self.checkpoint_dir,
                step,
                self._metadata(ctx),
                keep_last_n=self.keep_last_n,
                passed_over=passed_over,
                async_save=self.async_save,
                rank_zero_only=self.rank_zero_only,
                submit=self._writer.submit,
                discard=self._delete_in_background,
                on_published=functools.partial(self._written, step),
            )
            return
        writes = self._writes(ctx)
        if writes:
            self._writer.wait()  # the previous write is complete (or its error surfaces) before the next
        gathered = None
        if self.rank_zero_only and _distributed(ctx):
            # One collective: every rank's RNG state for rank 0 to save, and the point where no rank
            # passes before rank 0's previous write finished.
            gathered = [None] * ctx.world_size
            torch.distributed.all_gather_object(gathered, capture_rng_state(ctx.train_loader))
        if writes:
            state = capture_state(ctx.strategy)  # type: ignore[arg-type]
            if gathered is not None:
                state["rng_by_rank"] = gathered
            # The previous write is complete (waited for above), so its buffers are free to take the new
            # copy. A synchronous save writes before training resumes: host tensors need no copy.
            root, metadata = self.checkpoint_root(ctx), self._metadata(ctx)
            job: Callable[[], Path]
            if self.async_save and self._in_process_writer():
                staged = self._stager.stage(state)  # into shared memory, for the writer process
                job = functools.partial(
                    self._writer_process().save, staged, root, step, metadata, self.keep_last_n, passed_over
                )
            else:
                copied = snapshot(state, reuse=self._reusable, copy_host=self.async_save)
                self._reusable = copied if self.async_save else None
                # In the background a save deletes what retention dropped itself; a synchronous one hands
                # that to the background writer, which is idle then.
                discard = storage.delete_trash if self.async_save else self._delete_in_background
                job = functools.partial(
                    storage.save_checkpoint,
                    root,
                    step,
                    copied,
                    metadata,
                    self.keep_last_n,
                    discard=discard,
                    passed_over=passed_over,
                )
            if self.async_save:
                task = f"writing {storage.checkpoint_name(step)} in the background (async_save=True)"
                self._writer.submit(job, task, functools.partial(self._written, step))
            else:
                job()
                self._mark_saved(step)
        if self.rank_zero_only and _distributed(ctx) and not self.async_save:
            torch.distributed.barrier()  # nobody races ahead of a half-written checkpoint
            if not writes:
                self._mark_saved(step, wrote=False)

    def _delete_in_background(self, trash: list[Path]) -> None:
        """Delete the checkpoints a synchronous save's retention dropped on the background writer.

        They are already renamed out of sight; what is left is freeing their files, and
        unlinking a large file that is still in the page cache takes as long as writing a
        small one (about 70 ms for 268 MB on ext4). The next save, the end of the run,
        :meth:`flush` and :meth:`close` wait for it, so leftovers never race the next save.
        """
        names = ", ".join(path.name for path in trash)
        self._writer.submit(
            functools.partial(storage.delete_trash, trash), f"deleting {names} in the background (keep_last_n={self.keep_last_n})"
        )

    def _written(self, step: int, path: Path) -> None:
        self._mark_saved(step)

    def _mark_saved(self, step: int, *, wrote: bool = True) -> None:
        if wrote:
            self.last_checkpoint_index = step
        root = self._root if self._root is not None else self.checkpoint_dir
        self._last_saved = (step, root / storage.checkpoint_name(step))

    def _metadata(self, ctx: nvtrain.TrainingContext) -> dict[str, Any]:
        if self._plugins is None:
            self._plugins = _active_plugins(strategy_hooks(ctx.strategy))  # type: ignore[arg-type]
        return {
            "epoch": ctx.epoch,
            "healthy": _loss_is_finite(ctx),
            "global_step_count": ctx.global_step_count,
            "world_size": ctx.world_size,
            "nvtrain_version": nvtrain.__version__,
            "plugins": self._plugins,
            **({"run_config": self.run_config} if self.run_config is not None else {}),
        }

    # -- resuming --------------------------------------------------------------------------

    def resume_checkpoint(self, rank: int = 0, world_size: int = 1) -> Path | None:
        """The checkpoint a run starting now resumes from, verified against its manifest; None for a fresh start.

        ``resume="auto"`` takes the checkpoint ``latest`` names, or when that one is
        missing or broken the highest intact step: one that is incomplete (no manifest)
        or corrupt (size or sha256 differ) is passed over with a warning naming it and
        the one used instead; when ``step_<N>`` directories exist but none is intact,
        :class:`~nvtrain_checkpoint.CheckpointError` naming them. An explicit path must
        be intact (CheckpointError naming the file otherwise). The answer is kept for the
        run about to start (``nvtrain train`` asks before it, and the run's BEFORE_TRAINING
        gets the same answer without reading the disk again); that run consumes it, so a
        later run with this hook decides afresh.
        """
        if self._resume_choice is not None and self._resume_choice[0] == (self.resume, rank, world_size):
            return self._resume_choice[1]
        root = self.checkpoint_dir if self.rank_zero_only or world_size == 1 else self.checkpoint_dir / f"rank_{rank}"
        _require_directory(self.checkpoint_dir)
        passed_over: frozenset[str] = frozenset()
        if self.resume == NEVER:
            chosen = None
        elif self.resume != AUTO:
            chosen = storage.resolve_checkpoint(self.resume, rank)
            storage.verify_checkpoint(chosen)
        else:
            chosen, passed_over = _newest_intact(root, warn=rank == 0)
        self._resume_choice = ((self.resume, rank, world_size), chosen, passed_over)
        return chosen

    def _resume_path(self, ctx: nvtrain.TrainingContext) -> Path | None:
        if self.resume == NEVER:
            if self._writes(ctx) and storage.latest_checkpoint(self.checkpoint_root(ctx)) is not None:
                warnings.warn(
                    f"CheckpointHook: {self.checkpoint_root(ctx)} already holds checkpoints and resume='never'; "
                    "this run starts fresh and replaces same-numbered ones (resume='auto' continues instead)",
                    stacklevel=2,
                )
            return None
        found = self.resume_checkpoint(ctx.rank, ctx.world_size)
        if self.resume != AUTO or not _distributed(ctx):
            return found
        return _agree(ctx, self.checkpoint_root(ctx), found, shared=self.rank_zero_only)


def _loss_is_finite(ctx: nvtrain.TrainingContext) -> bool | None:
    """Whether the saved step's loss was finite (one host read per checkpoint); None when no loss exists."""
    loss = ctx.loss
    if not isinstance(loss, torch.Tensor):
        return None
    return bool(torch.isfinite(loss.detach()).all())


def _newest_intact(root: Path, *, warn: bool) -> tuple[Path | None, frozenset[str]]:
    """The checkpoint to resume from under ``root``: the one ``latest`` names, else the highest step, that
    passes verification, and the names of the complete ones it passed over as corrupt; warn about newer
    ones that do not pass.

    The pointer wins over a higher complete step it does not name (a kill between publishing that
    step and writing ``latest``). ``step_<N>`` directories with none of them intact (corrupt, or
    without a manifest) raise a CheckpointError naming them: a resume never silently starts afresh.
    A checkpoint in a newer format stops the resume (see :func:`_refuse_newer_format`).
    """
    complete = storage.list_checkpoints(root)
    for info in complete:
        _refuse_newer_format(info.path)
    pointed = storage.latest_checkpoint(root)
    order = [info.path for info in reversed(complete)]
    if pointed is not None and pointed in order:  # the pointer wins over a higher step it does not name
        order.remove(pointed)
        order.insert(0, pointed)
    newest_step = complete[-1].step if complete else -1
    incomplete = storage.incomplete_checkpoints(root)
    skipped = [_no_manifest(info.path) for info in incomplete if info.step > newest_step]
    chosen = None
    corrupt = set()
    for path in order:
        try:
            storage.verify_checkpoint(path)
        except storage.CheckpointError as err:
            skipped.append(str(err))
            corrupt.add(path.name)
            continue
        chosen = path
        break
    if chosen is None and (order or incomplete):
        older = [_no_manifest(info.path) for info in incomplete if info.step <= newest_step]
        raise storage.CheckpointError(
            f"no intact checkpoint in {root} to resume from: " + "; ".join(skipped + older)
            + " (delete the broken ones, or set resume: never to start afresh)"
        )
    if skipped and chosen is not None and warn:
        logger.warning("resume: passing over %s; resuming from %s instead", "; ".join(skipped), chosen)
    return chosen, frozenset(corrupt)


def _refuse_newer_format(path: Path) -> None:
    """Stop the resume at a checkpoint in a newer format than this nvtrain-checkpoint reads.

    It is no damage: a later version wrote it intact. Passed over as corrupt it would be set
    aside, and a run resumed from an older step would replace it with its save of that step
    or rotate it out (``keep_last_n``); so no run of this version resumes in its directory.
    """
    message = storage.newer_format_message(
        path, storage.raw_manifest(path), instead="set checkpoint_dir to another directory to run without it"
    )
    if message is not None:  # None: this format, or one no version writes (damage: passed over as such)
        raise storage.CheckpointError(message)


def _require_directory(path: Path) -> None:
    """Refuse a ``checkpoint_dir`` that cannot be a directory (it, or a folder above it, is a file): one clear
    line naming the field, before anything reads or writes under it."""
    blocking = blocking_file(path)
    if blocking is not None:
        expected = "a directory (or a path where one can be created)"
        where = "is a file" if blocking == path else f"lies under {str(blocking)!r}, which is a file"
        message = f"CheckpointHook.checkpoint_dir must be {expected}; {str(path)!r} {where}"
        raise refused("CheckpointHook", "checkpoint_dir", str(path), expected, message=message, error=FieldTypeError)


def _real(path: Path) -> Path:
    """``path`` with links and ``..`` resolved, so two spellings of one directory compare equal."""
    return Path(os.path.realpath(path))


def _no_manifest(path: Path) -> str:
    return f"{path} is incomplete (no {storage.MANIFEST_NAME})"


@functools.cache
def _warn_no_process_writer() -> None:
    warnings.warn(
        f"CheckpointHook: async_writer='process' needs memfd shared memory (Linux); on {sys.platform} background "
        "saves are written by a thread of this process instead (async_writer='thread')",
        stacklevel=3,
    )


def _distributed(ctx: nvtrain.TrainingContext) -> bool:
    return ctx.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def _agree(ctx: nvtrain.TrainingContext, root: Path, found: Path | None, shared: bool) -> Path | None:
    """Make every rank resume from the same step (one all_reduce)."""
    step = -1 if found is None else storage.checkpoint_step(found)
    device = collective_device(None, ctx.device)
    both = torch.tensor([step, -step], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    highest, lowest = int(both[0]), -int(both[1])
    if highest == lowest:
        return found
    if shared:
        seen = f"steps {lowest} to {highest}" if lowest >= 0 else f"none on some ranks, step {highest} on others"
        raise storage.CheckpointError(
            f"ranks see different latest checkpoints in {root} ({seen}); with "
            "rank_zero_only=True checkpoint_dir must be storage every rank shares"
        )
    if lowest < 0:
        raise storage.CheckpointError(
            f"some ranks have no complete checkpoint under {root.parent} while others reach step {highest}"
        )
    chosen = storage.checkpoint_path(root, storage.checkpoint_name(lowest))
    if not (chosen / storage.MANIFEST_NAME).is_file():
        raise storage.CheckpointError(f"{chosen} is missing on rank {ctx.rank}; the ranks cannot agree on a step")
    return chosen


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _active_plugins(hooks: list[object]) -> dict[str, dict[str, str]]:
    """``{plugin_name: {"distribution": ..., "version": ...}}`` of the hooks that name a plugin."""
    plugins: dict[str, dict[str, str]] = {}
    for hook in hooks:
        name = getattr(hook, "plugin_name", None)
        if not isinstance(name, str) or name in plugins:
            continue
        top = type(hook).__module__.partition(".")[0]
        distribution = (_distributions().get(top) or [top])[0]
        version = storage.running_version(distribution) or storage.running_version(top) or storage.UNKNOWN_VERSION
        plugins[name] = {"distribution": distribution, "version": version}
    return plugins
