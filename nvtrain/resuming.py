"""Resuming with a changed config: what each difference does, said before training starts.

``nvtrain train`` compares the resolved config a checkpoint was written with
(stored in its manifest, else ``config.yaml`` in the run directory) with the
config of the new run. Every difference gets one of four effects:

- **refused**: the run stops with exit status 2 before writing anything (another
  optimizer or LR-scheduler class, or a warmup added or removed, which changes the
  scheduler's class: their saved states cannot move to it);
- **applied on resume**: the checkpoint restores the old value and nvtrain then
  replaces it (optimizer hyperparameters such as ``lr`` in the param groups, LR
  scheduler settings, another non-zero ``warmup_steps``, and the schedule's
  ``T_max`` / ``total_steps`` re-derived from the new run length);
- **no effect**: the checkpoint's value wins (``seed``: the random streams
  continue from the checkpoint; ``start_step`` / ``start_epoch``);
- **takes effect**: everything else (run length, cadences, logging, hook
  settings, the model and data factories' arguments; the checkpoint's weights and
  data position must still fit, else the resume is refused with exit status 2).

See docs/checkpointing.md ("Resuming with a changed config").
"""

from __future__ import annotations

import bisect
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

#: LR-scheduler state entries that encode the run length; re-derived when it changes (``total_iters``: the
#: ``linear`` schedule's ``total_steps``, kept by its ``LinearLR``).
HORIZON_KEYS = ("T_max", "total_steps", "total_iters", "_schedule_phases")
#: The config key whose change adds, removes or resizes the warmup in front of the schedule.
WARMUP_KEY = "lr_scheduler.warmup_steps"
#: The state entries of a warmup's ramp (a ``LinearLR``) that the warmup's length sets.
RAMP_KEYS = ("total_iters",)


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
        effect, note = _warmup_effect(was, is_now) if key == WARMUP_KEY else _classify(key, derives_horizon)
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


def _warmup_effect(was: Any, is_now: Any) -> tuple[str, str]:
    """Adding or removing a warmup swaps the scheduler for a ``SequentialLR`` (or back): refused, as another
    scheduler class is. Another non-zero length is applied: the restored schedule is positioned as a fresh
    one of the new config would be at the resumed step."""
    had, has = _warms_up(was), _warms_up(is_now)
    if had != has:
        return REFUSED, (
            "adding or removing a warmup changes the LR scheduler's class (a SequentialLR of the warmup and the "
            "schedule); its state cannot move to it"
        )
    if has:
        return APPLIED, "the warmup's length and the schedule's horizon are set in the restored LR scheduler"
    return TAKES_EFFECT, ""


def _warms_up(warmup_steps: Any) -> bool:
    """Whether a config's ``warmup_steps`` builds a warmup (a config written without the field has none)."""
    return isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps > 0


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
    settings, taken from a scheduler built for the new run (``fresh``). Behind a
    warmup (a ``SequentialLR``) the settings are its last child's, and a changed
    warmup length moves the milestone and every child to where a fresh run of the
    new config has them. When the scheduler that sets the LR now has a closed
    form, the current LR is recomputed from it.
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
        if not _same_shape(state, fresh):
            return  # another scheduler class: refused before training, nothing here can move its state
        keys = (*HORIZON_KEYS, *sorted(changed_keys))
        if _is_sequence(state):
            merged = self._merged_sequence(name, state, fresh, lr, keys)
        else:
            merged = self._merged(name, state, fresh, lr, keys)
        if merged == state:
            return
        scheduler.load_state_dict(merged)
        rates = _closed_form_rates(scheduler)
        if rates is None:
            return
        for group, rate in zip(optimizer.param_groups, rates, strict=False):
            group["lr"] = rate
        _set_last_lr(scheduler, [group["lr"] for group in optimizer.param_groups])

    def _merged(
        self,
        name: str,
        state: Mapping[str, Any],
        fresh: Mapping[str, Any],
        lr: Any,
        keys: tuple[str, ...],
        announce: bool = True,
    ) -> dict[str, Any]:
        """``state`` with ``keys`` taken from the fresh scheduler's state where they differ, and a new ``lr`` as
        its base LR."""
        merged = dict(state)
        for key in keys:
            if key in fresh and key in state and fresh[key] != state[key]:
                merged[key] = copy.deepcopy(fresh[key])
                if announce and key != "_schedule_phases":
                    self.applied.append(f"LR scheduler {name!r}: {key} {_show(state[key])} -> {_show(fresh[key])}")
        if lr is not _MISSING and "base_lrs" in state:
            merged["base_lrs"] = [lr] * len(state["base_lrs"])
        return merged

    def _merged_sequence(
        self, name: str, state: Mapping[str, Any], fresh: Mapping[str, Any], lr: Any, keys: tuple[str, ...]
    ) -> dict[str, Any]:
        """A warmup's ``SequentialLR`` state: the configured schedule (the last child) merged as a lone one is,
        the warmup (the children before it) and the milestones resized as the new config's, and every child
        positioned where a fresh run of the new config has it at the resumed step."""
        merged = dict(state)
        was, now = state["_milestones"], fresh["_milestones"]
        if was != now:
            merged["_milestones"] = list(now)
            change = f"warmup_steps {was[0]} -> {now[0]}" if len(was) == len(now) == 1 else f"milestones {was} -> {now}"
            self.applied.append(f"LR scheduler {name!r}: {change}")
        *ramps, schedule = state["_schedulers"]
        *fresh_ramps, fresh_schedule = fresh["_schedulers"]
        children = [
            self._merged(name, old, new, lr, RAMP_KEYS, announce=False)
            for old, new in zip(ramps, fresh_ramps, strict=True)
        ]
        children.append(self._merged(name, schedule, fresh_schedule, lr, keys))
        if was != now:
            children = _positioned(children, merged["_milestones"], merged["last_epoch"])
        merged["_schedulers"] = children
        return merged


def _same_shape(state: Mapping[str, Any], fresh: Mapping[str, Any]) -> bool:
    """Whether both states are a lone scheduler's, or both a ``SequentialLR``'s with as many children."""
    if _is_sequence(state) != _is_sequence(fresh):
        return False
    return len(state.get("_schedulers", ())) == len(fresh.get("_schedulers", ()))


def _is_sequence(state: Mapping[str, Any]) -> bool:
    """Whether a scheduler state is a ``SequentialLR``'s (a warmup and the schedule after it)."""
    children, milestones = state.get("_schedulers"), state.get("_milestones")
    return isinstance(children, list) and isinstance(milestones, list) and len(children) == len(milestones) + 1


def _positioned(children: list[dict[str, Any]], milestones: list[int], steps: int) -> list[dict[str, Any]]:
    """Each child's state as a fresh ``SequentialLR`` with these milestones has it after ``steps`` steps.

    The child running in ``[start, end)`` has counted ``steps - start`` steps there, one that ended stays at
    its last position, and one not yet started waits at -1 (``SequentialLR`` starts it at position 0 on
    reaching its milestone).
    """
    positioned = []
    for child, start, end in zip(children, [0, *milestones], [*milestones, None], strict=True):
        last = steps if end is None else min(steps, end - 1)
        position = -1 if steps < start else last - start
        child = dict(child)
        if "last_epoch" in child:
            child["last_epoch"] = position
        if "_step_count" in child:
            child["_step_count"] = max(position, 0) + 1
        positioned.append(child)
    return positioned


def _active(scheduler: Any) -> Any:
    """The scheduler that sets the LR now: a ``SequentialLR``'s child for its position, else itself."""
    children, milestones = getattr(scheduler, "_schedulers", None), getattr(scheduler, "_milestones", None)
    if isinstance(children, list) and isinstance(milestones, list):
        return _active(children[bisect.bisect_right(milestones, scheduler.last_epoch)])
    return scheduler


def _closed_form_rates(scheduler: Any) -> list[Any] | None:
    """The LR of each param group at the scheduler's position, from its closed form (None: it has none)."""
    closed_form = getattr(_active(scheduler), "_get_closed_form_lr", None)
    return list(closed_form()) if callable(closed_form) else None


def _set_last_lr(scheduler: Any, rates: list[Any]) -> None:
    """What ``get_last_lr()`` returns, for the scheduler and the child that sets the LR now."""
    scheduler._last_lr = list(rates)
    active = _active(scheduler)
    if active is not scheduler:
        active._last_lr = list(rates)
