"""Fine-tuning helpers: choose the trainable parameters and swap submodules before training.

Both act at SETUP, after the models are on their device and before the strategy
builds optimizers from the parameters that require gradients. They run early
among SETUP implementations (module patches at priority 1, then trainable
parameters at 2), so a DDP wrapper registered at a later priority sees the
final module tree and ``requires_grad`` flags.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from nvtrain.hookspecs import hookimpl
from nvtrain.validators import (
    FieldProblem,
    FieldTypeError,
    FieldValueError,
    as_tuple,
    optional_str_tuple,
    refused,
    strict_int,
)

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext

__all__ = ["ModulePatchHook", "TrainableParameterHook"]

ModuleFactory = Callable[[torch.nn.Module], torch.nn.Module]


_GLOBS, _MODEL_NAMES = "a glob or globs, or None", "a model name or names, or None"


def _as_items(value: Any, owner: str, field: str, expected: str) -> Any:
    """A pattern or name, or several, as a tuple (an iterable that cannot be iterated, a 0-d tensor, is refused
    here naming ``owner.field``); anything else unchanged, for the validator to refuse."""
    if value is None or not isinstance(value, Iterable):
        return value
    if isinstance(value, str):
        return (value,)
    return as_tuple(value, owner, field, expected)


def _as_trainable(value: Any) -> Any:
    return _as_items(value, "TrainableParameterHook", "trainable", _GLOBS)


def _as_frozen(value: Any) -> Any:
    return () if value is None else _as_items(value, "TrainableParameterHook", "frozen", _GLOBS)


def _as_trainable_model_keys(value: Any) -> Any:
    return _as_items(value, "TrainableParameterHook", "model_keys", _MODEL_NAMES)


def _as_patched_model_keys(value: Any) -> Any:
    return _as_items(value, "ModulePatchHook", "model_keys", _MODEL_NAMES)


def _patterns(instance: Any, attribute: attrs.Attribute[Any], value: tuple[str, ...] | None) -> None:
    if value is None:
        return
    bad = [p for p in value if not isinstance(p, str) or not p] if isinstance(value, tuple) else value
    if bad or not isinstance(value, tuple):
        owner = type(instance).__name__
        message = f"{owner}.{attribute.name} must hold non-empty glob strings (got {bad!r})"
        raise refused(owner, attribute.name, value, "non-empty glob strings", message=message)


_model_keys = optional_str_tuple("model names")


def _selected_models(
    owner: str, models: Mapping[str, torch.nn.Module], keys: tuple[str, ...] | None
) -> dict[str, torch.nn.Module]:
    if keys is None:
        return dict(models)
    missing = [key for key in keys if key not in models]
    if missing:
        raise refused(
            owner,
            "model_keys",
            keys,
            f"names of the strategy's models ({sorted(models)})",
            message=f"{owner}.model_keys names {missing}, but the models are {sorted(models)}",
        )
    return {key: models[key] for key in keys}


def _refuse_built_optimizers(owner: str, optimizers: Mapping[str, Any] | None) -> None:
    if optimizers:
        raise RuntimeError(
            f"{owner} must run before the optimizers are built, but optimizers exist for {sorted(optimizers)}: "
            "they already hold the old parameters. Pass the hook in TrainingStrategy(hooks=[...]) so it "
            "acts at SETUP, or call apply() before building optimizers."
        )


def _examples(names: Iterable[str], limit: int = 5) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (", ..." if len(names) > limit else "") if names else "none"


class _AppliedAtSetup:
    """Applies the hook at SETUP, and stops training when it was registered too late to have done so.

    A subclass defines ``apply(models, optimizers)``, which sets ``_applied``, and
    ``_missed_setup``: what is left undone when SETUP passed without it.
    """

    __slots__ = ()

    _missed_setup: ClassVar[str]
    _applied: bool

    def apply(self, models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, Any] | None = None) -> object:
        raise NotImplementedError

    @hookimpl
    def setup(self, ctx: TrainingContext) -> None:
        self.apply(ctx.models, ctx.optimizers)

    @hookimpl
    def before_training(self, ctx: TrainingContext) -> None:
        if not self._applied:
            raise RuntimeError(
                f"{type(self).__name__} was registered after SETUP, so {self._missed_setup}; "
                "pass it in TrainingStrategy(hooks=[...])"
            )


@attrs.define(eq=False)
class TrainableParameterHook(_AppliedAtSetup):
    """Set ``requires_grad`` by parameter-name globs, so optimizers get only trainable parameters.

    ``trainable`` is an allow-list: when given, exactly the parameters matching one
    of its patterns stay trainable and every other parameter is frozen. ``frozen``
    then freezes the parameters matching its patterns (it wins over ``trainable``).
    With only ``frozen``, the other parameters keep their flags. Patterns are
    ``fnmatch`` globs on names as ``model.named_parameters()`` gives them
    (``*`` also crosses dots: ``"backbone.*"`` covers every backbone parameter);
    ``model_keys`` limits which models are touched. A pattern that matches no
    parameter is an error naming it, since it is almost always a typo.
    """

    plugin_name: ClassVar[str] = "trainable_params"
    _missed_setup: ClassVar[str] = "no requires_grad flag was set and the optimizers hold every parameter"

    trainable: tuple[str, ...] | None = attrs.field(default=None, converter=_as_trainable, validator=_patterns)
    frozen: tuple[str, ...] = attrs.field(default=(), converter=_as_frozen, validator=_patterns)
    model_keys: tuple[str, ...] | None = attrs.field(
        default=None, converter=_as_trainable_model_keys, validator=_model_keys
    )
    priority: int = attrs.field(default=2, validator=strict_int)

    #: After applying: the trainable parameter names of each touched model.
    trainable_names: dict[str, list[str]] = attrs.field(init=False, factory=dict)
    _applied: bool = attrs.field(init=False, default=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.trainable and not self.frozen:
            raise ValueError(
                "TrainableParameterHook needs at least one pattern in 'trainable' or 'frozen' "
                f"(got trainable={self.trainable!r}, frozen={self.frozen!r})"
            )

    def apply(
        self, models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, Any] | None = None
    ) -> dict[str, list[str]]:
        """Set the flags on ``models`` now; returns the trainable parameter names per model."""
        _refuse_built_optimizers("TrainableParameterHook", optimizers)
        selected = _selected_models("TrainableParameterHook", models, self.model_keys)
        # Every name a parameter goes by (a tied weight has several): a pattern may name any of them.
        named = {key: list(model.named_parameters(remove_duplicate=False)) for key, model in selected.items()}
        all_names = [name for params in named.values() for name, _ in params]
        for field, patterns in (("trainable", self.trainable or ()), ("frozen", self.frozen)):
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(name, pattern) for name in all_names):
                    raise ValueError(
                        f"TrainableParameterHook.{field} pattern {pattern!r} matches no parameter of "
                        f"{sorted(selected)} (parameter names look like: {_examples(all_names)})"
                    )
        names_of: dict[int, list[str]] = {}
        params_by_id: dict[int, torch.nn.Parameter] = {}
        for params in named.values():
            for name, param in params:
                names_of.setdefault(id(param), []).append(name)
                params_by_id[id(param)] = param
        for identity, param in params_by_id.items():  # one decision per parameter, whatever name matched
            names = names_of[identity]
            if self.trainable is not None:
                param.requires_grad_(any(fnmatch.fnmatchcase(n, p) for n in names for p in self.trainable))
            if any(fnmatch.fnmatchcase(n, p) for n in names for p in self.frozen):
                param.requires_grad_(False)
        self.trainable_names = {
            key: [name for name, param in model.named_parameters() if param.requires_grad]
            for key, model in selected.items()
        }
        self._applied = True
        return self.trainable_names


_FACTORY = "callable as factory(old_module) -> new module"


def _as_patches(value: Any) -> Any:
    """A mapping (or pairs) as a dict, import-path factories resolved; anything else unchanged, for the validator.

    A factory given as ``"package.module:attr"`` (all a YAML config can say) is
    imported here, from the working directory or the installed modules, so a bad
    path fails when the hook is built (``nvtrain validate``), not at SETUP.
    """
    try:
        patches = dict(value)
    except (TypeError, ValueError):
        return value
    return {pattern: _factory(pattern, factory) for pattern, factory in patches.items()}


def _factory(pattern: Any, factory: Any) -> Any:
    """``factory``, or the callable its import path ``"package.module:attr"`` names."""
    if not isinstance(factory, str):
        return factory
    from nvtrain.config import resolve_import_path

    field = f"ModulePatchHook.patches[{pattern!r}]"
    expected = f"{_FACTORY}, or an import path 'package.module:attr' to one"
    module, _, attr = factory.partition(":")
    if not module or not attr:
        message = f"{field} must be {expected} (got {factory!r})"
        raise refused("ModulePatchHook", "patches", factory, expected, message=message, error=FieldTypeError)
    try:
        target = resolve_import_path(factory, [Path.cwd()])
    except (ImportError, AttributeError) as err:
        message = f"{field}: cannot import the module factory {factory!r}: {err}"
        raise refused("ModulePatchHook", "patches", factory, expected, message=message) from None
    if not callable(target):
        message = f"{field}: {factory!r} names {target!r}, which is not {_FACTORY}"
        raise refused("ModulePatchHook", "patches", factory, expected, message=message, error=FieldTypeError)
    return target


def _check_patches(instance: Any, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
    owner = type(instance).__name__
    expected = "a mapping of non-empty glob strings to module factories"

    def refuse(message: str, error: type[FieldProblem] = FieldValueError) -> FieldProblem:
        return refused(owner, attribute.name, value, expected, message=message, error=error)

    if not isinstance(value, dict):
        raise refuse(f"{owner}.patches must be {expected} (got {value!r})", FieldTypeError)
    if not value:
        raise refuse(f"{owner}.patches must map at least one glob to a module factory (got {{}})")
    for pattern, factory in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise refuse(f"{owner}.patches keys must be non-empty glob strings (got {pattern!r})")
        if not callable(factory):
            raise refuse(
                f"{owner}.patches[{pattern!r}] must be {_FACTORY}, or an import path 'package.module:attr' to one "
                f"(got {factory!r})",
                FieldTypeError,
            )


@attrs.define(eq=False)
class ModulePatchHook(_AppliedAtSetup):
    """Replace submodules whose qualified names match a glob, before optimizers exist.

    ``patches`` maps a glob on names from ``model.named_modules()`` (``"head"``,
    ``"blocks.*.mlp"``) to ``factory(old_module) -> new_module``, or to the import
    path of one, ``"package.module:attr"`` (what a YAML config can give), imported
    when the hook is built, from the working directory or the installed modules
    (not from a config file's folder). The new module is
    moved to the old one's device. When a match lies inside a module that is
    replaced as well, only the outer one is replaced. A module registered under
    two names matches either, and its replacement takes every place it held. A pattern that replaces
    nothing is an error naming it; so is running after optimizers were built
    (they would keep training the old parameters).
    """

    plugin_name: ClassVar[str] = "module_patch"
    _missed_setup: ClassVar[str] = "no module was replaced and the optimizers hold the old parameters"

    patches: dict[str, ModuleFactory] = attrs.field(converter=_as_patches, validator=_check_patches)
    model_keys: tuple[str, ...] | None = attrs.field(
        default=None, converter=_as_patched_model_keys, validator=_model_keys
    )
    priority: int = attrs.field(default=1, validator=strict_int)

    #: After applying: ``(model key, qualified name)`` of every replaced submodule.
    replaced: list[tuple[str, str]] = attrs.field(init=False, factory=list)
    _applied: bool = attrs.field(init=False, default=False, repr=False)

    def apply(
        self, models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str]]:
        """Patch ``models`` in place now; returns ``(model key, name)`` of each replaced submodule."""
        _refuse_built_optimizers("ModulePatchHook", optimizers)
        selected = _selected_models("ModulePatchHook", models, self.model_keys)
        plan: list[tuple[str, str, str]] = []  # (model key, module name, pattern)
        used: set[str] = set()
        matched: set[str] = set()
        for key, model in selected.items():
            # Every name a module goes by (one registered twice has two): a pattern may name any of them.
            names = [name for name, _ in model.named_modules(remove_duplicate=False) if name]
            replaced_prefixes: list[str] = []
            for name in names:
                matching = [p for p in self.patches if fnmatch.fnmatchcase(name, p)]
                if not matching:
                    continue
                if len(matching) > 1:
                    raise ValueError(
                        f"ModulePatchHook.patches: module {name!r} of model {key!r} matches several patterns "
                        f"{matching}; make them disjoint"
                    )
                matched.add(matching[0])
                if any(name.startswith(prefix + ".") for prefix in replaced_prefixes):
                    continue
                replaced_prefixes.append(name)
                plan.append((key, name, matching[0]))
                used.add(matching[0])
        nested = [p for p in self.patches if p in matched and p not in used]
        if nested:
            raise ValueError(
                f"ModulePatchHook.patches pattern(s) {nested} match only modules inside modules that are "
                "replaced whole; drop them or narrow the outer pattern"
            )
        unused = [p for p in self.patches if p not in matched]
        if unused:
            examples = _examples(n for model in selected.values() for n, _ in model.named_modules() if n)
            raise ValueError(
                f"ModulePatchHook.patches pattern(s) {unused} match no submodule of {sorted(selected)} "
                f"(module names look like: {examples})"
            )
        # One replacement per module object, put in every place that holds it: a module registered
        # under two names stays shared (tied), it is not split into a new and a stale copy.
        chosen: dict[int, tuple[torch.nn.Module, str, str, str]] = {}  # id(old) -> (old, pattern, key, name)
        for key, name, pattern in plan:
            old = selected[key].get_submodule(name)
            earlier = chosen.setdefault(id(old), (old, pattern, key, name))
            if self.patches[earlier[1]] is not self.patches[pattern]:
                raise ValueError(
                    f"ModulePatchHook.patches: module {earlier[3]!r} of model {earlier[2]!r} is also registered "
                    f"as {name!r} of model {key!r}, and patterns {earlier[1]!r} and {pattern!r} give it different "
                    "factories; give it one"
                )
        self.replaced = []
        for old, pattern, key, name in chosen.values():
            new = self.patches[pattern](old)
            if not isinstance(new, torch.nn.Module):
                raise TypeError(
                    f"ModulePatchHook.patches[{pattern!r}] returned {type(new).__name__} for module {name!r} of "
                    f"model {key!r}; a factory must return a torch.nn.Module"
                )
            device = _device_of(old)
            if device is not None:
                new = new.to(device)
            for model_key, model in selected.items():
                for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
                    for child, module in list(parent._modules.items()):
                        if module is old:
                            setattr(parent, child, new)
                            self.replaced.append((model_key, f"{parent_name}.{child}" if parent_name else child))
        self._applied = True
        return self.replaced


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return None
