"""The update path: BEFORE_BATCH, DO_BACKWARD, DO_OPTIMIZER_STEP and AFTER_OPTIMIZER_STEP
through the orchestrator with 0 to 4 no-op update hooks.

No optimizer is bound and the loss's ``backward()`` does nothing, so what is timed is
dispatch: the bus (``nvtrain``), the orchestrator's implementations called through
pluggy directly (the baseline), and a plain loop calling every update hook on each of
its stages (the floor, without the orchestrator's veto and loss bookkeeping).
Times are per sweep of the four stages.

    python -m pytest benchmarks/test_update_path.py
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import update_path_workloads

UPDATE_HOOKS = (0, 1, 2, 3, 4)
KINDS = {"pluggy_direct_baseline": "pluggy", "nvtrain_bus": "nvtrain", "plain_loop": "plain"}


@pytest.mark.parametrize("update_hooks", UPDATE_HOOKS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("kind", list(KINDS))
def test_update_sweep(benchmark: Any, time_sweep: Any, kind: str, update_hooks: int) -> None:
    workload = update_path_workloads(update_hooks)[KINDS[kind]]
    benchmark.group = f"update path: 4 stages, {update_hooks} update hooks"
    time_sweep(workload, suite="update_path", kind=KINDS[kind], update_hooks=update_hooks)
