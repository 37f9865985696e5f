"""The exit statuses of ``nvtrain train`` (documented in ``docs/cli.md``)."""

from __future__ import annotations

#: The run finished (all epochs or ``max_steps``).
EXIT_OK = 0
#: Training raised an exception (its traceback is printed).
EXIT_FAILURE = 1
#: The config, the command line or the checkpoint to resume from is wrong; nothing was trained or written.
EXIT_USAGE = 2
#: The run stopped as diverged: ``trainer.max_consecutive_skipped_steps`` steps in a row were skipped.
EXIT_DIVERGED = 3
#: A preemption signal stopped the run after a checkpoint (``EX_TEMPFAIL``): requeue and rerun to resume.
EXIT_PREEMPTED = 75
#: A preemption signal stopped the run but no checkpoint hook saved it: a rerun starts from step 0.
EXIT_PREEMPTED_UNSAVED = 76
#: A second Ctrl-C aborted the run at once (128 + SIGINT, the shell's convention).
EXIT_INTERRUPTED = 130
