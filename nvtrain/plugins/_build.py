"""Builds a hook from a plugin's class and user settings, refusing unknown settings by name."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from nvtrain.plugins._describe import required_settings, settings_of
from nvtrain.plugins._errors import PluginSettingsError

__all__ = ["build_hook"]


def build_hook(cls: type, settings: Mapping[str, Any], *, label: str) -> Any:
    """``cls(**settings)``, after checking the names; the class's validators check the values.

    ``label`` names the plugin in errors (``plugin 'ema' (nvtrain-ema 0.1.0)``). A
    validator's own exception propagates with a note naming the plugin.
    """
    accepted = settings_of(cls)
    name = cls.__qualname__
    if accepted is not None:
        unknown = [key for key in settings if key not in accepted]
        if unknown:
            raise PluginSettingsError(_unknown_message(label, name, unknown, accepted), unknown=tuple(unknown))
    missing = [key for key in required_settings(cls) if key not in settings]
    if missing:
        listed = ", ".join(repr(key) for key in missing)
        raise PluginSettingsError(f"{label}: {name} needs the setting(s) {listed}")
    try:
        return cls(**settings)
    except Exception as err:
        if hasattr(err, "add_note"):
            err.add_note(f"while building {name} for {label} with settings {dict(settings)!r}")
        raise


def _unknown_message(label: str, name: str, unknown: list[str], accepted: tuple[str, ...]) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parts.append(f"{key!r}{hint}")
    plural = "s" if len(unknown) > 1 else ""
    accepts = ", ".join(accepted) if accepted else "no settings"
    return f"{label}: {name} has no setting{plural} {', '.join(parts)}; {name} accepts: {accepts}"
