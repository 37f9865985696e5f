"""The last phase of ``nvtrain train``: :func:`train` builds, writes the run directory, trains and reports."""

from __future__ import annotations

import errno
import logging
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from nvtrain.app.building import Built, build, folders_to_create
from nvtrain.app.checking import Plan, env_world_size
from nvtrain.app.resume_plan import with_model_changes
from nvtrain.app.run_watch import RunWatch
from nvtrain.app.status import EXIT_OK, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from nvtrain.errors import ResumeError, TrainingDivergedError, disk_full, one_line
from nvtrain.hook import SavesCheckpoints

logger = logging.getLogger("nvtrain.app")


@attrs.frozen
class TrainOutcome:
    """What :func:`train` reports besides the exit status."""

    exit_code: int
    run_dir: Path
    result: Any
    seconds: float


def train(plan: Plan, *, out: TextIO | None = None) -> TrainOutcome:
    """Build everything, then (only then) write the run directory, train, plot; return the exit status.

    Under torchrun (``WORLD_SIZE > 1``) the process group is set up here and torn
    down at the end; only rank 0 writes the config, the metrics and the plot, and
    prints. Every rank is seeded with ``seed`` while the model and data factories
    run, so a factory drawing from the global generator (``random_split``) gives
    every rank the same model and split; then rank ``r > 0`` with ``seed + r`` before
    training, so dropout and augmentation differ per rank, while rank 0 draws on from
    its stream as a single process does (a resume's checkpoint restores its saved
    states later, in BEFORE_TRAINING). Construction errors raise
    :class:`~nvtrain.config.ConfigError` before anything is written; a diverged run raises
    :class:`~nvtrain.errors.TrainingDivergedError`, once its curves are drawn (the
    loggers wrote its last steps when the strategy closed).
    """
    out = out if out is not None else sys.stdout
    config = plan.config
    manager = None
    if env_world_size() > 1:
        from nvtrain.distributed import DeviceAssignmentError, DistributedManager

        try:  # the config's device decides the backend: device=cpu trains with gloo where GPUs are visible
            manager = DistributedManager.initialize(device=config.device, backend=config.backend)
        except DeviceAssignmentError as err:
            raise plan.loaded.error(str(err), ("backend",) if config.backend is not None else ("device",)) from None
    rank = manager.rank if manager is not None else 0
    started = time.perf_counter()
    threads = torch.get_num_threads()  # cpu_threads is the run's: a caller in-process (a notebook) gets its own back
    try:
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        _seed_everything(config.seed)  # every rank builds the same model and the same data split
        built = build(plan, manager)
        if rank > 0:  # per-rank draws in training; rank 0 goes on as a single process does
            _seed_everything(config.seed + rank)  # (a resume restores its saved states after this)
        if built.resume_from is not None and built.run_length is not None and built.resume_step >= built.run_length:
            if rank == 0:
                print(
                    f"run {plan.run_dir} | already at step {built.resume_step} ({built.resume_from}), nothing to "
                    f"train ({_what_ends_the_run(config, built.run_length)})",
                    file=out,
                    flush=True,
                )
            built.strategy.close()
            return TrainOutcome(exit_code=EXIT_OK, run_dir=plan.run_dir, result=None, seconds=0.0)
        if rank == 0:
            _announce(plan, built)
        strategy = built.strategy
        missing, _ = folders_to_create(plan.run_dir)  # removed again if the run directory cannot be made
        try:
            with strategy:
                try:
                    result = strategy.run(built.train_loader)
                except ResumeError as err:
                    message = f"cannot resume: {with_model_changes(str(err), built)}"
                    raise plan.loaded.error(message, ("hooks",)) from None
        except OSError as err:  # the run directory could not be made after all (the build checked it can)
            refusal = _run_dir_refusal(plan, err)
            if refusal is None:
                raise
            _remove_empty(missing)
            raise refusal from None
        except TrainingDivergedError as err:
            if rank == 0:  # the metrics of the steps it took are worth seeing, the divergence most of all
                try:
                    _plot(plan)
                except Exception as plot_err:  # the divergence stays the error reported
                    err.add_note(f"curves.png was not drawn: {type(plot_err).__name__}: {plot_err}")
            raise
        seconds = time.perf_counter() - started
        code = EXIT_OK
        saved = None
        if result.preempted:
            saved = _saved_checkpoint(plan.hooks)
            code = EXIT_PREEMPTED if saved is not None else EXIT_PREEMPTED_UNSAVED
        if rank == 0:
            _finish(plan, result, seconds, out, built.watch, saved, resumed=built.resume_from is not None)
    finally:
        torch.set_num_threads(threads)
        if manager is not None:
            from nvtrain.distributed import DistributedManager

            DistributedManager.cleanup()
    return TrainOutcome(exit_code=code, run_dir=plan.run_dir, result=result, seconds=seconds)


def _run_dir_refusal(plan: Plan, err: OSError) -> Exception | None:
    """The one-line config error for an OSError raised creating the run directory (or a folder above it), which
    happens before the first step, so nothing was trained; None for any other OSError (a full disk included)."""
    if disk_full(err) is not None or err.filename is None:
        return None
    failed = Path(os.fsdecode(err.filename))
    if failed not in (plan.run_dir, *plan.run_dir.parents) or failed == Path("."):
        return None
    reason = err.strerror or type(err).__name__
    named = failed == plan.run_dir and err.errno == errno.ENAMETOOLONG
    at = "" if failed == plan.run_dir else f" (making {str(failed)!r})"
    return plan.loaded.error(
        f"the run directory {str(plan.run_dir)!r} cannot be created: expected a writable folder, got {reason}{at}",
        ("name",) if named else ("output_dir",),
    )


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove what a failed ``mkdir(parents=True)`` made of ``folders`` (deepest first): a refused run leaves nothing."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # never made, or not empty: not ours to remove
            continue


def _announce(plan: Plan, built: Built) -> None:
    """Rank 0's messages before the first step: a preemption that would save nothing, resume changes."""
    signals = plan.config.trainer.preemption_signal
    savers = [h for h in plan.hooks if isinstance(h, SavesCheckpoints)]
    names = ", ".join(str(s) for s in (signals if isinstance(signals, tuple) else (signals,)))
    if signals and not savers:
        logger.warning(
            "a preemption signal (%s) will stop the run but nothing will be saved: add the checkpoint hook "
            "with resume: auto (hooks: [{name: checkpoint, resume: auto}]) to resume after one",
            names,
        )
    elif signals and not _resumes(savers):
        logger.warning(
            "a preemption signal (%s) will stop the run after a checkpoint, but the checkpoint hook has "
            "resume: never, so rerunning this config would start again from step 0: set resume: auto on it "
            "to continue from the checkpoint",
            names,
        )
    if built.resume_from is not None and built.changes:
        logger.info("resuming from %s with a changed config:", built.resume_from)
        for change in built.changes:
            logger.info("  %s", change.describe())


def _resumes(hooks: Sequence[object]) -> bool:
    """Whether rerunning the config continues from a checkpoint: a checkpoint hook whose ``resume`` is not never."""
    return any(getattr(h, "resume", "never") not in ("never", None) for h in hooks if isinstance(h, SavesCheckpoints))


def _saved_checkpoint(hooks: Sequence[object]) -> tuple[int, Path] | None:
    """The newest checkpoint a checkpoint hook reports complete on disk (its ``last_saved``), or None."""
    found = [saved for h in hooks if isinstance(h, SavesCheckpoints) and (saved := h.last_saved) is not None]
    return max(found, key=lambda item: item[0]) if found else None


def _seed_everything(seed: int) -> None:
    """Seed Python's, torch's (every device's) and numpy's global generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def _plot(plan: Plan) -> None:
    """Draw ``curves.png`` from the run's ``metrics.csv`` (when ``logging.plot`` is on and there are values)."""
    config = plan.config
    metrics_file = plan.run_dir / "metrics.csv"
    if config.logging.plot and config.logging.csv and metrics_file.exists():
        from nvtrain.plotting import PLOT_NAME, plot_metrics, read_metrics

        try:  # the run is done and its metrics are on disk: a plot that fails does not fail it
            if read_metrics(metrics_file):
                plot_metrics(metrics_file, plan.run_dir / PLOT_NAME, title=config.name)
        except Exception as err:
            if isinstance(err, OSError) and disk_full(err) is not None:
                raise  # a full disk is the run's failure to report (its metrics may be cut short too)
            logger.warning(
                "%s was not drawn: %s (draw it later with: nvtrain plot %s)", PLOT_NAME, one_line(err), plan.run_dir
            )


def _finish(
    plan: Plan,
    result: Any,
    seconds: float,
    out: TextIO,
    watch: RunWatch,
    saved: tuple[int, Path] | None,
    *,
    resumed: bool,
) -> None:
    config = plan.config
    _plot(plan)
    # the epoch of the run's last step; a run that took none (it only made a validation a preemption had left
    # owed) reports that validation's epoch, not the next one it would have started
    epoch = next((e for e in (watch.last_step_epoch, watch.validated_epoch) if e is not None), result.epoch)
    total = config.trainer.num_epochs
    summary = [
        f"run {plan.run_dir}",
        f"step {result.step_count}",
        f"epoch {epoch + 1}" + (f"/{total}" if total else ""),
        f"{seconds:.1f} s",
    ]
    if watch.start_step:  # from a checkpoint, or from trainer.start_step alone
        summary.insert(2, f"{'resumed' if resumed else 'started'} at step {watch.start_step}")
    prefix = "val_ema_" if plan.use_ema else "val_"
    values = [
        f"{prefix}{key} {value.item():.4f}"
        for key, value in (result.validation or {}).items()
        if isinstance(value, torch.Tensor) and value.numel() == 1
    ]
    if values and watch.validated_at is not None and watch.validated_at != result.step_count:
        values.append(f"(validated at step {watch.validated_at})")  # not the final weights': say whose
    summary += values
    if result.preempted:
        if saved is not None:
            rerun = "rerun to resume" if _resumes(plan.hooks) else "set resume: auto on the checkpoint hook to resume"
            summary.append(
                f"preempted: checkpoint saved at step {saved[0]} ({saved[1]}), {rerun} (exit status {EXIT_PREEMPTED})"
            )
        else:
            summary.append(
                f"preempted: nothing was saved (no checkpoint hook), a rerun starts from step 0 "
                f"(exit status {EXIT_PREEMPTED_UNSAVED})"
            )
    elif result.stop_reason is not None:
        summary.append(f"stopped early: {result.stop_reason}")
    print(" | ".join(summary), file=out, flush=True)


def _what_ends_the_run(config: Any, run_length: int) -> str:
    """Which bound ends the run at ``run_length``: the run stops at whichever of ``max_steps`` and
    ``num_epochs`` comes first, so raising the other one changes nothing."""
    trainer = config.trainer
    if trainer.max_steps is not None and trainer.max_steps <= run_length:
        return f"trainer.max_steps={trainer.max_steps} ends the run at step {run_length}: raise it"
    if trainer.num_epochs is None:
        return f"one epoch (trainer.num_epochs and max_steps unset) ends the run at step {run_length}: set either"
    if trainer.max_steps is None:
        return f"trainer.num_epochs={trainer.num_epochs} ends the run at step {run_length}: raise it"
    return (
        f"trainer.num_epochs={trainer.num_epochs} ends the run at step {run_length}, before "
        f"trainer.max_steps={trainer.max_steps}: raise trainer.num_epochs"
    )

