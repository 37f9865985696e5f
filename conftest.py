"""Fixtures shared by the core tests, the plugins' tests and the benchmarks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

#: The variables torchrun sets; a test that builds a process group of its own clears them.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real gloo process group of one process (an in-memory store: no ports, no torchrun variables)."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
