"""What a background checkpoint write costs a loop that keeps the GIL busy: writer thread against writer process.

A launch-bound training loop spends its time in Python (dispatching small kernels), so it
wants the GIL all the time. Each round times ``STEPS`` host-bound steps while saves of a
64 MB state run back to back in the background, so every timed step overlaps a write
(the last write is waited for after the clock stops). The target for a background write
is at most 1.05x the steps without one. Candidates, in the same run:

Two kinds of step: small torch ops (they let go of the GIL inside each op) and pure
Python (it never does: the worst case for a writer thread).

- baseline: the steps alone, no write;
- writer thread: ``save_checkpoint`` on a thread of this process (``async_writer="thread"``);
- writer process: the state staged in shared memory, written by the writer process
  (``async_writer="process"``, the default).

``extra_info`` has the writes' median time and count: a thread writer is slowed by the steps
as well as slowing them.

A second group times one save from start to end while the benchmark thread spins in Python
(the writer process is its baseline); ``extra_info`` has the time the spinning loop stood
still meanwhile (``loop_lost_ms_median``): what the write took from it.

    python -m pytest benchmarks/test_background_write.py
"""

from __future__ import annotations

import itertools
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
STEPS = 4000


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


def _time(benchmark: Any, kind: str, write: Callable[[int], Any] | None, rounds: int) -> None:
    """Time ``STEPS`` steps while writes run back to back in the background (started in the setup,
    stopped in the teardown: waiting for the last one is not timed), so every timed step overlaps a write."""
    numbers = itertools.count(1)
    writes: list[float] = []
    stop = threading.Event()
    writing: list[threading.Thread] = []

    def keep_writing() -> None:
        assert write is not None
        while not stop.is_set():
            start = time.perf_counter()
            write(next(numbers))
            writes.append((time.perf_counter() - start) * 1e3)

    def setup() -> None:
        if write is not None:
            stop.clear()
            writing.append(threading.Thread(target=keep_writing))
            writing[-1].start()
            time.sleep(0.005)  # the write is under way before the clock starts

    def teardown(*args: Any) -> None:
        stop.set()
        while writing:
            writing.pop().join()

    steps, benchmark.group = KINDS[kind]
    benchmark.pedantic(steps, setup=setup, teardown=teardown, rounds=rounds, iterations=1, warmup_rounds=1)
    if writes:
        benchmark.extra_info["write_ms_median"] = round(statistics.median(writes), 1)
        benchmark.extra_info["writes"] = len(writes)


@pytest.mark.parametrize("kind", KINDS)
def test_steps_without_a_write_baseline(benchmark: Any, kind: str, scale: Any) -> None:
    _time(benchmark, kind, None, scale.pick(15, 5))


@pytest.mark.parametrize("kind", KINDS)
def test_steps_while_a_thread_writes(benchmark: Any, tmp_path: Path, kind: str, scale: Any) -> None:
    copied = snapshot(_state())
    _time(
        benchmark,
        kind,
        lambda step: storage.save_checkpoint(tmp_path, step, copied, {}, keep_last_n=1),
        scale.pick(15, 5),
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.skipif(not shared_memory_supported(), reason="the writer process needs memfd (Linux)")
def test_steps_while_the_writer_process_writes(
    benchmark: Any, tmp_path: Path, writer: WriterProcess, kind: str, scale: Any
) -> None:
    stager = Stager()
    staged = stager.stage(_state())
    try:
        _time(benchmark, kind, lambda step: writer.save(staged, tmp_path, step, {}, 1), scale.pick(15, 5))
    finally:
        stager.release()


# -- how long the write itself takes beside a GIL-hungry loop -------------------------------------------

SPIN_GROUP = f"one background save of {STATE_MB} MB while a Python loop spins"


def _spin_until(done: threading.Event) -> float:
    """Spin in Python until ``done``; return the milliseconds the loop stood still (waiting for the GIL)."""
    lost, last = 0.0, time.perf_counter()
    while not done.is_set():
        now = time.perf_counter()
        if now - last > 2e-4:
            lost += now - last
        last = now
    return lost * 1e3


def _time_one_write(benchmark: Any, write: Callable[[int], Any], rounds: int) -> None:
    """Time one save, from its start to its end, while this thread spins; record the time the spinning lost."""
    numbers = itertools.count(1)
    lost: list[float] = []

    def save_while_spinning() -> None:
        done = threading.Event()

        def run() -> None:
            write(next(numbers))
            done.set()

        writing = threading.Thread(target=run)
        writing.start()
        lost.append(_spin_until(done))
        writing.join()

    benchmark.group = SPIN_GROUP
    benchmark.pedantic(save_while_spinning, rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info["loop_lost_ms_median"] = round(statistics.median(lost), 1)


@pytest.mark.skipif(not shared_memory_supported(), reason="the writer process needs memfd (Linux)")
def test_one_save_by_the_writer_process_baseline(
    benchmark: Any, tmp_path: Path, writer: WriterProcess, scale: Any
) -> None:
    stager = Stager()
    staged = stager.stage(_state())
    try:
        _time_one_write(benchmark, lambda step: writer.save(staged, tmp_path, step, {}, 1), scale.pick(5, 3))
    finally:
        stager.release()


def test_one_save_by_a_writer_thread(benchmark: Any, tmp_path: Path, scale: Any) -> None:
    copied = snapshot(_state())
    _time_one_write(
        benchmark, lambda step: storage.save_checkpoint(tmp_path, step, copied, {}, keep_last_n=1), scale.pick(5, 3)
    )
