"""Two gloo ranks: rank_zero_only writes once (rank 1 writes nothing and waits), every rank can load
it and gets its own RNG state back; without rank_zero_only each rank writes and reads its own tree."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvtrain.testing import free_port

pytestmark = pytest.mark.slow


def test_two_gloo_ranks(tmp_path: Path, run_driver: Callable[..., str]) -> None:
    run_driver("gloo", str(tmp_path), str(free_port()), str(tmp_path / "report"), timeout=150)
    reports: list[dict[str, Any]] = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    every_third = [3, 6, 9, 12, 15, 18]

    shared = [report["shared"] for report in reports]
    assert shared[0]["written"] == every_third and shared[1]["written"] == []
    assert {p.name for p in (tmp_path / "shared").iterdir()} == {"latest", *(f"step_{s}" for s in [*every_third, 21, 24, 27])}
    for rank in (0, 1):
        assert shared[rank]["loaded_step"] == 18
        assert shared[rank]["rng_by_rank"] == 2
        assert shared[rank]["rng_restored"], f"rank {rank} did not get its own RNG state back"
    assert shared[0]["weights_equal"]  # rank 0's weights are the ones saved
    assert shared[0]["last_checkpoint_index"] == 18 and shared[1]["last_checkpoint_index"] is None
    # started again with resume="auto" and one more epoch: both ranks continue from step 18
    assert [s["extended"] for s in shared] == [
        {"step_count": 27, "written": [21, 24, 27]},
        {"step_count": 27, "written": []},
    ]

    per_rank = [report["per_rank"] for report in reports]
    for rank in (0, 1):
        assert per_rank[rank]["written"] == every_third
        assert per_rank[rank]["loaded_step"] == 18 and per_rank[rank]["weights_equal"] and per_rank[rank]["rng_restored"]
        assert (tmp_path / "per_rank" / f"rank_{rank}" / "step_18" / "manifest.json").is_file()
        assert per_rank[rank]["extended"] == {"step_count": 27, "written": [21, 24, 27]}
