"""The on-disk format: crash-consistent writing, the ``latest`` pointer, retention and safe loading.

Layout of a checkpoint directory::

    checkpoint_dir/
        step_500/               one complete checkpoint per saved step
            state.pt            the training state (torch.save, loaded with weights_only=True)
            manifest.json       format version, step, versions, size and sha256 of state.pt
        step_1000/
        latest                  text: the name of the newest complete checkpoint ("step_1000")
        .tmp-step_1500-<hex>/   a save in progress (or interrupted): never loaded, removed by the next save

A save writes everything under a ``.tmp-`` name, flushes and fsyncs each file and
the directory, publishes it with one ``os.rename`` (then fsyncs the parent), and
only then replaces ``latest`` (temporary file, ``os.replace``, fsync). A process
killed at any moment therefore leaves every ``step_*`` directory complete and
``latest`` naming one of them. Deletion (retention) first renames to ``.trash-``
so no half-deleted checkpoint ever looks complete; the renamed tree is then
deleted at once, or handed to a ``discard`` callable (``CheckpointHook`` deletes it
on its background writer: freeing a large file's pages takes as long as writing a
small one). Replacing a same-numbered checkpoint takes two renames: the old one
to a ``.replaced-`` name, the new one into place. A process killed between them
leaves no ``step_<N>``, so until the next save puts the parked one back, the
readers take ``.replaced-step_<N>-<hex>`` for ``step_<N>``: the old checkpoint
stays loadable, and ``latest`` still finds it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import operator
import os
import pickle
import re
import shutil
import sys
import uuid
import warnings
import zipfile
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch

from nvtrain.errors import ResumeError, disk_full
from nvtrain.validators import FieldProblem, FieldTypeError, FieldValueError, refused

__all__ = [
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "STATE_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointVersionWarning",
    "checkpoint_name",
    "delete_trash",
    "incomplete_checkpoints",
    "latest_checkpoint",
    "list_checkpoints",
    "newer_format",
    "newer_format_message",
    "raw_manifest",
    "read_checkpoint",
    "read_checkpoint_manifest",
    "read_manifest",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

#: Version of the directory layout and manifest; a reader refuses versions it does not know.
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.pt"
LATEST_NAME = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: A checkpoint a resume found corrupt, kept for inspection out of the ``step_<N>`` names (see :func:`set_aside`).
CORRUPT_PREFIX = ".corrupt-"
#: A complete checkpoint moved aside while a new one of the same step takes its name (see :func:`publish`).
REPLACED_PREFIX = ".replaced-"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_REPLACED_DIR = re.compile(r"^\.replaced-(step_\d+)-[0-9a-f]+$")
#: The most bytes a `latest` pointer is read for: a step_<N> name and its newline fit many times over.
_POINTER_LIMIT = 256
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_ZIP_MAGIC = b"PK\x03\x04"
#: ``CheckpointHook.plugin_name``: the manifest's ``plugins`` entry naming the nvtrain-checkpoint that wrote it.
_PLUGIN_NAME = "checkpoint"
#: Manifest keys the writers set themselves (``sharded``: the sharded saver's, naming its shards); a reader
#: trusts them, so ``save_checkpoint``'s ``metadata`` may not set them.
RESERVED_METADATA = ("format_version", "step", "files", "sharded")


class CheckpointError(ResumeError):
    """A checkpoint is missing, incomplete, truncated, corrupt or not an nvtrain checkpoint.

    A :class:`nvtrain.errors.ResumeError` (so a ``RuntimeError``): ``nvtrain train``
    reports it in one line with exit status 2.
    """


class CheckpointVersionWarning(UserWarning):
    """A checkpoint was written by other versions of nvtrain or its plugins than the running ones."""


@attrs.frozen
class CheckpointInfo:
    """A complete checkpoint found on disk."""

    path: Path
    step: int


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


#: What becomes of checkpoints retention dropped, once they are renamed to ``.trash-`` names and the
#: renames are durable: ``delete_trash`` (the default) deletes them at once.
Discard = Callable[[list[Path]], None]


def delete_trash(trash: list[Path]) -> None:
    """Delete retired checkpoint trees (``.trash-`` names: nothing reads them, the next save removes leftovers)."""
    for path in trash:
        shutil.rmtree(path)


# -- writing ------------------------------------------------------------------------------------


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    metadata: Mapping[str, Any],
    keep_last_n: int | None = None,
    *,
    discard: Discard = delete_trash,
    passed_over: Collection[str] = (),
) -> Path:
    """Write ``state`` as ``root/step_<step>`` crash-consistently, point ``latest`` at it, apply retention.

    ``state`` must already be a snapshot (host tensors nobody mutates). ``metadata``
    goes into the manifest next to the format version, step and file digests.
    ``discard`` receives the checkpoints retention retired (see :func:`apply_retention`);
    ``passed_over`` names the ones a resume found corrupt, set aside first (:func:`set_aside`).
    Returns the published directory.

    The arguments are checked before anything is written (:func:`check_save_arguments`): what the
    readers would refuse is never published, nor ``latest`` moved to it.
    """
    step, keep_last_n = check_save_arguments(step, state, metadata, keep_last_n)
    root = Path(root)
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        fsync_dir(root.parent)  # the new directory's own entry survives a crash too
    remove_leftovers(root)
    name = checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex}"
    try:
        tmp.mkdir()
        files = {STATE_NAME: write_state_file(tmp / STATE_NAME, state)}
        manifest = {"format_version": FORMAT_VERSION, "step": step, **metadata, "files": files}
        write_manifest(tmp / MANIFEST_NAME, manifest)
        fsync_dir(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # the original error is what matters; never leave a half-save
        full = disk_full(err)
        if full is not None:  # torch.save may hide ENOSPC behind "[enforce fail at ...]": name the checkpoint
            raise OSError(full.errno, full.strerror or "No space left on device", str(root / name)) from err
        raise
    final = publish(tmp, root / name)
    try:
        write_latest(root, name)
    except OSError as err:  # a full disk now: the checkpoint is complete, only the pointer did not move
        err.add_note(f"while pointing {root / LATEST_NAME} at {final}, which is published and complete")
        raise
    set_aside(root, set(passed_over) - {name})
    apply_retention(root, keep_last_n, discard=discard)
    return final


def check_save_arguments(step: Any, state: Any, metadata: Any, keep_last_n: Any) -> tuple[int, int | None]:
    """``step`` and ``keep_last_n`` as ints, once every argument of :func:`save_checkpoint` is one its readers take.

    ``step`` an int >= 0, ``keep_last_n`` None or an int >= 1 (numpy's integers and a 0-d integer
    tensor count as ints; a bool does not), ``state`` a mapping, ``metadata`` a mapping of str keys
    to JSON values that sets none of :data:`RESERVED_METADATA`. Each refusal names the argument
    (a :class:`~nvtrain.validators.FieldValueError` or ``FieldTypeError``).
    """
    step = _as_count(step, "step", 0)
    if keep_last_n is not None:
        keep_last_n = _as_count(keep_last_n, "keep_last_n", 1, or_none=True)
    if not isinstance(state, Mapping):
        raise _refused("state", state, "a mapping (a training state dict)", error=FieldTypeError)
    if not isinstance(metadata, Mapping):
        raise _refused("metadata", metadata, "a mapping of manifest entries ({} for none)", error=FieldTypeError)
    for key, value in metadata.items():
        _check_metadata_entry(key, value)
    return step, keep_last_n


def _as_count(value: Any, name: str, minimum: int, *, or_none: bool = False) -> int:
    """``value`` as an int >= ``minimum``: an int or an integer scalar (``operator.index``), never a bool."""
    expected = f"an int >= {minimum}" + (" or None" if or_none else "")
    is_bool = isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    is_tensor_of_many = isinstance(value, torch.Tensor) and value.dim() != 0
    try:
        number = None if is_bool or is_tensor_of_many else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise _refused(name, value, expected)
    return number


def _check_metadata_entry(key: Any, value: Any) -> None:
    """One manifest entry: a str key the writer does not set itself, a JSON value (checked now, not mid-save)."""
    if not isinstance(key, str):
        message = f"save_checkpoint: metadata keys must be str (manifest entry names), got {key!r}"
        raise _refused("metadata", key, "a mapping with str keys", message=message, error=FieldTypeError)
    if key in RESERVED_METADATA:
        reserved = ", ".join(repr(name) for name in RESERVED_METADATA)
        message = (
            f"save_checkpoint: metadata may not set {key!r}: {reserved} are the manifest entries save_checkpoint "
            "writes itself (the step is the step argument)"
        )
        raise _refused("metadata", key, "no reserved key", message=message)
    try:
        json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as err:
        message = f"save_checkpoint: metadata[{key!r}] must be JSON data (got {shown_value(value)}: {err})"
        raise _refused("metadata", value, "JSON data", message=message, error=FieldTypeError) from None


def _refused(
    name: str, value: Any, expected: str, *, message: str | None = None, error: type[FieldProblem] = FieldValueError
) -> FieldProblem:
    """``save_checkpoint: <name> must be <expected> (got value)``, as a field refusal names a hook's setting."""
    message = message or f"save_checkpoint: {name} must be {expected} (got {value!r})"
    return refused("save_checkpoint", name, value, expected, message=message, error=error)


def write_state_file(path: Path, state: Mapping[str, Any]) -> dict[str, Any]:
    """``torch.save`` to ``path``, flushed and fsynced; returns its size and sha256 for the manifest.

    The digest is taken from what the file holds, read back from the page cache while
    ``fsync`` waits for the disk on another thread: the two overlap, so hashing adds
    nothing to a save whose disk flush takes longer, and ``torch.save`` itself runs
    without a hash update per record. Both the reads and the hash release the GIL.
    """
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvtrain-fsync") as flusher:
            synced = flusher.submit(os.fsync, file.fileno())
            entry = file_digest(path)
            synced.result()  # an fsync error (EIO, ENOSPC) fails the save here
    return entry


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size", "sha256"}`` of the file at ``path``, as a manifest lists it."""
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256")
        size = file.tell()
    return {"size": size, "sha256": digest.hexdigest()}


def write_manifest(path: Path, manifest: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(manifest, file, indent=2, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())


def publish(tmp: Path, final: Path) -> Path:
    """Rename the finished temporary directory to its final name (replacing a same-named one).

    A same-named checkpoint is first parked under a ``.replaced-`` name, which the readers
    take for it while its name is free: a kill between the two renames loses neither.
    """
    if final.exists() or final.is_symlink():
        parked = final.parent / f"{REPLACED_PREFIX}{final.name}-{uuid.uuid4().hex}"
        os.rename(final, parked)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if parked.is_dir() and not parked.is_symlink():
            shutil.rmtree(parked)
        else:  # a file (or link) squatting on the checkpoint's name
            parked.unlink()
    else:
        os.rename(tmp, final)
        fsync_dir(final.parent)
    return final


def write_latest(root: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (temporary file, fsync, ``os.replace``, fsync)."""
    tmp = root / f"{TMP_PREFIX}{LATEST_NAME}-{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(name + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, root / LATEST_NAME)
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(root: Path) -> None:
    """Put back a checkpoint parked by an interrupted replacement whose name is still free; delete what
    interrupted saves and deletions left behind (``.tmp-*``, ``.trash-*``, parked copies already replaced)."""
    restored = False
    for name, parked in _parked_checkpoints(root).items():
        if not (root / name).exists():
            os.rename(parked, root / name)
            restored = True
    if restored:
        fsync_dir(root)
    for entry in root.iterdir():
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX, REPLACED_PREFIX)):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def retire(path: Path) -> Path:
    """Rename a checkpoint to a ``.trash-`` name (not yet durable: fsync its directory) and return that name.

    Deleting the renamed tree can then never leave a half-deleted directory that looks complete.
    """
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex}"
    os.rename(path, trash)
    return trash


def set_aside(root: Path, corrupt: Collection[str]) -> list[Path]:
    """Rename the checkpoints ``corrupt`` names (``step_<N>``, found corrupt by a resume) to
    ``.corrupt-step_<N>-<hex>``; return the new paths.

    Out of the ``step_<N>`` names they are never resumed from nor warned about again, and
    retention neither counts them (a corrupt one must not rotate an intact one out) nor
    deletes them: they stay for inspection until somebody deletes them.
    """
    moved = []
    for name in sorted(corrupt):
        path = root / name
        if _STEP_DIR.match(name) and path.is_dir():
            target = root / f"{CORRUPT_PREFIX}{name}-{uuid.uuid4().hex}"
            os.rename(path, target)
            moved.append(target)
    if moved:
        fsync_dir(root)
    return moved


def apply_retention(root: Path, keep_last_n: int | None, *, discard: Discard = delete_trash) -> list[Path]:
    """Keep the ``keep_last_n`` complete checkpoints with the highest steps, the one ``latest`` names, and
    the newest healthy one (its step's loss was finite) up to that one when none of those is; return the others.

    A run whose loss turned NaN keeps saving unhealthy checkpoints; without the healthy
    rule they would rotate the last good one out. The dropped checkpoints are renamed out
    of sight (one directory fsync for all of them) before ``discard`` gets their new
    names: deleted now by default, or later by whoever ``discard`` hands them to.
    """
    if keep_last_n is None:
        return []
    complete = list_checkpoints(root)
    pointed = _read_pointer(root)
    kept = complete[-keep_last_n:]
    # The run's own timeline: up to the checkpoint latest names (the one just saved). A higher step left by an
    # earlier run (a resume from an older checkpoint, another step cadence) is no healthy stand-in for it.
    last = checkpoint_step(Path(pointed)) if pointed is not None else None
    own = [info for info in complete if last is None or info.step <= last]
    if not any(is_healthy(info.path) for info in kept if info in own):
        healthy = [info for info in own if is_healthy(info.path)]
        if healthy:
            kept = [healthy[-1], *kept]
    keep = {info.path.name for info in kept}
    removed = [
        info.path
        for info in complete
        if info.path.name not in keep
        and info.path.name != pointed
        and not info.path.name.startswith(REPLACED_PREFIX)  # an interrupted replacement: the next save puts it back
        and newer_format(raw_manifest(info.path)) is None  # a later version's: not this one's to rotate out
    ]
    if removed:
        trash = [retire(path) for path in removed]
        fsync_dir(root)  # the renames are durable before any file of them goes
        discard(trash)
    return removed


def raw_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest's JSON as it is, unchecked: None when it cannot be read as JSON, {} when it is no object.

    For the decisions that look at one field of any checkpoint, damaged or not (retention, a resume's
    scan); loading goes through :func:`read_manifest`, which checks every field.
    """
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else {}


def newer_format(manifest: Mapping[str, Any] | None) -> int | None:
    """The manifest's format version when a later one than this version reads and writes (else None)."""
    version = manifest.get("format_version") if manifest is not None else None
    return version if type(version) is int and version > FORMAT_VERSION else None


def newer_format_message(
    path: Path, manifest: Mapping[str, Any] | None, *, instead: str = f"name a checkpoint in format {FORMAT_VERSION}"
) -> str | None:
    """Why the checkpoint at ``path`` is refused when its manifest is in a newer format (None when it is not).

    A later version wrote it intact, so the refusal says what to install (the version named
    in its manifest, when it is one) and, in ``instead``, what to do without it: a resume
    that finds it in its directory and one told its path give the same advice.
    """
    version = newer_format(manifest)
    if manifest is None or version is None:
        return None
    plugins = manifest.get("plugins")
    plugin = plugins.get(_PLUGIN_NAME) if isinstance(plugins, dict) else None
    writer = plugin.get("version") if isinstance(plugin, dict) else None
    named = isinstance(writer, str) and writer != running_version("nvtrain-checkpoint")
    wrote = f"nvtrain-checkpoint {writer}" if named else "the nvtrain-checkpoint version that wrote it"
    return (
        f"{path} is a checkpoint in format {version}, which this nvtrain-checkpoint does not read (it reads format "
        f"{FORMAT_VERSION}); it is left as it is. Install {wrote} to resume from it, or {instead}"
    )


def is_healthy(directory: Path) -> bool:
    """The manifest's ``healthy`` mark: False only when the saved step's loss was known to be NaN/inf."""
    manifest = raw_manifest(directory)
    return manifest is not None and manifest.get("healthy") is not False


# -- finding ------------------------------------------------------------------------------------


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root`` (``step_<N>`` directories with a manifest), by step.

    Empty for a ``root`` that does not exist (yet); a file there is refused (:class:`CheckpointError`).
    """
    return [info for info in _step_directories(root) if (info.path / MANIFEST_NAME).is_file()]


def incomplete_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """``step_<N>`` directories under ``root`` without a manifest (damaged: never written that way), by step."""
    return [info for info in _step_directories(root) if not (info.path / MANIFEST_NAME).is_file()]


def _step_directories(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every ``step_<N>`` directory under ``root``, by step; a parked ``.replaced-step_<N>-<hex>`` one
    stands for ``step_<N>`` while that name is free (see :func:`publish`)."""
    root = Path(root)
    if not _is_root(root):
        return []
    found = {}
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found[entry.name] = CheckpointInfo(entry, int(match.group(1)))
    for name, parked in _parked_checkpoints(root).items():
        found.setdefault(name, CheckpointInfo(parked, int(name.removeprefix("step_"))))
    return sorted(found.values(), key=lambda info: info.step)


def _is_root(root: Path) -> bool:
    """Whether ``root`` is a directory to look for checkpoints in: False when nothing is there (a run that has not
    saved yet), CheckpointError when something other than a directory is (a file, a broken link)."""
    if root.is_dir():
        return True
    if not root.exists() and not root.is_symlink():
        return False
    what = "a file" if root.is_file() else "no directory"
    raise CheckpointError(f"{root} is {what}, not a checkpoint root (the directory of step_<N> checkpoints)")


def _parked_checkpoints(root: Path) -> dict[str, Path]:
    """``{"step_<N>": .replaced-step_<N>-<hex>}``: complete checkpoints an interrupted replacement moved aside."""
    parked = {}
    for entry in root.iterdir():
        match = _REPLACED_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST_NAME).is_file():
            parked[match.group(1)] = entry
    return parked


def checkpoint_step(path: Path) -> int:
    """The step of the checkpoint directory ``path``: ``step_<N>``, or its parked copy ``.replaced-step_<N>-<hex>``."""
    match = _STEP_DIR.match(path.name) or _REPLACED_DIR.match(path.name)
    if match is None:
        raise CheckpointError(f"{path} is not a checkpoint directory (step_<N>)")
    name = match.group(1)
    return int(name.removeprefix("step_"))


def checkpoint_path(root: Path, name: str) -> Path:
    """Where the checkpoint ``name`` (``step_<N>``) of ``root`` is: its own directory, or its parked copy."""
    own = root / name
    if own.exists():
        return own
    return _parked_checkpoints(root).get(name, own) if root.is_dir() else own


def verify_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a checkpoint directory's manifest and its state file's size and sha256; return the manifest.

    :raises CheckpointError: naming the file that is missing, truncated or corrupt.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, entry in manifest["files"].items():  # state.pt, and a sharded checkpoint's shards
        if not isinstance(entry, dict) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{directory / MANIFEST_NAME} lists {name!r}, which is not a file of the checkpoint")
        verify_file(directory / name, entry)
    return manifest


def _read_pointer(root: Path) -> str | None:
    """The ``step_<N>`` name ``latest`` holds; None when there is none to read (missing, unreadable, not
    text, not a file, not a checkpoint name): the readers then fall back to the highest complete step."""
    pointer = root / LATEST_NAME
    try:
        with open(pointer, "rb") as file:
            raw = file.read(_POINTER_LIMIT + 1)
        name = raw.decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        warnings.warn(f"{pointer} cannot be read ({err}); taking the highest complete step_<N> instead", stacklevel=2)
        return None
    if len(raw) > _POINTER_LIMIT or not _STEP_DIR.fullmatch(name):
        return None
    return name


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``latest`` names; the highest complete step if the pointer is missing or stale.

    None for a ``root`` that does not exist (yet): no checkpoint. A file there is refused.
    """
    root = Path(root)
    if not _is_root(root):
        return None
    pointed = _read_pointer(root)
    if pointed is not None and (checkpoint_path(root, pointed) / MANIFEST_NAME).is_file():
        return checkpoint_path(root, pointed)
    complete = list_checkpoints(root)
    return complete[-1].path if complete else None


def resolve_checkpoint(path: str | os.PathLike[str], rank: int | None = None) -> Path:
    """The checkpoint directory ``path`` means: itself, or a checkpoint root's latest complete one.

    A root written by every rank (``rank_<r>/`` subdirectories) resolves to ``rank``'s
    (default: the current ``torch.distributed`` rank, else 0).
    """
    path = Path(path)
    if path.is_file():
        if path.name in (STATE_NAME, MANIFEST_NAME):
            return resolve_checkpoint(path.parent, rank)
        raise CheckpointError(
            f"{path} is a file: an nvtrain checkpoint is a directory holding {MANIFEST_NAME} and {STATE_NAME}"
        )
    if not path.exists() and _STEP_DIR.match(path.name):
        path = checkpoint_path(path.parent, path.name)  # its parked copy, while an interrupted replacement left one
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: it does not exist")
    if (path / MANIFEST_NAME).is_file():
        return path
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"{path} is an unfinished save (no {MANIFEST_NAME}); unfinished saves are never loaded")
    if _STEP_DIR.match(path.name):
        raise CheckpointError(f"{path} has no {MANIFEST_NAME}: it is not a complete checkpoint")
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    ranks = sorted(entry for entry in path.iterdir() if _RANK_DIR.match(entry.name) and entry.is_dir())
    if ranks:
        return resolve_checkpoint(path / f"rank_{_current_rank() if rank is None else rank}", rank)
    raise CheckpointError(f"{path} holds no complete checkpoint (no step_<N> directory with {MANIFEST_NAME})")


def _current_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# -- reading ------------------------------------------------------------------------------------


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked for the fields a reader relies on."""
    file = Path(directory) / MANIFEST_NAME
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file} does not exist: {directory} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not a valid manifest (not JSON: {err})") from None
    except OSError as err:  # unreadable (permissions), a directory in its place, an I/O error
        raise CheckpointError(f"{file} cannot be read: {err.strerror or err}") from None
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        raise CheckpointError(f"{file} is not an nvtrain checkpoint manifest (no format_version)")
    version = manifest["format_version"]
    if type(version) is not int:  # 1.0 and true equal 1 in Python, but no nvtrain wrote them
        raise CheckpointError(f"{file}: format_version must be an int (got {version!r}): the manifest was modified")
    if version < 1:
        raise CheckpointError(
            f"{file}: format_version {version} is one no nvtrain-checkpoint writes (formats start at 1; this one "
            f"reads format {FORMAT_VERSION}): the manifest was modified"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            newer_format_message(Path(directory), manifest)
            or f"{file}: checkpoint format {version} was written by an older nvtrain-checkpoint (this one reads "
            f"format {FORMAT_VERSION}); install the version that wrote it"
        )
    _check_manifest_step(file, manifest.get("step"))
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE_NAME not in files:
        raise CheckpointError(f"{file} does not list {STATE_NAME} with its size and sha256")
    for name, entry in files.items():  # state.pt, and a sharded checkpoint's shards
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"{file} does not list {name} with its size and sha256 (it has {entry!r})")
    if "sharded" in manifest:
        _check_sharded_entry(file, manifest["sharded"])
    if "run_config" in manifest and not isinstance(manifest["run_config"], dict):
        raise CheckpointError(
            f"{file}: 'run_config' must be a mapping (the resolved config of the run that wrote the checkpoint; "
            f"one written from Python has none), got {shown_value(manifest['run_config'])}: the manifest was modified"
        )
    return manifest


def _check_sharded_entry(file: Path, entry: Any) -> None:
    """A ``sharded`` entry says the weights lie in DCP shards, not in ``state.pt`` (a plain checkpoint's manifest
    has none): a malformed one would have the reader look for them in the wrong place."""
    from nvtrain_checkpoint.dcp_files import FORMAT, SHARDED_DIR  # dcp_files imports this module

    world_size = entry.get("world_size") if isinstance(entry, dict) else None
    if (
        isinstance(entry, dict)
        and entry.get("format") == FORMAT
        and entry.get("directory") == SHARDED_DIR
        and type(world_size) is int
        and world_size >= 1
    ):
        return
    expected = f'{{"format": "{FORMAT}", "directory": "{SHARDED_DIR}", "world_size": <int >= 1>}}'
    raise CheckpointError(
        f"{file}: 'sharded' is malformed: expected a mapping {expected} (what a sharded checkpoint's manifest holds; "
        f"a plain one has no 'sharded'), got {shown_value(entry)}: the manifest was modified"
    )


def shown_value(value: Any) -> str:
    """How a refusal names what a field holds: its repr (cut short past a line's worth) and its type."""
    text = repr(value)
    return f"{text[:120] + '...' if len(text) > 120 else text} ({type(value).__name__})"


def _check_manifest_step(file: Path, step: Any) -> None:
    """The manifest's ``step`` is what a resume trains on from: an int, and the one its directory is named by
    (a directory of another name, such as a copy, is not checked against its name)."""
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{file}: 'step' must be the checkpoint's step, an int >= 0 (got {step!r})")
    directory = file.parent
    if _STEP_DIR.match(directory.name) or _REPLACED_DIR.match(directory.name):
        named = checkpoint_step(directory)
        if named != step:
            raise CheckpointError(
                f"{file} records step {step}, but its directory is {directory.name}: the manifest was modified or "
                "belongs to another checkpoint"
            )


def read_checkpoint_manifest(path: str | os.PathLike[str], rank: int | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (a ``step_<N>`` directory or a checkpoint root)."""
    return read_manifest(resolve_checkpoint(path, rank))


def verify_file(path: Path, entry: Mapping[str, Any]) -> None:
    """Refuse a file whose size or sha256 differs from what the manifest recorded."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing although the manifest lists it") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror or err}") from None
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file although the manifest lists it as one")
    if size != entry["size"]:
        raise CheckpointError(
            f"{path} is {size} bytes but the manifest recorded {entry['size']}: the file is truncated or was "
            "modified after the checkpoint was written"
        )
    try:
        digest = file_digest(path)["sha256"]
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror or err}") from None
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path} does not match the sha256 in its manifest: the file is corrupt")


def load_state_file(path: Path) -> Any:
    """``torch.load(weights_only=True)``: a checkpoint can hold data, never code."""
    with open(path, "rb") as file:
        if file.read(4) != _ZIP_MAGIC:
            raise CheckpointError(f"{path} is not a readable torch file (torch.save's zip format expected)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} was refused by torch.load(weights_only=True): it holds objects other than tensors and "
            f"plain data, which a checkpoint may not ({_reason(err)})"
        ) from err
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{path} is not a readable torch file: {type(err).__name__}: {err}") from err


def saved_state(path: str | os.PathLike[str], rank: int | None = None) -> dict[str, Any] | None:
    """The training state of the checkpoint at ``path``, mapped from disk (``mmap``: the tensors' shapes are
    there, their data is not read), for checks before a resume; None for a sharded checkpoint or one that
    cannot be read so (the resume itself then says why)."""
    try:
        directory = resolve_checkpoint(path, rank)
        if "sharded" in read_manifest(directory):
            return None
        state = torch.load(directory / STATE_NAME, map_location="cpu", weights_only=True, mmap=True)
    except (CheckpointError, OSError, RuntimeError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile):
        return None
    return state if isinstance(state, dict) else None


def _reason(err: Exception) -> str:
    """The line of a weights-only refusal that says what was refused (torch's message opens with advice)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    specific = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line]
    return (specific or lines or [type(err).__name__])[0]


def read_checkpoint(path: str | os.PathLike[str], rank: int | None = None) -> dict[str, Any]:
    """Read, verify and return the training state stored at ``path`` (a checkpoint or a checkpoint root).

    :raises CheckpointError: naming the file, for a missing, incomplete, truncated,
        corrupt or foreign checkpoint, before anything is applied to a model.
    """
    from nvtrain.state import check_state

    directory = resolve_checkpoint(path, rank)
    manifest = read_manifest(directory)
    if "sharded" in manifest:  # checked by read_manifest: a mapping naming the format and the ranks
        raise CheckpointError(
            f"{directory} is a sharded checkpoint (written by {manifest['sharded'].get('world_size')} FSDP ranks): "
            "its weights are not in one state file. Resume it with CheckpointHook(resume=...) on any number of "
            "ranks, or write one plain weights file with CheckpointHook.export(path) / nvtrain_checkpoint.export_weights"
        )
    state_file = directory / STATE_NAME
    verify_checkpoint(directory)  # every file the manifest lists, as a resume and an export check them
    state = load_state_file(state_file)
    try:
        check_state(state, source=str(state_file))
    except (TypeError, ValueError) as err:
        raise CheckpointError(str(err)) from None
    differences = version_differences(manifest)
    if differences:
        warnings.warn(
            f"checkpoint {directory} was written by other versions than the running ones: "
            + "; ".join(differences),
            CheckpointVersionWarning,
            stacklevel=2,
        )
    return state


# -- versions -----------------------------------------------------------------------------------


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


#: What a manifest records for a hook from code that is no installed distribution and has no ``__version__``
#: (a class in the training script, a module beside it).
UNKNOWN_VERSION = "unknown"


def running_version(distribution: str) -> str | None:
    """The version of ``distribution`` as a manifest records it: installed, else the ``__version__`` of the
    loaded module of that name (code beside the script), else None."""
    return installed_version(distribution) or _module_version(distribution)


def _module_version(name: str) -> str | None:
    version = getattr(sys.modules.get(name), "__version__", None)
    return str(version) if version is not None else None


def version_differences(manifest: Mapping[str, Any]) -> list[str]:
    """``"<what> <saved> -> <running>"`` for nvtrain and every plugin whose version changed."""
    import nvtrain

    differences = []
    saved_core = manifest.get("nvtrain_version")
    if saved_core is not None and saved_core != nvtrain.__version__:
        differences.append(f"nvtrain {saved_core} -> {nvtrain.__version__}")
    plugins = manifest.get("plugins") or {}
    for name, info in sorted(plugins.items()) if isinstance(plugins, dict) else ():
        if not isinstance(info, dict):
            continue
        distribution, saved = info.get("distribution"), info.get("version")
        if not isinstance(distribution, str) or distribution == "nvtrain":
            continue
        running = running_version(distribution)
        if running is None and saved == UNKNOWN_VERSION:
            continue  # code of no known version (a hook defined in the script): nothing to compare
        if running != saved:
            differences.append(f"plugin {name!r} ({distribution}) {saved} -> {running or 'not installed'}")
    return differences
