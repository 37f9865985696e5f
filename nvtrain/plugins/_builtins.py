"""The built-in hooks a config names by their ``plugin_name``, and what happens when a plugin takes one of those names.

A config's ``clip`` must mean one class. When an installed plugin's entry point is
also named ``clip``, neither silently wins: the bare name is refused, by configs and
``load()`` alike, with a message naming both owners and how to pick one.
"""

from __future__ import annotations

from nvtrain.plugins._errors import PluginNameError
from nvtrain.plugins._registry import REGISTRY, EntryPointRecord, LoadedPlugin

__all__ = ["builtin_hooks", "shadowed_builtin", "shadowing_error", "shadowing_note"]


def builtin_hooks() -> dict[str, type]:
    """Built-in hooks a config can name, by their ``plugin_name`` (``clip``, ``accumulate``...)."""
    import nvtrain.hooks as builtin

    classes: dict[str, type] = {}
    for class_name in builtin.__all__:
        cls = getattr(builtin, class_name)
        name = getattr(cls, "plugin_name", None)
        if isinstance(name, str):
            classes[name] = cls
    return classes


def shadowed_builtin(name: str) -> type | None:
    """The built-in hook class an entry point named ``name`` collides with, if any."""
    return builtin_hooks().get(name)


def shadowing_error(record: EntryPointRecord, builtin: type) -> PluginNameError:
    """Why the bare name of ``record`` is refused: it is also ``builtin``'s name. Imports the plugin (it was
    named) to say which ``name:Class`` builds its default hook."""
    outcome = REGISTRY.outcome(record)
    default = outcome.classes[0].__name__ if isinstance(outcome, LoadedPlugin) else "ClassName"
    return PluginNameError(
        f"the name {record.name!r} is both {record.label} and nvtrain's built-in hook {builtin.__name__}; "
        f"pick one: {record.name}:{default} for the plugin's hook, nvtrain.hooks:{builtin.__name__} "
        f"for the built-in (in code: nvtrain.hooks.{builtin.__name__}(...))"
    )


def shadowing_note(name: str, default_class: str | None) -> str | None:
    """The listing's note for a plugin named like a built-in hook; None for any other name. Reads no plugin."""
    builtin = shadowed_builtin(name)
    if builtin is None:
        return None
    spec = f"{name}:{default_class or 'ClassName'}"
    return f"name collides with built-in hook {builtin.__name__}: a bare {name!r} is refused, write {spec}"
