"""Writing a file so that readers never see half of it: a temporary file beside it, renamed over it.

``tempfile.mkstemp`` creates its file readable by the owner alone (0600); a published
file gets the permissions a new file gets under the process's umask instead (0644
under the usual 022), so a run's metrics and plots stay readable by the others who
may read them on a shared machine, as its checkpoints are.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["new_file_mode", "replaced_atomically"]


@contextlib.contextmanager
def replaced_atomically(path: Path, *, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends it replaces ``path`` (with the mode
    of a newly created file), and when the block raises it is removed and ``path`` is left as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.cache
def new_file_mode() -> int:
    """``0o666`` less the process's umask: the mode ``open(path, "w")`` gives a new file."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:  # Linux says it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it, and put it back at once
    os.umask(mask)
    return mask
