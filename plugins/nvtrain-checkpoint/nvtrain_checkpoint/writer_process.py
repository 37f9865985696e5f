"""The checkpoint writer process of ``async_save``: serialising, hashing and fsync outside the training process.

The training process starts one writer (a fresh ``python`` running :func:`main`,
a clean interpreter that never imports the training script) and talks to it over a
socket pair: it sends the shared-memory arena's file once (again when it grows) and
then, per save, the staged state's structure and where to write it. The writer
runs :func:`nvtrain_checkpoint.storage.save_checkpoint` (the same crash-consistent
write as in-process saves: fsync, atomic publish, ``latest`` last, digests in the
manifest) and answers with the published path or the error.

The writer ignores SIGINT and SIGTERM and runs in its own session: a Ctrl-C or a
preemption signal reaches the training process, which decides what to save, and
the writer finishes the write in hand. It exits when told to, or when the training
process goes away (its end of the socket closes), after the write in hand.

Starting a writer costs an interpreter and ``import torch`` (seconds of one core), so
writers are kept: :func:`acquire` hands out an idle one (or a new one), :func:`release`
takes it back when its hook closes, and the idle ones are closed when Python exits.
A second run in the same process (a sweep, a benchmark, a notebook) reuses the writer.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from types import ModuleType
from typing import Any, final

from nvtrain_checkpoint.staging import StagedState, rebuild

__all__ = ["WriterProcess", "WriterProcessError", "acquire", "close_idle", "release"]

#: The writer's command line: ``-c`` rather than ``-m``, since the package imports this module first.
_ENTRY = "import sys; from nvtrain_checkpoint.writer_process import main; sys.exit(main(sys.argv))"
#: Idle writers kept for later runs; more are closed when they are released.
MAX_IDLE = 2
#: Seconds ``close()`` waits for the writer to exit before killing it (it has no write in hand by then).
CLOSE_TIMEOUT = 30.0


class WriterProcessError(RuntimeError):
    """The checkpoint writer process could not start, or ended while it had a write in hand."""


@final
class WriterProcess:
    """The training process's side: starts the writer, hands it saves, returns its answers.

    Not thread-safe: one thread at a time (the background writer's) calls :meth:`save`.
    """

    __slots__ = ("_arena", "_busy", "_connection", "_process", "_ready")

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._connection: Connection | None = None
        self._arena: int | None = None
        self._ready = False
        self._busy = False

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def busy(self) -> bool:
        """Is a save in hand (handed over, not yet answered)?"""
        return self._busy

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the writer unless it runs; it imports torch meanwhile (the first save waits for that)."""
        if self._process is not None:
            return
        ours, theirs = socket.socketpair()
        environment = dict(os.environ)
        # The writer imports this very nvtrain_checkpoint, never touches a GPU, and needs no thread pool.
        # It sees the modules this process sees, in the same order ('' is this process's working
        # directory); -P keeps `python -c` from putting the working directory first on top of
        # that, where a user's json.py or enum.py would shadow the standard library's.
        environment["PYTHONPATH"] = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
        environment["CUDA_VISIBLE_DEVICES"] = ""
        environment["OMP_NUM_THREADS"] = "1"
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-P", "-c", _ENTRY, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=environment,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as err:
            ours.close()
            raise WriterProcessError(
                f"checkpoint: could not start the writer process ({sys.executable}): {err}; "
                "async_writer='thread' writes without one"
            ) from err
        finally:
            theirs.close()
        self._connection = Connection(ours.detach())
        self._arena = None
        self._ready = False

    def wait_until_ready(self, label: str = "a checkpoint") -> None:
        """Start the writer if needed and block until it has imported what it needs (once per writer)."""
        self.start()
        if not self._ready:
            self._receive(label)  # ("ready", pid)
            self._ready = True

    def save(
        self,
        staged: StagedState,
        root: Path,
        step: int,
        metadata: dict[str, Any],
        keep_last_n: int | None,
        passed_over: frozenset[str] = frozenset(),
    ) -> Path:
        """Have the writer save ``staged`` as ``root/step_<step>``; block until it is published (or failed).

        ``keep_last_n`` and ``passed_over`` are as :func:`~nvtrain_checkpoint.storage.save_checkpoint` takes them.
        """
        label = f"step_{step}"
        self._busy = True
        try:
            return self._save(staged, root, step, metadata, (keep_last_n, passed_over), label)
        finally:
            self._busy = False

    def _save(
        self,
        staged: StagedState,
        root: Path,
        step: int,
        metadata: dict[str, Any],
        retention: tuple[int | None, frozenset[str]],
        label: str,
    ) -> Path:
        self.wait_until_ready(label)
        connection = self._connected(label)
        arena = staged.arena
        try:
            if self._arena != arena.identity:
                connection.send(("arena", arena.capacity))
                send_handle(connection, arena.fd, self.pid)
                self._arena = arena.identity
            connection.send(("save", staged.skeleton, staged.specs, str(root), step, metadata, retention))
        except OSError as err:
            raise self._ended(label) from err
        reply = self._receive(label)
        if reply[0] == "failed":
            _, error, trace = reply
            error.add_note(f"raised in the checkpoint writer process (pid {self.pid}):\n{trace.rstrip()}")
            raise error
        return Path(reply[1])

    def close(self) -> None:
        """Tell the writer to exit and wait for it (kill it if it does not); a later save starts a new one."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if process is None:
            return
        try:
            if connection is not None:
                with contextlib.suppress(OSError):  # it is gone already
                    connection.send(("close",))
            process.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        finally:
            if connection is not None:
                connection.close()

    def _connected(self, label: str) -> Connection:
        if self._connection is None:
            raise self._ended(label)
        return self._connection

    def _receive(self, label: str) -> tuple[Any, ...]:
        try:
            reply: tuple[Any, ...] = self._connected(label).recv()
        except (EOFError, OSError) as err:
            raise self._ended(label) from err
        return reply

    def _ended(self, label: str) -> WriterProcessError:
        """The writer is gone: say how, and forget it so the next save starts a fresh one."""
        process = self._process
        status = None
        if process is not None:
            try:
                status = process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None
        how = "" if status is None else f" ({_describe(status)})"
        pid = "" if process is None else f" (pid {process.pid})"
        started = self._ready
        self._ready = False
        if not started:  # it never got as far as saying it was ready: an environment problem
            return WriterProcessError(
                f"checkpoint: the writer process{pid} ended{how} while starting, before {label} could be handed "
                "to it (its error output above says why); async_writer='thread' writes without a writer process"
            )
        return WriterProcessError(
            f"checkpoint: the writer process{pid} ended{how} before finishing {label}; that checkpoint was not "
            "published (its temporary directory is removed by the next save), the previous ones are intact"
        )


_idle: list[WriterProcess] = []
_idle_lock = threading.Lock()
#: The process the idle writers belong to (a forked child inherits the list, not the writers).
_owner = os.getpid()


def acquire() -> WriterProcess:
    """An idle writer that still runs, or a new (not yet started) one."""
    with _idle_lock:
        idle = list(_idle) if os.getpid() == _owner else []
        _idle.clear()
    keep = next((writer for writer in reversed(idle) if writer.running), None)
    for writer in idle:
        if writer is not keep:
            writer.close()
    return keep if keep is not None else WriterProcess()


def release(writer: WriterProcess) -> None:
    """Take ``writer`` back (its hook closed, no write in hand): keep it for a later run, or close it."""
    if os.getpid() == _owner and writer.running and not writer.busy:
        with _idle_lock:
            if len(_idle) < MAX_IDLE:
                _idle.append(writer)
                return
    writer.close()


@atexit.register
def close_idle() -> None:
    """Close every idle writer (at exit; a later :func:`acquire` starts a new one)."""
    if os.getpid() != _owner:
        return
    with _idle_lock:
        idle = list(_idle)
        _idle.clear()
    for writer in idle:
        writer.close()


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__module__}.{type(error).__qualname__}: {error}")
    return error


def serve(connection: Connection) -> None:
    """The writer's loop: map arenas, write saves, answer each; return on "close" or when the other end goes."""
    from nvtrain_checkpoint import storage

    connection.send(("ready", os.getpid()))
    buffer: mmap.mmap | None = None
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return  # the training process is gone
        kind = message[0]
        if kind == "arena":
            descriptor = recv_handle(connection)
            try:
                buffer = mmap.mmap(descriptor, message[1])  # the previous mapping goes with its last tensor
            finally:
                os.close(descriptor)
        elif kind == "save":
            connection.send(_write(storage, buffer, *message[1:]))
        elif kind == "close":
            return


def _write(
    storage: ModuleType,
    buffer: mmap.mmap | None,
    skeleton: Any,
    specs: Any,
    root: str,
    step: int,
    metadata: dict[str, Any],
    retention: tuple[int | None, frozenset[str]],
) -> tuple[Any, ...]:
    """One save, answered: ``("done", path)`` or ``("failed", error, traceback)``. Its tensors (views of
    the arena) go with the call, so a replaced arena can be unmapped."""
    try:
        if buffer is None:
            raise RuntimeError("checkpoint writer: a save arrived before its shared-memory arena")
        state = rebuild(skeleton, specs, buffer)
        keep_last_n, passed_over = retention
        path = storage.save_checkpoint(Path(root), step, state, metadata, keep_last_n, passed_over=passed_over)
        return ("done", str(path))
    except Exception as err:
        return ("failed", _portable(err), traceback.format_exc())


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    with Connection(int(argv[1])) as connection:
        serve(connection)
    return 0
