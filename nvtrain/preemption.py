"""Preemption signals: caught only while a run is active, agreed across ranks in one collective.

Cluster schedulers announce preemption with a signal (SLURM: ``SIGTERM``, or the
one named by ``--signal``; Kubernetes: ``SIGTERM`` then ``SIGKILL`` after the
grace period). :class:`PreemptionWatcher` installs a handler that only records
the signal, so the training loop can finish the current step, write a
checkpoint and return. The previous handlers come back when the run ends, also
after an exception, so a script that keeps running after training sees the
signal disposition it set up itself.

Reading the answer is one explicit call, :meth:`PreemptionWatcher.poll`. Under
``torch.distributed`` it is a single ``all_reduce(MAX)`` of a one-element tensor,
so every rank stops at the same step even when only one of them got the signal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import warnings
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvtrain.distributed import backend_for

__all__ = ["PreemptionWatcher", "SignalLike", "collective_device", "is_rank_zero", "resolve_signals"]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from typing import Self

SignalLike = int | str | signal.Signals

#: Signals a process cannot catch; asking for them is a configuration error.
_UNCATCHABLE = frozenset(getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name))

#: Signals that say something else than "stop": a child process ended (every DataLoader worker does),
#: the terminal was resized, a stopped process continues; or a fault in this very process, which Python
#: cannot resume from. Taken as a preemption, they would stop healthy runs.
_NOT_A_STOP_REQUEST = {
    getattr(signal, name): why
    for name, why in (
        ("SIGCHLD", "a child process ended (every DataLoader worker sends it)"),
        ("SIGWINCH", "the terminal was resized"),
        ("SIGCONT", "a stopped process continues"),
        ("SIGURG", "urgent socket data arrived"),
        ("SIGSEGV", "a memory fault in this process, which Python cannot continue after"),
        ("SIGBUS", "a bus error in this process, which Python cannot continue after"),
        ("SIGFPE", "an arithmetic fault in this process, which Python cannot continue after"),
        ("SIGILL", "an illegal instruction in this process, which Python cannot continue after"),
    )
    if hasattr(signal, name)
}


def resolve_signals(
    spec: SignalLike | Sequence[SignalLike] | None, owner: str = "preemption_signal"
) -> tuple[signal.Signals, ...]:
    """Turn ``"SIGTERM"``, ``"TERM"``, ``15``, ``signal.SIGUSR1`` or a list of them into signals.

    ``None`` (or an empty list) disables preemption handling. Unknown names and
    numbers, the uncatchable ``SIGKILL`` / ``SIGSTOP``, and signals that mean something
    else (``SIGCHLD``, ``SIGWINCH``, a fault such as ``SIGSEGV``) raise ``ValueError``
    naming ``owner``.
    """
    if spec is None:
        return ()
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    resolved: list[signal.Signals] = []
    for item in items:
        sig = _resolve_one(item, owner)
        if sig in _UNCATCHABLE:
            raise ValueError(
                f"{owner}: {sig.name} cannot be caught by a process; use SIGTERM or SIGUSR1 (got {item!r})"
            )
        if sig in _NOT_A_STOP_REQUEST:
            raise ValueError(
                f"{owner}: {sig.name} means {_NOT_A_STOP_REQUEST[sig]}, not a request to stop; use SIGTERM, SIGINT "
                f"or SIGUSR1 (got {item!r})"
            )
        if sig not in resolved:
            resolved.append(sig)
    return tuple(resolved)


def _resolve_one(item: object, owner: str) -> signal.Signals:
    if isinstance(item, signal.Signals):
        return item
    if isinstance(item, int) and not isinstance(item, bool):
        try:
            return signal.Signals(item)
        except ValueError:
            raise ValueError(f"{owner}: {item} is not a signal number on this platform") from None
    if isinstance(item, str):
        name = item.strip().upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"{owner}: {item!r} is not a signal name on this platform (e.g. 'SIGTERM')") from None
    raise ValueError(f"{owner} must be a signal name, number or a list of them (got {type(item).__name__} {item!r})")


class PreemptionWatcher:
    """Records preemption signals between :meth:`install` and :meth:`restore` (or as a context manager).

    The handler only stores the signal number: no I/O, no exception in the middle
    of a CUDA call. :meth:`poll` turns the local flag into the job's answer; once
    it answered ``True`` it stays ``True`` (and runs no more collectives).
    Installing is only possible from the main thread; elsewhere the watcher warns
    and stays passive (``poll`` still agrees with the other ranks).
    """

    def __init__(self, signals: Sequence[signal.Signals], process_group: Any = None) -> None:
        self.signals: tuple[signal.Signals, ...] = tuple(signals)
        self.process_group = process_group
        #: Number of the first signal caught on this rank, or None.
        self.received_signal: int | None = None
        #: The answer of the latest :meth:`poll` (reading it never runs a collective).
        self.preempted = False
        #: Why this rank asked the run to stop (:meth:`request_stop`), or None.
        self.requested_stop: str | None = None
        #: The agreed stop request of the latest :meth:`poll`: this rank's reason, or a note that
        #: another rank asked; None while no rank asked.
        self.stop_reason: str | None = None
        self._previous: dict[signal.Signals, Any] = {}
        #: A Ctrl-C (SIGINT) was caught already: the next one aborts.
        self._interrupted = False
        self._flag: torch.Tensor | None = None
        self._multi_rank: bool | None = None

    # -- handler lifetime ---------------------------------------------------------------

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Catch ``signals`` from now on, remembering the handlers they replace."""
        self._multi_rank = None
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            names = ", ".join(s.name for s in self.signals)
            warnings.warn(
                f"PreemptionWatcher: not catching {names} because the run is not on the main thread "
                "(Python installs signal handlers only there); preemption will not be detected on this rank",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if handler is None:  # installed from C: Python cannot reinstate it
                logger.warning(
                    "PreemptionWatcher: the previous %s handler was not set from Python; using SIG_DFL", sig.name
                )
                handler = signal.SIG_DFL
            signal.signal(sig, handler)

    def __enter__(self) -> Self:
        self.install()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self._interrupted:
                # A second Ctrl-C: the user will not wait for the step to end. Abort as Python would. (A
                # Ctrl-C after a scheduler's SIGTERM is a first one: the run is already stopping anyway.)
                self.restore()
                raise KeyboardInterrupt
            self._interrupted = True
        if self.received_signal is None:
            self.received_signal = signum
            if signum == signal.SIGINT and is_rank_zero():
                # os.write, not logging or print: both take locks a signal handler may interrupt.
                with contextlib.suppress(OSError):
                    os.write(2, b"\nCtrl-C: stopping after this step (press Ctrl-C again to abort now)\n")

    # -- the answer -----------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Ask the job to stop (the first reason on this rank is kept).

        A single process needs no agreement: the request holds at once. Several ranks
        agree on it at the next :meth:`poll`.
        """
        if self.requested_stop is None:
            self.requested_stop = reason
        if self.stop_reason is None and not self._is_multi_rank():
            self.stop_reason = reason

    def _is_multi_rank(self) -> bool:
        multi_rank = self._multi_rank
        if multi_rank is None:  # decided once per installation: the job's ranks do not change mid-run
            group = self.process_group
            multi_rank = self._multi_rank = (
                dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
            )
        return multi_rank

    @property
    def stopping(self) -> bool:
        """Whether the latest :meth:`poll` agreed to end the run (a signal or a stop request)."""
        return self.preempted or self.stop_reason is not None

    def poll(self) -> bool:
        """Should the run stop here? One ``all_reduce`` when the job has several ranks.

        The answer covers both a preemption signal on any rank (:attr:`preempted`) and a
        stop request on any rank (:attr:`stop_reason`), in the same collective. Every rank
        must call this at the same points of the run. A single process runs no collective;
        several run one per call, also with no signals configured (a stop request must be
        agreed on). Returns :attr:`stopping`.
        """
        if self.preempted or self.stop_reason is not None:
            return True
        local_signal = self.received_signal is not None
        local_stop = self.requested_stop is not None
        group = self.process_group
        multi_rank = self._multi_rank
        if multi_rank is None:
            multi_rank = self._is_multi_rank()
        if multi_rank:
            flag = self._flag
            if flag is None:
                flag = self._flag = torch.zeros(2, dtype=torch.int32, device=collective_device(group))
            flag[0], flag[1] = int(local_signal), int(local_stop)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            agreed, stop = (bool(v) for v in flag.tolist())  # the one host sync of a step boundary
        else:
            agreed, stop = local_signal, local_stop
        if stop:
            self.stop_reason = self.requested_stop or "another rank requested a stop"
            if is_rank_zero():
                logger.warning("stop requested (%s): stopping at this step", self.stop_reason)
        if not agreed:
            return self.stop_reason is not None
        if is_rank_zero():
            received = self.received_signal
            source = signal.Signals(received).name if received is not None else "another rank"
            logger.warning("preemption signal received (%s): stopping at this step", source)
        self.preempted = agreed
        return True


def is_rank_zero() -> bool:
    """Per-run messages come from rank 0 only (the torchrun environment tells before the group exists)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def collective_device(group: Any, device: torch.device | None = None) -> torch.device:
    """The CPU whenever the group has a backend for it (gloo, or the gloo half of ``"cpu:gloo,cuda:nccl"``):
    reading a CPU result back waits for the collective only, not for the device's queued work. A group of NCCL
    alone reduces CUDA tensors only: on ``device`` when it is a CUDA device (the rank's own, which a script
    may not have made current), else on the current one."""
    if backend_for(str(dist.get_backend(group)), "cpu") is not None:
        return torch.device("cpu")
    if device is not None and device.type == "cuda":
        return device
    return torch.device("cuda", torch.cuda.current_device())
