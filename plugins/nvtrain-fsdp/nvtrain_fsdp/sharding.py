"""Applying torch's ``fully_shard`` (FSDP2) to a model, and gathering a sharded model back.

The wrapping follows the pattern torchtitan uses: the units that are sharded (and
all-gathered, one at a time, in forward and backward) are the modules of chosen
classes (transformer blocks), or each top-level child when none are chosen; the
root is sharded last and owns whatever parameters no unit took.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["gathered_state_dict", "is_sharded", "shard_model", "sharding_units"]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (its parameters are DTensor shards)."""
    return isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters())


def sharding_units(
    model: torch.nn.Module, shard_classes: Iterable[str], *, owner: str = "FSDPHook", key: str = "main"
) -> list[tuple[str, torch.nn.Module]]:
    """The submodules sharded as units of their own, innermost first (the root is not among them).

    With ``shard_classes``: every submodule whose class name is listed; a listed name
    that matches no submodule is an error (a typo would otherwise shard the whole model
    as one unit). Without: each top-level child that has parameters, and each member of a top-level
    ``ModuleList`` / ``ModuleDict`` (a transformer's layers): a container has no forward of its own, which
    ``fully_shard`` needs.
    """
    names = frozenset(shard_classes)
    if names:
        units = [(name, module) for name, module in model.named_modules() if name and type(module).__name__ in names]
        missing = names - {type(module).__name__ for _, module in units}
        if missing:
            present = sorted({type(module).__name__ for name, module in model.named_modules() if name})
            raise ValueError(
                f"{owner}.shard_classes: model {key!r} has no submodule of class {sorted(missing)}; "
                f"expected class names of its submodules (it has {present})"
            )
    else:
        units = _top_level_units(model)
    _refuse_tied_across_units(model, [name for name, _ in units], owner=owner, key=key, chosen=bool(names))
    # named_modules() lists a parent before its children: shard in reverse, innermost first.
    return list(reversed(units))


def _top_level_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The default units: the top-level children with parameters, a container's members in its place."""
    units: list[tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            if next(child.parameters(), None) is None:
                continue
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                visit(f"{prefix}{name}.", child)
            else:
                units.append((f"{prefix}{name}", child))

    visit("", model)
    return units


def _refuse_tied_across_units(
    model: torch.nn.Module, units: list[str], *, owner: str, key: str, chosen: bool
) -> None:
    """A parameter registered in two units (tied weights: an embedding and an output head) cannot be sharded:
    ``fully_shard`` gives each parameter to one unit and fails at the first forward. Refused here, naming both."""
    def unit_of(name: str) -> str:
        holders = [unit for unit in units if name.startswith(unit + ".")]
        return max(holders, key=len) if holders else ""

    first: dict[int, tuple[str, str]] = {}  # id(parameter) -> (its first name, that name's unit)
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = unit_of(name)
        seen = first.setdefault(id(param), (name, unit))
        if seen[1] != unit:
            where = [f"{seen[0]!r} in {_unit_label(seen[1])}", f"{name!r} in {_unit_label(unit)}"]
            advice = (
                "choose shard_classes so that both names fall in one unit or in the root"
                if chosen
                else "set shard_classes to the class names of the repeated blocks (a transformer's layers): "
                "they become the units, and the tied modules stay in the root"
            )
            raise ValueError(
                f"{owner}: model {key!r} ties one parameter as {where[0]} and as {where[1]}; FSDP shards a "
                f"parameter in one unit only, so the units cannot share it: {advice}"
            )


def _unit_label(unit: str) -> str:
    return f"unit {unit!r}" if unit else "the root"


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    shard_classes: Iterable[str] = (),
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    owner: str = "FSDPHook",
    key: str = "main",
) -> list[str]:
    """Apply ``fully_shard`` to the units of ``model`` (see :func:`sharding_units`), then to the root.

    The model is changed in place (its class becomes an ``FSDPModule``, its parameters
    DTensors sharded on dimension 0 over ``mesh``). Returns the units' names, root last (``""``).
    """
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
    }
    units = sharding_units(model, shard_classes, owner=owner, key=key)
    # output_dtype is the root's: a unit casting its outputs would hand the next unit another dtype than its
    # parameters' (float32 weights fed bf16), or cast bf16 activations to float32 and back at every unit.
    unit_options = {**options, "mp_policy": dataclasses.replace(options["mp_policy"], output_dtype=None)}
    for _, module in units:
        fully_shard(module, **unit_options)
    fully_shard(model, **options)
    return [name for name, _ in units] + [""]


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered into a full tensor, on the CPU.

    A collective under FSDP: every rank must call it (each gets the full weights).
    The keys are those of the plain model, so the result loads into one.
    """
    gathered: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        gathered[name] = full.detach().to("cpu", copy=True)
    return gathered

