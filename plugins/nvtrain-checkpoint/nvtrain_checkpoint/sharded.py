"""Sharded checkpoints: models whose parameters are DTensors (FSDP) saved with torch.distributed.checkpoint.

Layout of one sharded checkpoint (the rest of the directory is as in :mod:`storage`)::

    step_500/
        state.pt            rank 0: everything but the sharded tensors (counters, data position, LR
                            schedulers, hook states, every rank's RNG states); weights_only-loadable
        sharded/            torch.distributed.checkpoint (DCP): every rank writes its own shards
            .metadata       DCP's index of the shards (a pickle: read with a restricted unpickler)
            __0_0.distcp    rank 0's shards of the models, the optimizers and DTensor hook states
            __1_0.distcp    ...
        manifest.json       size and sha256 of every file above, "sharded": {...}

Saving follows the single-file rules: everything is written under a ``.tmp-`` name
(every rank writes its shards there, DCP fsyncs them), rank 0 writes ``state.pt`` and
the manifest once all shards are on disk, publishes the directory with one rename,
then points ``latest`` at it and applies ``keep_last_n``. A process killed at any
moment leaves ``latest`` naming a complete checkpoint. With ``async_save`` the shards
are staged to host memory (a copy) and written by DCP's ``async_save`` on a thread;
the rank-0 publication runs after it, on the hook's background writer.

Loading reshards: the templates are the live models' and optimizers' state dicts
(DTensors on N ranks, plain tensors in one process), and DCP reads into each rank
exactly the parts of the saved shards that its template covers. Nothing read can run
code: DCP's ``.metadata`` pickle goes through an unpickler that admits only DCP's
metadata classes, and the non-tensor entries DCP stores (optimizer hyper-parameters)
are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import shutil
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvtrain.errors import ResumeError
from nvtrain.state import (
    capture_rng_state,
    capture_state,
    check_state,
    checkpointable_hooks,
    load_state,
    strategy_hooks,
)
from nvtrain.validators import FieldValueError
from nvtrain_checkpoint import storage
from nvtrain_checkpoint.snapshot import snapshot

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import Metadata

    from nvtrain.context import TrainingContext
    from nvtrain.strategy import TrainingStrategy

# torch.distributed.checkpoint and torch.distributed.tensor cost most of a second to import: they are
# imported where a sharded checkpoint is written or read, not when the plugin is.

__all__ = [
    "METADATA_NAME",
    "SHARDED_DIR",
    "ShardedSaver",
    "export_weights",
    "is_sharded_checkpoint",
    "load_sharded",
    "models_are_sharded",
    "read_dcp_metadata",
]

#: The subdirectory holding the DCP checkpoint, and DCP's index file in it.
SHARDED_DIR = "sharded"
METADATA_NAME = ".metadata"
#: ``manifest["sharded"]["format"]``.
FORMAT = "torch.distributed.checkpoint"
#: A hook-state tensor stored in the DCP part; in ``state.pt`` it is replaced by ``{MARKER: key}``.
MARKER = "__nvtrain_sharded__"


# -- what is sharded ---------------------------------------------------------------------------------


def _dtensor_type() -> type[torch.Tensor] | None:
    """DTensor, when torch.distributed.tensor is loaded (without it no tensor is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def models_are_sharded(ctx: TrainingContext) -> bool:
    """Whether any trained model has DTensor parameters (FSDP): its checkpoint must be sharded."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(
        isinstance(p, dtensor) for model in ctx.models.values() for p in model.parameters()
    )


def is_sharded_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether the complete checkpoint at ``directory`` was written sharded (its manifest says so)."""
    sharded = storage.read_manifest(directory).get("sharded")
    return isinstance(sharded, dict) and sharded.get("format") == FORMAT


# -- safe reading --------------------------------------------------------------------------------------

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


def _dcp_load(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> None:
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


def _saving(directory: Path, save: Callable[[], Metadata]) -> Metadata:
    """Run a DCP save, turning its gathered failure (a BaseException) into an ordinary error naming the place."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return save()
    except CheckpointException as err:
        ranks, inner = _first_failure(err)
        raise RuntimeError(
            f"writing the sharded checkpoint {directory} failed on rank(s) {ranks}: {type(inner).__name__}: {inner}"
        ) from inner


# -- splitting a captured state --------------------------------------------------------------------------


def _optimizer_model(name: str, optimizer: torch.optim.Optimizer, models: Mapping[str, torch.nn.Module]) -> Any:
    """The model whose parameters ``optimizer`` steps: the one of the same name, else the one holding its params."""
    if name in models:
        return models[name]
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    for model in models.values():
        if any(p is first for p in model.parameters()):
            return model
    raise ResumeError(f"optimizer {name!r} steps no parameter of the models {sorted(models)}")


def _sharded_parts(strategy: TrainingStrategy) -> dict[str, Any]:
    """Models and optimizers as DCP state dicts (FQN keys; DTensor shards where the model is sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    ctx = strategy.ctx
    return {
        "models": {name: get_model_state_dict(model) for name, model in ctx.models.items()},
        "optimizers": {
            name: get_optimizer_state_dict(_optimizer_model(name, optimizer, ctx.models), optimizer)
            for name, optimizer in ctx.optimizers.items()
        },
    }


def _extract_dtensors(value: Any, path: str, found: dict[str, torch.Tensor]) -> Any:
    """``value`` with every DTensor replaced by ``{MARKER: key}``; the DTensors go into ``found`` by key."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        found[path] = value
        return {MARKER: path}
    if isinstance(value, dict):
        return type(value)((k, _extract_dtensors(v, f"{path}/{k}", found)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_extract_dtensors(v, f"{path}/{i}", found) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _put_back(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Undo :func:`_extract_dtensors` with the loaded tensors."""
    if isinstance(value, dict):
        if set(value) == {MARKER}:
            return tensors[value[MARKER]]
        return type(value)((k, _put_back(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items = [_put_back(v, tensors) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _find(value: Any, path: str) -> Any:
    """The value at an :func:`_extract_dtensors` path (``"hooks/ema:main/averaged/module.0.weight"``), or None."""
    for part in path.split("/")[1:]:
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# -- saving ---------------------------------------------------------------------------------------------------


def _data_files(metadata: Metadata) -> list[str]:
    """The files DCP wrote (relative to its directory), from its own index."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


class ShardedSaver:
    """The sharded saves of one CheckpointHook; every rank calls :meth:`save` at the same step.

    ``async_save`` runs DCP's collectives on a gloo group of its own (created at the first
    asynchronous save), so they never interleave with training's on the default group.
    """

    def __init__(self) -> None:
        self._async_group: Any = None

    def save(
        self,
        ctx: TrainingContext,
        root: Path,
        step: int,
        metadata: dict[str, Any],
        *,
        keep_last_n: int | None,
        async_save: bool,
        rank_zero_only: bool,
        submit: Callable[[Callable[[], Path], str, Callable[[Path], None]], None],
        discard: storage.Discard = storage.delete_trash,
        on_published: Callable[[Path], None],
    ) -> None:
        """Write the state of ``ctx.strategy`` as ``root/step_<step>``: shards on every rank, the rest on rank 0.

        Synchronously, every rank returns once the checkpoint is published; with ``async_save``
        the writing continues in ``submit`` (the hook's background writer, whose previous job
        must be finished) and ``on_published`` runs there when it is done. A synchronous save hands
        the checkpoints retention dropped to ``discard``; a background one deletes them itself.
        """
        if not rank_zero_only and ctx.world_size > 1:
            raise FieldValueError(
                "CheckpointHook.rank_zero_only=False writes one checkpoint tree per rank, but models sharded with "
                "FSDP are saved as one sharded checkpoint that every rank writes into (in checkpoint_dir, storage "
                "every rank shares); set rank_zero_only=True (the default)",
                owner="CheckpointHook", field="rank_zero_only", value=False, expected="True when models are sharded",
            )
        strategy = ctx.strategy
        assert strategy is not None
        rank, world_size = dist.get_rank(), dist.get_world_size()
        # One collective: every rank's RNG states, for rank 0 to save (each rank resumes with its own).
        rng_states: list[Any] = [None] * world_size
        dist.all_gather_object(rng_states, capture_rng_state(ctx.train_loader))
        tmp_name: list[Any] = [None]
        if rank == 0:
            if not root.is_dir():
                root.mkdir(parents=True, exist_ok=True)
                storage.fsync_dir(root.parent)
            storage.remove_leftovers(root)
            tmp = root / f"{storage.TMP_PREFIX}{storage.checkpoint_name(step)}-{uuid.uuid4().hex}"
            (tmp / SHARDED_DIR).mkdir(parents=True)
            tmp_name[0] = tmp.name
        dist.broadcast_object_list(tmp_name, src=0)
        tmp = root / str(tmp_name[0])
        state = capture_state(strategy)
        hook_tensors: dict[str, torch.Tensor] = {}
        rest = {
            **state,
            "models": {name: {} for name in state["models"]},
            "optimizers": {name: {} for name in state["optimizers"]},
            "hooks": _extract_dtensors(state["hooks"], "hooks", hook_tensors),
        }
        rest["rng_by_rank"] = rng_states
        parts = {**_sharded_parts(strategy), "hook_tensors": hook_tensors}
        # rank 0's small state is copied now, on the training thread, like the single-file path's snapshot
        copied = snapshot(rest) if rank == 0 else None
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(tmp / SHARDED_DIR, sync_files=True)
        manifest = {**metadata, "sharded": {"format": FORMAT, "directory": SHARDED_DIR, "world_size": world_size}}
        finish = functools.partial(
            _finish, root=root, tmp=tmp, step=step, state=copied, manifest=manifest, keep_last_n=keep_last_n
        )
        if not async_save:
            saved = _saving(tmp, functools.partial(dcp.save, parts, storage_writer=writer))
            path = finish(saved, group=None, discard=discard)
            on_published(path)
            return
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        group = self._async_group
        future = dcp.async_save(parts, storage_writer=writer, process_group=group)  # stages a copy, then returns
        if not isinstance(future, Future):  # a staging future: only with a non-blocking stager, never given here
            raise TypeError(f"torch.distributed.checkpoint.async_save returned {type(future).__name__}")

        def job() -> Path:
            return finish(_saving(tmp, future.result), group=group)

        submit(job, f"writing {storage.checkpoint_name(step)} in the background (async_save=True)", on_published)

    def close(self) -> None:
        """Destroy the asynchronous saves' process group (the hook's writer has finished by then)."""
        group, self._async_group = self._async_group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


def _finish(
    _: Metadata,
    *,
    group: Any,
    root: Path,
    tmp: Path,
    step: int,
    state: Any,
    manifest: dict[str, Any],
    keep_last_n: int | None,
    discard: storage.Discard = storage.delete_trash,
) -> Path:
    """After every rank's shards are on disk: digests (each rank hashes a share), then rank 0 publishes."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    directory = tmp / SHARDED_DIR
    # The index as the coordinator wrote it: the Metadata dcp.save returns has no storage_data on
    # some torch releases (seen with torch 2.11 and NCCL), the file always has it.
    written = read_dcp_metadata(directory / METADATA_NAME)
    mine = {
        f"{SHARDED_DIR}/{name}": storage.file_digest(directory / name)
        for index, name in enumerate(_data_files(written))
        if index % world_size == rank
    }
    gathered: list[Any] = [None] * world_size
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0, group=group)  # every group holds rank 0
    final = root / storage.checkpoint_name(step)
    if rank == 0:
        try:
            files = {f"{SHARDED_DIR}/{METADATA_NAME}": storage.file_digest(directory / METADATA_NAME)}
            for share in gathered:
                files.update(share)
            on_disk = {f"{SHARDED_DIR}/{entry.name}" for entry in directory.iterdir()}
            if on_disk != set(files):
                raise storage.CheckpointError(
                    f"{directory}: DCP wrote {sorted(on_disk)} but its metadata lists {sorted(files)}"
                )
            storage.fsync_dir(directory)
            files[storage.STATE_NAME] = storage.write_state_file(tmp / storage.STATE_NAME, state)
            entry = {"format_version": storage.FORMAT_VERSION, "step": step, **manifest, "files": files}
            storage.write_manifest(tmp / storage.MANIFEST_NAME, entry)
            storage.fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-save; the original error is what matters
            raise
        storage.publish(tmp, final)
        storage.write_latest(root, final.name)
        storage.apply_retention(root, keep_last_n, discard=discard)
    dist.barrier(group=group)  # no rank goes on (or reads the checkpoint) before rank 0 published it
    return final


# -- loading --------------------------------------------------------------------------------------------------


def _template_for(key: str, metadata: Metadata, live: Any) -> torch.Tensor:
    """Where the saved hook tensor ``key`` is read into: the live one when it fits, else a full plain tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entry = metadata.state_dict_metadata.get(f"hook_tensors.{key}")
    if not isinstance(entry, TensorStorageMetadata):
        raise storage.CheckpointError(f"the sharded checkpoint lists no tensor for {key!r}")
    if isinstance(live, torch.Tensor) and tuple(live.shape) == tuple(entry.size) and live.dtype == entry.properties.dtype:
        return live
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def load_sharded(
    strategy: TrainingStrategy, directory: Path, *, data_position: bool = True, source: str | None = None
) -> None:
    """Restore a sharded checkpoint into a set-up ``strategy`` (on any number of ranks), as ``load_state`` would.

    The models and optimizers are loaded through DCP into their live state dicts (each rank
    reading what its shards need: the weights and optimizer state reshard to this job's
    ranks), then the rest of the state is applied by ``load_state``. Every rank of the job
    calls it. ``directory`` must have been verified.

    The data position (the step scheduler's state) belongs to the saving job's samplers:
    with another number of ranks it cannot be resumed, and this raises unless
    ``data_position=False``, which leaves it out (the run then starts the saved epoch's
    data from its beginning).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    ctx = strategy.ctx
    source = source or f"checkpoint {str(directory)!r}"
    rest = storage.load_state_file(directory / storage.STATE_NAME)
    try:
        check_state(rest, source=str(directory / storage.STATE_NAME))
    except (TypeError, ValueError) as err:
        raise storage.CheckpointError(str(err)) from None
    saved_ranks = storage.read_manifest(directory)["sharded"].get("world_size")
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not data_position:
        rest["scheduler"] = None
    elif saved_ranks != ranks and rest.get("scheduler") is not None:
        raise ResumeError(
            f"{source} was written by {saved_ranks} ranks and this job has {ranks}: the weights and optimizer "
            f"state reshard, but the data position belongs to {saved_ranks} ranks' samplers. Resume on "
            f"{saved_ranks} ranks, or restore without the data position: "
            "CheckpointHook.load_into(strategy, path, data_position=False) after strategy.setup(train_loader) "
            "(the run then starts the saved epoch's data from its beginning)"
        )
    for kind, live in (("models", ctx.models), ("optimizers", ctx.optimizers)):
        if set(rest[kind]) != set(live):
            raise ResumeError(
                f"the checkpoint's {kind} are {sorted(rest[kind])} but this strategy has {sorted(live)}; "
                "build the strategy with the same names as the one that saved it"
            )
    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME)
    markers: dict[str, torch.Tensor] = {}
    _extract_markers(rest["hooks"], markers)
    live_hooks = {key: hook.state_dict() for key, hook in checkpointable_hooks(strategy_hooks(strategy)).items()}
    template = {
        **_sharded_parts(strategy),
        "hook_tensors": {key: _template_for(key, metadata, _find(live_hooks, key)) for key in markers},
    }
    try:
        _dcp_load(template, directory / SHARDED_DIR)
    except storage.CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError) as err:  # ResumeError too: a shape or a key that does not fit
        raise ResumeError(f"{source} does not fit this strategy's models and optimizers: {err}") from err
    for name, model in ctx.models.items():
        set_model_state_dict(model, template["models"][name])
    for name, optimizer in ctx.optimizers.items():
        set_optimizer_state_dict(_optimizer_model(name, optimizer, ctx.models), optimizer, template["optimizers"][name])
    state = {
        **rest,
        "models": {name: model.state_dict() for name, model in ctx.models.items()},
        "optimizers": {name: optimizer.state_dict() for name, optimizer in ctx.optimizers.items()},
        "hooks": _put_back(rest["hooks"], template["hook_tensors"]),
    }
    load_state(strategy, state, source=source)


def _extract_markers(value: Any, found: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        if set(value) == {MARKER}:
            found[value[MARKER]] = None
            return
        for item in value.values():
            _extract_markers(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _extract_markers(item, found)


# -- export -------------------------------------------------------------------------------------------------------


def export_weights(checkpoint: str | os.PathLike[str], path: str | os.PathLike[str], model_key: str | None = None) -> Path:
    """Write one model's weights from a checkpoint as one plain ``state_dict`` file (``torch.save``).

    ``checkpoint`` is a checkpoint directory or a checkpoint root (its latest); a sharded
    checkpoint is consolidated (every shard read, in this process alone, into full tensors).
    ``model_key`` may be left out when the checkpoint holds one model. The file loads with
    ``torch.load(path, weights_only=True)`` into the plain model. Written atomically.
    """
    directory = storage.resolve_checkpoint(checkpoint)
    manifest = storage.verify_checkpoint(directory)
    sharded = manifest.get("sharded")
    if isinstance(sharded, dict) and sharded.get("format") == FORMAT:
        weights = _consolidated_model(directory, model_key)
    else:
        models = storage.read_checkpoint(directory)["models"]
        weights = dict(models[_one_model(model_key, models, directory)])
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{storage.TMP_PREFIX}{target.name}-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as file:
            torch.save(weights, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def _one_model(model_key: str | None, names: Iterable[str], directory: Path) -> str:
    names = sorted(names)
    if model_key is None:
        if len(names) != 1:
            raise ValueError(f"{directory} holds the models {names}: name the one to export (model_key=...)")
        return names[0]
    if model_key not in names:
        raise ValueError(f"{directory} holds no model {model_key!r} (models: {names})")
    return model_key


def _consolidated_model(directory: Path, model_key: str | None) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    entries: dict[str, dict[str, Any]] = {}
    for flat, path in paths.items():
        if isinstance(path, tuple) and len(path) == 3 and path[0] == "models":
            entries.setdefault(str(path[1]), {})[str(path[2])] = metadata.state_dict_metadata.get(flat)
    key = _one_model(model_key, entries, directory)
    template: dict[str, Any] = {}
    for fqn, entry in entries[key].items():
        if isinstance(entry, TensorStorageMetadata):
            template[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif not isinstance(entry, BytesStorageMetadata):
            raise storage.CheckpointError(f"{directory}: no saved entry for {key}.{fqn}")
    loaded: dict[str, Any] = {"models": {key: template}}
    _dcp_load(loaded, directory / SHARDED_DIR, no_dist=True)
    return {fqn: value for fqn, value in loaded["models"][key].items() if isinstance(value, torch.Tensor)}
