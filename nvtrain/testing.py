"""Multi-process tests on one machine: ranks started as torchrun starts them, on the CPU (gloo).

For testing a plugin across ranks without a cluster or a GPU. Each rank is a fresh
interpreter running a worker script (never a fork: autograd's threads do not survive
one), with the variables torchrun gives it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
...). Several scenarios can share one launch, since starting processes dominates the
time: each gets its own free port, listed in ``NVTRAIN_TEST_PORTS`` (read them with
:func:`scenario_ports` in the worker) so that every scenario opens its own process group.

The ranks inherit this process's environment without torchrun's variables and without
``NVTRAIN_*`` settings, with one intra-op thread and, unless ``cuda=True``, no visible
GPU: on a machine with one, the test still runs the gloo path it was written for.

    outputs = run_ranks(Path(__file__).with_name("worker.py"), [str(tmp_path), "scenario"])
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from nvtrain.validators import refused

__all__ = [
    "PORTS_VARIABLE",
    "RanksFailed",
    "free_port",
    "full_tensors",
    "gloo_group",
    "kill_ranks",
    "load_script",
    "rank_environment",
    "run_ranks",
    "run_scenarios",
    "scenario_ports",
    "spawn_ranks",
    "start_ranks",
    "wait_ranks",
]

#: Where the ranks find one port per scenario (comma-separated).
PORTS_VARIABLE = "NVTRAIN_TEST_PORTS"
_TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: How much of a failed rank's output a failure message quotes (its end, where the traceback is).
_OUTPUT_TAIL = 6000
#: How much of each other rank's output a message quotes besides.
_OTHER_TAIL = 2000
#: How long the other ranks may still run once one failed before they are killed: time to fail on their own,
#: with their own traceback, but a rank blocked in a collective with the failed one would wait far longer.
_FAILURE_GRACE_S = 5.0


class RanksFailed(AssertionError):
    """A rank exited with an error or the ranks ran out of time; the message quotes their output."""


def _check_nprocs(function: str, nprocs: Any) -> None:
    """Refuse a rank count below 1: no rank would start, and a test built on it would pass without running."""
    if not (isinstance(nprocs, int) and not isinstance(nprocs, bool) and nprocs >= 1):
        message = f"{function}(nprocs=...) must be an int >= 1 (got {nprocs!r})"
        raise refused(function, "nprocs", nprocs, "an int >= 1", message=message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(*, cuda: bool = False) -> dict[str, str]:
    """This process's environment as a rank should start with it (see the module docstring)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _TORCHRUN_VARIABLES and not key.startswith("NVTRAIN_")
    }
    env["OMP_NUM_THREADS"] = "1"
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def scenario_ports() -> list[int]:
    """In a rank: the ports :func:`start_ranks` chose, one per scenario, in order."""
    return [int(port) for port in os.environ.get(PORTS_VARIABLE, "").split(",") if port]


def start_ranks(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    scenarios: int = 1,
    cuda: bool = False,
) -> list[subprocess.Popen[str]]:
    """Start ``nprocs`` ranks of ``python script *args``, each in its own process group (so a kill
    reaches everything it started); ``scenarios`` free ports go to :data:`PORTS_VARIABLE`."""
    _check_nprocs("start_ranks", nprocs)
    env = rank_environment(cuda=cuda) | {
        "MASTER_ADDR": "127.0.0.1",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        PORTS_VARIABLE: ",".join(str(free_port()) for _ in range(scenarios)),
    }
    return [
        subprocess.Popen(
            [sys.executable, os.fspath(script), *args],
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in range(nprocs)
    ]


def kill_ranks(procs: Sequence[subprocess.Popen[str]]) -> None:
    """SIGKILL every rank still running (with whatever it started) and reap them: no handler runs."""
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc)
    for proc in procs:
        proc.wait(timeout=60)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended (and was reaped) meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


class _Watched:
    """One rank being waited for: a thread drains its output as it comes (a rank blocked on a full pipe would
    never finish) and another notes when it exits (so the rank that failed first is known)."""

    def __init__(self, rank: int, proc: subprocess.Popen[str]) -> None:
        self.rank = rank
        self.proc = proc
        self.exited_at: float | None = None
        self.killed = False
        self._exited = threading.Event()
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self) -> None:
        if self.proc.stdout is None:
            return
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            self._chunks.append(chunk)

    def _wait(self) -> None:
        self.proc.wait()
        self.exited_at = time.monotonic()
        self._exited.set()

    @property
    def running(self) -> bool:
        return not self._exited.is_set()

    @property
    def failed(self) -> bool:
        return not self.running and self.proc.returncode != 0

    def wait(self, timeout_s: float) -> None:
        self._exited.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL the rank's process group if the rank still runs, and wait until it is reaped."""
        if self.running:
            self.killed = True
            _kill_group(self.proc)
        self._exited.wait(60)

    def output(self) -> str:
        """Everything the rank printed (its process group is gone, so the pipe ends)."""
        self._reader.join(timeout=10)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        return b"".join(self._chunks).decode(errors="replace")


def wait_ranks(procs: Sequence[subprocess.Popen[str]], timeout_s: float) -> list[str]:
    """Each rank's output once all exited with status 0, within one ``timeout_s`` for all of them together.

    The ranks' outputs are read as they come, so a rank that prints a lot never blocks.
    Once a rank fails, the others get a few seconds to end (a rank waiting for it in a
    collective never would) and are then killed, as torchrun does.

    :raises RanksFailed: when one did not exit with status 0, quoting the end of the output of
        the rank that failed first, then of every other failed or killed rank; or when they
        are still running after ``timeout_s`` seconds (they are killed, and the end of each
        rank's output is quoted).
    """
    watched = [_Watched(rank, proc) for rank, proc in enumerate(procs)]
    try:
        _wait_for_all_or_a_failure(watched, time.monotonic() + timeout_s)
    finally:
        for rank in watched:
            rank.kill()
    outputs = [rank.output() for rank in watched]
    failed = sorted((rank for rank in watched if rank.failed and not rank.killed), key=_exit_time)
    if failed:
        raise RanksFailed(_failure_message(failed[0], watched, outputs))
    if any(rank.killed for rank in watched):
        raise RanksFailed(_timeout_message(timeout_s, watched, outputs))
    return outputs


def _exit_time(rank: _Watched) -> float:
    return rank.exited_at if rank.exited_at is not None else math.inf


def _wait_for_all_or_a_failure(watched: Sequence[_Watched], deadline: float) -> None:
    """Return when every rank exited, when ``deadline`` passed, or ``_FAILURE_GRACE_S`` after a rank failed."""
    end = deadline
    while running := [rank for rank in watched if rank.running]:
        failures = [_exit_time(rank) for rank in watched if rank.failed]
        if failures:
            end = min(end, min(failures) + _FAILURE_GRACE_S)
        left = end - time.monotonic()
        if left <= 0:
            return
        running[0].wait(min(left, 0.1))


def _failure_message(first: _Watched, watched: Sequence[_Watched], outputs: Sequence[str]) -> str:
    """The first failed rank's status and output tail, then every other failed or killed rank's."""
    parts = [f"rank {first.rank} exited with status {first.proc.returncode}:\n{outputs[first.rank][-_OUTPUT_TAIL:]}"]
    for rank in sorted(watched, key=_exit_time):
        if rank is first or not rank.failed:
            continue
        what = (
            f"was killed, still running after rank {first.rank} failed"
            if rank.killed
            else f"exited with status {rank.proc.returncode} too"
        )
        parts.append(f"rank {rank.rank} {what}:\n{outputs[rank.rank][-_OTHER_TAIL:]}")
    return "\n".join(parts)


def _timeout_message(timeout_s: float, watched: Sequence[_Watched], outputs: Sequence[str]) -> str:
    """Which ranks were still running at the deadline, and the end of each rank's output."""
    late = ", ".join(f"rank {rank.rank}" for rank in watched if rank.killed)
    parts = [f"the ranks did not finish within {timeout_s:g} s (still running: {late})"]
    for rank in watched:
        state = "was killed" if rank.killed else f"had exited with status {rank.proc.returncode}"
        parts.append(f"rank {rank.rank} {state}:\n{outputs[rank.rank][-_OTHER_TAIL:]}")
    return "\n".join(parts)


def run_ranks(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    scenarios: int = 1,
    cuda: bool = False,
    timeout_s: float = 180,
) -> list[str]:
    """:func:`start_ranks`, then :func:`wait_ranks`: each rank's output, or :class:`RanksFailed`."""
    _check_nprocs("run_ranks", nprocs)
    return wait_ranks(start_ranks(script, args, nprocs=nprocs, scenarios=scenarios, cuda=cuda), timeout_s)


def load_script(path: str | os.PathLike[str], name: str) -> ModuleType:
    """The worker script at ``path`` imported as module ``name`` (registered in ``sys.modules``), so a test can
    reuse its models and helpers: a test directory's sibling files are not importable by name everywhere."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {os.fspath(path)!r} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_scenarios(specs: Sequence[str], run: Callable[[str, str, Any], None]) -> None:
    """In a rank: run each ``name=arg`` of ``specs`` in order as ``run(name, arg, manager)``, each in a process
    group of its own on its port from :func:`scenario_ports` (opened before, barrier'd and destroyed after;
    ``manager`` is the :class:`~nvtrain.DistributedManager` of that group)."""
    import torch
    import torch.distributed as dist

    from nvtrain.distributed import DistributedManager

    ports = scenario_ports()
    torch.set_num_threads(1)
    for index, spec in enumerate(specs):
        name, _, arg = spec.partition("=")
        if ports:
            os.environ["MASTER_PORT"] = str(ports[index])
        manager = DistributedManager.initialize(device="cpu")
        run(name, arg, manager)
        dist.barrier()  # tear the group down together
        DistributedManager.cleanup()


def spawn_ranks(fn: Callable[..., None], *args: Any, nprocs: int = 2, timeout_s: float = 120) -> None:
    """Run ``fn(rank, port, *args)`` in ``nprocs`` spawned processes (a function of the test module, which the
    ranks import by name), ``port`` a free one for :func:`gloo_group`; :class:`RanksFailed` after ``timeout_s``.

    A rendezvous that lost a race for its port or socket is tried once more on another port;
    any other failure is raised as torch's ``ProcessRaisedException``, with the rank's traceback.
    """
    _check_nprocs("spawn_ranks", nprocs)
    import torch.multiprocessing as mp

    for attempt in range(2):
        context = mp.spawn(fn, args=(free_port(), *args), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise RanksFailed(f"the {nprocs} ranks did not finish within {timeout_s:.0f} s")
            return
        except mp.ProcessRaisedException as err:
            transient = ("address already in use", "connection refused", "connection reset", "timed out")
            if attempt or not any(word in str(err).lower() for word in transient):
                raise
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int, *, timeout_s: float = 60) -> Iterator[None]:
    """In a rank of :func:`spawn_ranks`: the default process group (gloo, on ``port``) for the block. After a
    block that ends normally the ranks meet at a barrier before it is destroyed: a rank that tears gloo down
    while another still uses it makes that one abort."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def full_tensors(value: Any) -> Any:
    """A copy of a nested state (dicts, lists, tuples) whose tensors are detached clones and whose DTensors
    are gathered into full tensors: what a rank compares with a one-process reference (every rank calls it,
    since gathering is a collective)."""
    import torch

    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and isinstance(value, dtensor):
        return value.full_tensor().detach().clone()  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: full_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [full_tensors(item) for item in value]
    return value
