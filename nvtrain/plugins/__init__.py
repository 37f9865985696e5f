"""Discover, list and load nvtrain plugins: distributions with an entry point in the group ``nvtrain``.

A plugin is an installed distribution declaring::

    [project.entry-points.nvtrain]
    ema = "nvtrain_ema"

whose module lists its hook classes in ``__nvtrain_hooks__`` (the first is the
default). Nothing is activated by being installed: ``available()`` lists plugins,
``load("ema", decay=0.999)`` builds a configured hook that you pass to a strategy.

Environment: ``NVTRAIN_PLUGINS=amp,ema`` makes only those plugins visible;
``NVTRAIN_DISABLE_PLUGIN_AUTOLOAD=1`` lists plugins from metadata without importing
them (``load()`` still works). See ``docs/plugins.md``.
"""

from __future__ import annotations

from nvtrain.plugins._api import (
    PluginInfo,
    PluginStatus,
    available,
    hook_class,
    load,
    load_all,
    refresh,
    visible_records,
)
from nvtrain.plugins._build import build_hook
from nvtrain.plugins._builtins import builtin_hooks
from nvtrain.plugins._describe import HookInfo
from nvtrain.plugins._environment import ALLOW_LIST_ENV, DISABLE_AUTOLOAD_ENV, allow_list, autoload_disabled
from nvtrain.plugins._errors import (
    PluginError,
    PluginLoadError,
    PluginNameError,
    PluginNotFoundError,
    PluginSettingsError,
)
from nvtrain.plugins._exports import resolve_hook_class
from nvtrain.plugins._registry import ENTRY_POINT_GROUP, HOOKS_ATTRIBUTE, REGISTRY, EntryPointRecord


def entry_points() -> list[EntryPointRecord]:
    """Every installed plugin's entry point, allowed by ``NVTRAIN_PLUGINS`` or not (nothing is imported)."""
    return list(REGISTRY.records())

__all__ = [
    "ALLOW_LIST_ENV",
    "DISABLE_AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "HOOKS_ATTRIBUTE",
    "EntryPointRecord",
    "HookInfo",
    "PluginError",
    "PluginInfo",
    "PluginLoadError",
    "PluginNameError",
    "PluginNotFoundError",
    "PluginSettingsError",
    "PluginStatus",
    "allow_list",
    "autoload_disabled",
    "available",
    "build_hook",
    "builtin_hooks",
    "entry_points",
    "hook_class",
    "load",
    "load_all",
    "refresh",
    "resolve_hook_class",
    "visible_records",
]
