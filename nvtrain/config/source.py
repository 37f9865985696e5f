"""YAML in, with the ``file:line:col`` of every key and list item, so errors can point at lines.

The loader is PyYAML's ``SafeLoader`` reading ``1e-3`` as a float (YAML 1.1 reads it
as a string, and learning rates are written that way) and ``0o17`` as an int, as YAML 1.2
does. Plain numbers that YAML 1.1 and 1.2 read differently (base 60 ``1:20``, a leading
zero ``017``) are refused instead of guessed. Duplicate keys, keys that are not names and
aliases that expand to more than :data:`MAX_VALUES` values are refused with their location.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nvtrain.config.errors import ConfigError, ConfigPath, describe
from nvtrain.errors import first_line

__all__ = ["dump_yaml", "parse_yaml", "yaml_module"]


def yaml_module() -> Any:
    try:
        import yaml
    except ImportError as err:
        raise ImportError("nvtrain's config files need PyYAML: pip install 'nvtrain[cli]'") from err
    return yaml


_LOADER: Any = None
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
#: YAML 1.1 reads ``2024-01-01`` as a date; YAML 1.2's core schema, and every nvtrain field, as a string.
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
#: The tag the loader gives a plain number that YAML 1.1 and 1.2 read differently: refused, never constructed.
_AMBIGUOUS_TAG = "tag:nvtrain,2024:ambiguous-number"
# YAML 1.1 reads ``1e-3`` (no dot) as a string; learning rates are written that way. No base-60 ``1:20.5``
# (see _AMBIGUOUS), and a digit after a lone dot: PyYAML fails on ``._`` with a bare ValueError.
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]*[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
# YAML 1.1's ints without its base-60 and leading-zero octal forms (see _AMBIGUOUS), with YAML 1.2's ``0o17``,
# and a digit after each prefix: PyYAML fails on ``0x_`` with a bare ValueError.
_INT = re.compile(
    r"""^(?:[-+]?0b_*[01][01_]*
    |[-+]?0o_*[0-7][0-7_]*
    |[-+]?0x_*[0-9a-fA-F][0-9a-fA-F_]*
    |[-+]?(?:0|[1-9][0-9_]*))$""",
    re.VERBOSE,
)
# Numbers YAML 1.1 and 1.2 read differently: base 60 (``1:20`` is 80 in 1.1, a string in 1.2) and a
# leading zero (``017`` is octal 15 in 1.1, 17 in 1.2; ``08`` a string in 1.1, 8 in 1.2).
_BASE60_INT = re.compile(r"[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+")
_BASE60_FLOAT = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*")
_LEADING_ZERO = re.compile(r"[-+]?0(?:[0-7_]+|[0-9]+)")  # a number in YAML 1.1 or in 1.2: not ``08_``
_AMBIGUOUS = re.compile(f"^(?:{_BASE60_INT.pattern}|{_BASE60_FLOAT.pattern}|{_LEADING_ZERO.pattern})$")
_OCTAL_IN_YAML_1_1 = re.compile(r"[-+]?0[0-7_]+")
_INT_IN_YAML_1_2 = re.compile(r"[-+]?[0-9]+")


def _loader_class() -> Any:
    global _LOADER
    if _LOADER is None:
        yaml = yaml_module()

        class Loader(yaml.SafeLoader):  # type: ignore[misc,name-defined]
            """SafeLoader that reads ``1e-3`` as a float, ``0o17`` as an int, dates as strings, and tags ambiguous
            numbers."""

        Loader.yaml_implicit_resolvers = {
            key: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG)]
            for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }
        Loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
        Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
        Loader.add_implicit_resolver(_AMBIGUOUS_TAG, _AMBIGUOUS, list("-+0123456789"))
        Loader.add_constructor(_AMBIGUOUS_TAG, _refuse_ambiguous_number)
        _LOADER = Loader
    return _LOADER


_DUMPER: Any = None


def _dumper_class() -> Any:
    global _DUMPER
    if _DUMPER is None:
        yaml = yaml_module()

        class Dumper(yaml.SafeDumper):  # type: ignore[misc,name-defined]
            """SafeDumper that quotes the strings the config loader reads as something else."""

        Dumper.yaml_implicit_resolvers = {
            key: list(resolvers) for key, resolvers in _loader_class().yaml_implicit_resolvers.items()
        }
        _DUMPER = Dumper
    return _DUMPER


def dump_yaml(data: Any) -> str:
    """``data`` as block YAML that :func:`parse_yaml` reads back as ``data``.

    PyYAML's ``safe_dump`` quotes a string only where YAML 1.1 would read it as something
    else, so it writes the strings ``'1e-3'``, ``'0o17'`` and ``'08'`` plain, which this
    loader reads as a float, an int and an ambiguous number.
    """
    return str(yaml_module().dump(data, Dumper=_dumper_class(), sort_keys=False, default_flow_style=False))


#: How deep a config may nest mappings and lists: far beyond any real config, well inside Python's
#: recursion limit (PyYAML composes a node per stack frame, and later steps copy the data recursively).
MAX_DEPTH = 100
#: How many values (mappings, lists and scalars) a config may hold, an alias counting all it repeats each
#: time it is used: real configs hold hundreds; nested aliases (``b: &b [*a, *a]``, ...) double it per level.
MAX_VALUES = 100_000


def parse_yaml(text: str, source: str) -> tuple[Any, dict[ConfigPath, str]]:
    """Parse ``text``; return the data and the ``file:line:col`` of every key and list item.

    Whatever PyYAML refuses (a syntax error, a control character, nesting deeper than
    the stack allows) is a located :class:`ConfigError`, as are a recursive alias,
    nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_VALUES` values (aliases
    expanded), and a plain number YAML 1.1 and 1.2 read differently (``1:20``, ``017``).
    """
    yaml = yaml_module()
    locations: dict[ConfigPath, str] = {}
    loader = None
    try:
        loader = _loader_class()(text)  # it reads the whole text at once: a control character stops it here
        node = loader.get_single_node()
        data = {} if node is None else _construct(_Reading(loader, source, locations), node, (), ())
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = _mark(source, mark) if mark is not None else source
        raise ConfigError(f"invalid YAML: {err.problem or err.context}", location=where) from None
    except yaml.reader.ReaderError as err:  # a control character: not a MarkedYAMLError, but it has a position
        raise _reader_error(err, text, source) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML: {first_line(err) or type(err).__name__}", location=source) from None
    except RecursionError:  # PyYAML composes nested nodes recursively
        where = _mark(source, loader.get_mark()) if loader is not None else source
        raise ConfigError(_too_deep("more levels than the parser can follow"), location=where) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, locations


def _mark(source: str, mark: Any) -> str:
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


def _too_deep(got: str) -> str:
    return f"nested too deeply: expected at most {MAX_DEPTH} levels of mappings and lists, got {got}"


def _reader_error(err: Any, text: str, source: str) -> ConfigError:
    """A character YAML does not allow (``\\x01`` in a comment, in a ``--set`` value), at its line and column."""
    character = err.character
    shown = f"#x{character:04x}" if isinstance(character, int) else repr(character)
    position = err.position if isinstance(err.position, int) and 0 <= err.position <= len(text) else None
    where = _printable(source)
    if position is not None:
        line = text.count("\n", 0, position)
        column = position - (text.rfind("\n", 0, position) + 1)
        where = f"{where}:{line + 1}:{column + 1}"
    return ConfigError(
        f"invalid YAML: expected printable text, got the control character {shown} ({err.reason})", location=where
    )


def _printable(text: str) -> str:
    """``text`` with control characters escaped, so a location quoting a ``--set`` value stays one readable line."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


@dataclass
class _Reading:
    """What constructing one text carries along: its loader and name, the locations found, the values made."""

    loader: Any
    source: str
    locations: dict[ConfigPath, str]
    values: int = 0


def _construct(reading: _Reading, node: Any, path: ConfigPath, ancestors: tuple[int, ...]) -> Any:
    """The data of ``node``, recording locations. ``ancestors`` holds the ids of the nodes above it: an alias
    to one of them (``hooks: &h [*h]``) would recurse forever."""
    yaml = yaml_module()
    _count_value(reading, node, path)
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        _check_nesting(node, path, reading.source, ancestors)
        ancestors = (*ancestors, id(node))
    if isinstance(node, yaml.MappingNode):
        return _construct_mapping(reading, node, path, ancestors)
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            reading.locations[(*path, index)] = _mark(reading.source, item.start_mark)
            items.append(_construct(reading, item, (*path, index), ancestors))
        return items
    return _construct_scalar(reading, node, path)


def _construct_mapping(reading: _Reading, node: Any, path: ConfigPath, ancestors: tuple[int, ...]) -> dict[Any, Any]:
    source, locations = reading.source, reading.locations
    reading.loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = _construct_scalar(reading, key_node, path)
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise ConfigError(
                f"keys must be names, got {describe(key)}", path=path, location=_mark(source, key_node.start_mark)
            )
        if key in result:
            raise ConfigError(
                f"duplicate key {key!r} (first at {locations[(*path, key)]})",
                path=path,
                location=_mark(source, key_node.start_mark),
            )
        locations[(*path, key)] = _mark(source, key_node.start_mark)
        result[key] = _construct(reading, value_node, (*path, key), ancestors)
    return result


def _construct_scalar(reading: _Reading, node: Any, path: ConfigPath) -> Any:
    """A scalar's value (or a key's: a mapping or list there is refused by the caller), refusing an ambiguous
    number at its own line and column."""
    if node.tag == _AMBIGUOUS_TAG:
        message = _ambiguous_number(reading.loader, node)
        raise ConfigError(message, path=path, location=_mark(reading.source, node.start_mark))
    return reading.loader.construct_object(node, deep=True)


def _count_value(reading: _Reading, node: Any, path: ConfigPath) -> None:
    """Refuse the value past :data:`MAX_VALUES`: aliases nested a few levels deep (``b: &b [*a, *a, ...]``,
    ``c: &c [*b, *b, ...]``) would expand to billions of values from a short text."""
    reading.values += 1
    if reading.values > MAX_VALUES:
        # Named by its first keys, as in _check_nesting, and placed at the first: the node itself sits
        # where its anchor is, not where the aliases repeating it are.
        where = reading.locations.get(path[:1]) or _mark(reading.source, node.start_mark)
        raise ConfigError(
            f"too many values: expected at most {MAX_VALUES} mappings, lists and scalars, got more"
            " (an alias counts everything it repeats, each time it is used)",
            path=path[:3],
            location=where,
        )


def _ambiguous_number(loader: Any, node: Any) -> str:
    """Why a plain ``1:20`` or ``017`` is refused: both of its readings, and how to write each of them."""
    text = node.value
    if _LEADING_ZERO.fullmatch(text):
        in_1_1 = loader.construct_yaml_int(node) if _OCTAL_IN_YAML_1_1.fullmatch(text) else None
        in_1_2 = int(text) if _INT_IN_YAML_1_2.fullmatch(text) else None
        write = " or ".join(dict.fromkeys(str(n) for n in (in_1_1, in_1_2) if n is not None))
        read_1_1 = "a string" if in_1_1 is None else f"octal ({in_1_1})"
        read_1_2 = "a string" if in_1_2 is None else str(in_1_2)
        return (
            f"ambiguous number {text}: with a leading zero YAML 1.1 reads it as {read_1_1}, YAML 1.2 as {read_1_2};"
            f" write {write}, or quote it ('{text}') for a string"
        )
    value = loader.construct_yaml_float(node) if "." in text else loader.construct_yaml_int(node)
    return (
        f"ambiguous number {text}: YAML 1.1 reads it as the base-60 number {value}, YAML 1.2 as a string; "
        f"write {value}, or quote it ('{text}') for a string"
    )


def _refuse_ambiguous_number(loader: Any, node: Any) -> Any:
    """The constructor of ambiguous numbers, for those inside a key (``? [1:20]``), which PyYAML constructs."""
    yaml = yaml_module()
    raise yaml.constructor.ConstructorError(None, None, _ambiguous_number(loader, node), node.start_mark)


def _check_nesting(node: Any, path: ConfigPath, source: str, ancestors: tuple[int, ...]) -> None:
    """Refuse a mapping or list that contains itself through an alias, or nests deeper than :data:`MAX_DEPTH`."""
    if id(node) in ancestors:
        raise ConfigError(
            "recursive alias: expected a value, got an alias to a mapping or list that contains it",
            path=path,
            location=_mark(source, node.start_mark),
        )
    if len(ancestors) >= MAX_DEPTH:  # named by its first keys: the line and column point at the deep end
        where = _mark(source, node.start_mark)
        raise ConfigError(_too_deep(f"more than {MAX_DEPTH}"), path=path[:3], location=where)
