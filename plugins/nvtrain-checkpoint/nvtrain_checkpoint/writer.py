"""The background writer of ``async_save``: one thread, at most one write in flight.

It also deletes the checkpoints retention dropped after a synchronous save, so
freeing their pages does not hold the training thread either.

The training thread hands over a snapshot (already copied off the live tensors)
and continues. The job writes it here (``async_writer="thread"``) or hands it to
the writer process and waits for its answer, which takes no GIL (the default).
The next save first waits for the previous one, so writes never overlap or reorder, and a failed write raises on the training thread at the next
save, at the end of the run or at ``close()``: never silently.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, final

__all__ = ["BackgroundWriter"]

T = TypeVar("T")


@final
class BackgroundWriter:
    """Runs write jobs one at a time on a worker thread (not a daemon: the interpreter waits for it)."""

    __slots__ = ("_executor", "_future", "_task")

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[Any] | None = None
        self._task = ""

    @property
    def busy(self) -> bool:
        """Is a write still running (or finished but not yet collected by :meth:`wait`)?"""
        return self._future is not None

    def submit(self, job: Callable[[], T], task: str, on_done: Callable[[T], None] | None = None) -> None:
        """Wait for the previous job, then start ``job``; ``on_done(result)`` runs on the worker after it.

        ``task`` says what the job does ("writing step_500 in the background (async_save=True)"):
        an error raised by the job gets the note "while <task>".
        """
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvtrain-checkpoint")

        def run() -> T:
            result = job()
            if on_done is not None:
                on_done(result)
            return result

        self._task = task
        self._future = self._executor.submit(run)

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; re-raise its error here."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        except BaseException as err:
            err.add_note(f"while {self._task}")
            raise

    def close(self) -> None:
        """Flush, then stop the worker thread (a later submit starts a new one)."""
        try:
            self.wait()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
