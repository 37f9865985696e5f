"""``--set key.sub=value`` overrides, applied to the raw YAML data before it is structured.

Each override becomes the recorded location of what it set (``--set trainer.max_steps=0``),
so a later error about that value names the argument instead of a file line.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

from nvtrain.config.errors import ConfigError, ConfigPath, describe
from nvtrain.config.source import parse_yaml
from nvtrain.validators import FieldTypeError, refused

__all__ = ["apply_overrides", "check_overrides"]

_OVERRIDES_EXPECTED = "a list of 'key.sub=value' strings, e.g. ['trainer.max_steps=3']"


def check_overrides(overrides: Any, function: str) -> None:
    """Refuse anything but a sequence of str, a bare str above all: iterated, it would be one override per
    character (``--set t: expected ...``)."""
    if isinstance(overrides, str):
        _refuse_overrides(overrides, function, f", not a bare str (got {overrides!r})")
    if not isinstance(overrides, Sequence):
        _refuse_overrides(overrides, function, f" (got {overrides!r})")
    for index, item in enumerate(overrides):
        if not isinstance(item, str):
            _refuse_overrides(overrides, function, f" (got {item!r} at index {index})")


def _refuse_overrides(overrides: Any, function: str, got: str) -> NoReturn:
    message = f"{function}() overrides must be {_OVERRIDES_EXPECTED}{got}"
    raise refused(function, "overrides", overrides, _OVERRIDES_EXPECTED, message=message, error=FieldTypeError)


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], locations: dict[ConfigPath, str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings (values parsed as YAML) to raw config data, in order.

    List items are addressed by index (``hooks.0.decay``) or, for hooks, by name
    (``hooks.ema.decay``). Missing sections are created; unknown keys are caught
    when the result is structured, with the ``--set`` argument as location. A bare
    str is refused with a ``TypeError``: pass ``[override]``.
    """
    check_overrides(overrides, "apply_overrides")
    for override in overrides:
        where = f"--set {override}"
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".") if key.strip() else []
        if not sep or not parts or any(not p for p in parts):
            raise ConfigError("expected --set key.subkey=value, e.g. --set trainer.max_steps=200", location=where)
        value, _ = parse_yaml(raw, where) if raw.strip() else (None, {})
        node: Any = data
        path: list[str | int] = []
        created: list[tuple[str | int, ...]] = []
        for part in parts[:-1]:
            parent, before = node, _child(node, part)
            node, step = _descend(node, part, path, where)
            path.append(step)
            kept = isinstance(parent, list) and isinstance(before, str)  # a hook name became {name: ...}
            if node is not before and not kept:  # made by this override: its errors name the argument
                created.append(tuple(path))
        last = parts[-1]
        if isinstance(node, list):
            index = _list_index(node, last, path, where)
            node[index] = value
            path.append(index)
        elif isinstance(node, dict):
            node[last] = value
            path.append(last)
        else:
            raise ConfigError(f"cannot set {last!r} inside {describe(node)}", path=tuple(path), location=where)
        prefix = tuple(path)
        for known in [p for p in locations if p[: len(prefix)] == prefix]:
            del locations[known]
        locations[prefix] = where
        for made in created:
            locations[made] = where
    return data


def _child(node: Any, part: str) -> Any:
    """What ``node`` holds under ``part`` before an override descends into it (None when nothing)."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
        return node[int(part)]
    return None


def _descend(node: Any, part: str, path: list[str | int], where: str) -> tuple[Any, str | int]:
    if isinstance(node, list):
        index = _list_index(node, part, path, where)
        item = node[index]
        if isinstance(item, str) and path == ["hooks"]:
            node[index] = {"name": item}  # a hook named by itself takes settings: {name: ..., setting: ...}
        elif not isinstance(item, (dict, list)):
            raise ConfigError(
                f"cannot set a key inside {describe(item)} (item {index} of the list)",
                path=(*path, index),
                location=where,
            )
        return node[index], index
    if isinstance(node, dict):
        child = node.get(part)
        if not isinstance(child, (dict, list)):
            child = node[part] = {}
        return child, part
    raise ConfigError(f"cannot descend into {describe(node)} with {part!r}", path=tuple(path), location=where)


def _list_index(items: list[Any], part: str, path: list[str | int], where: str) -> int:
    if part.lstrip("-").isdigit():
        index = int(part)
        if not -len(items) <= index < len(items):
            raise ConfigError(
                f"index {index} is out of range (the list has {len(items)} items)", path=tuple(path), location=where
            )
        return index % len(items)
    names = [_hook_name(item) for item in items]
    matches = [index for index, name in enumerate(names) if name == part]
    if len(matches) > 1:  # two monitors, one per model: setting the first alone would pass for setting "the" one
        raise ConfigError(
            f"{len(matches)} items are named {part!r} (items {', '.join(map(str, matches))}); "
            f"name one by its index ({'.'.join(map(str, path))}.{matches[0]}...)",
            path=tuple(path),
            location=where,
        )
    if matches:
        return matches[0]
    close = difflib.get_close_matches(part, [n for n in names if n], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"no item named {part!r}{hint} (items: {', '.join(n or '?' for n in names) or 'none'})",
        path=tuple(path),
        location=where,
    )


def _hook_name(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        return str(item["name"])
    return None
