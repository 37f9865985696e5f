"""What a background checkpoint write costs a loop that keeps the GIL busy: writer thread against writer process.

A launch-bound training loop spends its time in Python (dispatching small kernels), so it
wants the GIL all the time. Each round times ``STEPS`` host-bound steps (small torch ops:
the host side of a launch-bound step) started just after a background save of a 64 MB
state; the write takes longer than the steps, so every timed step runs during it (the
write is waited for in the next round's setup, untimed). The target for a background
write is at most 1.05x the steps without one. Candidates, in the same run:

Two kinds of step: small torch ops (they let go of the GIL inside each op) and pure
Python (it never does: the worst case for a writer thread).

- baseline: the steps alone, no write;
- writer thread: ``save_checkpoint`` on a thread of this process (``async_writer="thread"``);
- writer process: the state staged in shared memory, written by the writer process
  (``async_writer="process"``, the default).

``extra_info`` has the write's own time (median and minimum): a thread writer is slowed by the
steps as much as it slows them.

    python -m pytest benchmarks/test_background_write.py
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("nvtrain_checkpoint")
from nvtrain_checkpoint import storage
from nvtrain_checkpoint.snapshot import snapshot
from nvtrain_checkpoint.staging import Stager, shared_memory_supported
from nvtrain_checkpoint.writer_process import WriterProcess

STATE_MB = 64
STEPS = 2000


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    count = STATE_MB * 10**6 // 4 // 4
    return {"model": {f"w{index}": torch.randn(count, generator=generator) for index in range(4)}}


def _torch_steps() -> None:
    """A launch-bound step's host side: many small ops, each a trip through the dispatcher."""
    weight, grad = torch.ones(64), torch.full((64,), 1e-3)
    for _ in range(STEPS):
        for _ in range(20):
            weight.sub_(grad)


def _python_steps() -> None:
    """Steps that never let go of the GIL (Python bookkeeping, a tokenizer): the worst case for a thread."""
    total = 0
    for step in range(STEPS):
        for item in range(200):
            total += item ^ step


#: step kind -> (steps, benchmark group)
KINDS: dict[str, tuple[Callable[[], None], str]] = {
    "torch ops": (_torch_steps, f"background write of {STATE_MB} MB during {STEPS} steps of small torch ops"),
    "pure Python": (_python_steps, f"background write of {STATE_MB} MB during {STEPS} pure-Python steps"),
}


@pytest.fixture(scope="module")
def writer() -> Iterator[WriterProcess]:
    process = WriterProcess()
    process.wait_until_ready()  # its start-up is a once-per-run cost, not a per-write one
    yield process
    process.close()


def _time(benchmark: Any, kind: str, write: Callable[[int], Any] | None) -> None:
    """Time ``STEPS`` steps started just after a write; each round's write is joined in the next setup."""
    rounds = iter(range(1, 10**6))
    writes: list[float] = []
    writing: list[threading.Thread] = []

    def finish() -> None:
        while writing:
            writing.pop().join()

    def start_a_write() -> None:
        finish()  # the previous round's write, outside the timed region
        if write is None:
            return
        step = next(rounds)

        def run() -> None:
            start = time.perf_counter()
            write(step)
            writes.append((time.perf_counter() - start) * 1e3)

        writing.append(threading.Thread(target=run))
        writing[0].start()

    steps, benchmark.group = KINDS[kind]
    benchmark.pedantic(steps, setup=start_a_write, rounds=7, iterations=1, warmup_rounds=1)
    finish()
    if writes:  # every round's steps ran inside its write only if the write took longer
        benchmark.extra_info["write_ms_median"] = round(statistics.median(writes), 1)
        benchmark.extra_info["write_ms_min"] = round(min(writes), 1)


@pytest.mark.parametrize("kind", KINDS)
def test_steps_without_a_write_baseline(benchmark: Any, kind: str) -> None:
    _time(benchmark, kind, None)


@pytest.mark.parametrize("kind", KINDS)
def test_steps_while_a_thread_writes(benchmark: Any, tmp_path: Path, kind: str) -> None:
    copied = snapshot(_state())
    _time(benchmark, kind, lambda step: storage.save_checkpoint(tmp_path, step, copied, {}, keep_last_n=1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.skipif(not shared_memory_supported(), reason="the writer process needs memfd (Linux)")
def test_steps_while_the_writer_process_writes(
    benchmark: Any, tmp_path: Path, writer: WriterProcess, kind: str
) -> None:
    stager = Stager()
    staged = stager.stage(_state())
    try:
        _time(benchmark, kind, lambda step: writer.save(staged, tmp_path, step, {}, 1))
    finally:
        stager.release()
