"""nvtrain-amp: mixed precision (autocast and, for fp16, GradScaler) as one nvtrain update hook.

    strategy = nvtrain.TrainingStrategy(..., hooks=[MixedPrecisionHook(precision="bf16")])

The hook is also reachable as ``nvtrain.hooks.MixedPrecisionHook`` and as plugin ``amp``.
"""

from __future__ import annotations

from nvtrain_amp.hook import MixedPrecisionHook
from nvtrain_amp.precision import parse_precision, resolve_auto

__all__ = ["MixedPrecisionHook", "parse_precision", "resolve_auto"]

#: The hook classes this plugin provides; the first is what ``nvtrain.plugins.load("amp")`` builds.
__nvtrain_hooks__ = (MixedPrecisionHook,)
