"""nvtrain-ddp: data-parallel training on torch.distributed (torchrun), as one nvtrain plugin.

    strategy = nvtrain.TrainingStrategy(
        ..., distributed_manager=nvtrain.DistributedManager.initialize(), hooks=[DDPHook()]
    )

Launch with ``torchrun --nproc_per_node=N train.py``.
"""

from __future__ import annotations

from nvtrain_ddp.hook import DDPHook

__all__ = ["DDPHook"]

#: The hook classes this plugin provides; the first is what ``nvtrain.plugins.load("ddp")`` builds.
__nvtrain_hooks__ = (DDPHook,)
