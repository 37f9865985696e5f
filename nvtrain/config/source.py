"""YAML in, with the ``file:line:col`` of every key and list item, so errors can point at lines.

The loader is PyYAML's ``SafeLoader`` reading ``1e-3`` as a float (YAML 1.1 reads it
as a string, and learning rates are written that way). Duplicate keys and keys that
are not names are refused with their location.
"""

from __future__ import annotations

import re
from typing import Any

from nvtrain.config.errors import ConfigError, ConfigPath, describe

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


def parse_yaml(text: str, source: str) -> tuple[Any, dict[ConfigPath, str]]:
    """Parse ``text``; return the data and the ``file:line:col`` of every key and list item."""
    yaml = yaml_module()
    loader = _loader_class()(text)
    locations: dict[ConfigPath, str] = {}
    try:
        node = loader.get_single_node()
        data = {} if node is None else _construct(loader, node, (), locations, source)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = _mark(source, mark) if mark is not None else source
        raise ConfigError(f"invalid YAML: {err.problem or err.context}", location=where) from None
    finally:
        loader.dispose()
    return data, locations


def _mark(source: str, mark: Any) -> str:
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


def _construct(loader: Any, node: Any, path: ConfigPath, locations: dict[ConfigPath, str], source: str) -> Any:
    yaml = yaml_module()
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
            result[key] = _construct(loader, value_node, (*path, key), locations, source)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            locations[(*path, index)] = _mark(source, item.start_mark)
            items.append(_construct(loader, item, (*path, index), locations, source))
        return items
    return loader.construct_object(node, deep=True)
