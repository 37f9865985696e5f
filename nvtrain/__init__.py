"""nvtrain: a PyTorch training loop whose 18 stages are pluggy hooks."""

from __future__ import annotations

import importlib
from typing import Any

from nvtrain import schedules
from nvtrain.bus import HookBus
from nvtrain.context import TrainingContext
from nvtrain.distributed import DeviceAssignmentError, DistributedManager
from nvtrain.hook import PRIORITY_FIRST, PRIORITY_LAST, CheckpointableHook, Hook, TrainingUpdateHook
from nvtrain.hookspecs import hookimpl, hookspec
from nvtrain.lr_schedule import LRSchedule
from nvtrain.orchestrator import TrainingUpdateOrchestrator
from nvtrain.stages import TrainingStage
from nvtrain.stash import Stash, StashKey
from nvtrain.step_scheduler import StepScheduler, StepSchedulerConfig
from nvtrain.strategy import RunResult, TrainingStrategy
from nvtrain.validation import ValidationConfig, ValidationLoop

__version__ = "0.1.0"

#: Subpackages ``import nvtrain`` leaves unimported (plugin discovery reads entry points): the first
#: ``nvtrain.plugins.load(...)`` or ``nvtrain.hooks.X`` imports them, as ``import nvtrain.plugins`` would.
_LAZY_SUBMODULES = frozenset({"hooks", "plugins", "testing", "validators"})


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"nvtrain.{name}")
    if name[:1].isupper():  # ``from nvtrain import CheckpointHook``, as the reference documents write it
        hooks = importlib.import_module("nvtrain.hooks")
        if name in hooks.PLUGIN_HOOK_CLASSES:
            return getattr(hooks, name)
    raise AttributeError(f"module 'nvtrain' has no attribute {name!r}")


__all__ = [
    "PRIORITY_FIRST",
    "PRIORITY_LAST",
    "CheckpointableHook",
    "DeviceAssignmentError",
    "DistributedManager",
    "Hook",
    "HookBus",
    "LRSchedule",
    "RunResult",
    "Stash",
    "StashKey",
    "StepScheduler",
    "StepSchedulerConfig",
    "TrainingContext",
    "TrainingStage",
    "TrainingStrategy",
    "TrainingUpdateHook",
    "TrainingUpdateOrchestrator",
    "ValidationConfig",
    "ValidationLoop",
    "__version__",
    "hookimpl",
    "hookspec",
    "schedules",
]
