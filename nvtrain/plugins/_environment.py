"""The environment variables that control which plugins are visible and imported."""

from __future__ import annotations

import os

__all__ = ["ALLOW_LIST_ENV", "DISABLE_AUTOLOAD_ENV", "allow_list", "autoload_disabled"]

#: Comma-separated entry-point names; when set, only those plugins are visible (listed, loadable).
ALLOW_LIST_ENV = "NVTRAIN_PLUGINS"
#: When set to a true value, ``available()`` lists plugins from metadata without importing them.
DISABLE_AUTOLOAD_ENV = "NVTRAIN_DISABLE_PLUGIN_AUTOLOAD"

_FALSE = frozenset({"", "0", "false", "no", "off"})


def allow_list() -> tuple[str, ...] | None:
    """The allowed entry-point names in the order given, or ``None`` when every plugin is visible.

    ``NVTRAIN_PLUGINS=""`` (set but empty) allows none, like ``LLM_LOAD_PLUGINS``.
    """
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    names = (part.strip() for part in raw.split(","))
    return tuple(dict.fromkeys(name for name in names if name))


def autoload_disabled() -> bool:
    """True when ``NVTRAIN_DISABLE_PLUGIN_AUTOLOAD`` is set to anything but ``0``/``false``/``no``/``off``."""
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in _FALSE
