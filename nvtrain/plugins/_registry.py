"""The entry-point scan and the import of plugin modules, both cached until ``refresh()``.

Scanning metadata is cheap but not free, and importing a plugin runs its code: both
happen at most once per process unless :func:`refresh` is called (after installing
or removing a distribution at run time, as tests do).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from nvtrain.errors import one_line
from nvtrain.hookspecs import PROJECT_NAME
from nvtrain.plugins._describe import HookInfo, describe_hook_class
from nvtrain.plugins._errors import PluginLoadError

__all__ = ["ENTRY_POINT_GROUP", "REGISTRY", "EntryPointRecord", "LoadFailure", "LoadedPlugin", "Registry"]

#: The entry-point group plugins register under.
ENTRY_POINT_GROUP = PROJECT_NAME
#: The module attribute listing a plugin's hook classes; the first is the default.
HOOKS_ATTRIBUTE = "__nvtrain_hooks__"


@attrs.frozen
class EntryPointRecord:
    """One entry point of the group, with the distribution that declares it."""

    name: str
    value: str
    distribution: str | None
    version: str | None
    entry_point: importlib.metadata.EntryPoint = attrs.field(eq=False, repr=False)

    @property
    def source(self) -> str:
        """The distribution and its version: ``nvtrain-ema 0.1.0``."""
        return " ".join(part for part in (self.distribution, self.version) if part) or "unknown distribution"

    @property
    def label(self) -> str:
        """How errors name the plugin: ``plugin 'ema' (nvtrain-ema 0.1.0)``."""
        return f"plugin {self.name!r} ({self.source})"


@attrs.frozen
class LoadedPlugin:
    """An imported plugin: its entry point, the object it names, and its hook classes."""

    record: EntryPointRecord
    target: Any = attrs.field(repr=False)
    classes: tuple[type, ...]
    hooks: tuple[HookInfo, ...]


@attrs.frozen
class LoadFailure:
    """Why a plugin could not be used; raised anew (chained to ``cause``) on each use."""

    record: EntryPointRecord
    summary: str
    cause: BaseException | None = attrs.field(eq=False, repr=False)

    def error(self) -> PluginLoadError:
        record = self.record
        err = PluginLoadError(
            f"{record.label} cannot be used: {self.summary} "
            f"(entry point {record.name} = {record.value!r} in group {ENTRY_POINT_GROUP!r})",
            plugin=record.name,
            distribution=record.distribution,
            error=self.summary,
        )
        err.__cause__ = self.cause
        return err


class Registry:
    """Scans entry points once and imports each plugin at most once, thread-safely."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._records: tuple[EntryPointRecord, ...] | None = None
        self._outcomes: dict[EntryPointRecord, LoadedPlugin | LoadFailure] = {}

    def refresh(self) -> None:
        """Forget the scan and every import outcome (modules already imported stay in ``sys.modules``)."""
        with self._lock:
            importlib.invalidate_caches()
            self._records = None
            self._outcomes.clear()

    def records(self) -> tuple[EntryPointRecord, ...]:
        """Every entry point of the group, sorted by name then distribution."""
        with self._lock:
            if self._records is None:
                self._records = tuple(sorted(_scan(), key=lambda r: (r.name, r.distribution or "")))
            return self._records

    def named(self, name: str) -> list[EntryPointRecord]:
        return [record for record in self.records() if record.name == name]

    def cached(self, record: EntryPointRecord) -> LoadedPlugin | LoadFailure | None:
        """The import outcome if this plugin was already imported; never imports."""
        with self._lock:
            return self._outcomes.get(record)

    def outcome(self, record: EntryPointRecord) -> LoadedPlugin | LoadFailure:
        """Import the plugin (once) and read its hook classes; failures are returned, not raised."""
        with self._lock:
            found = self._outcomes.get(record)
            if found is None:
                found = self._outcomes[record] = _import(record)
            return found

    def load(self, record: EntryPointRecord) -> LoadedPlugin:
        """Like :meth:`outcome`, raising :class:`PluginLoadError` for a broken plugin."""
        found = self.outcome(record)
        if isinstance(found, LoadFailure):
            raise found.error()
        return found


#: The process-wide registry behind ``nvtrain.plugins``.
REGISTRY = Registry()


def _scan() -> list[EntryPointRecord]:
    records = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = entry_point.dist
        records.append(
            EntryPointRecord(
                name=entry_point.name,
                value=entry_point.value,
                distribution=dist.name if dist is not None else None,
                version=dist.version if dist is not None else None,
                entry_point=entry_point,
            )
        )
    return records


def _import(record: EntryPointRecord) -> LoadedPlugin | LoadFailure:
    try:
        target = record.entry_point.load()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # a sys.exit() at import too: reported by available(), raised by load()
        return LoadFailure(record, one_line(err), err)
    if not inspect.ismodule(target):
        return LoadFailure(record, _not_a_module(record, target), None)
    classes = getattr(target, HOOKS_ATTRIBUTE, None)
    problem = _check_classes(classes)
    if problem is not None:
        what = getattr(target, "__name__", repr(target))
        return LoadFailure(record, f"{what} {problem}", None)
    assert isinstance(classes, (tuple, list))
    try:
        hooks = tuple(describe_hook_class(cls, default=index == 0) for index, cls in enumerate(classes))
    except Exception as err:
        return LoadFailure(record, one_line(err), err)
    return LoadedPlugin(record=record, target=target, classes=tuple(classes), hooks=hooks)


def _not_a_module(record: EntryPointRecord, target: object) -> str:
    """The entry point names a class (or another object) where nvtrain reads a module's ``__nvtrain_hooks__``."""
    kind = "class" if isinstance(target, type) else type(target).__name__
    what = getattr(target, "__qualname__", None) or repr(target)
    module = record.value.partition(":")[0].strip()
    return (
        f"the entry point names {kind} {what}, not a module; point it at the module that lists the hook classes "
        f'in {HOOKS_ATTRIBUTE}: {record.name} = "{module}"'
    )


def _check_classes(classes: object) -> str | None:
    what = "a non-empty tuple of hook classes, the first being the one load() builds"
    if classes is None:
        return f"does not declare {HOOKS_ATTRIBUTE} ({what})"
    if not isinstance(classes, (tuple, list)) or not classes:
        return f"declares {HOOKS_ATTRIBUTE} = {classes!r}; expected {what}"
    not_classes: Sequence[object] = [c for c in classes if not isinstance(c, type)]
    if not_classes:
        listed = ", ".join(repr(c) for c in not_classes)
        return f"declares {HOOKS_ATTRIBUTE} with entries that are not classes ({listed}); expected {what}"
    return None
