"""YAML in, with the ``file:line:col`` of every key and list item, so errors can point at lines.

The loader is PyYAML's ``SafeLoader`` reading ``1e-3`` as a float (YAML 1.1 reads it
as a string, and learning rates are written that way). Duplicate keys and keys that
are not names are refused with their location.
"""

from __future__ import annotations

import re
from typing import Any

from nvtrain.config.errors import ConfigError, ConfigPath, describe
from nvtrain.errors import first_line

__all__ = ["parse_yaml", "yaml_module"]


def yaml_module() -> Any:
    try:
        import yaml
    except ImportError as err:
        raise ImportError("nvtrain's config files need PyYAML: pip install 'nvtrain[cli]'") from err
    return yaml


_LOADER: Any = None
# YAML 1.1 reads ``1e-3`` (no dot) as a string; learning rates are written that way.
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)


def _loader_class() -> Any:
    global _LOADER
    if _LOADER is None:
        yaml = yaml_module()

        class Loader(yaml.SafeLoader):  # type: ignore[misc,name-defined]
            """SafeLoader that also reads ``1e-3`` as a float."""

        Loader.yaml_implicit_resolvers = {
            key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
            for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
        _LOADER = Loader
    return _LOADER


#: How deep a config may nest mappings and lists: far beyond any real config, well inside Python's
#: recursion limit (PyYAML composes a node per stack frame, and later steps copy the data recursively).
MAX_DEPTH = 100


def parse_yaml(text: str, source: str) -> tuple[Any, dict[ConfigPath, str]]:
    """Parse ``text``; return the data and the ``file:line:col`` of every key and list item.

    Whatever PyYAML refuses (a syntax error, a control character, nesting deeper than
    the stack allows) is a located :class:`ConfigError`, as are a recursive alias and
    nesting deeper than :data:`MAX_DEPTH`.
    """
    yaml = yaml_module()
    locations: dict[ConfigPath, str] = {}
    loader = None
    try:
        loader = _loader_class()(text)  # it reads the whole text at once: a control character stops it here
        node = loader.get_single_node()
        data = {} if node is None else _construct(loader, node, (), locations, source, ())
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


def _construct(
    loader: Any,
    node: Any,
    path: ConfigPath,
    locations: dict[ConfigPath, str],
    source: str,
    ancestors: tuple[int, ...],
) -> Any:
    """The data of ``node``, recording locations. ``ancestors`` holds the ids of the nodes above it: an alias
    to one of them (``hooks: &h [*h]``) would recurse forever."""
    yaml = yaml_module()
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        _check_nesting(node, path, source, ancestors)
        ancestors = (*ancestors, id(node))
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
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
            result[key] = _construct(loader, value_node, (*path, key), locations, source, ancestors)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            locations[(*path, index)] = _mark(source, item.start_mark)
            items.append(_construct(loader, item, (*path, index), locations, source, ancestors))
        return items
    return loader.construct_object(node, deep=True)


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
