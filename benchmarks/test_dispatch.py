"""Dispatch: one sweep of all 18 stages with K no-op observers on each of the 16 observer stages.

Three ways to fire the same plugins, measured in the same run:

- ``nvtrain``: the bus's compiled stage callers (what ``TrainingStrategy`` calls);
- ``pluggy`` (the group's baseline): the same plugins' pluggy hook callers, called directly;
- ``plain loop``: a Python loop over the same bound implementations, the floor of calling them at all.

A stage without implementations is part of every sweep (the two DO slots always are:
observers cannot implement them). Times are per sweep.

    python -m pytest benchmarks/test_dispatch.py
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import dispatch_workloads

OBSERVERS = (0, 1, 5, 20)
KINDS = {"pluggy_direct_baseline": "pluggy", "nvtrain_bus": "nvtrain", "plain_loop": "plain"}


@pytest.mark.parametrize("observers", OBSERVERS, ids=lambda k: f"K{k}")
@pytest.mark.parametrize("kind", list(KINDS))
def test_sweep(benchmark: Any, time_sweep: Any, kind: str, observers: int) -> None:
    workload = dispatch_workloads(observers)[KINDS[kind]]
    benchmark.group = f"dispatch: 18-stage sweep, K={observers:02d} observers per stage"
    time_sweep(workload, suite="dispatch", kind=KINDS[kind], observers=observers)
