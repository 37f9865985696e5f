"""From a :class:`~nvtrain.config.RunConfig` to a finished run: what ``nvtrain train`` does, in three phases.

1. :func:`prepare` (``checking``) checks everything a config names without
   building a model or touching the disk: import paths resolve, keyword arguments
   fit the factories' signatures, hook names exist (``hook_stack``) and their
   settings pass the hooks' own validators.
2. :func:`build` (``building``) builds model, loaders, optimizer, scheduler and
   strategy, and decides the resume (``resume_plan``); still nothing is written.
   ``nvtrain validate`` then runs one batch through the forward, the loss and the
   metrics (:func:`check_one_batch`, ``batch_check``).
3. Only then does :func:`train` (``running``) create the run directory, run the
   :class:`~nvtrain.TrainingStrategy` and report.

:func:`build_from_checkpoint` (``from_checkpoint``) rebuilds a run from the config
saved with a checkpoint. Exit statuses (``status``, documented in ``docs/cli.md``):
:data:`EXIT_OK`, :data:`EXIT_FAILURE` (training raised; the traceback is printed),
:data:`EXIT_USAGE` (bad config, arguments or resume; one line on stderr),
:data:`EXIT_DIVERGED` (too many skipped steps in a row), :data:`EXIT_PREEMPTED`
(a preemption signal stopped the run after a checkpoint; run the same command
again to resume), :data:`EXIT_PREEMPTED_UNSAVED` (stopped by a preemption
signal, nothing saved) and :data:`EXIT_INTERRUPTED` (a second Ctrl-C).
"""

from __future__ import annotations

from nvtrain.app.batch_check import BatchCheck, check_one_batch
from nvtrain.app.building import Built, build
from nvtrain.app.checking import Plan, prepare
from nvtrain.app.from_checkpoint import build_from_checkpoint, config_import_paths, trusted_packages
from nvtrain.app.hook_stack import builtin_hook_classes
from nvtrain.app.running import TrainOutcome, train
from nvtrain.app.status import (
    EXIT_DIVERGED,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    EXIT_USAGE,
)

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_UNSAVED",
    "EXIT_USAGE",
    "BatchCheck",
    "Built",
    "Plan",
    "TrainOutcome",
    "build",
    "build_from_checkpoint",
    "builtin_hook_classes",
    "check_one_batch",
    "config_import_paths",
    "prepare",
    "train",
    "trusted_packages",
]
