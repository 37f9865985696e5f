"""``available()``, ``load()`` and friends: what users call."""

from __future__ import annotations

import difflib
import enum
import itertools
from collections.abc import Mapping
from typing import Any

import attrs

from nvtrain.plugins._build import build_hook
from nvtrain.plugins._builtins import shadowed_builtin, shadowing_error, shadowing_note
from nvtrain.plugins._describe import HookInfo
from nvtrain.plugins._environment import ALLOW_LIST_ENV, allow_list, autoload_disabled
from nvtrain.plugins._errors import PluginNotFoundError
from nvtrain.plugins._registry import (
    ENTRY_POINT_GROUP,
    REGISTRY,
    EntryPointRecord,
    LoadedPlugin,
    LoadFailure,
)

__all__ = [
    "PluginInfo",
    "PluginStatus",
    "available",
    "hook_class",
    "load",
    "load_all",
    "refresh",
    "visible_records",
]


class PluginStatus(enum.StrEnum):
    """Where a listed plugin stands."""

    #: Imported; its hook classes are listed.
    OK = "ok"
    #: Installed but unusable: import failed, the entry point points nowhere, or a name conflict.
    ERROR = "error"
    #: Listed from metadata only (autoloading disabled); ``load()`` still works.
    NOT_LOADED = "not loaded"
    #: Named in the allow-list but not installed.
    MISSING = "missing"


@attrs.frozen
class PluginInfo:
    """One installed plugin as ``available()`` reports it."""

    name: str
    distribution: str | None
    version: str | None
    #: The entry point's target, e.g. ``"nvtrain_ema"``.
    entry_point: str | None
    status: PluginStatus
    #: One line: why the plugin cannot be used (``status`` is ``ERROR`` or ``MISSING``).
    error: str | None = None
    hooks: tuple[HookInfo, ...] = ()
    #: One line about a usable plugin: its name is also a built-in hook's, so the bare name is refused.
    note: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is PluginStatus.OK

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the status as its string)."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "status": self.status.value,
            "error": self.error,
            "hooks": [hook.to_dict() for hook in self.hooks],
            "note": self.note,
        }


def refresh() -> None:
    """Rescan entry points and forget import outcomes: call after installing a plugin at run time."""
    REGISTRY.refresh()


def available() -> list[PluginInfo]:
    """List the visible plugins (sorted by name) without building any hook.

    Plugin modules are imported to read their hook classes unless
    ``NVTRAIN_DISABLE_PLUGIN_AUTOLOAD`` is set; then only metadata is read and plugins
    not yet loaded show as ``not loaded``. A broken plugin is listed with its error;
    names in ``NVTRAIN_PLUGINS`` that are not installed are listed as ``missing``.
    """
    allowed = allow_list()
    import_modules = not autoload_disabled()
    infos = []
    for name, records in _by_name(REGISTRY.records()).items():
        if allowed is not None and name not in allowed:
            continue
        for record in records:
            if len(records) > 1:
                outcome: LoadedPlugin | LoadFailure | None = _conflict(record, records)
            else:
                outcome = REGISTRY.outcome(record) if import_modules else REGISTRY.cached(record)
            infos.append(_info(record, outcome))
    installed = {record.name for record in REGISTRY.records()}
    for name in allowed or ():
        if name not in installed:
            infos.append(
                PluginInfo(
                    name=name,
                    distribution=None,
                    version=None,
                    entry_point=None,
                    status=PluginStatus.MISSING,
                    error=f"named in {ALLOW_LIST_ENV} but not installed",
                )
            )
    return sorted(infos, key=lambda info: (info.name, info.distribution or ""))


def load(spec: str, /, **settings: Any) -> Any:
    """Build a configured hook from the plugin named ``spec``: ``load("ema", decay=0.999)``.

    ``spec`` is an entry-point name (the plugin's default hook class) or
    ``"name:ClassName"`` for another class the plugin lists. Settings are the class's
    constructor arguments; an unknown name raises :class:`PluginSettingsError` with the
    accepted ones, and the class's validators check the values. A broken plugin raises
    :class:`PluginLoadError`; an unknown or filtered-out one :class:`PluginNotFoundError`.
    Works when autoloading is disabled: naming a plugin is explicit activation. A bare
    name that is also a built-in hook's (``clip``) raises :class:`PluginNameError`, as a
    config naming it does: ``"clip:ClassName"`` picks the plugin.
    """
    _check_spec("load", spec)
    record = _visible_record(spec.partition(":")[0])
    return build_hook(hook_class(spec), settings, label=record.label)


def load_all(config: Mapping[str, Mapping[str, Any] | None]) -> list[Any]:
    """Build one hook per entry of a ``{spec: settings}`` mapping, e.g. read from a config file."""
    return [load(spec, **dict(settings or {})) for spec, settings in config.items()]


def hook_class(spec: str) -> type:
    """The class ``load(spec)`` would build, without building it (refusing the same names ``load()`` refuses)."""
    _check_spec("hook_class", spec)
    name, _, class_name = spec.partition(":")
    record = _visible_record(name)
    builtin = shadowed_builtin(name)
    if builtin is not None and not class_name:
        raise shadowing_error(record, builtin)
    return _pick_class(REGISTRY.load(record), class_name or None)


def visible_records() -> list[EntryPointRecord]:
    """Entry points that pass the allow-list (conflicting names included)."""
    allowed = allow_list()
    return [r for r in REGISTRY.records() if allowed is None or r.name in allowed]


# -- helpers ---------------------------------------------------------------------------


def _check_spec(function: str, spec: Any) -> None:
    """Refuse a spec that is no str, which would fail as a bare AttributeError on ``partition``."""
    if not isinstance(spec, str):
        raise TypeError(
            f"nvtrain.plugins.{function}(spec) must be a str naming a plugin, e.g. 'ema' or 'ema:EMAHook' "
            f"(got {spec!r})"
        )


def _close_match(name: str, candidates: list[str]) -> str | None:
    """The candidate ``name`` most likely misspells, ignoring case (``EMA`` is ``ema``), or None."""
    by_folded = {candidate.casefold(): candidate for candidate in candidates}
    close = difflib.get_close_matches(name.casefold(), list(by_folded), n=1)
    return by_folded[close[0]] if close else None


def _by_name(records: tuple[EntryPointRecord, ...]) -> dict[str, list[EntryPointRecord]]:
    return {name: list(group) for name, group in itertools.groupby(records, key=lambda r: r.name)}


def _conflict(record: EntryPointRecord, records: list[EntryPointRecord]) -> LoadFailure:
    others = ", ".join(r.distribution or "?" for r in records if r is not record)
    return LoadFailure(
        record,
        f"the name {record.name!r} is also declared by {others}; uninstall one of them",
        None,
    )


def _info(record: EntryPointRecord, outcome: LoadedPlugin | LoadFailure | None) -> PluginInfo:
    info = PluginInfo(
        name=record.name,
        distribution=record.distribution,
        version=record.version,
        entry_point=record.value,
        status=PluginStatus.NOT_LOADED,
    )
    if isinstance(outcome, LoadFailure):
        return attrs.evolve(info, status=PluginStatus.ERROR, error=outcome.summary)
    if isinstance(outcome, LoadedPlugin):
        note = shadowing_note(record.name, outcome.classes[0].__name__)
        return attrs.evolve(info, status=PluginStatus.OK, hooks=outcome.hooks, note=note)
    return attrs.evolve(info, note=shadowing_note(record.name, None))


def _visible_record(name: str) -> EntryPointRecord:
    records = REGISTRY.named(name)
    allowed = allow_list()
    if allowed is not None and name not in allowed:
        where = f"is installed ({records[0].source}) but" if records else "is not"
        raise PluginNotFoundError(
            f"plugin {name!r} {where} not listed in {ALLOW_LIST_ENV}={','.join(allowed)!s}; "
            f"add it there to use it, or unset {ALLOW_LIST_ENV}"
        )
    if not records:
        installed = sorted({r.name for r in visible_records()})
        builtin = shadowed_builtin(name)
        close = _close_match(name, installed)
        hint = f"; did you mean {close!r}?" if close else ""
        if builtin is not None:  # a config's hook name, not an installed plugin's
            hint = (
                f"; {name!r} is nvtrain's built-in {builtin.__name__}: build it as "
                f"nvtrain.hooks.{builtin.__name__}(...) (configs name it {name!r})"
            )
        listed = ", ".join(installed) if installed else "none"
        raise PluginNotFoundError(
            f"no plugin named {name!r} in entry-point group {ENTRY_POINT_GROUP!r}{hint} (installed: {listed})"
        )
    if len(records) > 1:
        raise _conflict(records[0], records).error()
    return records[0]


def _pick_class(loaded: LoadedPlugin, class_name: str | None) -> type:
    if class_name is None:
        return loaded.classes[0]
    for cls in loaded.classes:
        if cls.__name__ == class_name:
            return cls
    names = [cls.__name__ for cls in loaded.classes]
    close = _close_match(class_name, names)
    hint = f"; did you mean {close!r}?" if close else ""
    raise PluginNotFoundError(
        f"{loaded.record.label} has no hook class {class_name!r}{hint} (it provides: {', '.join(names)})"
    )
