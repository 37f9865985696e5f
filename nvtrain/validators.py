"""Attrs validators for configuration classes, so bad values fail alike everywhere.

Each factory returns a validator whose error names the class and field, what was
expected and what came: ``EMAHook.decay must be in [0.0, 1.0) (got 1.5)``. A wrong
value raises :class:`FieldValueError` (a ``ValueError``); the ``strict_*`` checks,
which are about the type only, raise :class:`FieldTypeError` (a ``TypeError``).
Both are a :class:`FieldProblem` that carries the class, field, value and
expectation, so a caller (the config loader, ``nvtrain train``) places the error at
the field without parsing its message. ``bool`` is never taken for a number.

A check of a field's own goes through :func:`satisfies` (``accepts(value)`` and
what the field takes), or :func:`one_of`, :func:`a_callable` and friends; a
converter or a check with a message of its own raises :func:`refused`, so its
error is structured too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "FieldProblem",
    "FieldTypeError",
    "FieldValueError",
    "a_bool",
    "a_callable",
    "as_path",
    "as_tuple",
    "blocking_file",
    "file_path",
    "float_in_range",
    "folder_path",
    "int_at_least",
    "non_empty_str",
    "number_above",
    "one_of",
    "optional_bool",
    "optional_int_at_least",
    "optional_non_empty_str",
    "optional_number_above",
    "optional_str_tuple",
    "refused",
    "satisfies",
    "strict_bool",
    "strict_int",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


class FieldProblem(Exception):
    """A field refused a value: ``owner.field`` expected ``expected`` and got ``value``.

    ``str()`` is the whole message; the attributes are its parts, for callers that
    place the error (at a config line, a hook's setting) rather than show it.
    """

    def __init__(
        self, message: str, *, owner: str = "", field: str = "", value: Any = None, expected: str = ""
    ) -> None:
        super().__init__(message)
        #: The class whose field refused the value (``EMAHook``), or "".
        self.owner = owner
        #: The field's name (``decay``).
        self.field = field
        #: The refused value.
        self.value = value
        #: What the field takes (``in [0.0, 1.0)``), or "" when the message says it another way.
        self.expected = expected


class FieldValueError(FieldProblem, ValueError):
    """A value of the right kind outside what the field accepts."""


class FieldTypeError(FieldProblem, TypeError):
    """A value of a kind the field does not take."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def refused(
    owner: str,
    field: str,
    value: Any,
    expected: str,
    *,
    message: str | None = None,
    error: type[FieldProblem] = FieldValueError,
) -> FieldProblem:
    """The error for a value ``owner.field`` refuses, to raise: ``Owner.field must be <expected> (got value)``.

    For checks that are not built here: a converter (it is not told its class or
    field, so it names them), or a validator whose ``message`` says more than that
    line (which item of a list is wrong, why a signal cannot be used).
    """
    if message is None:
        message = f"{owner}.{field} must be {expected} (got {value!r})"
    return error(message, owner=owner, field=field, value=value, expected=expected)


def as_path(value: Any, owner: str, field: str) -> Path:
    """``Path(value)`` for a converter, refusing what is no path (None, a number) naming ``owner.field``, where
    ``Path(value)`` says only ``expected str, bytes or os.PathLike object, not NoneType``."""
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise refused(owner, field, value, "a path (a str or os.PathLike)", error=FieldTypeError)


def as_tuple(value: Any, owner: str, field: str, expected: str) -> tuple[Any, ...]:
    """``tuple(value)`` for a converter, refusing what cannot be iterated as a :class:`FieldTypeError` naming
    ``owner.field``: a number, or a 0-d tensor or array, whose ``iter()`` says only ``iteration over a
    0-d tensor``."""
    try:
        return tuple(value)
    except TypeError as err:
        message = f"{owner}.{field} must be {expected} (got {value!r}, which cannot be iterated: {err})"
        raise refused(owner, field, value, expected, message=message, error=FieldTypeError) from err


def file_path(expected: str = "a file path, neither an existing directory nor under a file") -> Validator:
    """A path a file can be written at (a ``pathlib.Path``, after :func:`as_path`): not an existing directory,
    nor under an existing file. Refused when the hook is built, not at its first write (an
    ``IsADirectoryError`` or ``FileExistsError`` then, naming no setting)."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Path) -> None:
        if value.is_dir():
            got = f"'{value}', a directory"
        elif (blocking := blocking_file(value.parent)) is not None:
            got = f"'{value}': '{blocking}' is a file"
        else:
            return
        owner, field = type(instance).__name__, attribute.alias or attribute.name
        raise refused(owner, field, value, expected, message=f"{owner}.{field} must be {expected} (got {got})")

    return check


def folder_path(expected: str = "a folder path, neither an existing file nor under one") -> Validator:
    """A path a folder can be made at (a ``pathlib.Path``, after :func:`as_path`): not an existing file, nor
    under one. Refused when the hook is built, not at its first write (a ``FileExistsError`` then)."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Path) -> None:
        blocking = blocking_file(value)
        if blocking is None:
            return
        owner, field = type(instance).__name__, attribute.alias or attribute.name
        got = f"'{value}', a file" if blocking == value else f"'{value}': '{blocking}' is a file"
        raise refused(owner, field, value, expected, message=f"{owner}.{field} must be {expected} (got {got})")

    return check


def blocking_file(folder: Path) -> Path | None:
    """The existing file that stops ``folder`` from being created (``folder`` itself or a parent), or None.

    A folder setting is checked with it when the hook is built: ``out/sub`` under a file
    ``out`` fails then, naming the setting, not at the first write with an OS error.
    """
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def satisfies(
    expected: str,
    accepts: Callable[[Any], bool],
    *,
    or_none: bool = False,
    error: type[FieldProblem] = FieldValueError,
) -> Validator:
    """A validator of one's own: ``accepts(value)``, else ``Owner.field must be <expected> (got value)``.

    ``or_none`` also accepts None (and adds " or None" to ``expected``); ``error`` is
    :class:`FieldValueError`, or :class:`FieldTypeError` for a check of the kind only.
    """
    if or_none:
        expected += " or None"

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (value is None and or_none) or accepts(value):
            return
        # the setting's name: a private field ``_limit`` is set as ``limit`` (attrs' alias)
        raise refused(type(instance).__name__, attribute.alias or attribute.name, value, expected, error=error)

    return check


def int_at_least(minimum: int | None) -> Validator:
    """An int (not a bool) >= ``minimum``; any int when ``minimum`` is None."""
    if minimum is None:
        return satisfies("an int", _is_int)
    return satisfies(f"an int >= {minimum}", lambda v: _is_int(v) and v >= minimum)


def optional_int_at_least(minimum: int) -> Validator:
    """None, or an int (not a bool) >= ``minimum``."""
    return satisfies(f"an int >= {minimum}", lambda v: _is_int(v) and v >= minimum, or_none=True)


def number_above(bound: float, *, finite: bool = False, example: str | None = None) -> Validator:
    """An int or float > ``bound`` (never NaN); ``finite`` also refuses infinity.

    ``example`` is appended to the message, e.g. ``"2.0 or float('inf')"``.
    """
    expected = f"a {'finite ' if finite else ''}number > {bound}"
    if example:
        expected += f", e.g. {example}"
    return satisfies(expected, lambda v: _is_number(v) and v > bound and not (finite and math.isinf(v)))


def optional_number_above(bound: float) -> Validator:
    """None, or an int or float > ``bound`` (never NaN)."""
    return satisfies(f"a number > {bound}", lambda v: _is_number(v) and v > bound, or_none=True)


def float_in_range(low: float, high: float, *, include_low: bool = False, include_high: bool = False) -> Validator:
    """An int or float between ``low`` and ``high``, each bound excluded unless included (never NaN)."""
    interval = f"{'[' if include_low else '('}{low}, {high}{']' if include_high else ')'}"

    def accepts(v: Any) -> bool:
        if not _is_number(v):
            return False
        return (low <= v if include_low else low < v) and (v <= high if include_high else v < high)

    return satisfies(f"in {interval}", accepts)


def non_empty_str(what: str = "string") -> Validator:
    """A non-empty str; the message calls it "a non-empty ``what``" (``model name``, ``backend name``)."""
    return satisfies(f"a non-empty {what}", lambda v: isinstance(v, str) and bool(v))


def optional_non_empty_str(what: str = "string") -> Validator:
    """None, or a non-empty str."""
    return satisfies(f"a non-empty {what}", lambda v: isinstance(v, str) and bool(v), or_none=True)


def one_of(choices: Sequence[Any], expected: str | None = None) -> Validator:
    """One of ``choices``, of the same kind too (``1`` is not ``True``); ``expected`` words the choices.

    By default the message lists them: ``must be 'step' or 'epoch'``.
    """
    options = tuple(choices)
    if expected is None:
        shown = [repr(choice) for choice in options]
        expected = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    return satisfies(expected, lambda v: any(_same_kind(v, c) and v == c for c in options))


def _same_kind(value: Any, choice: Any) -> bool:
    return isinstance(value, type(choice)) and isinstance(value, bool) == isinstance(choice, bool)


def a_callable(expected: str = "callable") -> Validator:
    """Anything callable; raises :class:`FieldTypeError`. ``expected`` may say how it is called.

    ``a_callable("callable as factory(optimizer)")``: ``must be callable as factory(optimizer) (got 3)``.
    """
    return satisfies(expected, callable, error=FieldTypeError)


def optional_str_tuple(what: str = "names") -> Validator:
    """None, or a non-empty tuple of non-empty str (after a converter made it a tuple).

    The message says "must be None or a non-empty tuple of ``what``" (``model names``).
    """

    def accepts(value: Any) -> bool:
        if value is None:
            return True
        return isinstance(value, tuple) and bool(value) and all(isinstance(item, str) and item for item in value)

    return satisfies(f"None or a non-empty tuple of {what}", accepts)


#: A bool; raises :class:`FieldTypeError` ("must be a bool").
a_bool: Validator = satisfies("a bool", lambda v: isinstance(v, bool), error=FieldTypeError)
#: None or a bool; raises :class:`FieldTypeError` ("must be a bool or None").
optional_bool: Validator = satisfies("a bool", lambda v: isinstance(v, bool), or_none=True, error=FieldTypeError)

#: True or False, nothing else (not 0 or 1); raises :class:`FieldTypeError`.
strict_bool: Validator = satisfies("True or False", lambda v: isinstance(v, bool), error=FieldTypeError)

#: Any int (not a bool); raises :class:`FieldTypeError`.
strict_int: Validator = satisfies("an int", _is_int, error=FieldTypeError)
