"""Full states (written by one process, plain tensors) loaded into models sharded with FSDP.

In one process the FSDP hook is inactive, so a checkpoint written there holds the
full tensors. On N ranks the parameters are DTensors, which ``load_state_dict``
cannot copy plain tensors into: torch's full-state-dict loads cut each rank's
shards instead. :mod:`nvtrain.state` hands such states here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nvtrain.distributed import dtensor_type, unwrap_model
from nvtrain.errors import ResumeError, first_line

__all__ = ["full_into_sharded", "load_full_model", "load_full_optimizer"]


def full_into_sharded(live: Iterable[torch.Tensor], saved: Any) -> bool:
    """Whether ``saved`` holds full (plain) tensors for parameters sharded here (DTensors, FSDP).

    One process runs with FSDPHook inactive, so its checkpoint holds plain tensors, which
    ``load_state_dict`` cannot copy into DTensors. A sharded state holds plain scalars too
    (AdamW's ``step``): only a tensor of one dimension or more marks a full state.
    """
    dtensor = dtensor_type()
    if dtensor is None or not any(isinstance(param, dtensor) for param in live):
        return False
    tensors = [leaf for leaf in tree_leaves(saved) if isinstance(leaf, torch.Tensor)]
    return not any(isinstance(t, dtensor) for t in tensors) and any(t.dim() > 0 for t in tensors)


def _some(items: list[str], most: int = 4) -> str:
    """The first ``most`` of ``items``, and how many more: a mismatch message stays readable."""
    shown = ", ".join(items[:most])
    return shown if len(items) <= most else f"{shown} (and {len(items) - most} more)"


def _weight_differences(saved: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    """What keeps ``saved`` (full tensors) from loading into ``live`` (a sharded model's state dict, whose
    DTensors have the full shapes), or "" when it fits."""
    parts = []
    lacking = sorted(set(live) - set(saved))
    if lacking:
        parts.append(f"the checkpoint lacks {_some([repr(key) for key in lacking])}")
    extra = sorted(set(saved) - set(live))
    if extra:
        parts.append(f"this model has no {_some([repr(key) for key in extra])}")
    shapes = [
        f"{key!r} is {list(saved[key].shape)} in the checkpoint but {list(value.shape)} in this model"
        for key, value in live.items()
        if isinstance(value, torch.Tensor)
        and isinstance(saved.get(key), torch.Tensor)
        and saved[key].shape != value.shape
    ]
    if shapes:
        parts.append(_some(shapes))
    return "; ".join(parts)


def load_full_model(name: str, module: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    """Load full weights (a checkpoint written by one process) into a model sharded with FSDP.

    Every rank read the whole file, so torch's full-state-dict load (without
    ``broadcast_from_rank0``) distributes each tensor like the live DTensor it replaces. Keys
    and shapes are compared first, alike on every rank, so a model that does not fit is
    refused by all of them before any collective runs.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    differences = _weight_differences(saved, module.state_dict())
    if differences:
        raise ResumeError(f"the checkpoint's weights for model {name!r} do not fit this model: {differences}")
    try:
        # a copy: torch renames and replaces entries of the dict it is given
        set_model_state_dict(module, dict(saved), options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, ValueError) as err:
        raise ResumeError(
            f"the checkpoint's weights for model {name!r} (full tensors, written by one process) could not be "
            f"sharded into this model: {first_line(err)}"
        ) from None


def _optimizer_model(name: str, optimizer: torch.optim.Optimizer, models: Mapping[str, torch.nn.Module]) -> Any:
    """The (unwrapped) model holding every parameter ``optimizer`` steps, the one named ``name`` first:
    torch names an optimizer's state by that model's parameter names."""
    params = {id(param) for group in optimizer.param_groups for param in group["params"]}
    candidates = sorted(models.items(), key=lambda item: item[0] != name)
    for _, model in candidates:
        module = unwrap_model(model)
        if params <= {id(param) for param in module.parameters()}:
            return module
    raise ResumeError(
        f"the checkpoint's state for optimizer {name!r} holds full tensors (written by one process), and "
        f"resharding it needs the one model whose parameters it steps, but it steps parameters of none or "
        f"several of the models {sorted(models)}; give each model an optimizer of its own, or resume it in one "
        "process, as it was written"
    )


def load_full_optimizer(
    name: str, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], models: Mapping[str, torch.nn.Module]
) -> None:
    """Load a full optimizer state (``optimizer.state_dict()`` of one process) into an optimizer of sharded parameters.

    The saved state names parameters by their position in the param groups; torch's
    full-state-dict load wants them named as ``get_optimizer_state_dict`` names them (the
    model's parameter names). Positions map to this optimizer's parameters group by group,
    then each rank keeps the shards of its own. A parameter the checkpoint has no state for
    (it never had a gradient) starts without one, as ``load_state_dict`` would leave it.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved_groups = saved.get("param_groups")
    saved_state = saved.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        raise ResumeError(
            f"the checkpoint's state for optimizer {name!r} does not fit it: expected an optimizer state_dict "
            f"(a 'state' mapping and a 'param_groups' list), got the keys {sorted(map(str, saved))}"
        )
    was = [len(group["params"]) for group in saved_groups]
    now = [len(group["params"]) for group in optimizer.param_groups]
    if was != now:
        raise ResumeError(
            f"the checkpoint's state for optimizer {name!r} does not fit it: its parameter groups hold {was} "
            f"parameters in the checkpoint but {now} in this optimizer"
        )
    model = _optimizer_model(name, optimizer, models)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    grads = [param.grad for param in params]
    # Loading replaces the whole state, as load_state_dict does. torch cuts the saved tensors into
    # shards like the states it first gives every parameter (a step at lr 0 on zero gradients), only
    # when the optimizer has none and no parameter a gradient: a state it kept would leave the
    # parameters it lacks with full tensors. The gradients come back afterwards.
    before = dict(optimizer.state)
    optimizer.state.clear()
    for param in params:
        param.grad = None
    try:
        # torch's names of this optimizer's parameters, group by group in its order
        named: Any = get_optimizer_state_dict(model, optimizer)
        names: list[list[str]] = [list(group["params"]) for group in named["param_groups"]]
        by_position = {
            position: param_name
            for saved_group, group_names in zip(saved_groups, names, strict=True)
            for position, param_name in zip(saved_group["params"], group_names, strict=True)
        }
        full: dict[str, Any] = {
            "state": {by_position[pos]: dict(value) for pos, value in saved_state.items() if pos in by_position},
            "param_groups": [
                {**saved_group, "params": group_names}
                for saved_group, group_names in zip(saved_groups, names, strict=True)
            ],
        }
        set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True, strict=False))
    except (RuntimeError, ValueError, KeyError) as err:
        optimizer.state.clear()  # not the state torch made up to shard into: the one it had
        optimizer.state.update(before)
        raise ResumeError(
            f"the checkpoint's state for optimizer {name!r} (full tensors, written by one process) could not be "
            f"sharded into it: {first_line(err)}"
        ) from None
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
    # A parameter the checkpoint has no state for starts without one; the hyperparameters are the saved
    # ones (torch's round trip turns AdamW's betas into a list).
    for group, saved_group, group_names in zip(optimizer.param_groups, saved_groups, names, strict=True):
        group.update(copy.deepcopy({key: value for key, value in saved_group.items() if key != "params"}))
        for param, param_name in zip(group["params"], group_names, strict=True):
            if param_name not in full["state"]:
                optimizer.state.pop(param, None)
