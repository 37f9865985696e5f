"""Fixtures shared by the core tests, the plugins' tests and the benchmarks."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

#: The variables torchrun sets; a test that builds a process group of its own clears them.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables: the process is a single one, whatever the shell it runs in set."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real gloo process group of one process (an in-memory store: no ports, no torchrun variables)."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        _destroy_process_group()


@pytest.fixture
def init_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """torchrun's variables for rank 0 of 2; each ``init_process_group`` call is recorded, then made for one
    rank (an in-memory store instead of a rendezvous that would wait for the second process)."""
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for name, value in (torchrun | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).items():
        monkeypatch.setenv(name, value)
    calls: list[dict[str, Any]] = []
    real_init = dist.init_process_group

    def init_process_group(**kwargs: Any) -> None:
        calls.append(kwargs)
        real_init(kwargs["backend"], store=dist.HashStore(), rank=0, world_size=1)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    try:
        yield calls
    finally:
        _destroy_process_group()


def _destroy_process_group() -> None:
    """Destroy the default group once what the test built on it is gone: DDP wrappers (reference cycles)
    collected while the group lives, never later as the last owner of a destroyed gloo group."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
