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
code (:mod:`dcp_files`). :mod:`export` consolidates a sharded checkpoint into plain
weights in one process.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nvtrain.errors import ResumeError
from nvtrain.state import (
    applies_data_position_now,
    capture_rng_state,
    capture_state,
    check_restorable,
    check_state,
    checkpointable_hooks,
    load_state,
    strategy_hooks,
    without_data_position,
)
from nvtrain.validators import FieldValueError
from nvtrain_checkpoint import storage
from nvtrain_checkpoint.dcp_files import (
    FORMAT,
    METADATA_NAME,
    SHARDED_DIR,
    data_files,
    dcp_load,
    dcp_save,
    read_dcp_metadata,
)
from nvtrain_checkpoint.snapshot import snapshot

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from nvtrain.context import TrainingContext
    from nvtrain.strategy import TrainingStrategy

# torch.distributed.checkpoint and torch.distributed.tensor cost most of a second to import: they are
# imported where a sharded checkpoint is written or read, not when the plugin is.

__all__ = [
    "MARKER",
    "ShardedSaver",
    "hook_tensor_template",
    "is_sharded_checkpoint",
    "load_sharded",
    "models_are_sharded",
]

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
    return "sharded" in storage.read_manifest(directory)  # checked there: a well-formed entry of FORMAT


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
        passed_over: frozenset[str] = frozenset(),
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

        # Wherever CUDA is available, DCP's writer copies tensors ahead on the current CUDA stream, which makes a
        # CUDA context in every rank of a run on the CPU (one GPU's memory, or a refusal in exclusive-process
        # mode); a CPU run's tensors need no copy ahead.
        if ctx.device.type == "cpu":
            writer = dcp.FileSystemWriter(tmp / SHARDED_DIR, sync_files=True, per_thread_copy_ahead=0)
        else:
            writer = dcp.FileSystemWriter(tmp / SHARDED_DIR, sync_files=True)
        manifest = {**metadata, "sharded": {"format": FORMAT, "directory": SHARDED_DIR, "world_size": world_size}}
        finish = functools.partial(
            _finish,
            root=root,
            tmp=tmp,
            step=step,
            state=copied,
            manifest=manifest,
            keep_last_n=keep_last_n,
            passed_over=passed_over,
        )
        if not async_save:
            saved = dcp_save(tmp, functools.partial(dcp.save, parts, storage_writer=writer))
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
            return finish(dcp_save(tmp, future.result), group=group)

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
    passed_over: frozenset[str] = frozenset(),
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
        for index, name in enumerate(data_files(written))
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
        storage.set_aside(root, set(passed_over) - {final.name})
        storage.apply_retention(root, keep_last_n, discard=discard)
    dist.barrier(group=group)  # no rank goes on (or reads the checkpoint) before rank 0 published it
    return final


# -- loading --------------------------------------------------------------------------------------------------


def hook_tensor_template(key: str, metadata: Metadata, live: Any = None) -> torch.Tensor:
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

    The data position (the step scheduler's state) carries over to another number of
    ranks when the epochs are read through a DistributedSampler and the global batch
    size is the same (:mod:`nvtrain.data_resharding`); otherwise the step scheduler
    refuses it, and ``data_position=False`` leaves it out (the run then starts the epoch
    the checkpoint would continue from its beginning: :func:`nvtrain.state.without_data_position`).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    ctx = strategy.ctx
    source = source or f"checkpoint {str(directory)!r}"
    rest = storage.load_state_file(directory / storage.STATE_NAME)
    try:
        check_state(rest, source=str(directory / storage.STATE_NAME))
    except (TypeError, ValueError) as err:
        raise storage.CheckpointError(str(err)) from None
    if not data_position:
        rest = without_data_position(rest)
    for kind, live in (("models", ctx.models), ("optimizers", ctx.optimizers)):
        if set(rest[kind]) != set(live):
            raise ResumeError(
                f"the checkpoint's {kind} are {sorted(rest[kind])} but this strategy has {sorted(live)}; "
                "build the strategy with the same names as the one that saved it"
            )
    # The rest of the state (counters, RNG, LR schedulers, the data position) is checked before DCP loads the
    # weights and optimizer states: a refusal then leaves the strategy as it was.
    check_restorable(strategy, rest, scheduler=applies_data_position_now(strategy), weights=False)
    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME)
    markers: dict[str, torch.Tensor] = {}
    _extract_markers(rest["hooks"], markers)
    live_hooks = {key: hook.state_dict() for key, hook in checkpointable_hooks(strategy_hooks(strategy)).items()}
    template = {
        **_sharded_parts(strategy),
        "hook_tensors": {key: hook_tensor_template(key, metadata, _find(live_hooks, key)) for key in markers},
    }
    try:
        dcp_load(template, directory / SHARDED_DIR)
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
