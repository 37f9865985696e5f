"""The errors discovery and loading raise; each names the plugin and its distribution."""

from __future__ import annotations

__all__ = ["PluginError", "PluginLoadError", "PluginNameError", "PluginNotFoundError", "PluginSettingsError"]


class PluginError(Exception):
    """Base of every nvtrain plugin error."""


class PluginLoadError(PluginError, ImportError):
    """An installed plugin cannot be used: its import failed, its entry point points nowhere,
    it declares no hook classes, or two distributions claim its name.

    An ImportError, so code that already guards optional imports handles it. The original
    exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, plugin: str, distribution: str | None, error: str) -> None:
        super().__init__(message, name=plugin)
        self.plugin = plugin
        self.distribution = distribution
        #: One line: the original exception's type and message.
        self.error = error


class PluginNotFoundError(PluginError, LookupError):
    """No visible entry point (or hook class) has the requested name."""


class PluginNameError(PluginNotFoundError):
    """The requested name is not one hook: an installed plugin and a built-in hook share it.

    ``load("clip")`` and a config's ``clip`` are refused alike, rather than each picking
    a different class; ``"clip:ClassName"`` names the plugin's hook, the built-in's
    import path the built-in.
    """


class PluginSettingsError(PluginError, TypeError):
    """A plugin was given a setting its hook class does not accept, or lacks a required one.

    Values of accepted settings are checked by the hook class's own validators, which
    raise their own ``ValueError`` / ``TypeError``.
    """

    def __init__(self, message: str, *, unknown: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: The settings the hook class does not accept, in the order given (empty for a missing one).
        self.unknown = unknown
