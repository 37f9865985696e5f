"""Raw config data into a :class:`~nvtrain.config.schema.RunConfig`, every problem in one located error.

cattrs reports what it refuses as a tree of exception groups whose notes name the
attribute or list index of each member. :func:`problems` flattens that tree into
:class:`Problem` records (a config path and a message); :func:`structure_config`
raises the first as a :class:`~nvtrain.config.errors.ConfigError` at its location
and lists the others on the same line.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import attrs

from nvtrain.config.converter import converter
from nvtrain.config.errors import ConfigError, ConfigPath, format_path, in_config_words
from nvtrain.config.schema import SECTIONS, RunConfig
from nvtrain.validators import FieldProblem

__all__ = ["Problem", "problems", "structure_config"]


class Problem(NamedTuple):
    """One thing wrong with the data: where it is and what it is."""

    path: ConfigPath
    message: str


def structure_config(data: dict[str, Any], locate: Callable[[ConfigPath], str]) -> RunConfig:
    """``data`` as a :class:`RunConfig`; ``locate`` turns a config path into ``file:line:col``.

    Raises one :class:`ConfigError` at the first problem (a misspelt key with a
    suggestion first: it often explains the others, "missing max_steps"), naming the
    rest with their locations.
    """
    from cattrs.errors import BaseValidationError

    try:
        return converter().structure(data, RunConfig)  # type: ignore[no-any-return]
    except BaseValidationError as err:
        found = list(problems(err))
        found += [p for p in _behind_unknown_keys(data, found) if p not in found]
        found.sort(key=lambda problem: "did you mean" not in problem.message)
        path, message = found[0]
        if len(found) > 1:
            others = "; ".join(f"{locate(p)}: {format_path(p) + ': ' if p else ''}{m}" for p, m in found[1:])
            message += f" (and {len(found) - 1} more: {others})"
        raise ConfigError(message, path=path, location=locate(path)) from None


def _behind_unknown_keys(data: dict[str, Any], found: list[Problem]) -> list[Problem]:
    """What a section's validators refuse that its unknown keys hid: cattrs refuses the keys before it builds
    the section, so the data is structured once more without them."""
    from cattrs.errors import BaseValidationError

    unknown = [p.path for p in found if p.message.startswith("unknown key ")]
    if not unknown:
        return []
    cleaned = copy.deepcopy(data)
    for path in unknown:
        parent: Any = cleaned
        for part in path[:-1]:
            if isinstance(parent, dict):
                parent = parent.get(part)
            elif isinstance(parent, list) and isinstance(part, int) and 0 <= part < len(parent):
                parent = parent[part]
            else:
                parent = None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    try:
        converter().structure(cleaned, RunConfig)
    except BaseValidationError as err:
        return [p for p in problems(err) if not p.message.startswith("unknown key ")]
    except Exception:  # the cleaned data is only a second look: what it cannot say, the first error says
        return []
    return []


def problems(err: BaseException, path: ConfigPath = ()) -> Iterator[Problem]:
    """Flatten cattrs' exception groups into :class:`Problem` records, in the file's order."""
    from cattrs.errors import BaseValidationError, ForbiddenExtraKeysError

    if isinstance(err, BaseValidationError):
        for sub in err.exceptions:
            yield from problems(sub, (*path, *_note_path(sub)))
        return
    if isinstance(err, ForbiddenExtraKeysError):
        for key in sorted(err.extra_fields):
            yield Problem((*path, key), f"unknown key {key!r} in {_section_label(err.cl)}{_hint(str(key), err.cl)}")
        return
    if isinstance(err, KeyError):  # cattrs: a required key is absent
        yield Problem(path, f"missing required key {err.args[0]!r}")
        return
    if isinstance(err, FieldProblem):  # a field's validator, or a hook entry without a usable name
        yield Problem((*path, err.field) if err.field else path, in_config_words(err, name_the_field=False))
        return
    if isinstance(err, (TypeError, ValueError)):  # a structure hook's; cattrs noted the attribute or index
        yield Problem(path, str(err))
        return
    raise err


def _hint(key: str, section: type) -> str:
    """What an unknown key of ``section`` may have meant: the same key in another section (``max_steps`` at the
    top level is ``trainer.max_steps``), else the closest key here, else the closest elsewhere."""
    here = [a.name for a in attrs.fields(section)]
    elsewhere = {
        f"{name}.{field.name}" if name else field.name: field.name
        for name, other in SECTIONS
        if other is not section
        for field in attrs.fields(other)
    }
    moved = [path for path, name in elsewhere.items() if name == key]
    if moved:
        return f"; did you mean {moved[0]!r}?"
    close = difflib.get_close_matches(key, here, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    close = difflib.get_close_matches(key, list(elsewhere.values()), n=1, cutoff=0.8)
    if close:
        return f"; did you mean {next(path for path, name in elsewhere.items() if name == close[0])!r}?"
    name = next((name for name, other in SECTIONS if other is section), "")
    if "kwargs" in here and name:  # optimizer.lr: the factory's arguments go under kwargs
        return f"; the factory's keyword arguments go under kwargs: did you mean '{name}.kwargs.{key}'?"
    return f" (valid keys: {', '.join(here)})"


def _note_path(err: BaseException) -> ConfigPath:
    """The attribute or index cattrs attached to ``err`` as a note."""
    for note in getattr(err, "__notes__", ()):
        name = getattr(note, "name", None)
        if name is not None:
            return (name,)
        index = getattr(note, "index", None)
        if index is not None:
            return (index,)
    return ()


def _section_label(cls: type) -> str:
    for name, section in SECTIONS:
        if section is cls:
            return f"section '{name}'" if name else "the top level"
    return cls.__name__
