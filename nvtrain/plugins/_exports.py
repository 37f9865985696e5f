"""Resolves ``nvtrain.hooks.<ClassName>`` to a plugin's hook class on first use."""

from __future__ import annotations

import re
from collections.abc import Mapping

from nvtrain.plugins._api import visible_records
from nvtrain.plugins._environment import ALLOW_LIST_ENV, allow_list, autoload_disabled
from nvtrain.plugins._registry import REGISTRY, EntryPointRecord, LoadedPlugin, LoadFailure

__all__ = ["resolve_hook_class"]


def resolve_hook_class(name: str, known: Mapping[str, tuple[str, str]]) -> type:
    """Find the hook class ``name`` among installed plugins.

    ``known`` maps the class names of the plugins nvtrain ships to their
    ``(distribution, module)``: those are looked up in that distribution only, and a
    missing distribution raises ImportError naming what to install. Any other name is
    searched in every visible plugin's ``__nvtrain_hooks__`` (imported plugins only when
    autoloading is disabled); a class only a plugin the ``NVTRAIN_PLUGINS`` allow-list
    hides provides raises ImportError naming the variable; not finding it at all raises
    AttributeError, so ``from nvtrain.hooks import Unknown`` fails with Python's usual
    ImportError.
    """
    if name in known:
        distribution, module = known[name]
        return _from_distribution(name, distribution, module)
    return _from_any_plugin(name)


def _normalize(distribution: str | None) -> str:
    return re.sub(r"[-_.]+", "-", distribution or "").lower()


def _from_distribution(name: str, distribution: str, module: str) -> type:
    records = [r for r in REGISTRY.records() if _normalize(r.distribution) == _normalize(distribution)]
    if not records:
        raise ImportError(
            f"{name} is provided by the {distribution} distribution (module {module}), which is not "
            f"installed; install it with: pip install {distribution}",
            name=module,
        )
    allowed = allow_list()
    visible = [r for r in records if allowed is None or r.name in allowed]
    if not visible:
        entry_points = ", ".join(repr(r.name) for r in records)
        raise ImportError(
            f"{name} is provided by plugin {entry_points} ({records[0].source}), which "
            f"{ALLOW_LIST_ENV}={','.join(allowed or ())} does not list; add {records[0].name!r} there to use {name}",
            name=module,
        )
    provided = []
    for record in visible:
        loaded = REGISTRY.load(record)  # a broken plugin raises PluginLoadError (an ImportError)
        for cls in loaded.classes:
            if cls.__name__ == name:
                return cls
            provided.append(cls.__name__)
    raise ImportError(
        f"{name} should come from {records[0].source}, but its plugin provides only: {', '.join(provided)}",
        name=module,
    )


def _from_any_plugin(name: str) -> type:
    lazy = autoload_disabled()
    matches: list[tuple[LoadedPlugin, type]] = []
    failures: list[LoadFailure] = []
    for record in visible_records():
        outcome = REGISTRY.cached(record) if lazy else REGISTRY.outcome(record)
        if isinstance(outcome, LoadFailure):
            failures.append(outcome)
        elif outcome is not None:
            matches.extend((outcome, cls) for cls in outcome.classes if cls.__name__ == name)
    if len(matches) == 1:
        return matches[0][1]
    if matches:
        where = ", ".join(f"{loaded.record.label} as {cls.__module__}.{cls.__qualname__}" for loaded, cls in matches)
        raise ImportError(f"{name} is provided by several plugins: {where}; import it from its module instead")
    hidden = _hidden_provider(name, lazy)
    if hidden is not None:
        raise ImportError(
            f"{name} is provided by {hidden.label}, which {ALLOW_LIST_ENV}={','.join(allow_list() or ())} "
            f"does not list; add {hidden.name!r} there to use {name}",
            name=hidden.value.partition(":")[0].strip(),
        )
    message = f"module 'nvtrain.hooks' has no attribute {name!r}"
    if failures:
        broken = "; ".join(f"{f.record.label}: {f.summary}" for f in failures)
        message += f" (plugins that failed to load, and might provide it: {broken})"
    raise AttributeError(message)


def _hidden_provider(name: str, lazy: bool) -> EntryPointRecord | None:
    """The installed plugin the ``NVTRAIN_PLUGINS`` allow-list hides that provides class ``name``, if any.

    Only asked once the visible plugins lack ``name``, so the error can name the
    variable instead of saying the class does not exist. Hidden plugins are imported
    for this (already imported ones only when autoloading is disabled).
    """
    allowed = allow_list()
    if allowed is None:
        return None
    for record in REGISTRY.records():
        if record.name in allowed:
            continue
        outcome = REGISTRY.cached(record) if lazy else REGISTRY.outcome(record)
        if isinstance(outcome, LoadedPlugin) and any(cls.__name__ == name for cls in outcome.classes):
            return record
    return None
