"""Exceptions that end a run for a reason the user can act on (the CLI prints them as one line).

:class:`TrainingDivergedError`
    Too many optimizer steps in a row were skipped (vetoes, GradScaler overflows):
    the loss or the gradients have stopped being finite. ``nvtrain train`` exits
    with status 3.
:class:`ResumeError`
    A run cannot continue from the checkpoint it was told to use (missing, corrupt,
    or written for another model or optimizer). ``nvtrain train`` exits with status 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ResumeError", "TrainingDivergedError", "disk_full", "first_line", "naming_file", "one_line"]

_DISK_FULL = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if code is not None)


def disk_full(err: BaseException) -> OSError | None:
    """The out-of-space OSError (ENOSPC, EDQUOT) in ``err`` or its cause / context chain, if there is one."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL:
            return current
        current = current.__cause__ or current.__context__
    return None


class TrainingDivergedError(RuntimeError):
    """``max_consecutive_skipped_steps`` optimizer steps in a row were skipped; the run stopped.

    ``skipped`` is that count, ``step`` the last completed optimizer step and
    ``epoch`` the (0-based) epoch the run stopped in.
    """

    def __init__(self, message: str, *, skipped: int, step: int, epoch: int) -> None:
        super().__init__(message)
        self.skipped = skipped
        self.step = step
        self.epoch = epoch


class ResumeError(RuntimeError, ValueError):
    """A checkpoint cannot be resumed from: missing, incomplete, corrupt or incompatible with this run.

    Also a ``ValueError``: code written before this class existed caught those.
    """


@contextlib.contextmanager
def naming_file(path: str | Path) -> Iterator[None]:
    """Give an OSError raised inside that names no file (a write to an open file, a full disk), or names
    the hidden temporary ``.<name>.*`` that is renamed to ``path``, ``path`` as its file name: the
    one-line report of ``nvtrain train`` then says which file could not be written."""
    path = Path(path)
    try:
        yield
    except OSError as err:
        temporary = err.filename is not None and Path(os.fsdecode(err.filename)).name.startswith(f".{path.name}.")
        if err.filename is None or temporary:
            err.filename = str(path)
        raise


def one_line(err: BaseException) -> str:
    """``SyntaxError: '(' was never closed (my_model.py, line 1)``: the error's type and first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def first_line(err: BaseException) -> str:
    """torch's load_state_dict errors span lines (one per tensor); the first mismatch says enough."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[0]} {lines[1]} (and {len(lines) - 2} more)"
