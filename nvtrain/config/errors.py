"""The config layer's errors: one located :class:`ConfigError`, and the field a validator's error names."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from nvtrain.validators import FieldProblem, FieldValueError

__all__ = ["ConfigError", "ConfigPath", "FieldError", "describe", "field_of", "format_path", "in_config_words"]

#: Where a value sits in the config: ``("hooks", 1, "decay")``.
ConfigPath = tuple[str | int, ...]


class ConfigError(ValueError):
    """A config that cannot run. ``str()`` is one line: ``location: path: problem``."""

    def __init__(self, message: str, *, path: ConfigPath = (), location: str | None = None) -> None:
        self.problem = message
        self.path = tuple(path)
        self.location = location
        parts = [p for p in (location, format_path(self.path)) if p]
        super().__init__(": ".join([*parts, message]))


class FieldError(FieldValueError):
    """Raised by a config field's validator so the error can be placed at that field's line."""

    def __init__(self, field: str, message: str, *, owner: str = "", value: Any = None, expected: str = "") -> None:
        super().__init__(message, owner=owner, field=field, value=value, expected=expected)


def format_path(path: Sequence[str | int]) -> str:
    """``("hooks", 1, "decay")`` -> ``hooks[1].decay``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def field_of(err: BaseException) -> str | None:
    """The field a plain ``ValueError`` / ``TypeError`` of a hook's constructor names, or None.

    Every check in nvtrain and the plugins in its repository raises a
    :class:`~nvtrain.validators.FieldProblem`, which carries its field, and is placed
    by it. Hooks from elsewhere (a third-party plugin, an import-path hook; the plugin
    template's validators too) may raise plain errors in the house style, opening the
    message with ``Owner.field``: ``GradNormMonitor.every must be ...``. For those,
    ``nvtrain train`` reads that first word (``every``) here.
    """
    head = str(err).split(" ", 1)[0].rstrip(":")
    owner, dot, field = head.partition(".")
    if dot and owner.isidentifier() and owner[0].isupper() and field.isidentifier():
        return field
    return None


def describe(value: Any) -> str:
    """A value as a message shows it, in YAML's words: ``null``, ``true``, ``a mapping``, ``a list``, ``int 3``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


#: Python's words in a field's expectation, and the config file's for them.
_YAML_WORDS = (
    (re.compile(r"\bNone\b"), "null"),
    (re.compile(r"\bTrue\b"), "true"),
    (re.compile(r"\bFalse\b"), "false"),
    (re.compile(r"\ban int\b"), "an integer"),
    (re.compile(r"\ba str or os\.PathLike\b"), "a string"),
)


def in_config_words(err: FieldProblem, *, name_the_field: bool) -> str:
    """A validator's refusal as a config file reads it: ``must be an integer >= 1 or null (got 0)``.

    Validators word their messages for Python callers (``StepSchedulerConfig.max_steps must be an int >= 1 or
    None (got 0)``); the config error already names the key (``trainer.max_steps``), and its writer wrote
    ``null``, not ``None``. ``name_the_field`` keeps ``Owner.field`` in front (a hook's class says whose setting
    it is). A message of the validator's own, which says more than that form, is kept as it is.
    """
    message = str(err)
    if not err.expected or message != f"{err.owner}.{err.field} must be {err.expected} (got {err.value!r})":
        return message
    expected = err.expected
    for python, yaml in _YAML_WORDS:
        expected = python.sub(yaml, expected)
    got = describe(err.value) if err.value is None or isinstance(err.value, (bool, Mapping, list)) else repr(err.value)
    head = f"{err.owner}.{err.field} must be" if name_the_field else "must be"
    return f"{head} {expected} (got {got})"
