"""The run config: YAML in, frozen attrs classes out, errors that point at the file line.

A config file is structured into :class:`RunConfig` by a cattrs converter (no
hand-written dict walking). Every error is a :class:`ConfigError` whose one-line
message names the field, the place it came from (``train.yaml:12:3`` or the
``--set`` argument) and, for a misspelt key, the closest valid one.

Sections and their defaults are documented field by field (the ``help``
metadata of the schema); ``docs/cli.md`` carries the table
:func:`reference_markdown` generates, and a test keeps the two equal.

One module per job:

- :mod:`~nvtrain.config.schema`: the attrs classes of every section, their validators and help;
- :mod:`~nvtrain.config.source`: YAML parsing that records each key's ``file:line:col``;
- :mod:`~nvtrain.config.overrides`: ``--set key.sub=value``;
- :mod:`~nvtrain.config.converter`: the strict cattrs converter;
- :mod:`~nvtrain.config.structure`: structuring, and cattrs' errors flattened into one located error;
- :mod:`~nvtrain.config.loading`: :func:`load_config` and :func:`dump_config`, tying these together;
- :mod:`~nvtrain.config.errors`: :class:`ConfigError`, :class:`FieldError` and the paths they name;
- :mod:`~nvtrain.config.imports`: resolving ``package.module:name``;
- :mod:`~nvtrain.config.reference`: the reference tables of ``docs/cli.md``.
"""

from __future__ import annotations

# Also importable from here, as before the split, though not in __all__: the shared converter,
# the section table and the schema's type aliases (``name as name`` marks a re-export).
from nvtrain.config.converter import converter as converter
from nvtrain.config.errors import ConfigError, FieldError, format_path
from nvtrain.config.errors import ConfigPath as ConfigPath
from nvtrain.config.imports import resolve_import_path
from nvtrain.config.loading import BUILTIN_SOURCE, LoadedConfig, dump_config, load_config
from nvtrain.config.overrides import apply_overrides
from nvtrain.config.reference import reference_markdown
from nvtrain.config.schema import SECTIONS as SECTIONS
from nvtrain.config.schema import (
    TRAINER_HELP,
    DataConfig,
    HookConfig,
    LoggingConfig,
    LossConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    ValidationSection,
)
from nvtrain.config.schema import Auto as Auto

__all__ = [
    "BUILTIN_SOURCE",
    "TRAINER_HELP",
    "ConfigError",
    "DataConfig",
    "FieldError",
    "HookConfig",
    "LRSchedulerConfig",
    "LoadedConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "ValidationSection",
    "apply_overrides",
    "dump_config",
    "format_path",
    "load_config",
    "reference_markdown",
    "resolve_import_path",
]
