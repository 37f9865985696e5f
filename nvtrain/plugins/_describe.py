"""What a hook class declares, read from the class alone (no instance is built).

Used by ``available()`` to show each plugin's hook classes, their stages and
priorities, and by ``load()`` to know the settings a class accepts.
"""

from __future__ import annotations

import inspect
from typing import Any

import attrs

from nvtrain.hook import DEFAULT_PRIORITY, Hook, TrainingUpdateHook
from nvtrain.hookspecs import PROJECT_NAME
from nvtrain.stages import TrainingStage

__all__ = ["HookInfo", "class_default", "describe_hook_class", "settings_of"]

_IMPL_MARKER = PROJECT_NAME + "_impl"
_MISSING = object()


@attrs.frozen
class HookInfo:
    """One hook class a plugin provides.

    ``kind`` is ``"update"`` (a :class:`~nvtrain.TrainingUpdateHook`), ``"observer"``
    (a seed-style :class:`~nvtrain.Hook`) or ``"pluggy"`` (a class with
    ``@nvtrain.hookimpl`` methods). ``stages`` are hookspec names in loop order;
    ``wrappers`` the subset implemented as pluggy wrappers. ``default`` marks the class
    ``load(name)`` builds.
    """

    name: str
    qualname: str
    kind: str
    stages: tuple[str, ...]
    wrappers: tuple[str, ...]
    priority: int | None
    exclusive_key: str | None
    settings: tuple[str, ...]
    default: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples as lists)."""
        return {
            field.name: list(value) if isinstance(value, tuple) else value
            for field, value in ((f, getattr(self, f.name)) for f in attrs.fields(HookInfo))
        }


def describe_hook_class(cls: type, *, default: bool) -> HookInfo:
    """Read a hook class's kind, stages, priority and settings."""
    if issubclass(cls, TrainingUpdateHook):
        kind, declared = "update", class_default(cls, "stages", TrainingUpdateHook.stages)
    elif issubclass(cls, Hook):
        kind, declared = "observer", class_default(cls, "stages", ())
    else:
        kind, declared = "pluggy", ()
    marked = _marked_stages(cls)
    stages = set(_as_stages(cls, declared)) | set(marked)
    wrappers = {stage for stage, opts in marked.items() if opts.get("wrapper") or opts.get("hookwrapper")}
    priority = class_default(cls, "priority", DEFAULT_PRIORITY)
    exclusive_key = class_default(cls, "exclusive_key", None)
    return HookInfo(
        name=cls.__name__,
        qualname=f"{cls.__module__}:{cls.__qualname__}",
        kind=kind,
        stages=tuple(stage.hook_name for stage in sorted(stages)),
        wrappers=tuple(stage.hook_name for stage in sorted(wrappers)),
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
        exclusive_key=exclusive_key if isinstance(exclusive_key, str) else None,
        settings=settings_of(cls) or (),
        default=default,
    )


def class_default(cls: type, name: str, fallback: Any) -> Any:
    """The value ``name`` has on a fresh instance, as far as the class tells.

    For an attrs field that is the field's default (a slotted attrs class has no class
    attribute for its fields); ``None`` when the field is required or its factory needs
    the instance. Otherwise the class attribute, or ``fallback``.
    """
    if attrs.has(cls):
        field = getattr(attrs.fields(cls), name, None)
        if field is not None:
            default = field.default
            if default is attrs.NOTHING:
                return None
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                return None if default.takes_self else default.factory()
            return default
    value = inspect.getattr_static(cls, name, _MISSING)
    if value is _MISSING or inspect.isdatadescriptor(value) or inspect.ismethoddescriptor(value):
        return fallback
    return getattr(cls, name)


def settings_of(cls: type) -> tuple[str, ...] | None:
    """The keyword arguments the class's constructor accepts; ``None`` when it accepts any."""
    if attrs.has(cls):
        return tuple(field.alias for field in attrs.fields(cls) if field.init)
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    names = []
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.append(parameter.name)
    return tuple(names)


def required_settings(cls: type) -> tuple[str, ...]:
    """Settings without a default: ``load()`` must be given them."""
    if attrs.has(cls):
        return tuple(f.alias for f in attrs.fields(cls) if f.init and f.default is attrs.NOTHING)
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return ()
    return tuple(
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _marked_stages(cls: type) -> dict[TrainingStage, dict[str, Any]]:
    """The stages the class's ``@nvtrain.hookimpl`` methods implement, by method name or ``specname=``."""
    stages = {stage.hook_name: stage for stage in TrainingStage}
    marked = {}
    for attribute in dir(cls):
        if attribute.startswith("__"):
            continue
        opts = getattr(getattr(cls, attribute, None), _IMPL_MARKER, None)
        if not isinstance(opts, dict):
            continue
        stage = stages.get(opts.get("specname") or attribute)
        if stage is not None:
            marked[stage] = opts
    return marked


def _as_stages(cls: type, declared: Any) -> frozenset[TrainingStage]:
    try:
        return frozenset(TrainingStage(stage) for stage in declared)
    except (TypeError, ValueError):
        raise ValueError(
            f"hook class {cls.__qualname__}: 'stages' must be TrainingStage values (got {declared!r})"
        ) from None
