"""nvtrain-ema: an exponential moving average of a model's weights, updated on real optimizer steps.

    ema = EMAHook(model_key="main", decay=0.999)
    strategy = nvtrain.TrainingStrategy(..., hooks=[ema])
    averaged = ema.get_averaged_model()

The hook is also reachable as ``nvtrain.hooks.EMAHook`` and as plugin ``ema``.
"""

from __future__ import annotations

from nvtrain_ema.hook import EMAHook, ShardedAverage, unwrap_model

__all__ = ["EMAHook", "ShardedAverage", "unwrap_model"]

#: The hook classes this plugin provides; the first is what ``nvtrain.plugins.load("ema")`` builds.
__nvtrain_hooks__ = (EMAHook,)
