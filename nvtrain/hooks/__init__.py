"""Built-in hooks, and (lazily) the hook classes of installed plugins.

``from nvtrain.hooks import GradientAccumulationHook`` imports a built-in;
``from nvtrain.hooks import MixedPrecisionHook`` imports the class from the
installed ``nvtrain-amp`` distribution, or raises ImportError naming it. The
base classes a hook author subclasses are here too, where the reference
documents import them from.
"""

from __future__ import annotations

from typing import Any

# --- the base classes of hooks ---------------------------------------------------
from nvtrain.hook import CheckpointableHook, Hook, TrainingUpdateHook

# --- built-in hooks (core update policies and observers) -----------------------
from nvtrain.hooks.accumulation import GradientAccumulationHook
from nvtrain.hooks.clipping import GradientClippingHook
from nvtrain.hooks.early_stopping import EarlyStoppingHook
from nvtrain.hooks.finetune import ModulePatchHook, TrainableParameterHook
from nvtrain.hooks.spike_skip import SpikeSkipHook
from nvtrain.hooks.timing import StageTimingHook
from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook, TensorBoardHook

__all__: list[str] = [
    "CSVLoggerHook",
    "CheckpointableHook",
    "EarlyStoppingHook",
    "GradientAccumulationHook",
    "GradientClippingHook",
    "Hook",
    "ModulePatchHook",
    "ProgressBarHook",
    "SpikeSkipHook",
    "StageTimingHook",
    "TensorBoardHook",
    "TrainableParameterHook",
    "TrainingUpdateHook",
]


# --- lazily re-exported plugin hooks --------------------------------------------
#: The plugins nvtrain ships: class name -> (distribution, module). Installed, a class
#: resolves from that plugin's own declaration (its entry point's ``__nvtrain_hooks__``);
#: this table only names the distribution to install when it is missing. Classes of any
#: other installed plugin resolve from their declarations alone.
PLUGIN_HOOK_CLASSES: dict[str, tuple[str, str]] = {
    "MixedPrecisionHook": ("nvtrain-amp", "nvtrain_amp"),
    "EMAHook": ("nvtrain-ema", "nvtrain_ema"),
    "TorchProfilerHook": ("nvtrain-profiler", "nvtrain_profiler"),
    "CheckpointHook": ("nvtrain-checkpoint", "nvtrain_checkpoint"),
    "DDPHook": ("nvtrain-ddp", "nvtrain_ddp"),
    "FSDPHook": ("nvtrain-fsdp", "nvtrain_fsdp"),
}


def __getattr__(name: str) -> Any:
    """Resolve a plugin's hook class on first use, so importing this module imports no plugin.

    Only CapWords names are looked up: dunders and submodule names never import plugins.
    """
    if not name[:1].isupper():
        raise AttributeError(f"module 'nvtrain.hooks' has no attribute {name!r}")
    from nvtrain.plugins import resolve_hook_class

    return resolve_hook_class(name, PLUGIN_HOOK_CLASSES)
