"""nvtrain-fsdp: fully sharded data parallel (torch FSDP2) on torch.distributed, as one nvtrain plugin.

    strategy = nvtrain.TrainingStrategy(
        ..., distributed_manager=nvtrain.DistributedManager.initialize(), hooks=[FSDPHook()]
    )

Launch with ``torchrun --nproc_per_node=N train.py``. Parameters, gradients and
optimizer state are sharded over the ranks (each holds 1/N of them as DTensor shards).
"""

from __future__ import annotations

from nvtrain_fsdp.hook import FSDPHook
from nvtrain_fsdp.sharding import gathered_state_dict, is_sharded, shard_model

__all__ = ["FSDPHook", "gathered_state_dict", "is_sharded", "shard_model"]

#: The hook classes this plugin provides; the first is what ``nvtrain.plugins.load("fsdp")`` builds.
__nvtrain_hooks__ = (FSDPHook,)
