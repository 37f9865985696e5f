"""The eighteen points in a training run where nvtrain fires hooks."""

from __future__ import annotations

import enum

__all__ = [
    "BATCH_STAGES",
    "REPLACEMENT_STAGES",
    "UPDATE_STAGES",
    "TrainingStage",
]


class TrainingStage(enum.IntEnum):
    """Where a hook fires. Values follow the reference documents (SETUP=1 ... AFTER_VALIDATION=18).

    The loop, with the stage fired at each point, is drawn once: at the top of
    :mod:`nvtrain.hookspecs`, where each stage's hookspec says what it is for.
    """

    SETUP = 1
    BEFORE_TRAINING = 2
    BEFORE_EPOCH = 3
    BEFORE_BATCH = 4
    BEFORE_FORWARD = 5
    AFTER_FORWARD = 6
    BEFORE_LOSS = 7
    AFTER_LOSS = 8
    BEFORE_BACKWARD = 9
    DO_BACKWARD = 10
    AFTER_BACKWARD = 11
    BEFORE_OPTIMIZER_STEP = 12
    DO_OPTIMIZER_STEP = 13
    AFTER_OPTIMIZER_STEP = 14
    AFTER_BATCH = 15
    AFTER_EPOCH = 16
    AFTER_TRAINING = 17
    AFTER_VALIDATION = 18

    @property
    def hook_name(self) -> str:
        """The name of this stage's hookspec (``before_batch`` for BEFORE_BATCH)."""
        return self.name.lower()


#: Stages that fire once per micro-batch.
BATCH_STAGES: frozenset[TrainingStage] = frozenset(
    TrainingStage(v) for v in range(TrainingStage.BEFORE_BATCH, TrainingStage.AFTER_BATCH + 1)
)

#: The two replacement slots: at most one non-wrapper implementation each.
REPLACEMENT_STAGES: frozenset[TrainingStage] = frozenset(
    {TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP}
)

#: Stages a TrainingUpdateHook may run on.
UPDATE_STAGES: frozenset[TrainingStage] = frozenset(
    {
        TrainingStage.BEFORE_BATCH,
        TrainingStage.DO_BACKWARD,
        TrainingStage.DO_OPTIMIZER_STEP,
        TrainingStage.AFTER_OPTIMIZER_STEP,
    }
)
