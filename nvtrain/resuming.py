"""Resuming with a changed config: what each difference does, said before training starts.

``nvtrain train`` compares the resolved config a checkpoint was written with
(stored in its manifest, else ``config.yaml`` in the run directory) with the
config of the new run. Every difference gets one of four effects:

- **refused**: the run stops with exit status 2 before writing anything (another
  optimizer or LR-scheduler class: their saved states cannot move to it);
- **applied on resume**: the checkpoint restores the old value and nvtrain then
  replaces it (optimizer hyperparameters such as ``lr`` in the param groups, LR
  scheduler settings, and the schedule's ``T_max`` / ``total_steps`` re-derived
  from the new run length);
- **no effect**: the checkpoint's value wins (``seed``: the random streams
  continue from the checkpoint; ``start_step`` / ``start_epoch``);
- **takes effect**: everything else (run length, cadences, logging, hook
  settings, the model and data factories' arguments; the checkpoint's weights and
  data position must still fit, else the resume is refused with exit status 2).

See docs/checkpointing.md ("Resuming with a changed config").
"""

from __future__ import annotations

import collections
import copy
import logging
import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from nvtrain.hookspecs import hookimpl

__all__ = ["APPLIED", "NO_EFFECT", "REFUSED", "TAKES_EFFECT", "ConfigChange", "ResumeAdjuster", "config_changes"]

logger = logging.getLogger(__name__)

REFUSED = "refused"
APPLIED = "applied on resume"
NO_EFFECT = "no effect on resume"
TAKES_EFFECT = "takes effect"

#: LR-scheduler state entries that encode the run length; re-derived when it changes.
HORIZON_KEYS = ("T_max", "total_steps", "_schedule_phases")


@attrs.frozen
class ConfigChange:
    """One difference between the checkpoint's config and the new one."""

    key: str
    saved: Any
    now: Any
    effect: str
    note: str = ""

    def describe(self) -> str:
        note = f": {self.note}" if self.note else ""
        return f"{self.key}: {_show(self.saved)} -> {_show(self.now)} ({self.effect}{note})"


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    return repr(value) if isinstance(value, str) else str(value)


_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "(absent)"})()


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "l": [{"x": 2}]}`` -> ``{"a.b": 1, "l[0].x": 2}``; other lists stay whole values.

    Items that all carry a ``name`` (hooks) are labelled by it, with their ``state_key`` when they have
    one (``hooks[ema].decay``, ``hooks[ema:fast].decay``), so removing one hook does not shift the others'
    settings onto each other; a second item of one label is ``hooks[ema#2]``.
    """
    if isinstance(data, Mapping):
        if not data and prefix:
            return {prefix: {}}
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(data, list) and data and all(isinstance(item, Mapping) for item in data):
        flat = {}
        for label, item in zip(_item_labels(data), data, strict=True):
            flat.update(flatten(item, f"{prefix}[{label}]"))
        return flat
    return {prefix: data}


def _item_labels(items: list[Mapping[str, Any]]) -> list[str]:
    names = [item.get("name") for item in items]
    if not all(isinstance(name, str) for name in names):
        return [str(index) for index in range(len(items))]
    keys = [item.get("state_key") for item in items]
    labels, seen = [], collections.Counter[str]()
    for name, key in zip(names, keys, strict=True):
        label = f"{name}:{key}" if isinstance(key, str) else str(name)
        seen[label] += 1
        labels.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return labels


#: A list item's part of a flattened key: ``hooks[ema]`` of ``hooks[ema].decay``.
_ITEM = re.compile(r"^([^\[]*\[[^\]]+\])(?:\.|$)")


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any], *, derives_horizon: bool) -> list[ConfigChange]:
    """Every difference between two unstructured run configs, classified (in the new config's order).

    A list item (a hook) only one side has is one change of its own, not one per setting.
    """
    old, new = flatten(saved), flatten(now)
    old_items, new_items = _items(old), _items(new)
    changes = []
    reported: set[str] = set()
    for key in [*new, *(k for k in old if k not in new)]:
        item = _item_of(key)
        if item is not None and (item in old_items) != (item in new_items):
            if item not in reported:
                reported.add(item)
                changes.append(_whole_item_change(item, old, new))
            continue
        was, is_now = old.get(key, _MISSING), new.get(key, _MISSING)
        if was == is_now or _filled_in(key, was, is_now, old, new):
            continue
        effect, note = _classify(key, derives_horizon)
        changes.append(ConfigChange(key, was, is_now, effect, note))
    return changes


def _item_of(key: str) -> str | None:
    match = _ITEM.match(key)
    return match.group(1) if match else None


def _items(flat: Mapping[str, Any]) -> set[str]:
    return {item for item in map(_item_of, flat) if item is not None}


def _settings(flat: Mapping[str, Any], item: str) -> dict[str, Any] | Any:
    """The item's settings as one mapping (``_MISSING`` when that side has no such item)."""
    inside = {key[len(item) + 1 :]: value for key, value in flat.items() if key.startswith(item + ".")}
    return inside or _MISSING


def _whole_item_change(item: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> ConfigChange:
    was, is_now = _settings(old, item), _settings(new, item)
    note = ""
    if item.startswith("hooks[") and was is _MISSING:
        note = "a hook the checkpoint's run did not have; it starts afresh"
    elif item.startswith("hooks["):
        note = "the hook is gone; what the checkpoint saved for it is left unused"
    return ConfigChange(item, was, is_now, TAKES_EFFECT, note)


def _filled_in(key: str, was: Any, is_now: Any, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """An empty mapping on one side whose keys the other side has (``model.kwargs: {}`` saved, ``hidden`` set
    now): the keys under it are the changes, the mapping itself is none."""
    inside = key + "."
    if was == {} and is_now is _MISSING:
        return any(k.startswith(inside) for k in new)
    if is_now == {} and was is _MISSING:
        return any(k.startswith(inside) for k in old)
    return False


def _classify(key: str, derives_horizon: bool) -> tuple[str, str]:
    if key == "optimizer.factory":
        return REFUSED, "an optimizer's state cannot move to another optimizer class"
    if key == "lr_scheduler" or key == "lr_scheduler.factory":
        return REFUSED, "an LR scheduler's state cannot move to another scheduler"
    if key.startswith("optimizer.kwargs."):
        return APPLIED, "set in the optimizer's param groups over the checkpoint's value"
    if key.startswith("lr_scheduler.kwargs."):
        return APPLIED, "set in the LR scheduler over the checkpoint's value"
    if key in ("trainer.num_epochs", "trainer.max_steps"):
        return TAKES_EFFECT, "the run length; the LR schedule's horizon is re-derived from it" if derives_horizon else ""
    if key == "seed":
        return NO_EFFECT, "the random streams continue from the checkpoint"
    if key in ("trainer.start_step", "trainer.start_epoch"):
        return NO_EFFECT, "the checkpoint's position wins"
    if key.startswith("model."):
        return TAKES_EFFECT, "the checkpoint's weights must fit the model it builds"
    if key.startswith("data.") or key == "trainer.global_batch_size":
        return TAKES_EFFECT, "the checkpoint's data position must fit (same batch size and data set length)"
    return TAKES_EFFECT, ""


def in_effect(saved: Mapping[str, Any], now: Mapping[str, Any], changes: list[ConfigChange]) -> dict[str, Any]:
    """The new config with every change of no effect reverted to the checkpoint's value (for ``config.yaml``)."""
    result = copy.deepcopy(dict(now))
    for change in changes:
        if change.effect == NO_EFFECT and "." not in change.key and "[" not in change.key:
            result[change.key] = change.saved
        elif change.effect == NO_EFFECT:
            section, _, field = change.key.partition(".")
            if isinstance(result.get(section), dict) and "." not in field:
                result[section][field] = change.saved
    return result


class ResumeAdjuster:
    """Applies the "applied on resume" changes once a checkpoint has been restored (first BEFORE_EPOCH).

    A restored optimizer carries the checkpoint's hyperparameters and a restored LR
    scheduler the old run length; this replaces what the user changed: param-group
    values (``lr`` also as the scheduler's base LR) and the scheduler's horizon and
    settings, taken from a scheduler built for the new run (``fresh``). When the
    scheduler has a closed form, the current LR is recomputed from it.
    """

    plugin_name = "nvtrain.app.resume"

    def __init__(self, changes: list[ConfigChange], fresh: Mapping[str, dict[str, Any]], resumed_step: int) -> None:
        self.changes = changes
        self.fresh = fresh
        self.resumed_step = resumed_step
        self._done = False
        #: What was applied, one line each (also logged on rank 0).
        self.applied: list[str] = []

    @hookimpl
    def before_epoch(self, ctx: Any) -> None:
        if self._done:
            return
        self._done = True
        if ctx.step_count != self.resumed_step or ctx.step_count == 0:
            return  # the run did not resume from the checkpoint these changes were computed against
        hyper = {
            c.key.removeprefix("optimizer.kwargs."): c.now
            for c in self.changes
            if c.effect == APPLIED and c.key.startswith("optimizer.kwargs.") and c.key.count(".") == 2
        }
        scheduler_keys = {
            c.key.removeprefix("lr_scheduler.kwargs.")
            for c in self.changes
            if c.effect == APPLIED and c.key.startswith("lr_scheduler.kwargs.")
        }
        for name, optimizer in ctx.optimizers.items():
            before = [group.get("lr") for group in optimizer.param_groups]
            for key, value in hyper.items():
                if value is _MISSING:
                    continue
                for group in optimizer.param_groups:
                    if key in group:
                        group[key] = tuple(value) if isinstance(group[key], tuple) and isinstance(value, list) else value
                        if key == "lr" and "initial_lr" in group:
                            group["initial_lr"] = value
                if any(key in group for group in optimizer.param_groups):
                    self.applied.append(f"optimizer {name!r}: {key} = {_show(value)}")
            scheduler = ctx.lr_schedulers.get(name)
            fresh = self.fresh.get(name)
            if scheduler is not None and fresh is not None and not isinstance(scheduler, (list, tuple)):
                self._adjust_scheduler(name, scheduler, optimizer, fresh, hyper.get("lr", _MISSING), scheduler_keys)
            after = [group.get("lr") for group in optimizer.param_groups]
            if after != before and before and after:
                self.applied.append(f"optimizer {name!r}: lr at step {ctx.step_count} is now {after[0]:.3g} (was {before[0]:.3g})")
        if ctx.rank == 0:
            for line in self.applied:
                logger.info("resume: %s", line)

    def _adjust_scheduler(
        self,
        name: str,
        scheduler: Any,
        optimizer: torch.optim.Optimizer,
        fresh: Mapping[str, Any],
        lr: Any,
        changed_keys: set[str],
    ) -> None:
        state = scheduler.state_dict()
        merged = dict(state)
        for key in (*HORIZON_KEYS, *sorted(changed_keys)):
            if key in fresh and key in state and fresh[key] != state[key]:
                merged[key] = copy.deepcopy(fresh[key])
                if key != "_schedule_phases":
                    self.applied.append(f"LR scheduler {name!r}: {key} {_show(state[key])} -> {_show(fresh[key])}")
        if lr is not _MISSING and "base_lrs" in state:
            merged["base_lrs"] = [lr] * len(state["base_lrs"])
        if merged == state:
            return
        scheduler.load_state_dict(merged)
        closed_form = getattr(scheduler, "_get_closed_form_lr", None)
        if callable(closed_form):
            rates = closed_form()
            for group, rate in zip(optimizer.param_groups, rates, strict=False):
                group["lr"] = rate
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
