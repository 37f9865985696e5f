"""nvtrain-checkpoint: crash-consistent checkpoints, async save and bitwise resume for nvtrain.

    checkpoint = CheckpointHook("runs/my-model/checkpoints", step_interval=500, resume="auto")
    strategy = nvtrain.TrainingStrategy(..., hooks=[checkpoint])

``read_checkpoint(path)`` is what ``TrainingStrategy.restore`` / ``load_checkpoint``
use (found through this distribution's ``checkpoint`` entry point); ``read_checkpoint_manifest(path)``
gives ``load_checkpoint`` the run config saved with a checkpoint written by ``nvtrain train``.
"""

from __future__ import annotations

from nvtrain_checkpoint.export import export_weights
from nvtrain_checkpoint.hook import CheckpointHook
from nvtrain_checkpoint.snapshot import snapshot
from nvtrain_checkpoint.storage import (
    CheckpointError,
    CheckpointInfo,
    CheckpointVersionWarning,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
    read_checkpoint_manifest,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from nvtrain_checkpoint.writer_process import WriterProcessError

__all__ = [
    "CheckpointError",
    "CheckpointHook",
    "CheckpointInfo",
    "CheckpointVersionWarning",
    "WriterProcessError",
    "export_weights",
    "latest_checkpoint",
    "list_checkpoints",
    "read_checkpoint",
    "read_checkpoint_manifest",
    "read_manifest",
    "save_checkpoint",
    "snapshot",
    "verify_checkpoint",
]

#: The hook classes this plugin provides; the first is what ``nvtrain.plugins.load("checkpoint")`` builds.
__nvtrain_hooks__ = (CheckpointHook,)
