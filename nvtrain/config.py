"""The run config: YAML in, frozen attrs classes out, errors that point at the file line.

A config file is structured into :class:`RunConfig` by a cattrs converter (no
hand-written dict walking). Every error is a :class:`ConfigError` whose one-line
message names the field, the place it came from (``train.yaml:12:3`` or the
``--set`` argument) and, for a misspelt key, the closest valid one.

Sections and their defaults are documented field by field (the ``help``
metadata below); ``docs/cli.md`` carries the table :func:`reference_markdown`
generates, and a test keeps the two equal.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from nvtrain.step_scheduler import StepSchedulerConfig

__all__ = [
    "BUILTIN_SOURCE",
    "TRAINER_HELP",
    "ConfigError",
    "DataConfig",
    "FieldError",
    "HookConfig",
    "LRSchedulerConfig",
    "LoadedConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "ValidationSection",
    "apply_overrides",
    "dump_config",
    "format_path",
    "load_config",
    "reference_markdown",
    "resolve_import_path",
]

#: How the built-in config is named in messages.
BUILTIN_SOURCE = "<built-in default.yaml>"

ConfigPath = tuple[str | int, ...]
Auto = Literal[True, False, "auto"]


# -- errors --------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config that cannot run. ``str()`` is one line: ``location: path: problem``."""

    def __init__(self, message: str, *, path: ConfigPath = (), location: str | None = None) -> None:
        self.problem = message
        self.path = tuple(path)
        self.location = location
        parts = [p for p in (location, format_path(self.path)) if p]
        super().__init__(": ".join([*parts, message]))


class FieldError(ValueError):
    """Raised by a field validator so the error can be placed at that field's line."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def format_path(path: Sequence[str | int]) -> str:
    """``("hooks", 1, "decay")`` -> ``hooks[1].decay``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


# -- field validators --------------------------------------------------------------------------

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def _owner(instance: Any) -> str:
    return type(instance).__name__


def _import_path(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is None:
        return
    if not _IMPORT_PATH.match(value):
        hint = ""
        if ":" not in value and "." in value:
            module, _, name = value.rpartition(".")
            hint = f"; did you mean '{module}:{name}'?"
        raise FieldError(
            attribute.name,
            f"{_owner(instance)}.{attribute.name} must be an import path 'package.module:name' (got {value!r}){hint}",
        )


def _positive_or_none(instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise FieldError(attribute.name, f"{_owner(instance)}.{attribute.name} must be >= 1 or null (got {value!r})")


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise FieldError(attribute.name, f"{_owner(instance)}.{attribute.name} must be >= 1 (got {value!r})")


def _non_empty(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value.strip():
        raise FieldError(attribute.name, f"{_owner(instance)}.{attribute.name} must not be empty")


def _run_name(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and (not value.strip() or "/" in value or "\\" in value or value in (".", "..")):
        raise FieldError(
            attribute.name, f"RunConfig.name must be a plain directory name without slashes (got {value!r})"
        )


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


# -- the schema ----------------------------------------------------------------------------------


@attrs.frozen
class ModelConfig:
    """What to train: a factory called with ``kwargs`` that returns a ``torch.nn.Module``."""

    factory: str = attrs.field(
        validator=_import_path, metadata=_doc("Import path `package.module:function` returning the model.")
    )
    kwargs: dict[str, Any] = attrs.field(factory=dict, metadata=_doc("Keyword arguments for the factory."))
    forward_fn: str | None = attrs.field(
        default=None,
        validator=_import_path,
        metadata=_doc("Optional `fn(ctx) -> outputs` for batches that are not `(inputs, targets)`."),
    )


@attrs.frozen
class DataConfig:
    """Where batches come from: a factory returning ``(train_loader, validation_loader)``."""

    factory: str = attrs.field(
        validator=_import_path,
        metadata=_doc(
            "Import path of a function returning `(train, validation)` loaders, "
            "a `{train: ..., validation: ...}` mapping, or only the train loader."
        ),
    )
    kwargs: dict[str, Any] = attrs.field(factory=dict, metadata=_doc("Keyword arguments for the factory."))


@attrs.frozen
class LossConfig:
    """The loss: ``function(outputs, targets, **kwargs)``."""

    function: str = attrs.field(
        default="torch.nn.functional:cross_entropy",
        validator=_import_path,
        metadata=_doc("Import path of `fn(outputs, targets) -> loss`."),
    )
    kwargs: dict[str, Any] = attrs.field(factory=dict, metadata=_doc("Extra keyword arguments bound to it."))


@attrs.frozen
class OptimizerConfig:
    """The optimizer class, built with the model's trainable parameters and ``kwargs``."""

    factory: str = attrs.field(
        default="torch.optim:AdamW",
        validator=_import_path,
        metadata=_doc("Import path of the optimizer class (called as `factory(params, **kwargs)`)."),
    )
    kwargs: dict[str, Any] = attrs.field(factory=dict, metadata=_doc("Keyword arguments, e.g. `lr`."))


def _scheduler_factory(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    from nvtrain.schedules import ALIASES

    if value in ALIASES:
        return
    if not _IMPORT_PATH.match(value):
        close = difflib.get_close_matches(value, list(ALIASES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FieldError(
            attribute.name,
            f"LRSchedulerConfig.factory must be a schedule name ({', '.join(ALIASES)}) or an import path "
            f"'package.module:name' (got {value!r}){hint}",
        )


def _not_negative(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise FieldError(attribute.name, f"{_owner(instance)}.{attribute.name} must be >= 0 (got {value!r})")


def _metric_name(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value.strip():
        raise FieldError(attribute.name, f"{_owner(instance)}.{attribute.name} must be a metric name or null")


@attrs.frozen
class LRSchedulerConfig:
    """An LR scheduler, stepped after every real optimizer step, every epoch, or after each validation.

    A factory with a ``T_max`` or ``total_steps`` parameter that the kwargs leave
    out gets the run's length (in optimizer steps, or in epochs with ``interval:
    epoch``) less the warmup, so a cosine schedule follows ``trainer.max_steps``
    and ``trainer.num_epochs`` overrides.
    """

    factory: str = attrs.field(
        validator=_scheduler_factory,
        metadata=_doc(
            "A schedule name (`cosine`, `linear`, `constant`, `step`, `exponential`, `onecycle`, `plateau`; "
            "see docs/run-control.md) or the import path of a scheduler class (called as "
            "`factory(optimizer, **kwargs)`)."
        ),
    )
    kwargs: dict[str, Any] = attrs.field(
        factory=dict,
        metadata=_doc(
            "Keyword arguments; `T_max` / `total_steps`, when left out, are the run's length less `warmup_steps`."
        ),
    )
    warmup_steps: int = attrs.field(
        default=0,
        validator=_not_negative,
        metadata=_doc(
            "Ramp the LR up linearly from 0.001 x lr over this many scheduler steps (epochs with `interval: "
            "epoch`), then follow `factory` (0: no warmup)."
        ),
    )
    interval: Literal["step", "epoch"] = attrs.field(
        default="step",
        metadata=_doc("`step`: after every real optimizer step; `epoch`: at the end of every epoch."),
    )
    monitor: str | None = attrs.field(
        default=None,
        validator=_metric_name,
        metadata=_doc(
            "Step after each validation with this validation value, e.g. `loss` (null: `loss` for `plateau`, "
            "else not metric-driven)."
        ),
    )


#: Help text of the ``trainer`` section, which is :class:`~nvtrain.step_scheduler.StepSchedulerConfig`
#: itself (a test checks that every field has an entry).
TRAINER_HELP: dict[str, str] = {
    "global_batch_size": "Samples per optimizer step across all processes (null: one loader batch per process). "
    "A multiple of batch size x processes; larger means gradient accumulation.",
    "num_epochs": "Epochs to train (null: derived from `max_steps`; both null: one epoch).",
    "max_steps": "Stop after this many optimizer steps (null: run all epochs).",
    "ckpt_every_steps": "Checkpoint every N optimizer steps (null: only at epoch ends, the last step and preemption).",
    "save_checkpoint_every_epoch": "Also checkpoint at every epoch end.",
    "validate_on_checkpoint": "Also validate at every checkpoint step.",
    "val_every_steps": "Validate every N optimizer steps (null: see `validation`).",
    "log_remote_every_steps": "Cadence of experiment loggers (TensorBoard; `ctx.scheduler.is_remote_logging_step`).",
    "loss_average_window_steps": "Steps the smoothed loss (`train_loss_avg`, the progress bar's loss) covers.",
    "gc_every_steps": "Run `gc.collect()` every N steps, with automatic gc off during the run (null: Python's own gc).",
    "start_step": "Step to start counting from (a resumed checkpoint overrides it).",
    "start_epoch": "Epoch to start from (a resumed checkpoint overrides it).",
    "preemption_signal": "Signal name(s) or number(s) that stop the run at the next step boundary, after a "
    "checkpoint when a checkpoint hook is configured (exit status 75; 76 without one). Ctrl-C twice aborts at once "
    "(null: none).",
    "max_consecutive_skipped_steps": "Stop the run as diverged (exit status 3) after this many optimizer steps "
    "in a row were skipped by a veto or a GradScaler overflow (null: never).",
}


@attrs.frozen
class ValidationSection:
    """When to validate, on which weights, with which metrics."""

    every_n_epochs: int | None = attrs.field(
        default=1, validator=_positive_or_none, metadata=_doc("Validate after every N epochs (null: never).")
    )
    every_n_steps: int | None = attrs.field(
        default=None, validator=_positive_or_none, metadata=_doc("Also validate every N optimizer steps.")
    )
    use_ema: Auto = attrs.field(
        default="auto", metadata=_doc("Evaluate the EMA weights (`auto`: when an EMA hook is configured).")
    )
    use_mixed_precision: Auto = attrs.field(
        default="auto", metadata=_doc("Autocast during validation (`auto`: follow the mixed-precision hook).")
    )
    metrics: tuple[str, ...] = attrs.field(
        default=(),
        metadata=_doc("Metric names (`accuracy`) or import paths of `fn(outputs, targets) -> tensor`."),
    )

    @metrics.validator
    def _check_metrics(self, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        from nvtrain.builtin.metrics import BUILTIN_METRICS

        for name in value:
            if name in BUILTIN_METRICS or _IMPORT_PATH.match(name):
                continue
            close = difflib.get_close_matches(name, list(BUILTIN_METRICS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise FieldError(
                attribute.name,
                f"ValidationSection.metrics: {name!r} is neither a built-in metric ({', '.join(BUILTIN_METRICS)}) "
                f"nor an import path 'package.module:function'{hint}",
            )


@attrs.frozen
class LoggingConfig:
    """Progress, metrics file, TensorBoard and the final plot (all on rank 0 only)."""

    log_every_n_steps: int = attrs.field(
        default=10,
        validator=_positive,
        metadata=_doc("Read losses to the host every N optimizer steps (the only per-step host syncs)."),
    )
    progress_bar: bool = attrs.field(
        default=True, metadata=_doc("A tqdm bar on a terminal, plain log lines otherwise.")
    )
    csv: bool = attrs.field(default=True, metadata=_doc("Write `metrics.csv` in the run directory."))
    tensorboard: Auto = attrs.field(
        default="auto",
        metadata=_doc("TensorBoard event files in `<run_dir>/tensorboard` (`auto`: when `tensorboard` is installed)."),
    )
    plot: bool = attrs.field(
        default=True, metadata=_doc("Draw `curves.png` from `metrics.csv` when the run ends (needs `csv`).")
    )


@attrs.frozen
class HookConfig:
    """One hook: a plugin name, a built-in hook name, or an import path, with its settings.

    In YAML the settings sit beside the name: ``{name: ema, decay: 0.99}``; a bare
    string is a hook without settings.
    """

    name: str = attrs.field(validator=_non_empty)
    settings: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class RunConfig:
    """A whole training job. ``model`` and ``data`` are required; everything else has a default."""

    name: str | None = attrs.field(
        default=None,
        validator=_run_name,
        metadata=_doc("Run name: the run directory is `output_dir/name` (default: the config file's stem)."),
    )
    output_dir: str = attrs.field(
        default="runs", validator=_non_empty, metadata=_doc("Parent folder of run directories.")
    )
    seed: int = attrs.field(default=0, metadata=_doc("Seeds torch, numpy and random (each rank adds its rank)."))
    device: str = attrs.field(
        default="auto",
        metadata=_doc("`auto` (cuda:LOCAL_RANK when CUDA is available, else cpu), `cpu`, `cuda`, `cuda:1`..."),
    )
    cpu_threads: int | None = attrs.field(
        default=None,
        validator=_positive_or_none,
        metadata=_doc("`torch.set_num_threads` for the run (null: torch's default, one per core)."),
    )
    model: ModelConfig = attrs.field(metadata=_doc("The model factory (section `model`)."))
    data: DataConfig = attrs.field(metadata=_doc("The loader factory (section `data`)."))
    loss: LossConfig = attrs.field(factory=LossConfig, metadata=_doc("Section `loss`."))
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig, metadata=_doc("Section `optimizer`."))
    lr_scheduler: LRSchedulerConfig | None = attrs.field(
        default=None, metadata=_doc("Section `lr_scheduler` (null: constant LR).")
    )
    trainer: StepSchedulerConfig = attrs.field(
        factory=StepSchedulerConfig, metadata=_doc("Section `trainer`: run length, step windows, cadences, preemption.")
    )
    validation: ValidationSection = attrs.field(
        factory=ValidationSection, metadata=_doc("Section `validation`.")
    )
    logging: LoggingConfig = attrs.field(factory=LoggingConfig, metadata=_doc("Section `logging`."))
    hooks: tuple[HookConfig, ...] = attrs.field(
        default=(), metadata=_doc("Hooks in order: `- amp`, `- {name: ema, decay: 0.99}`.")
    )

    @device.validator
    def _check_device(self, attribute: attrs.Attribute[Any], value: str) -> None:
        if value == "auto":
            return
        import torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            raise FieldError(
                attribute.name,
                f"RunConfig.device must be 'auto' or a torch device like 'cpu', 'cuda:0' (got {value!r})",
            ) from None

    @property
    def run_dir(self) -> Path:
        """``output_dir / name`` (``name`` is filled in by :func:`load_config`)."""
        return Path(self.output_dir) / (self.name or "run")


#: The sections (attrs classes) of the schema, in reference order.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("", RunConfig),
    ("model", ModelConfig),
    ("data", DataConfig),
    ("loss", LossConfig),
    ("optimizer", OptimizerConfig),
    ("lr_scheduler", LRSchedulerConfig),
    ("trainer", StepSchedulerConfig),
    ("validation", ValidationSection),
    ("logging", LoggingConfig),
)


# -- cattrs converter ----------------------------------------------------------------------------


def _strict(expected: type, label: str) -> Any:
    def structure(value: Any, _: Any) -> Any:
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {label}, got {_describe(value)}")
        return value

    return structure


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


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
        raise TypeError(f"expected one of {shown}, got {_describe(value)}")

    converter.register_structure_hook_func(lambda t: typing.get_origin(t) is Literal, structure_literal)

    def structure_tuple(value: Any, cls: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {_describe(value)}")
        (item_type, _) = typing.get_args(cls)
        items, errors = [], []
        for index, item in enumerate(value):
            try:
                items.append(converter.structure(item, item_type))
            except Exception as err:  # noqa: BLE001 - gathered with its index, re-raised in one group below
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
            raise TypeError(f"expected a mapping of keyword arguments, got {_describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"keyword names must be strings, got {_describe(key)}")
        return dict(value)

    converter.register_structure_hook_func(lambda t: t == dict[str, Any], structure_kwargs)

    def structure_signal(value: Any, cls: Any) -> Any:
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise TypeError(f"expected a signal name, number or a list of them, got {_describe(value)}")
        return tuple(value) if isinstance(value, list) else value

    signal_type = typing.get_type_hints(StepSchedulerConfig)["preemption_signal"]
    converter.register_structure_hook_func(lambda t: t == signal_type, structure_signal)

    def structure_hook(value: Any, cls: Any) -> HookConfig:
        if isinstance(value, str):
            return HookConfig(name=value)
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a hook name or a mapping with 'name' and its settings, got {_describe(value)}")
        if "name" not in value:
            raise FieldError("name", f"a hook entry needs 'name' (got keys: {', '.join(map(str, value)) or 'none'})")
        name = value["name"]
        if not isinstance(name, str):
            raise FieldError("name", f"a hook name must be a string, got {_describe(name)}")
        settings = {k: v for k, v in value.items() if k != "name"}
        for key in settings:
            if not isinstance(key, str):
                raise TypeError(f"hook setting names must be strings, got {_describe(key)}")
        return HookConfig(name=name, settings=settings)

    converter.register_structure_hook(HookConfig, structure_hook)
    converter.register_unstructure_hook(HookConfig, lambda hook: {"name": hook.name, **hook.settings})

    def section_factory(cls: type) -> Any:
        inner: Any = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=True)

        def structure(value: Any, _: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected a mapping (section {cls.__name__}), got {_describe(value)}")
            return inner(value, cls)

        return structure

    converter.register_structure_hook_factory(
        lambda t: attrs.has(t) and t is not HookConfig, section_factory
    )
    converter.register_unstructure_hook(tuple, lambda value: [converter.unstructure(v) for v in value])
    return converter


_CONVERTER: Any = None


def converter() -> Any:
    """The shared cattrs converter (built on first use: cattrs is an optional dependency)."""
    global _CONVERTER
    if _CONVERTER is None:
        _CONVERTER = _make_converter()
    return _CONVERTER


# -- YAML with locations ---------------------------------------------------------------------------


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as err:
        raise ImportError("nvtrain's config files need PyYAML: pip install 'nvtrain[cli]'") from err
    return yaml


_LOADER: Any = None
# YAML 1.1 reads ``1e-3`` (no dot) as a string; learning rates are written that way.
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)


def _loader_class() -> Any:
    global _LOADER
    if _LOADER is None:
        yaml = _yaml()

        class Loader(yaml.SafeLoader):  # type: ignore[misc,name-defined]
            """SafeLoader that also reads ``1e-3`` as a float."""

        Loader.yaml_implicit_resolvers = {
            key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
            for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }
        Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
        _LOADER = Loader
    return _LOADER


def _parse_yaml(text: str, source: str) -> tuple[Any, dict[ConfigPath, str]]:
    """Parse ``text``; return the data and the ``file:line:col`` of every key and list item."""
    yaml = _yaml()
    loader = _loader_class()(text)
    locations: dict[ConfigPath, str] = {}
    try:
        node = loader.get_single_node()
        data = {} if node is None else _construct(loader, node, (), locations, source)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = _mark(source, mark) if mark is not None else source
        raise ConfigError(f"invalid YAML: {err.problem or err.context}", location=where) from None
    finally:
        loader.dispose()
    return data, locations


def _mark(source: str, mark: Any) -> str:
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


def _construct(loader: Any, node: Any, path: ConfigPath, locations: dict[ConfigPath, str], source: str) -> Any:
    yaml = _yaml()
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ConfigError(
                    f"keys must be names, got {_describe(key)}", path=path, location=_mark(source, key_node.start_mark)
                )
            if key in result:
                raise ConfigError(
                    f"duplicate key {key!r} (first at {locations[(*path, key)]})",
                    path=path,
                    location=_mark(source, key_node.start_mark),
                )
            locations[(*path, key)] = _mark(source, key_node.start_mark)
            result[key] = _construct(loader, value_node, (*path, key), locations, source)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            locations[(*path, index)] = _mark(source, item.start_mark)
            items.append(_construct(loader, item, (*path, index), locations, source))
        return items
    return loader.construct_object(node, deep=True)


# -- overrides -------------------------------------------------------------------------------------


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], locations: dict[ConfigPath, str]
) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings (values parsed as YAML) to raw config data, in order.

    List items are addressed by index (``hooks.0.decay``) or, for hooks, by name
    (``hooks.ema.decay``). Missing sections are created; unknown keys are caught
    when the result is structured, with the ``--set`` argument as location.
    """
    for override in overrides:
        where = f"--set {override}"
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".") if key.strip() else []
        if not sep or not parts or any(not p for p in parts):
            raise ConfigError("expected --set key.subkey=value, e.g. --set trainer.max_steps=200", location=where)
        value, _ = _parse_yaml(raw, where) if raw.strip() else (None, {})
        node: Any = data
        path: list[str | int] = []
        for part in parts[:-1]:
            node, step = _descend(node, part, path, where)
            path.append(step)
        last = parts[-1]
        if isinstance(node, list):
            index = _list_index(node, last, path, where)
            node[index] = value
            path.append(index)
        elif isinstance(node, dict):
            node[last] = value
            path.append(last)
        else:
            raise ConfigError(f"cannot set {last!r} inside {_describe(node)}", path=tuple(path), location=where)
        prefix = tuple(path)
        for known in [p for p in locations if p[: len(prefix)] == prefix]:
            del locations[known]
        locations[prefix] = where
    return data


def _descend(node: Any, part: str, path: list[str | int], where: str) -> tuple[Any, str | int]:
    if isinstance(node, list):
        index = _list_index(node, part, path, where)
        if not isinstance(node[index], dict):
            node[index] = {"name": node[index]} if isinstance(node[index], str) else {}
        return node[index], index
    if isinstance(node, dict):
        child = node.get(part)
        if not isinstance(child, (dict, list)):
            child = node[part] = {}
        return child, part
    raise ConfigError(f"cannot descend into {_describe(node)} with {part!r}", path=tuple(path), location=where)


def _list_index(items: list[Any], part: str, path: list[str | int], where: str) -> int:
    if part.lstrip("-").isdigit():
        index = int(part)
        if not -len(items) <= index < len(items):
            raise ConfigError(
                f"index {index} is out of range (the list has {len(items)} items)", path=tuple(path), location=where
            )
        return index % len(items)
    names = [_hook_name(item) for item in items]
    if part in names:
        return names.index(part)
    close = difflib.get_close_matches(part, [n for n in names if n], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"no item named {part!r}{hint} (items: {', '.join(n or '?' for n in names) or 'none'})",
        path=tuple(path),
        location=where,
    )


def _hook_name(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        return str(item["name"])
    return None


# -- loading ---------------------------------------------------------------------------------------


@attrs.frozen
class LoadedConfig:
    """A structured config plus where it came from, so later checks can point at lines too."""

    config: RunConfig
    #: The file name, or :data:`BUILTIN_SOURCE`.
    source: str
    #: The config file's folder (import paths are also resolved from there), or None.
    directory: Path | None
    locations: Mapping[ConfigPath, str] = attrs.field(factory=dict, repr=False)

    def locate(self, path: Sequence[str | int]) -> str:
        """The nearest recorded location of ``path`` (or of its closest parent)."""
        key = tuple(path)
        while key:
            if key in self.locations:
                return self.locations[key]
            key = key[:-1]
        return self.source

    def error(self, message: str, path: Sequence[str | int] = ()) -> ConfigError:
        """A :class:`ConfigError` placed at ``path``."""
        return ConfigError(message, path=tuple(path), location=self.locate(path))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> LoadedConfig:
    """Read ``path`` (the built-in config when None), apply ``--set`` overrides, structure it.

    Raises :class:`ConfigError` for anything wrong, with its location.
    """
    if path is None:
        from nvtrain.builtin import default_config_text

        text, source, directory, stem = default_config_text(), BUILTIN_SOURCE, None, "digits"
    else:
        file = Path(path)
        source = str(path)
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError("no such config file", location=source) from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read the config file ({type(err).__name__}: {err})", location=source) from None
        directory, stem = file.resolve().parent, file.stem
    data, locations = _parse_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"a config file holds a mapping of sections, got {_describe(data)}", location=source)
    data = apply_overrides(data, overrides, locations)
    loaded = LoadedConfig(config=None, source=source, directory=directory, locations=locations)  # type: ignore[arg-type]
    config = _structure(data, loaded)
    if config.name is None:
        config = attrs.evolve(config, name=stem)
    return attrs.evolve(loaded, config=config)


def _structure(data: dict[str, Any], loaded: LoadedConfig) -> RunConfig:
    from cattrs.errors import BaseValidationError

    structure = converter().structure
    try:
        return structure(data, RunConfig)  # type: ignore[no-any-return]
    except BaseValidationError as err:  # cattrs' per-field errors, turned into one located ConfigError
        problems = list(_problems(err, ()))
        # A misspelt key with a suggestion first: it often explains the others ("missing max_steps").
        problems.sort(key=lambda problem: "did you mean" not in problem[1])
        path, message = problems[0]
        if len(problems) > 1:
            others = "; ".join(f"{loaded.locate(p)}: {format_path(p) + ': ' if p else ''}{m}" for p, m in problems[1:])
            message += f" (and {len(problems) - 1} more: {others})"
        raise loaded.error(message, path) from None


def _problems(err: BaseException, path: ConfigPath) -> Iterator[tuple[ConfigPath, str]]:
    """Flatten cattrs' exception groups into ``(path, message)`` pairs, in the file's order."""
    from cattrs.errors import BaseValidationError, ForbiddenExtraKeysError

    if isinstance(err, BaseValidationError):
        for sub in err.exceptions:
            yield from _problems(sub, (*path, *_note_path(sub)))
        return
    if isinstance(err, ForbiddenExtraKeysError):
        valid = [a.name for a in attrs.fields(err.cl)]
        for key in sorted(err.extra_fields):
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (valid keys: {', '.join(valid)})"
            yield (*path, key), f"unknown key {key!r} in {_section_label(err.cl)}{hint}"
        return
    if isinstance(err, FieldError):
        yield (*path, err.field), str(err)
        return
    if isinstance(err, TypeError) and "missing" in str(err) and "required" in str(err):
        names = re.findall(r"'(\w+)'", str(err))
        yield path, f"missing required key{'s' if len(names) > 1 else ''}: {', '.join(names)}"
        return
    if isinstance(err, (TypeError, ValueError, KeyError)):
        text = str(err) if not isinstance(err, KeyError) else f"missing required key {err.args[0]!r}"
        named = _NAMED_FIELD.match(text)  # attrs validators name "Class.field" (the project's style)
        yield ((*path, named.group(1)) if named and not _note_path(err) else path), text
        return
    raise err


_NAMED_FIELD = re.compile(r"^[A-Z]\w*\.(\w+)\b")


def _note_path(err: BaseException) -> ConfigPath:
    """The attribute or index cattrs attached to ``err`` as a note."""
    for note in getattr(err, "__notes__", ()):
        name = getattr(note, "name", None)
        if name is not None:
            return (name,)
        index = getattr(note, "index", None)
        if index is not None:
            return (index,)
    return ()


def _section_label(cls: type) -> str:
    for name, section in SECTIONS:
        if section is cls:
            return f"section '{name}'" if name else "the top level"
    return cls.__name__


# -- output ---------------------------------------------------------------------------------------


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML, in schema order (what ``--print-config`` shows)."""
    yaml = _yaml()
    data = converter().unstructure(config)
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=False))


# -- import paths --------------------------------------------------------------------------------


def resolve_import_path(spec: str, search_dirs: Sequence[Path] = ()) -> Any:
    """Import ``package.module:attr.sub``; ``search_dirs`` are tried for modules not installed.

    Raises ImportError/AttributeError with a message naming ``spec``.
    """
    module_name, _, attr_path = spec.partition(":")
    try:
        module = _import_module(module_name, search_dirs)
    except ModuleNotFoundError as err:
        if err.name and not module_name.startswith(err.name) and err.name != module_name:
            raise ImportError(f"importing {module_name!r} for {spec!r} failed: {err}") from err
        where = f" (also looked in {', '.join(str(d) for d in search_dirs)})" if search_dirs else ""
        raise ImportError(f"cannot import module {module_name!r} for {spec!r}{where}") from None
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AttributeError(f"{module_name!r} has no attribute {attr_path!r} ({spec!r}){hint}") from None
    return target


def _import_module(name: str, search_dirs: Sequence[Path]) -> Any:
    added = [str(d) for d in search_dirs if str(d) not in sys.path]
    sys.path[:0] = added
    try:
        return importlib.import_module(name)
    finally:
        for entry in added:
            if entry in sys.path:
                sys.path.remove(entry)


# -- reference --------------------------------------------------------------------------------


def _type_label(annotation: Any) -> str:
    """A YAML-minded name of a field type: ``list[str]``, ``int | null``, ``section``."""
    if attrs.has(annotation):
        return "section"
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("NoneType", "null").replace("None", "null")
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"\b[\w.]+\.(\w+Config)\b", r"\1", text)
    text = re.sub(r"tuple\[(.+), \.\.\.\]", r"list[\1]", text)
    text = text.replace("dict[str, Any]", "mapping").replace("Literal[True, False, 'auto']", "true | false | auto")
    text = re.sub(r"Literal\[([^\]]+)\]", lambda m: " | ".join(v.strip(" '") for v in m.group(1).split(",")), text)
    text = text.replace("list[HookConfig]", "list of hooks")
    for _, cls in SECTIONS:
        text = text.replace(cls.__name__, "section")
    return text.replace("|", "\\|")


def _default_label(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        value = default.factory()  # type: ignore[attr-defined,union-attr]
        if attrs.has(type(value)):
            return "see below"
        default = value
    if default is None:
        return "`null`"
    if default is True or default is False:
        return f"`{str(default).lower()}`"
    if isinstance(default, (tuple, list)):
        return "`[]`" if not default else f"`{list(default)}`"
    if isinstance(default, dict):
        return "`{}`" if not default else f"`{default}`"
    return f"`{default}`"


def reference_markdown() -> str:
    """The config reference tables of ``docs/cli.md``, generated from the attrs classes."""
    lines: list[str] = []
    types = typing.get_type_hints
    for section, cls in SECTIONS:
        hints = types(cls)
        title = f"`{section}`" if section else "top level"
        lines += [f"#### {title}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for field in attrs.fields(cls):
            help_text = field.metadata.get("help") or (TRAINER_HELP.get(field.name, "") if section == "trainer" else "")
            lines.append(
                f"| `{field.name}` | {_type_label(hints[field.name])} | {_default_label(field)} | {help_text} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
