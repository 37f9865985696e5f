"""The cattrs converter that structures YAML data into the schema, strictly.

No coercion: ``"3"`` is not an int, ``1`` is not ``true``. Every refusal is a
``TypeError`` whose message says what was expected and what came (``expected an
integer, got str 'abc'``); a hook entry without a usable name is a
:class:`~nvtrain.config.errors.FieldError` on ``name``. cattrs gathers them with
the attribute or index they belong to (see :mod:`nvtrain.config.structure`).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from nvtrain.config.errors import FieldError, describe
from nvtrain.config.schema import EmaChoice, HookConfig
from nvtrain.step_scheduler import StepSchedulerConfig

__all__ = ["converter"]


def _strict(expected: type, label: str) -> Any:
    def structure(value: Any, _: Any) -> Any:
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {label}, got {describe(value)}")
        return value

    return structure


def _make_converter() -> Any:
    try:
        import cattrs
        from cattrs.errors import IterableValidationError, IterableValidationNote
        from cattrs.gen import make_dict_structure_fn
    except ImportError as err:
        raise ImportError("nvtrain's config files need cattrs: pip install 'nvtrain[cli]'") from err

    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _strict(float, "a number"))
    converter.register_structure_hook(bool, _strict(bool, "true or false"))
    converter.register_structure_hook(str, _strict(str, "a string"))

    def structure_literal(value: Any, cls: Any) -> Any:
        allowed = typing.get_args(cls)
        for option in allowed:
            if value is option or (value == option and type(value) is type(option)):
                return option
        shown = ", ".join("true" if a is True else "false" if a is False else repr(a) for a in allowed)
        raise TypeError(f"expected one of {shown}, got {describe(value)}")

    converter.register_structure_hook_func(lambda t: typing.get_origin(t) is Literal, structure_literal)

    def structure_ema_choice(value: Any, cls: Any) -> Any:
        if isinstance(value, bool) or (isinstance(value, str) and value):
            return value
        raise TypeError(f"expected true, false, auto or the state_key of an EMA hook, got {describe(value)}")

    converter.register_structure_hook_func(lambda t: t == EmaChoice, structure_ema_choice)

    def structure_tuple(value: Any, cls: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {describe(value)}")
        (item_type, _) = typing.get_args(cls)
        items, errors = [], []
        for index, item in enumerate(value):
            try:
                items.append(converter.structure(item, item_type))
            except Exception as err:
                err.add_note(IterableValidationNote(f"Structuring {cls} @ index {index}", index, item_type))
                errors.append(err)
        if errors:
            raise IterableValidationError(f"While structuring {cls}", errors, cls)
        return tuple(items)

    converter.register_structure_hook_func(
        lambda t: typing.get_origin(t) is tuple and typing.get_args(t)[1:] == (Ellipsis,), structure_tuple
    )

    def structure_kwargs(value: Any, cls: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a mapping of keyword arguments, got {describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"keyword names must be strings, got {describe(key)}")
        return dict(value)

    converter.register_structure_hook_func(lambda t: t == dict[str, Any], structure_kwargs)

    def structure_signal(value: Any, cls: Any) -> Any:
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise TypeError(f"expected a signal name, number or a list of them, got {describe(value)}")
        return tuple(value) if isinstance(value, list) else value

    signal_type = typing.get_type_hints(StepSchedulerConfig)["preemption_signal"]
    converter.register_structure_hook_func(lambda t: t == signal_type, structure_signal)

    def structure_hook(value: Any, cls: Any) -> HookConfig:
        if isinstance(value, str):
            return HookConfig(name=value)
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a hook name or a mapping with 'name' and its settings, got {describe(value)}")
        if "name" not in value:
            keys = ", ".join(map(str, value)) or "none"
            raise FieldError("name", f"a hook entry needs 'name' (got keys: {keys})", expected="a hook name")
        name = value["name"]
        if not isinstance(name, str):
            message = f"a hook name must be a string, got {describe(name)}"
            raise FieldError("name", message, value=name, expected="a string")
        settings = {k: v for k, v in value.items() if k != "name"}
        for key in settings:
            if not isinstance(key, str):
                raise TypeError(f"hook setting names must be strings, got {describe(key)}")
        return HookConfig(name=name, settings=settings)

    converter.register_structure_hook(HookConfig, structure_hook)
    converter.register_unstructure_hook(HookConfig, lambda hook: {"name": hook.name, **hook.settings})

    def section_factory(cls: type) -> Any:
        inner: Any = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True)

        def structure(value: Any, _: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected a mapping of the section's keys, got {describe(value)}")
            return inner(value, cls)

        return structure

    converter.register_structure_hook_factory(lambda t: attrs.has(t) and t is not HookConfig, section_factory)
    converter.register_unstructure_hook(tuple, lambda value: [converter.unstructure(v) for v in value])
    return converter


_CONVERTER: Any = None


def converter() -> Any:
    """The shared cattrs converter (built on first use: cattrs is an optional dependency)."""
    global _CONVERTER
    if _CONVERTER is None:
        _CONVERTER = _make_converter()
    return _CONVERTER
