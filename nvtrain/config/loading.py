"""A config file (or the built-in one) plus ``--set`` overrides, loaded into a located :class:`LoadedConfig`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from nvtrain.config.converter import converter
from nvtrain.config.errors import ConfigError, ConfigPath, describe
from nvtrain.config.overrides import apply_overrides, check_overrides
from nvtrain.config.schema import RunConfig
from nvtrain.config.source import dump_yaml, parse_yaml
from nvtrain.config.structure import structure_config

__all__ = ["BUILTIN_SOURCE", "LoadedConfig", "dump_config", "load_config"]

#: How the built-in config is named in messages.
BUILTIN_SOURCE = "<built-in default.yaml>"


@attrs.frozen
class LoadedConfig:
    """A structured config plus where it came from, so later checks can point at lines too."""

    config: RunConfig
    #: The file name, or :data:`BUILTIN_SOURCE`.
    source: str
    #: The config file's folder (import paths are also resolved from there), or None.
    directory: Path | None
    locations: Mapping[ConfigPath, str] = attrs.field(factory=dict, repr=False)
    #: Whether the config file or a ``--set`` gave ``name``; False when ``config.name`` is the
    #: default (the file's stem, or the built-in config's ``digits``), which ``--print-config``
    #: leaves out so that a printed config saved as ``my-job.yaml`` runs as ``my-job``.
    name_given: bool = False

    def locate(self, path: Sequence[str | int]) -> str:
        """The nearest recorded location of ``path`` (or of its closest parent).

        A ``--set`` that changed something inside ``path`` (``validation.metrics.0=acc`` for an error
        about ``validation.metrics``, ``model.factory=...`` for one about ``model``) is where the problem
        came from, so it wins over the file's line; a list item keeps its own.
        """
        key = tuple(path)
        if key and not isinstance(key[-1], int):  # a list item keeps its own line (a hook named in the file)
            inside = [
                where
                for recorded, where in self.locations.items()
                if len(recorded) > len(key) and recorded[: len(key)] == key and where.startswith("--set ")
            ]
            own = self.locations.get(key)
            if inside and (own is None or not own.startswith("--set ")):
                return inside[-1]  # the last one applied
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key[:-1]
        return self.source

    def error(self, message: str, path: Sequence[str | int] = ()) -> ConfigError:
        """A :class:`ConfigError` placed at ``path``."""
        return ConfigError(message, path=tuple(path), location=self.locate(path))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> LoadedConfig:
    """Read ``path`` (the built-in config when None), apply ``--set`` overrides, structure it.

    ``overrides`` is a list of ``key.sub=value`` strings (``["trainer.max_steps=3"]``);
    a bare str raises ``TypeError`` rather than be split into characters. Raises
    :class:`ConfigError` for anything wrong in the config, with its location.
    """
    check_overrides(overrides, "load_config")
    if path is None:
        from nvtrain.builtin import default_config_text

        text, source, directory, stem = default_config_text(), BUILTIN_SOURCE, None, "digits"
    else:
        file = Path(path)
        source = str(path)
        text = _read_config_file(file, source)
        directory, stem = file.resolve().parent, file.stem
    data, locations = parse_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"a config file holds a mapping of sections, got {describe(data)}", location=source)
    file_location = locations.get(("name",))
    data = apply_overrides(data, overrides, locations)
    by_override = locations.get(("name",)) != file_location
    name_given = data.get("name") is not None and (path is not None or by_override)
    loaded = LoadedConfig(
        config=None,  # type: ignore[arg-type]
        source=source,
        directory=directory,
        locations=locations,
        name_given=name_given,
    )
    config = structure_config(data, loaded.locate)
    if config.name is None:
        config = attrs.evolve(config, name=stem)
    return attrs.evolve(loaded, config=config)


def _read_config_file(file: Path, source: str) -> str:
    """The text of the config file; whatever the OS or the decoder refuses (a symlink loop, a path under a
    file, a name too long, a special file) is one located line naming the file and the reason."""
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("no such config file", location=source) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read the config file: expected UTF-8 text, got {err}", location=source) from None
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise ConfigError(
            f"cannot read the config file: expected a readable file, got {reason} ({type(err).__name__})",
            location=source,
        ) from None
    except ValueError as err:  # a NUL character in the path
        raise ConfigError(f"cannot read the config file: expected a file path, got {err}", location=source) from None


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML, in schema order (what ``--print-config`` shows)."""
    return dump_yaml(converter().unstructure(config))
