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

__all__ = ["name_max", "new_file_mode", "replaced_atomically", "temporary_name"]

#: The length of the random part ``tempfile.mkstemp`` puts between its prefix and suffix.
_MKSTEMP_RANDOM = 8


@contextlib.contextmanager
def replaced_atomically(path: Path, *, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends it replaces ``path`` (with the mode
    of a newly created file), and when the block raises it is removed and ``path`` is left as it was."""
    reserved = _MKSTEMP_RANDOM + len(os.fsencode(suffix))
    prefix = temporary_name(path.parent, ".", path.name, ".", reserved=reserved)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is not None and os.fsdecode(err.filename) == tmp:
            err.filename = str(path)  # the file the caller asked for, not the temporary name nobody knows
        raise


def temporary_name(directory: Path, prefix: str, name: str, suffix: str = "", *, reserved: int = 0) -> str:
    """``prefix + name + suffix``, ``name`` cut short (whole characters) where the result and ``reserved`` more
    bytes would pass the file system's limit on one name (NAME_MAX): a temporary file beside a target whose
    own name is near that limit still gets a name, kept hidden and unique by ``prefix`` and what follows."""
    room = name_max(directory) - len(os.fsencode(prefix + suffix)) - reserved
    while name and len(os.fsencode(name)) > room:
        name = name[: min(len(name) - 1, max(room, 0))]
    return f"{prefix}{name}{suffix}"


def name_max(directory: Path) -> int:
    """The longest file name ``directory``'s file system takes, in bytes (255 where it cannot say)."""
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # no such directory yet, no such setting, no pathconf (Windows)
        return 255
    return limit if limit > 0 else 255  # -1: no limit it can state


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
