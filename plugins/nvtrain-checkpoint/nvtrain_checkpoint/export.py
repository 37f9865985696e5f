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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from nvtrain_checkpoint import storage
from nvtrain_checkpoint.dcp_files import METADATA_NAME, SHARDED_DIR, dcp_load, read_dcp_metadata
from nvtrain_checkpoint.sharded import MARKER, hook_tensor_template, is_sharded_checkpoint

__all__ = ["export_weights"]

#: The prefix ``torch.optim.swa_utils.AveragedModel`` (and the sharded average) put before the model's keys.
_AVERAGED_PREFIX = "module."


def export_weights(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    model_key: str | None = None,
    *,
    ema: bool | str = False,
) -> Path:
    """Write one model's weights from a checkpoint as one plain ``state_dict`` file (``torch.save``).

    ``checkpoint`` is a checkpoint directory or a checkpoint root (its latest); a sharded
    checkpoint is consolidated (every shard read, in this process alone, into full tensors).
    ``model_key`` may be left out when the checkpoint holds one model, or when ``ema`` names
    the average by its key. ``ema=True`` writes
    the model's exponential moving average instead (the EMA hook's state, saved under
    ``ema:<model_key>``); a string names the hook state to take it from
    (``ema="ema:teacher"``). The file loads with ``torch.load(path, weights_only=True)``
    into the plain model. Written atomically (temporary file, fsync, rename); returns its path.
    """
    directory = storage.resolve_checkpoint(checkpoint)
    storage.verify_checkpoint(directory)
    if is_sharded_checkpoint(directory):
        state = storage.load_state_file(directory / storage.STATE_NAME)  # verified with the manifest above
        model = _one_model(model_key, _state_models(state, directory), directory, ema)
        if ema is False:
            weights = _consolidated_model(directory, model)
        else:
            weights = _consolidated(directory, _averaged(state, model, ema, directory))
    else:
        state = storage.read_checkpoint(directory)
        model = _one_model(model_key, _state_models(state, directory), directory, ema)
        weights = _model_weights(state, model, directory) if ema is False else _averaged(state, model, ema, directory)
    return _write_atomically(weights, Path(path))


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


def _averaged(state: Mapping[str, Any], model: str, ema: bool | str, directory: Path) -> dict[str, Any]:
    """The EMA average of ``model`` as the plain model's state dict; sharded tensors still as markers."""
    hooks = state.get("hooks")
    hooks = hooks if isinstance(hooks, Mapping) else {}
    averages = sorted(key for key, value in hooks.items() if _is_ema_state(value))
    models = state.get("models")
    key = _ema_key(averages, model, isinstance(models, Mapping) and len(models) == 1, ema, directory)
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
    return {
        name.removeprefix(_AVERAGED_PREFIX): value
        for name, value in averaged.items()
        if isinstance(name, str) and name.startswith(_AVERAGED_PREFIX)
    }


def _is_ema_state(value: Any) -> bool:
    """An EMA hook's state: ``{"num_updates": int, "averaged": {"module.<key>": tensor, ...} or None}``."""
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("num_updates"), int)
        and (value.get("averaged") is None or isinstance(value.get("averaged"), Mapping))
    )


def _ema_key(averages: list[str], model: str, only_model: bool, ema: bool | str, directory: Path) -> str:
    """Which hook state holds the average: the one ``ema`` names, else ``ema:<model>``, else the only one
    when the checkpoint holds one model."""
    if isinstance(ema, str):
        if ema not in averages:
            raise ValueError(f"{directory} holds no EMA state {ema!r} (EMA states: {averages})")
        return ema
    wanted = f"ema:{model}"
    if wanted in averages:
        return wanted
    if len(averages) == 1 and only_model:
        return averages[0]  # one model, one average (keyed otherwise: a state_key, or ``ema:0`` from older releases)
    raise ValueError(
        f"{directory} holds no EMA average of model {model!r} (no hook state {wanted!r}; EMA states: {averages}); "
        "name the one to export (ema='<state key>' / --ema-key)"
    )


def _consolidated_model(directory: Path, model: str) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint's ``model``, read from every shard."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = read_dcp_metadata(directory / SHARDED_DIR / METADATA_NAME)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    template: dict[str, Any] = {}
    for flat, path in paths.items():
        if isinstance(path, tuple) and len(path) == 3 and path[0] == "models" and path[1] == model:
            entry = metadata.state_dict_metadata.get(flat)
            if isinstance(entry, TensorStorageMetadata):
                template[str(path[2])] = torch.empty(entry.size, dtype=entry.properties.dtype)
            elif not isinstance(entry, BytesStorageMetadata):
                raise storage.CheckpointError(f"{directory}: no saved entry for {model}.{path[2]}")
    if not template:
        raise storage.CheckpointError(f"{directory}: the sharded part holds no weights of model {model!r}")
    loaded: dict[str, Any] = {"models": {model: template}}
    dcp_load(loaded, directory / SHARDED_DIR, no_dist=True)
    return {fqn: value for fqn, value in loaded["models"][model].items() if isinstance(value, torch.Tensor)}


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
    storage.fsync_dir(target.parent)
    return target
