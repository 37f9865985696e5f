"""DCP files, read and written safely: the part of a sharded checkpoint torch.distributed.checkpoint writes.

DCP's ``.metadata`` index is a pickle; :func:`read_dcp_metadata` unpickles it with an
unpickler that admits only DCP's metadata classes. :func:`dcp_load` reads with that and
with a planner that loads DCP's non-tensor entries through ``torch.load(weights_only=True)``,
so nothing read can run code. DCP gathers every rank's failure into one BaseException;
:func:`dcp_load` and :func:`dcp_save` turn it into an ordinary error naming the directory
and the ranks.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvtrain.errors import ResumeError
from nvtrain_checkpoint import storage

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "FORMAT",
    "METADATA_NAME",
    "SHARDED_DIR",
    "data_files",
    "dcp_load",
    "dcp_save",
    "read_dcp_metadata",
]

#: The subdirectory of a checkpoint holding the DCP checkpoint, and DCP's index file in it.
SHARDED_DIR = "sharded"
METADATA_NAME = ".metadata"
#: ``manifest["sharded"]["format"]``.
FORMAT = "torch.distributed.checkpoint"


# -- reading --------------------------------------------------------------------------------------

_METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's metadata is made of: its dataclasses, torch sizes, dtypes and layouts, paths."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not part of a DCP metadata file")


def read_dcp_metadata(path: str | os.PathLike[str]) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, refusing every global but DCP's metadata classes.

    :raises CheckpointError: naming the file and what was refused.
    """
    path = Path(path)
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except FileNotFoundError:
        raise storage.CheckpointError(f"{path} is missing: not a complete sharded checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as err:
        raise storage.CheckpointError(
            f"{path} was refused: a DCP metadata file may hold only DCP's metadata classes, never code ({err})"
        ) from err
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise storage.CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    return metadata


@functools.lru_cache(maxsize=1)
def _safe_io() -> tuple[type, type]:
    """DCP's file reader and load planner, made safe (defined on first use: DCP is imported then)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class SafeFileSystemReader(FileSystemReader):
        """DCP's file reader with :func:`read_dcp_metadata` in place of a plain ``pickle.load``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if kwargs.get("rank") is not None:
                raise storage.CheckpointError(f"{self.path}: per-rank DCP metadata is not an nvtrain checkpoint")
            metadata = read_dcp_metadata(Path(self.path) / METADATA_NAME)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise storage.CheckpointError(
                    f"the sharded checkpoint's entry {read_item.dest_index.fqn!r} was refused by "
                    f"torch.load(weights_only=True): it holds more than plain data ({_first_line(err)})"
                ) from err
            super().load_bytes(read_item, io.BytesIO(_saved(loaded)))

    return SafeFileSystemReader, SafeLoadPlanner


def _first_line(err: Exception) -> str:
    """The line of a weights-only refusal that names what was refused (torch's message opens with advice)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    specific = [line for line in lines if "GLOBAL" in line or "nsupported" in line]
    return (specific or lines or [type(err).__name__])[0]


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def dcp_load(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` into ``state`` with the safe reader and planner; in this process alone when ``no_dist``
    or when there is no process group (DCP warns then; here that is the intent)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _safe_io()
    no_dist = no_dist or not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent is to load")
        try:
            load(state, storage_reader=reader(directory), planner=planner(), no_dist=no_dist)
        except CheckpointException as err:
            ranks, inner = _first_failure(err)
            if isinstance(inner, storage.CheckpointError):
                raise inner from None
            raise ResumeError(
                f"reading the sharded checkpoint {directory} failed on rank(s) {ranks}: {type(inner).__name__}: {inner}"
            ) from inner


def _first_failure(err: CheckpointException) -> tuple[list[int], BaseException]:
    """The ranks that failed and the first one's exception (DCP gathers them into a BaseException)."""
    failures = err.failures
    first = next(iter(failures.values()))
    inner = first[0] if isinstance(first, tuple) else first
    return sorted(failures), inner if isinstance(inner, BaseException) else RuntimeError(str(inner))


def dcp_save(directory: Path, save: Callable[[], Metadata]) -> Metadata:
    """Run a DCP save, turning its gathered failure (a BaseException) into an ordinary error naming the place."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return save()
    except CheckpointException as err:
        ranks, inner = _first_failure(err)
        raise RuntimeError(
            f"writing the sharded checkpoint {directory} failed on rank(s) {ranks}: {type(inner).__name__}: {inner}"
        ) from inner


def data_files(metadata: Metadata) -> list[str]:
    """The files DCP wrote (relative to its directory), from its own index."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
