"""Weights for inference: one model's weights, or its EMA average, from a checkpoint as one plain file.

The file is what ``model.state_dict()`` of the plain model holds (full tensors on the
CPU, its keys), saved with ``torch.save``: it loads with ``torch.load(path,
weights_only=True)`` and ``load_state_dict`` anywhere, without nvtrain. A sharded
checkpoint is consolidated in this process alone (DCP reads every shard into full
tensors), with no process group.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from nvtrain.atomic_files import temporary_name
from nvtrain_checkpoint import storage
from nvtrain_checkpoint.dcp_files import METADATA_NAME, SHARDED_DIR, dcp_load, read_dcp_metadata
from nvtrain_checkpoint.sharded import MARKER, hook_tensor_template, is_sharded_checkpoint

__all__ = ["export_weights"]

#: The prefix ``torch.optim.swa_utils.AveragedModel`` (and the sharded average) put before the model's keys.
_AVERAGED_PREFIX = "module."
#: How ``state_dict()`` names a module's ``get_extra_state()``: any object, the one entry that need be no tensor.
_EXTRA_STATE_SUFFIX = "_extra_state"


def export_weights(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    model_key: str | None = None,
    *,
    ema: bool | str = False,
    on_checkpoint: Callable[[Path], object] | None = None,
) -> Path:
    """Write one model's weights from a checkpoint as one plain ``state_dict`` file (``torch.save``).

    ``checkpoint`` is a checkpoint directory or a checkpoint root (its latest); a sharded
    checkpoint is consolidated (every shard read, in this process alone, into full tensors).
    ``model_key`` may be left out when the checkpoint holds one model, or when ``ema`` names
    the average by its key. ``ema=True`` writes
    the model's exponential moving average instead (the EMA hook's state, saved under
    ``ema:<model_key>``); a string names the hook state to take it from
    (``ema="ema:teacher"``); with ``model_key`` too, it must be that model's average.
    ``on_checkpoint`` is called with the checkpoint directory read, once chosen (a root's
    latest), so a caller can say which step it exported. The file loads with
    ``torch.load(path, weights_only=True)`` into the plain model. Written atomically
    (temporary file, fsync, rename), never inside the checkpoint root it reads; returns its path.
    """
    target = _output_file(path)
    if isinstance(ema, str) and not ema:
        raise ValueError(
            "the EMA state key is empty: name the hook state holding the average (ema='ema:main' / --ema-key "
            "ema:main), or take the model's own average with ema=True / --ema"
        )
    directory = _resolved(checkpoint)
    _refuse_output_inside(target, directory, Path(checkpoint))
    if on_checkpoint is not None:
        on_checkpoint(directory)
    storage.verify_checkpoint(directory)
    if is_sharded_checkpoint(directory):
        state = storage.load_state_file(directory / storage.STATE_NAME)  # verified with the manifest above
        model = _one_model(model_key, _state_models(state, directory), directory, ema)
        if ema is False:
            weights = _consolidated_model(directory, model)
        else:
            weights = _consolidated(directory, _averaged(state, model, ema, directory, sharded=True))
    else:
        state = storage.read_checkpoint(directory)
        model = _one_model(model_key, _state_models(state, directory), directory, ema)
        if ema is False:
            weights = _model_weights(state, model, directory)
        else:
            weights = _averaged(state, model, ema, directory, sharded=False)
    return _write_atomically(weights, target)


def _output_file(path: str | os.PathLike[str]) -> Path:
    """The file to write; an empty path (``Path('')`` is the current directory) or a directory is refused."""
    if not os.fspath(path):
        raise ValueError("the output path is empty: name the weights file to write (e.g. model.pt)")
    target = Path(path)
    if target.is_dir():
        raise ValueError(
            f"the output {target} is a directory: name the weights file to write (e.g. {target / 'model.pt'})"
        )
    return target


def _resolved(checkpoint: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``checkpoint`` means; a run directory is refused naming the root it holds."""
    try:
        return storage.resolve_checkpoint(checkpoint)
    except storage.CheckpointError as err:
        roots = _checkpoint_roots_in(Path(checkpoint))
        if not roots:
            raise
        raise storage.CheckpointError(f"{err}; did you mean {' or '.join(str(root) for root in roots)}?") from None


def _checkpoint_roots_in(folder: Path) -> list[Path]:
    """The folders directly in ``folder`` that hold a checkpoint (a run directory's ``checkpoints``)."""
    if not folder.is_dir() or (folder / storage.MANIFEST_NAME).exists():
        return []
    roots = []
    for child in sorted(folder.iterdir()):
        if child.is_dir() and not child.name.startswith("."):
            try:
                storage.resolve_checkpoint(child)
            except (storage.CheckpointError, OSError):
                continue
            roots.append(child)
    return roots


def _refuse_output_inside(target: Path, directory: Path, checkpoint: Path) -> None:
    """Refuse an output inside the checkpoint read or its root: the file would replace a checkpoint's own file
    (``step_30/state.pt``, found corrupt at the next resume) or sit among the checkpoints the hook manages."""
    given = checkpoint if checkpoint.is_dir() else checkpoint.parent  # a state.pt or manifest.json: its directory
    folders = [directory, given]
    if _is_checkpoint_root(directory.parent, directory):
        folders.append(directory.parent)
    written = target.resolve()
    inside = [folder for folder in folders if written.is_relative_to(folder.resolve())]
    if inside:
        outermost = min(inside, key=lambda folder: len(folder.resolve().parts))
        kind = "the checkpoint" if outermost.resolve() == directory.resolve() else "the checkpoint root"
        raise ValueError(
            f"the output {target} is inside {kind} {outermost} it reads: it would replace a checkpoint's file or lie "
            f"among them; write it elsewhere (e.g. {outermost.parent / target.name})"
        )


def _is_checkpoint_root(folder: Path, directory: Path) -> bool:
    """Whether ``directory`` sits in a checkpoint root: a ``latest`` pointer, or other checkpoints beside it."""
    if (folder / storage.LATEST_NAME).exists():
        return True
    own = directory.resolve()
    return any(info.path.resolve() != own for info in storage.list_checkpoints(folder))


def _model_weights(state: Mapping[str, Any], model: str, directory: Path) -> dict[str, Any]:
    """The saved ``state_dict`` of ``model``; a state file crafted to hold something else under its key is
    refused by name rather than failing inside ``dict()``."""
    weights = state["models"][model]
    if not isinstance(weights, Mapping):
        raise storage.CheckpointError(
            f"{directory / storage.STATE_NAME}: the state's models[{model!r}] must be a dict of tensors by "
            f"parameter name (the model's state_dict); got {storage.shown_value(weights)}"
        )
    return dict(weights)


def _state_models(state: Any, directory: Path) -> list[str]:
    models = state.get("models") if isinstance(state, Mapping) else None
    if not isinstance(models, Mapping):
        raise storage.CheckpointError(f"{directory / storage.STATE_NAME} holds no 'models' entry")
    return [str(name) for name in models]


def _one_model(model_key: str | None, names: Iterable[str], directory: Path, ema: bool | str = False) -> str:
    """The model to export: ``model_key``, else the only one; an EMA state named by key needs none (it says
    which average it is), so an empty name is returned for it."""
    names = sorted(names)
    if model_key is None:
        if isinstance(ema, str):
            return ""
        if len(names) != 1:
            raise ValueError(f"{directory} holds the models {names}: name the one to export (model_key=... / --model)")
        return names[0]
    if model_key not in names:
        raise ValueError(f"{directory} holds no model {model_key!r} (models: {names})")
    return model_key


def _averaged(
    state: Mapping[str, Any], model: str, ema: bool | str, directory: Path, *, sharded: bool
) -> dict[str, Any]:
    """The EMA average of ``model`` as the plain model's state dict; sharded tensors still as markers."""
    hooks = state.get("hooks")
    hooks = hooks if isinstance(hooks, Mapping) else {}
    averages = sorted(key for key, value in hooks.items() if _is_ema_state(value))
    models = sorted(str(name) for name in state["models"])
    key = _ema_key(averages, model, models, ema, directory)
    averaged = hooks[key]["averaged"]
    if averaged is None:
        raise storage.CheckpointError(
            f"{directory}: the EMA state {key!r} holds no average yet (saved before its first update)"
        )
    count = averaged.get("n_averaged")
    if hooks[key]["num_updates"] == 0 or (isinstance(count, torch.Tensor) and count.numel() == 1 and int(count) == 0):
        # The copy exists (made at BEFORE_TRAINING) but holds the weights it started from, not an average.
        raise storage.CheckpointError(
            f"{directory}: the EMA state {key!r} holds no average yet (saved before its first update: "
            "num_updates 0, its copy still holds the weights training started from)"
        )
    weights = _average_weights(averaged, key, directory, sharded)
    if model and key != f"ema:{model}":  # a key of its own (a state_key): the checkpoint does not say whose
        _check_average_fits(weights, key, state, model, directory, sharded)
    return weights


def _average_weights(averaged: Mapping[Any, Any], key: str, directory: Path, sharded: bool) -> dict[str, Any]:
    """The average's ``module.<name>`` entries by the plain model's names, each a tensor (in a sharded
    checkpoint, a marker of one in the shards) but a module's extra state: a state crafted to hold something
    else is refused by name."""
    weights: dict[str, Any] = {}
    for name, value in averaged.items():
        if not (isinstance(name, str) and name.startswith(_AVERAGED_PREFIX)):
            continue  # n_averaged
        tensor = isinstance(value, torch.Tensor) or (sharded and isinstance(value, Mapping) and MARKER in value)
        if not tensor and not name.endswith(_EXTRA_STATE_SUFFIX):
            raise storage.CheckpointError(
                f"{directory / storage.STATE_NAME}: the state's hooks[{key!r}]['averaged'][{name!r}] must be a "
                f"tensor (a weight of the average); got {storage.shown_value(value)}"
            )
        weights[name.removeprefix(_AVERAGED_PREFIX)] = value
    if not weights:
        raise storage.CheckpointError(
            f"{directory / storage.STATE_NAME}: the state's hooks[{key!r}]['averaged'] holds no weights "
            f"('{_AVERAGED_PREFIX}<name>' tensors; keys: {sorted(map(str, averaged))})"
        )
    return weights


def _is_ema_state(value: Any) -> bool:
    """An EMA hook's state: ``{"num_updates": int, "averaged": {"module.<key>": tensor, ...} or None}``."""
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("num_updates"), int)
        and (value.get("averaged") is None or isinstance(value.get("averaged"), Mapping))
    )


def _ema_key(averages: list[str], model: str, models: list[str], ema: bool | str, directory: Path) -> str:
    """Which hook state holds the average: the one ``ema`` names (not another model's ``ema:<name>`` when
    ``model`` is given), else ``ema:<model>``, else the only one when the checkpoint holds one model."""
    if not averages:
        raise ValueError(
            f"{directory} holds no EMA average: its run had no EMA hook (export the model's own weights: "
            "no --ema / ema=False)"
        )
    if isinstance(ema, str):
        if ema not in averages:
            raise ValueError(f"{directory} holds no EMA state {ema!r} (EMA states: {averages})")
        owner = ema.removeprefix("ema:")
        if model and ema != f"ema:{model}" and owner in models:
            raise ValueError(
                f"{directory}: the EMA state {ema!r} is the average of model {owner!r}, not of model {model!r}; "
                f"name model {model!r}'s average (EMA states: {averages}), or leave out the model (--model / model_key)"
            )
        return ema
    wanted = f"ema:{model}"
    if wanted in averages:
        return wanted
    if len(averages) == 1 and len(models) == 1:
        return averages[0]  # one model, one average (keyed otherwise: a state_key, or ``ema:0`` from older releases)
    raise ValueError(
        f"{directory} holds no EMA average of model {model!r} (no hook state {wanted!r}; EMA states: {averages}); "
        "name the one to export (ema='<state key>' / --ema-key)"
    )


def _check_average_fits(
    weights: Mapping[str, Any], key: str, state: Mapping[str, Any], model: str, directory: Path, sharded: bool
) -> None:
    """An average under a key of its own (``ema:<state_key>``) may be of any model: the checkpoint does not
    record which, so one asked for as ``model``'s must have that model's names and shapes."""
    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME) if sharded else None
    expected: dict[str, tuple[int, ...] | None]
    if metadata is not None:
        entries = _sharded_model_entries(metadata, model, directory)
        expected = {name: tuple(entry.size) for name, entry in entries.items()}
    else:
        expected = {str(name): _shape(value, None) for name, value in _model_weights(state, model, directory).items()}
    got = {name: _shape(value, metadata) for name, value in weights.items()}
    difference = _difference(got, expected)
    if difference:
        raise ValueError(
            f"{directory}: the EMA state {key!r} is not an average of model {model!r} ({difference}); name that "
            "model's average, or leave out the model (--model / model_key)"
        )


def _shape(value: Any, metadata: Any) -> tuple[int, ...] | None:
    """A saved tensor's shape (read from the shards' metadata for a marker); None for anything else."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if metadata is not None and isinstance(value, Mapping) and MARKER in value:
        entry = metadata.state_dict_metadata.get(f"hook_tensors.{value[MARKER]}")
        return tuple(entry.size) if entry is not None and hasattr(entry, "size") else None
    return None


def _difference(got: Mapping[str, Any], expected: Mapping[str, Any]) -> str:
    """How an average's names and shapes differ from a model's, the first differences named ('' if none)."""
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    if extra or missing:
        return f"names only in the average: {extra[:3]}, only in the model: {missing[:3]}"
    for name in sorted(got):
        if None not in (got[name], expected[name]) and got[name] != expected[name]:
            return f"{name} is {list(got[name])} in the average, {list(expected[name])} in the model"
    return ""


def _consolidated_model(directory: Path, model: str) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint's ``model``, read from every shard."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME)
    template: dict[str, Any] = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in _sharded_model_entries(metadata, model, directory).items()
        if isinstance(entry, TensorStorageMetadata)
    }
    if not template:
        raise storage.CheckpointError(f"{directory}: the sharded part holds no weights of model {model!r}")
    loaded: dict[str, Any] = {"models": {model: template}}
    dcp_load(loaded, directory / SHARDED_DIR, no_dist=True)
    return {fqn: value for fqn, value in loaded["models"][model].items() if isinstance(value, torch.Tensor)}


def _sharded_model_entries(metadata: Any, model: str, directory: Path) -> dict[str, Any]:
    """The shards' metadata of ``model``'s saved tensors by the model's names (non-tensor entries left out)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    entries: dict[str, Any] = {}
    for flat, path in paths.items():
        if isinstance(path, tuple) and len(path) == 3 and path[0] == "models" and path[1] == model:
            entry = metadata.state_dict_metadata.get(flat)
            if isinstance(entry, TensorStorageMetadata):
                entries[str(path[2])] = entry
            elif not isinstance(entry, BytesStorageMetadata):
                raise storage.CheckpointError(f"{directory}: no saved entry for {model}.{path[2]}")
    return entries


def _consolidated(directory: Path, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with each sharded tensor (a ``{MARKER: key}`` in ``state.pt``) read whole from the shards."""
    markers = {name: value[MARKER] for name, value in weights.items() if isinstance(value, Mapping) and MARKER in value}
    if not markers:
        return weights
    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME)
    loaded: dict[str, Any] = {"hook_tensors": {key: hook_tensor_template(key, metadata) for key in markers.values()}}
    dcp_load(loaded, directory / SHARDED_DIR, no_dist=True)
    return {
        name: loaded["hook_tensors"][markers[name]] if name in markers else value for name, value in weights.items()
    }


def _write_atomically(weights: dict[str, Any], target: Path) -> Path:
    """``torch.save`` to a temporary file beside ``target``, fsync, rename: never a half-written weights file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Hidden, unique, and cut short where ``target``'s own name is near the file system's limit on a name.
    tmp = target.with_name(temporary_name(target.parent, storage.TMP_PREFIX, target.name, f"-{uuid.uuid4().hex}"))
    try:
        with open(tmp, "wb") as file:
            _save(weights, file, target)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    storage.fsync_dir(target.parent)
    return target


def _save(weights: dict[str, Any], file: BinaryIO, target: Path) -> None:
    """``torch.save`` to ``file``; a write that fails inside torch's zip writer (a full disk) surfaces there as
    a RuntimeError ("unexpected pos ...") over the OSError: that OSError is raised instead, naming ``target``."""
    try:
        torch.save(weights, file)
    except RuntimeError as err:
        failed = _os_error_in(err)
        if failed is None:
            raise
        raise OSError(failed.errno, failed.strerror, os.fspath(target)) from err


def _os_error_in(err: BaseException) -> OSError | None:
    """The first OSError in ``err``'s chain of causes and contexts."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
