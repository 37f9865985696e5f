"""nvtrain-profiler: torch.profiler Chrome traces of nvtrain training runs, one folder per rank.

    profiler = TorchProfilerHook(output_dir="profiles/run-1", schedule=torch.profiler.schedule(wait=2, warmup=2, active=5))
    strategy = nvtrain.TrainingStrategy(..., hooks=[profiler])

The hook is also reachable as ``nvtrain.hooks.TorchProfilerHook`` and as plugin ``profiler``.
"""

from __future__ import annotations

from nvtrain_profiler.hook import TorchProfilerHook

__all__ = ["TorchProfilerHook"]

#: The hook classes this plugin provides; the first is what ``nvtrain.plugins.load("profiler")`` builds.
__nvtrain_hooks__ = (TorchProfilerHook,)
