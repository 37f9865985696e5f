"""From a :class:`~nvtrain.config.RunConfig` to a finished run: what ``nvtrain train`` does.

:func:`prepare` checks everything a config names without building a model or
touching the disk: import paths resolve, keyword arguments fit the factories'
signatures, hook names exist and their settings pass the hooks' own
validators. Only then does :func:`train` create the run directory, build the
model and loaders, and run a :class:`~nvtrain.TrainingStrategy`.

Exit statuses (documented in ``docs/cli.md``): :data:`EXIT_OK`,
:data:`EXIT_FAILURE` (training raised; the traceback is printed),
:data:`EXIT_USAGE` (bad config, arguments or resume; one line on stderr),
:data:`EXIT_DIVERGED` (too many skipped steps in a row),
:data:`EXIT_PREEMPTED` (a preemption signal stopped the run after a
checkpoint; run the same command again to resume),
:data:`EXIT_PREEMPTED_UNSAVED` (stopped by a preemption signal, nothing saved)
and :data:`EXIT_INTERRUPTED` (a second Ctrl-C).
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import logging
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from nvtrain.config import LoadedConfig, RunConfig, resolve_import_path
from nvtrain.config.errors import field_of
from nvtrain.errors import ResumeError, naming_file
from nvtrain.hook import AveragesWeights, Hook, ProvidesAutocast, SavesCheckpoints, accumulating_hook
from nvtrain.hookspecs import hookimpl
from nvtrain.validators import FieldProblem

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_UNSAVED",
    "EXIT_USAGE",
    "Built",
    "Plan",
    "TrainOutcome",
    "build",
    "build_from_checkpoint",
    "builtin_hook_classes",
    "config_import_paths",
    "prepare",
    "train",
    "trusted_packages",
]

logger = logging.getLogger(__name__)

#: The run finished (all epochs or ``max_steps``).
EXIT_OK = 0
#: Training raised an exception (its traceback is printed).
EXIT_FAILURE = 1
#: The config, the command line or the checkpoint to resume from is wrong; nothing was trained or written.
EXIT_USAGE = 2
#: The run stopped as diverged: ``trainer.max_consecutive_skipped_steps`` steps in a row were skipped.
EXIT_DIVERGED = 3
#: A preemption signal stopped the run after a checkpoint (``EX_TEMPFAIL``): requeue and rerun to resume.
EXIT_PREEMPTED = 75
#: A preemption signal stopped the run but no checkpoint hook saved it: a rerun starts from step 0.
EXIT_PREEMPTED_UNSAVED = 76
#: A second Ctrl-C aborted the run at once (128 + SIGINT, the shell's convention).
EXIT_INTERRUPTED = 130

#: Hook constructor parameters that name an output location, and where they default to in the run directory.
_OUTPUT_PARAMETERS = {"checkpoint_dir": "checkpoints", "output_dir": None, "log_dir": None}


@attrs.frozen
class Plan:
    """A checked config: every import resolved and every hook built, nothing else done yet."""

    loaded: LoadedConfig
    model_factory: Callable[..., Any]
    data_factory: Callable[..., Any]
    loss_fn: Callable[..., Any]
    optimizer_factory: Callable[..., Any]
    scheduler_factory: Callable[..., Any] | None
    #: Scheduler keyword names the run's step count fills in (``T_max``, ``total_steps``).
    scheduler_total_steps: tuple[str, ...]
    forward_fn: Callable[..., Any] | None
    metrics: dict[str, Callable[..., Any]]
    hooks: tuple[object, ...]
    use_ema: bool

    @property
    def config(self) -> RunConfig:
        return self.loaded.config

    @property
    def run_dir(self) -> Path:
        return self.loaded.config.run_dir


@attrs.frozen
class TrainOutcome:
    """What :func:`train` reports besides the exit status."""

    exit_code: int
    run_dir: Path
    result: Any
    seconds: float


# -- checking ---------------------------------------------------------------------------------------


def prepare(loaded: LoadedConfig, *, world_size: int | None = None) -> Plan:
    """Check ``loaded`` completely without training or writing; raise a located ConfigError.

    ``world_size`` (default: ``WORLD_SIZE`` from the environment) decides whether the
    DDP plugin is added for a torchrun launch.
    """
    config = loaded.config
    search = [loaded.directory] if loaded.directory is not None else []
    search.append(Path.cwd())

    def resolve(spec: str, path: tuple[str | int, ...]) -> Any:
        try:
            return resolve_import_path(spec, search)
        except (ImportError, AttributeError) as err:
            raise loaded.error(str(err), path) from None

    model_factory = resolve(config.model.factory, ("model", "factory"))
    _check_call(loaded, model_factory, (), config.model.kwargs, ("model",), config.model.factory)
    data_factory = resolve(config.data.factory, ("data", "factory"))
    _check_call(loaded, data_factory, (), config.data.kwargs, ("data",), config.data.factory)
    loss = resolve(config.loss.function, ("loss", "function"))
    _check_call(loaded, loss, ("outputs", "targets"), config.loss.kwargs, ("loss",), config.loss.function)
    loss_fn = functools.partial(loss, **config.loss.kwargs) if config.loss.kwargs else loss
    optimizer_cls = resolve(config.optimizer.factory, ("optimizer", "factory"))
    _check_call(loaded, optimizer_cls, ("params",), config.optimizer.kwargs, ("optimizer",), config.optimizer.factory)
    optimizer_factory = functools.partial(optimizer_cls, **config.optimizer.kwargs)
    scheduler_factory: Callable[..., Any] | None = None
    fills: tuple[str, ...] = ()
    if config.lr_scheduler is not None:
        from nvtrain.schedules import ALIASES

        section = config.lr_scheduler
        scheduler_cls = resolve(ALIASES.get(section.factory, section.factory), ("lr_scheduler", "factory"))
        accepted = _parameters(scheduler_cls)
        fills = tuple(name for name in ("T_max", "total_steps") if name in accepted and name not in section.kwargs)
        filled = dict(section.kwargs, **{name: 1 for name in fills})
        _check_call(loaded, scheduler_cls, ("optimizer",), filled, ("lr_scheduler",), section.factory)
        _check_schedule(loaded, scheduler_cls)
        scheduler_factory = functools.partial(scheduler_cls, **section.kwargs)
    forward_fn = None
    if config.model.forward_fn is not None:
        forward_fn = resolve(config.model.forward_fn, ("model", "forward_fn"))
        if not callable(forward_fn):
            raise loaded.error(f"{config.model.forward_fn!r} is not callable", ("model", "forward_fn"))
    metrics = _metrics(loaded, resolve)
    hooks = list(_build_hooks(loaded, search))
    if (world_size if world_size is not None else _env_world_size()) > 1 and not any(
        getattr(h, "plugin_name", None) == "ddp" or getattr(h, "data_parallel", False) is True for h in hooks
    ):
        hooks.append(_load_plugin(loaded, "ddp", {}, ("hooks",), for_what="a torchrun launch (WORLD_SIZE > 1)"))
    hooks += _logging_hooks(loaded)
    averaging = any(isinstance(h, AveragesWeights) for h in hooks)
    use_ema = config.validation.use_ema
    if use_ema is True and not averaging:
        raise loaded.error(
            "use_ema is true but no EMA hook is configured (add `- ema` to hooks)", ("validation", "use_ema")
        )
    if config.validation.use_mixed_precision is True and not any(isinstance(h, ProvidesAutocast) for h in hooks):
        raise loaded.error(
            "use_mixed_precision is true but no mixed-precision hook is configured "
            "(add `- amp` to hooks, or set it to auto or false)",
            ("validation", "use_mixed_precision"),
        )
    _check_monitors(loaded, metrics, hooks)
    if config.device != "auto" and torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise loaded.error(f"device {config.device!r} asked for CUDA, which this machine does not have", ("device",))
    return Plan(
        loaded=loaded,
        model_factory=model_factory,
        data_factory=data_factory,
        loss_fn=loss_fn,
        optimizer_factory=optimizer_factory,
        scheduler_factory=scheduler_factory,
        scheduler_total_steps=fills,
        forward_fn=forward_fn,
        metrics=metrics,
        hooks=tuple(hooks),
        use_ema=averaging if use_ema == "auto" else bool(use_ema),
    )


def _check_schedule(loaded: LoadedConfig, scheduler_cls: Any) -> None:
    """Refuse what a metric-driven scheduler cannot do: follow a warmup, or step per epoch."""
    section = loaded.config.lr_scheduler
    assert section is not None
    plateau = isinstance(scheduler_cls, type) and issubclass(scheduler_cls, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not plateau and section.monitor is None:
        return
    what = f"{section.factory} is stepped after each validation with validation value {section.monitor or 'loss'!r}"
    if section.warmup_steps:
        raise loaded.error(
            f"{what}: it cannot follow a warmup (set warmup_steps to 0, or use a step or epoch schedule)",
            ("lr_scheduler", "warmup_steps"),
        )
    if section.interval == "epoch":
        raise loaded.error(
            f"{what}: interval 'epoch' does not apply (leave it out; validate every epoch to step it once per epoch)",
            ("lr_scheduler", "interval"),
        )


def _validation_keys(metrics: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of every validation summary of a run with these metrics (what a ``monitor`` may name)."""
    return ("loss", *metrics, "num_samples")


def _check_monitors(loaded: LoadedConfig, metrics: Mapping[str, Any], hooks: Sequence[object]) -> None:
    """Refuse a ``monitor`` that names no key of the validation summary, before the first validation would.

    The summary holds ``loss``, the configured metrics and ``num_samples``. The LR
    scheduler steps before any hook sees it, so its check is exact; early stopping
    reads it after other hooks' ``after_validation``, so its check is skipped when a
    hook from outside nvtrain and its plugins could have added a key by then.
    """
    from nvtrain.hooks import EarlyStoppingHook

    keys = _validation_keys(metrics)
    section = loaded.config.lr_scheduler
    if section is not None and section.monitor is not None and section.monitor not in keys:
        raise loaded.error(_unknown_monitor(section.monitor, keys), ("lr_scheduler", "monitor"))
    if any(_may_extend_summary(h) for h in hooks):
        return
    for index, hook in enumerate(hooks[: len(loaded.config.hooks)]):
        if isinstance(hook, EarlyStoppingHook) and hook.monitor not in keys:
            raise loaded.error(_unknown_monitor(hook.monitor, keys), ("hooks", index, "monitor"))


def _may_extend_summary(hook: object) -> bool:
    """A hook from outside nvtrain and the plugins it ships that runs at AFTER_VALIDATION (an
    ``after_validation`` method, or a seed-style Hook listing the stage): it may add summary keys."""
    from nvtrain.hooks import PLUGIN_HOOK_CLASSES
    from nvtrain.stages import TrainingStage

    shipped = {"nvtrain", *(module for _, module in PLUGIN_HOOK_CLASSES.values())}
    if type(hook).__module__.partition(".")[0] in shipped:
        return False
    seed_style = isinstance(hook, Hook) and TrainingStage.AFTER_VALIDATION in tuple(hook.stages)
    return seed_style or callable(getattr(hook, "after_validation", None))


def _unknown_monitor(name: str, keys: Sequence[str]) -> str:
    bare = re.sub(r"^val_(ema_)?", "", name)
    close = [bare] if bare in keys else difflib.get_close_matches(name, keys, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (
        f"monitor {name!r} is not a key of the validation summary, which has: {', '.join(keys)}{hint} "
        "(a metric must be listed in validation.metrics; the logs' val_ / val_ema_ prefix is not part of the key)"
    )


def _parameters(target: Any) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return {}


def _check_call(
    loaded: LoadedConfig,
    target: Any,
    positional: Sequence[str],
    kwargs: Mapping[str, Any],
    section: tuple[str, ...],
    spec: str,
) -> None:
    """Refuse keyword arguments ``target`` cannot take, pointing at the offending key."""
    if not callable(target):
        raise loaded.error(f"{spec!r} is not callable (got {type(target).__name__})", (*section, "factory"))
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*positional, **kwargs)
    except TypeError as err:
        accepted = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in positional
        ]
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        for key in kwargs:
            if key not in accepted and not has_var_kw:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f" (it accepts: {', '.join(accepted) or 'none'})"
                raise loaded.error(f"{spec} takes no argument {key!r}{hint}", (*section, "kwargs", key)) from None
        raise loaded.error(f"{spec} cannot be called with these kwargs: {err}", (*section, "kwargs")) from None


def _metrics(loaded: LoadedConfig, resolve: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    from nvtrain.builtin.metrics import BUILTIN_METRICS

    metrics: dict[str, Callable[..., Any]] = {}
    for index, name in enumerate(loaded.config.validation.metrics):
        spec = BUILTIN_METRICS.get(name, name)
        function = resolve(spec, ("validation", "metrics", index))
        key = name if name in BUILTIN_METRICS else spec.rpartition(":")[2].rpartition(".")[2]
        if key in metrics:
            raise loaded.error(f"two metrics are named {key!r}", ("validation", "metrics", index))
        metrics[key] = function
    return metrics


def builtin_hook_classes() -> dict[str, type]:
    """Built-in hooks a config can name, by their ``plugin_name`` (``clip``, ``accumulate``...)."""
    import nvtrain.hooks as builtin

    classes: dict[str, type] = {}
    for class_name in builtin.__all__:
        cls = getattr(builtin, class_name)
        name = getattr(cls, "plugin_name", None)
        if isinstance(name, str):
            classes[name] = cls
    return classes


def _build_hooks(loaded: LoadedConfig, search: Sequence[Path]) -> list[object]:
    from nvtrain import plugins

    builtin = builtin_hook_classes()
    listed = plugins.available()
    installed = {info.name for info in listed if info.status != plugins.PluginStatus.MISSING}
    missing = sorted(info.name for info in listed if info.status == plugins.PluginStatus.MISSING)
    hooks = []
    for index, entry in enumerate(loaded.config.hooks):
        path = ("hooks", index)
        name, settings = entry.name, dict(entry.settings)
        plugin = name.partition(":")[0]
        if name in builtin:
            cls = builtin[name]
            settings = _default_outputs(cls, settings, loaded.config.run_dir, name)
            hooks.append(_construct(loaded, path, name, functools.partial(plugins_build, cls, settings, name)))
        elif plugin in installed:
            hooks.append(_load_plugin(loaded, name, settings, path))
        elif ":" in name:
            try:
                cls = resolve_import_path(name, search)
            except (ImportError, AttributeError) as err:
                raise loaded.error(str(err), (*path, "name")) from None
            settings = _default_outputs(cls, settings, loaded.config.run_dir, name.rpartition(":")[2])
            hooks.append(_construct(loaded, path, name, functools.partial(plugins_build, cls, settings, name)))
        else:
            raise loaded.error(_unknown_hook(name, builtin, installed, missing), (*path, "name"))
    return hooks


def _unknown_hook(name: str, builtin: Mapping[str, type], installed: set[str], missing: Sequence[str]) -> str:
    """Why ``name`` names no hook: a typo, or a plugin the ``NVTRAIN_PLUGINS`` allow-list hides."""
    from nvtrain.plugins import ALLOW_LIST_ENV, allow_list

    allowed = allow_list()
    if allowed is not None and name in {record.name for record in _all_entry_points()}:
        return (
            f"hook {name!r} is an installed plugin that {ALLOW_LIST_ENV}={','.join(allowed)} does not allow "
            f"(add it to {ALLOW_LIST_ENV}, or unset it)"
        )
    known = sorted({*builtin, *installed})
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    not_installed = f"; named in {ALLOW_LIST_ENV} but not installed: {', '.join(missing)}" if missing else ""
    return (
        f"unknown hook {name!r}{hint} (installed plugins: {', '.join(sorted(installed)) or 'none'}{not_installed}; "
        f"built-in hooks: {', '.join(sorted(builtin))}; or an import path 'package.module:HookClass')"
    )


def _all_entry_points() -> Sequence[Any]:
    from nvtrain.plugins import entry_points

    return entry_points()


def plugins_build(cls: type, settings: Mapping[str, Any], name: str) -> Any:
    """Build a built-in or import-path hook the way plugins are built (unknown settings named)."""
    from nvtrain.plugins import build_hook

    return build_hook(cls, settings, label=f"hook {name!r}")


def _load_plugin(
    loaded: LoadedConfig,
    name: str,
    settings: dict[str, Any],
    path: tuple[str | int, ...],
    for_what: str | None = None,
) -> Any:
    from nvtrain import plugins

    try:
        cls = plugins.hook_class(name)
    except plugins.PluginError as err:
        why = f"{for_what} needs plugin {name!r}: " if for_what else ""
        raise loaded.error(f"{why}{err}", path) from None
    settings = _default_outputs(cls, settings, loaded.config.run_dir, name.partition(":")[0])
    return _construct(loaded, path, name, lambda: plugins.load(name, **settings))


def _construct(loaded: LoadedConfig, path: tuple[str | int, ...], name: str, build: Callable[[], Any]) -> Any:
    from nvtrain.plugins import PluginError, PluginSettingsError

    try:
        return build()
    except PluginError as err:
        unknown = err.unknown if isinstance(err, PluginSettingsError) else ()
        raise loaded.error(str(err), (*path, unknown[0]) if unknown else path) from None
    except FieldProblem as err:  # the hook's own validators and converters say which field refused what
        raise loaded.error(f"hook {name!r}: {err}", (*path, err.field) if err.field else path) from None
    except (TypeError, ValueError) as err:  # a hook from elsewhere whose checks raise plain errors
        field = field_of(err)
        raise loaded.error(f"hook {name!r}: {err}", (*path, field) if field else path) from None


def _default_outputs(cls: type, settings: dict[str, Any], run_dir: Path, name: str) -> dict[str, Any]:
    """Output locations a hook takes but the config leaves out go inside the run directory."""
    parameters = _parameters(cls)
    for parameter, folder in _OUTPUT_PARAMETERS.items():
        if parameter in parameters and parameter not in settings:
            settings[parameter] = str(run_dir / (folder or name))
    return settings


def _logging_hooks(loaded: LoadedConfig) -> list[object]:
    from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook, TensorBoardHook, tensorboard_available

    section = loaded.config.logging
    run_dir = loaded.config.run_dir
    every = section.log_every_n_steps
    hooks: list[object] = []
    if section.progress_bar:
        hooks.append(ProgressBarHook(log_every_n_steps=every))
    if section.csv:
        hooks.append(CSVLoggerHook(run_dir / "metrics.csv", log_every_n_steps=every))
    elif section.plot:
        raise loaded.error("plot needs the metrics file: set logging.csv to true or plot to false", ("logging", "plot"))
    if section.tensorboard is True or (section.tensorboard == "auto" and tensorboard_available()):
        try:
            hooks.append(TensorBoardHook(run_dir / "tensorboard"))  # the step scheduler's log_remote_every_steps
        except ImportError as err:
            raise loaded.error(str(err), ("logging", "tensorboard")) from None
    return hooks


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


# -- building ---------------------------------------------------------------------------------------------


@attrs.define
class Built:
    """Everything ``train`` builds before the first step: the strategy, its loaders, the resume decision."""

    strategy: Any
    train_loader: Any
    watch: _RunWatch
    #: Optimizer steps of the whole run (None when the loader has no len() and no max_steps is set).
    run_length: int | None
    #: The checkpoint the run resumes from, its step, and the config changes since it was written.
    resume_from: Path | None = None
    resume_step: int = 0
    changes: list[Any] = attrs.field(factory=list)
    #: The resolved config as written to ``config.yaml`` (changes of no effect reverted).
    effective_config: dict[str, Any] = attrs.field(factory=dict)


def build(
    plan: Plan, manager: Any = None, *, strategy_cls: type | None = None, overrides: Mapping[str, Any] | None = None
) -> Built:
    """Build model, loaders, optimizer, LR scheduler, hooks and the strategy; decide the resume.

    Nothing is trained and nothing is written. A factory that refuses its arguments
    (``lr=-1``, ``batch_size=0``), a hook stack that cannot be composed (two
    mixed-precision hooks), an empty training loader, a corrupt checkpoint to resume
    from, or a config change a resume cannot honour raises a located
    :class:`~nvtrain.config.ConfigError`: ``nvtrain validate`` and ``nvtrain train``
    report it in one line with exit status 2. ``strategy_cls`` and ``overrides`` (constructor
    arguments that replace the config's) serve ``TrainingStrategy.load_checkpoint``.
    """
    from nvtrain.strategy import TrainingStrategy
    from nvtrain.validation import ValidationConfig

    loaded, config = plan.loaded, plan.config
    rank = manager.rank if manager is not None else 0
    world_size = manager.world_size if manager is not None else 1
    model = _constructing(loaded, ("model",), config.model.factory, lambda: _build_model(plan))
    if not isinstance(model, torch.nn.Module):
        raise loaded.error(
            f"{config.model.factory} returned {type(model).__name__}, not a torch.nn.Module", ("model", "factory")
        )
    data = _constructing(loaded, ("data",), config.data.factory, lambda: plan.data_factory(**config.data.kwargs))
    try:
        train_loader, val_loader = _split_loaders(data, config.data.factory)
    except TypeError as err:
        raise loaded.error(str(err), ("data", "factory")) from None
    if _length(train_loader) == 0:
        raise loaded.error(
            f"{config.data.factory} returned an empty training loader (len() == 0): no batch to train on",
            ("data",),
        )
    try:
        run_length, run_epochs = _run_bounds(config, train_loader, world_size, accumulation=_accumulation(plan))
    except ValueError as err:  # the step scheduler's own checks (global_batch_size a multiple of ...)
        raise loaded.error(str(err), ("trainer",)) from None
    _check_accumulation(plan, train_loader, world_size)
    if plan.scheduler_total_steps:
        _check_horizon(plan, run_length, run_epochs)
    _check_metric_schedule(plan, val_loader)
    # The optimizer and scheduler factories, tried once on the model's parameters (the strategy builds
    # the real ones after SETUP, on the possibly wrapped model): their own checks run here.
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise loaded.error(f"{config.model.factory} built a model with no trainable parameters", ("model",))
    optimizer = _constructing(loaded, ("optimizer",), config.optimizer.factory, lambda: plan.optimizer_factory(params))
    fresh: dict[str, dict[str, Any]] = {}
    holder: dict[str, Any] = {}
    schedulers = None
    if plan.scheduler_factory is not None:
        section = config.lr_scheduler
        assert section is not None
        horizon = _horizon(plan, run_length, run_epochs)
        _constructing(loaded, ("lr_scheduler",), section.factory, lambda: _schedule(plan, horizon)(optimizer))
        schedulers = _scheduler_factory(plan, holder, fresh)
    validation = None
    section_v = config.validation
    if val_loader is not None:  # the trainer's val_every_steps and validate_on_checkpoint validate as well
        validation = ValidationConfig(
            data=val_loader,
            every_n_steps=section_v.every_n_steps,
            every_n_epochs=section_v.every_n_epochs,
            use_mixed_precision=section_v.use_mixed_precision,
            use_ema=plan.use_ema,
            metrics=plan.metrics,
        )
    strategy = _constructing(
        loaded,
        ("hooks",),
        "the training strategy",
        lambda: (strategy_cls or TrainingStrategy)(
            **{
                "models": model,
                "optimizers": plan.optimizer_factory,
                "loss_fn": plan.loss_fn,
                "lr_schedulers": schedulers,
                "forward_fn": plan.forward_fn,
                "hooks": plan.hooks,
                "device": None if config.device == "auto" else config.device,
                "validation": validation,
                "step_scheduler": config.trainer,
                "distributed_manager": manager,
                **(overrides or {}),
            }
        ),
    )
    holder["strategy"] = strategy
    watch = _RunWatch(plan, rank)
    strategy.register_hook(watch)
    built = Built(strategy=strategy, train_loader=train_loader, watch=watch, run_length=run_length)
    _plan_resume(plan, built, rank, world_size, fresh)
    watch.effective_config = built.effective_config
    return built


# -- a checkpoint on its own ------------------------------------------------------------------------------

#: Top-level packages whose import paths a checkpoint's run config may always name.
TRUSTED_PACKAGES = ("torch", "nvtrain")


def config_import_paths(run_config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(config key, "module:attr")`` for every import path a resolved run config names; imports nothing.

    Built-in names (a schedule alias, a built-in metric) count as the path they stand
    for; a hook named by a built-in or installed plugin name is no import path.
    """
    from nvtrain.builtin.metrics import BUILTIN_METRICS
    from nvtrain.schedules import ALIASES

    def section(name: str) -> Mapping[str, Any]:
        value = run_config.get(name)
        return value if isinstance(value, Mapping) else {}

    found: list[tuple[str, str]] = []
    for key in ("model.factory", "model.forward_fn", "data.factory", "loss.function", "optimizer.factory"):
        part, _, field = key.partition(".")
        value = section(part).get(field)
        if isinstance(value, str):
            found.append((key, value))
    factory = section("lr_scheduler").get("factory")
    if isinstance(factory, str):
        found.append(("lr_scheduler.factory", ALIASES.get(factory, factory)))
    metrics = section("validation").get("metrics")
    for index, metric in enumerate(metrics if isinstance(metrics, list) else []):
        if isinstance(metric, str):
            found.append((f"validation.metrics[{index}]", BUILTIN_METRICS.get(metric, metric)))
    builtin = builtin_hook_classes()
    plugins = {record.name for record in _all_entry_points()}
    hooks = run_config.get("hooks")
    for index, entry in enumerate(hooks if isinstance(hooks, list) else []):
        name = entry.get("name") if isinstance(entry, Mapping) else entry
        if isinstance(name, str) and name not in builtin and name.partition(":")[0] not in plugins:
            found.append((f"hooks[{index}].name", name))
    return found


def trusted_packages(trust: Sequence[str] = ()) -> tuple[str, ...]:
    """``torch``, ``nvtrain``, the installed nvtrain plugins' top-level modules and ``trust``."""
    plugins = {record.value.partition(":")[0].split(".")[0].strip() for record in _all_entry_points()}
    return tuple(dict.fromkeys([*TRUSTED_PACKAGES, *sorted(p for p in plugins if p), *trust]))


def _is_trusted(spec: str, packages: Sequence[str]) -> bool:
    module = spec.partition(":")[0].strip()
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def build_from_checkpoint(
    run_config: Mapping[str, Any],
    source: str,
    *,
    trust: Sequence[str] = (),
    strategy_cls: type | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Built:
    """Build what ``nvtrain train`` builds from the run config saved with a checkpoint (``source``).

    Every import path the config names is checked against :func:`trusted_packages`
    before anything is imported: a checkpoint is data, and its config must not run code
    the caller did not choose. Untrusted paths raise a :class:`~nvtrain.errors.ResumeError`
    listing them.
    """
    from nvtrain.config.structure import structure_config

    if isinstance(trust, str):
        trust = (trust,)
    packages = trusted_packages(trust)
    refused = [(key, spec) for key, spec in config_import_paths(run_config) if not _is_trusted(spec, packages)]
    if refused:
        listed = ", ".join(f"{key} = {spec!r}" for key, spec in refused)
        names = sorted({spec.partition(":")[0].split(".")[0] for _, spec in refused})
        raise ResumeError(
            f"the run config saved in {source} names import paths outside the trusted packages "
            f"({', '.join(packages)}): {listed}. Nothing was imported. A checkpoint is data; to let it "
            f"run that code, trust the package(s) by name: TrainingStrategy.load_checkpoint(path, trust={names!r})"
        )
    data = copy.deepcopy(dict(run_config))
    overrides = dict(overrides or {})
    for bound in ("max_steps", "num_epochs"):  # the run's bounds live in the config's trainer section
        if bound in overrides and isinstance(data.get("trainer"), dict):
            data["trainer"][bound] = overrides.pop(bound)
    loaded = LoadedConfig(config=None, source=f"the run config of {source}", directory=None)  # type: ignore[arg-type]
    loaded = attrs.evolve(loaded, config=structure_config(data, loaded.locate))
    return build(prepare(loaded), strategy_cls=strategy_cls, overrides=overrides)


def _constructing(loaded: LoadedConfig, path: tuple[str | int, ...], what: str, make: Callable[[], Any]) -> Any:
    """Call ``make``; a ValueError / TypeError it raises becomes one located line naming ``what``."""
    from nvtrain.config import ConfigError

    try:
        return make()
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AssertionError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise loaded.error(f"{what}: {text}", _blame(loaded, path, text)) from None


def _blame(loaded: LoadedConfig, path: tuple[str | int, ...], message: str) -> tuple[str | int, ...]:
    """The most specific config key behind a factory's error: a kwarg the message names, else one
    the command line just set, else the section."""
    section: Any = loaded.config
    for part in path:
        section = getattr(section, str(part), None)
    kwargs = getattr(section, "kwargs", None)
    if not isinstance(kwargs, Mapping):
        return path
    for key in kwargs:
        if re.search(rf"\b{re.escape(str(key))}\b", message):
            return (*path, "kwargs", key)
    for key in kwargs:
        if loaded.locations.get((*path, "kwargs", key), "").startswith("--set"):
            return (*path, "kwargs", key)
    return path


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


class _Share:
    """A stand-in loader of ``batches`` batches: one rank's estimated share, for the step scheduler to count."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return self.batches


def _accumulation(plan: Plan) -> int:
    """Micro-batches per optimizer step an accumulation hook sets (1 without one): what the strategy
    takes as the window when ``trainer.global_batch_size`` is left out."""
    hook = accumulating_hook(plan.hooks, strict=False)  # two are refused at the strategy, naming hooks
    return hook.accumulation_steps if hook is not None else 1


def _run_bounds(
    config: RunConfig, loader: Any, world: int, *, per_rank: bool = False, accumulation: int = 1
) -> tuple[int | None, int | None]:
    """The run's length in optimizer steps (absolute, like ``max_steps``) and in epochs, as the run's
    :class:`~nvtrain.StepScheduler` counts them (``total_steps``, ``num_epochs``); None where unknown
    (a loader without len()).

    ``per_rank``: ``loader`` already yields one rank's share (after SETUP, where the DDP
    plugin re-samples it); otherwise, under several ranks, the share is estimated as a
    DistributedSampler cuts it.
    """
    trainer = config.trainer
    batches = _length(loader)
    local_batch = getattr(loader, "batch_size", None)
    local = local_batch if isinstance(local_batch, int) and local_batch > 0 else 1
    counted = loader
    if batches and world > 1 and not per_rank and not _is_distributed_sampler(getattr(loader, "sampler", None)):
        samples = _length(getattr(loader, "dataset", None))
        drop_last = bool(getattr(loader, "drop_last", False))
        if samples and local_batch:
            share = math.ceil(samples / world)
            batches = share // local if drop_last else math.ceil(share / local)
        else:
            batches = math.ceil(batches / world)
        counted = _Share(batches)
    scheduler = trainer.create(
        global_batch_size=trainer.global_batch_size or local * world * accumulation,
        local_batch_size=local,
        dp_size=world,
        dataloader=counted,
        preemption_signal=None,
        synchronized_stream=bool(getattr(loader, "synchronized_stream", False)),
    )
    steps = scheduler.total_steps
    return (max(1, steps) if steps is not None else None), scheduler.num_epochs


def _check_accumulation(plan: Plan, loader: Any, world: int) -> None:
    """``trainer.global_batch_size`` and an accumulation hook's ``steps`` must agree, as the strategy
    checks in ``run()``: refused here, before anything is written."""
    gbs = plan.config.trainer.global_batch_size
    hook = accumulating_hook(plan.hooks, strict=False)  # two are refused at the strategy, naming hooks
    if gbs is None or hook is None:
        return
    index = next(i for i, h in enumerate(plan.hooks) if h is hook)
    size = getattr(loader, "batch_size", None)
    local = size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else 1
    steps = gbs // (local * world)
    if hook.accumulation_steps == steps:
        return
    name = getattr(hook, "plugin_name", type(hook).__name__)
    setting = ".steps" if hasattr(hook, "steps") else ""
    where = f"hooks[{index}]{setting} ({name})" if index < len(plan.config.hooks) else f"the {name} hook"
    raise plan.loaded.error(
        f"global_batch_size={gbs} with a local batch size of {local} (the training loader's) and {world} "
        f"process(es) means {steps} micro-batch(es) per optimizer step, but {where} accumulates over "
        f"{hook.accumulation_steps}; drop one of them or make them agree",
        ("trainer", "global_batch_size"),
    )


def _check_metric_schedule(plan: Plan, val_loader: Any) -> None:
    """A plateau / ``monitor`` LR scheduler steps only after validations: refuse a run that never validates."""
    section = plan.config.lr_scheduler
    if section is None or plan.scheduler_factory is None:
        return
    target = getattr(plan.scheduler_factory, "func", plan.scheduler_factory)
    plateau = isinstance(target, type) and issubclass(target, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if section.monitor is None and not plateau:
        return
    if val_loader is None:
        why = f"{plan.config.data.factory} returns no validation loader"
    elif not _validates(plan):
        why = (
            "no validation cadence is set (validation.every_n_steps and every_n_epochs are null, "
            "and so is trainer.val_every_steps)"
        )
    else:
        return
    raise plan.loaded.error(
        f"{section.factory} is stepped after each validation with validation value {section.monitor or 'loss'!r}, "
        f"but the run never validates: {why}; validate, or use a step or epoch schedule",
        ("lr_scheduler", "monitor"),
    )


def _validates(plan: Plan) -> bool:
    """Whether some cadence validates during the run (given a validation loader)."""
    section, trainer = plan.config.validation, plan.config.trainer
    epochs = section.every_n_epochs
    if epochs == "auto":
        epochs = 1 if section.every_n_steps is None else None
    on_checkpoint = trainer.validate_on_checkpoint and any(isinstance(h, SavesCheckpoints) for h in plan.hooks)
    return bool(section.every_n_steps or epochs or trainer.val_every_steps or on_checkpoint)


def _check_horizon(plan: Plan, steps: int | None, epochs: int | None) -> None:
    """The scheduler's horizon (``T_max`` / ``total_steps`` left out) must be known and longer than the warmup."""
    section = plan.config.lr_scheduler
    assert section is not None
    names = " / ".join(plan.scheduler_total_steps)
    if section.interval == "epoch":
        length, unit = epochs, "epochs"
        unknown = "the run's epoch count is unknown; set trainer.num_epochs"
    else:
        length, unit = steps, "optimizer steps"
        unknown = "the run's step count is unknown (the training loader has no len()); set trainer.max_steps"
    if length is None:
        raise plan.loaded.error(f"{unknown} or give {names} in lr_scheduler.kwargs", ("lr_scheduler",))
    if section.warmup_steps >= length:
        raise plan.loaded.error(
            f"warmup_steps={section.warmup_steps} leaves no {unit} for {section.factory}: the run has {length} "
            f"{unit}; lower warmup_steps or give {names} in lr_scheduler.kwargs",
            ("lr_scheduler", "warmup_steps"),
        )


def _horizon(plan: Plan, steps: int | None, epochs: int | None) -> dict[str, int]:
    """``T_max`` / ``total_steps`` the kwargs leave out: the run's length in the schedule's interval
    (optimizer steps, or epochs), less the warmup."""
    section = plan.config.lr_scheduler
    if section is None or not plan.scheduler_total_steps:
        return {}
    length = epochs if section.interval == "epoch" else steps
    return {name: max(1, (length or 1) - section.warmup_steps) for name in plan.scheduler_total_steps}


def _build_model(plan: Plan) -> Any:
    """The model factory's result; with ``model.init_device: meta``, built without memory for FSDP to shard."""
    section = plan.config.model
    if section.init_device != "meta":
        return plan.model_factory(**section.kwargs)
    if not any(getattr(hook, "materializes_meta_models", False) for hook in plan.hooks):
        raise plan.loaded.error(
            "model.init_device: meta builds a model with no weights, which a hook must allocate and initialise; "
            "add the fsdp hook (hooks: [fsdp]), which does so for each rank's shards, or drop init_device",
            ("model", "init_device"),
        )
    with torch.device("meta"):
        return plan.model_factory(**section.kwargs)


def _schedule(plan: Plan, horizon: Mapping[str, int]) -> Callable[[torch.optim.Optimizer], Any]:
    """``optimizer -> scheduler``: the configured factory with its horizon, behind a warmup when
    ``warmup_steps`` is set (how it is stepped, ``interval`` or ``monitor``, is :func:`_scheduler_factory`'s)."""
    from nvtrain.schedules import warmup

    section = plan.config.lr_scheduler
    assert section is not None and plan.scheduler_factory is not None
    factory = functools.partial(plan.scheduler_factory, **horizon) if horizon else plan.scheduler_factory
    if section.warmup_steps:
        factory = warmup(factory, section.warmup_steps)
    return factory


def _is_distributed_sampler(sampler: Any) -> bool:
    return isinstance(sampler, torch.utils.data.distributed.DistributedSampler)


def _split_loaders(result: Any, spec: str) -> tuple[Any, Any]:
    """Accept ``(train, val)``, ``{"train": ..., "validation": ...}`` or a lone train loader."""
    if isinstance(result, Mapping):
        unknown = set(result) - {"train", "validation", "val"}
        if "train" not in result or unknown:
            raise TypeError(
                f"{spec} returned a mapping with keys {sorted(result)}; expected 'train' and optionally 'validation'"
            )
        return result["train"], result.get("validation", result.get("val"))
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError(f"{spec} returned {len(result)} items; expected (train, validation)")
        return result[0], result[1]
    return result, None


def _scheduler_factory(plan: Plan, holder: Mapping[str, Any], fresh: dict[str, dict[str, Any]]) -> Any:
    """An :class:`~nvtrain.LRSchedule` that builds the LR scheduler when the strategy asks (after SETUP),
    with the run's length filled in from the loader the strategy holds then (re-sampled per rank under DDP).

    The state it starts with is kept in ``fresh``: a resume that restores an older
    schedule takes the new horizon from it.
    """
    from nvtrain.lr_schedule import LRSchedule

    section = plan.config.lr_scheduler
    assert section is not None and plan.scheduler_factory is not None

    def make(optimizer: torch.optim.Optimizer) -> Any:
        horizon: dict[str, int] = {}
        if plan.scheduler_total_steps:
            ctx = holder["strategy"].ctx
            steps, epochs = _run_bounds(
                plan.config, ctx.train_loader, ctx.world_size, per_rank=True, accumulation=_accumulation(plan)
            )
            horizon = _horizon(plan, steps, epochs)
        scheduler = _schedule(plan, horizon)(optimizer)
        fresh["main"] = copy.deepcopy(scheduler.state_dict())
        return scheduler

    return LRSchedule(make, interval=section.interval, monitor=section.monitor)


def _plan_resume(plan: Plan, built: Built, rank: int, world_size: int, fresh: Mapping[str, dict[str, Any]]) -> None:
    """Find the checkpoint the run will resume from and compare its config with this one."""
    from nvtrain.config import converter
    from nvtrain.resuming import REFUSED, ResumeAdjuster, config_changes, in_effect

    loaded = plan.loaded
    now = _plain(converter().unstructure(plan.config))
    built.effective_config = now
    # the checkpoint plugin's hooks (resume_checkpoint, read_manifest, run_config)
    hooks: list[Any] = [h for h in plan.hooks if callable(getattr(h, "resume_checkpoint", None))]
    for resumer in hooks:
        resumer.run_config = now  # stored in each manifest
    if not hooks:
        return
    hook = hooks[0]
    index = plan.hooks.index(hook)
    try:
        path = hook.resume_checkpoint(rank, world_size)
        manifest = hook.read_manifest(path) if path is not None else None
    except ResumeError as err:
        raise loaded.error(f"cannot resume: {err}", ("hooks", index, "resume")) from None
    if path is None or manifest is None:
        return
    step = int(manifest.get("step", 0))
    built.resume_from, built.resume_step = Path(path), step
    saved = manifest.get("run_config")
    if not isinstance(saved, dict):
        saved = _saved_config_file(plan.run_dir)
    if saved is None:
        return
    changes = config_changes(saved, now, derives_horizon=bool(plan.scheduler_total_steps))
    refused = [c for c in changes if c.effect == REFUSED]
    if refused:
        raise loaded.error(
            f"cannot resume from {path} with this config: "
            + "; ".join(c.describe() for c in refused)
            + ". Start a fresh run (another name, or the checkpoint hook's resume: never)",
            tuple(refused[0].key.replace("[", ".").replace("]", "").split(".")),
        )
    built.changes = changes
    built.effective_config = in_effect(saved, now, changes)
    adjust = [c for c in changes if c.effect != REFUSED]
    if adjust:
        built.strategy.register_hook(ResumeAdjuster(adjust, fresh, step))


def _plain(data: Any) -> Any:
    """JSON-compatible data (tuples to lists, other objects to str): what a manifest can hold."""
    import json

    return json.loads(json.dumps(data, default=str))


def _saved_config_file(run_dir: Path) -> dict[str, Any] | None:
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return _plain(data) if isinstance(data, dict) else None


class _RunWatch:
    """The app's own observer: notes where the run starts and where its last step was, writes
    ``config.yaml`` once a resume has been applied, and reports a non-finite loss at once."""

    plugin_name = "nvtrain.app.watch"

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        self.every = plan.config.logging.log_every_n_steps
        self.start_step: int | None = None
        #: 0-based epoch of the latest optimizer step (the summary shows it 1-based).
        self.last_step_epoch: int | None = None
        self.effective_config: dict[str, Any] = {}
        self._reported_train = False

    @hookimpl
    def before_epoch(self, ctx: Any) -> None:
        if self.start_step is None:
            self.start_step = ctx.step_count  # a resume has been applied by now
            if self.rank == 0:
                self.plan.run_dir.mkdir(parents=True, exist_ok=True)
                _write_atomically(self.plan.run_dir / "config.yaml", _dump(self.effective_config))

    @hookimpl
    def after_batch(self, ctx: Any) -> None:
        if not ctx.sync_gradients or ctx.step_skipped:
            return
        self.last_step_epoch = ctx.epoch
        if self.rank != 0 or ctx.step_count % self.every or self._reported_train:
            return
        loss = ctx.loss
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):  # a logging step
            self._reported_train = True  # once: the divergence check or the user takes it from here
            logger.warning(
                "training loss is %s at step %d (epoch %d): the run is diverging (lower the learning rate or "
                "check the data); checkpoints from now on are marked unhealthy",
                float(loss.detach().float().mean()), ctx.step_count, ctx.epoch + 1,
            )

    @hookimpl
    def after_validation(self, ctx: Any) -> None:
        if self.rank != 0:
            return
        loss = (ctx.validation or {}).get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not math.isfinite(float(loss)):
            logger.warning("validation loss is %s at step %d: the weights are no longer finite", float(loss), ctx.step_count)


def _dump(data: Mapping[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=False))


# -- running --------------------------------------------------------------------------------------------


def train(plan: Plan, *, out: TextIO | None = None) -> TrainOutcome:
    """Build everything, then (only then) write the run directory, train, plot; return the exit status.

    Under torchrun (``WORLD_SIZE > 1``) the process group is set up here and torn
    down at the end; only rank 0 writes the config, the metrics and the plot, and
    prints. Construction errors raise :class:`~nvtrain.config.ConfigError` before
    anything is written; a diverged run raises
    :class:`~nvtrain.errors.TrainingDivergedError`.
    """
    out = out if out is not None else sys.stdout
    config = plan.config
    manager = None
    if _env_world_size() > 1:
        from nvtrain.distributed import DeviceAssignmentError, DistributedManager

        try:  # the config's device decides the backend: device=cpu trains with gloo where GPUs are visible
            manager = DistributedManager.initialize(device=config.device)
        except DeviceAssignmentError as err:
            raise plan.loaded.error(str(err), ("device",)) from None
    rank = manager.rank if manager is not None else 0
    started = time.perf_counter()
    try:
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        _seed_everything(config.seed + rank)
        built = build(plan, manager)
        if built.resume_from is not None and built.run_length is not None and built.resume_step >= built.run_length:
            if rank == 0:
                print(
                    f"run {plan.run_dir} | already at step {built.resume_step} ({built.resume_from}), nothing to "
                    f"train (the run ends at step {built.run_length}: raise trainer.max_steps or num_epochs)",
                    file=out,
                    flush=True,
                )
            built.strategy.close()
            return TrainOutcome(exit_code=EXIT_OK, run_dir=plan.run_dir, result=None, seconds=0.0)
        if rank == 0:
            _announce(plan, built)
        strategy = built.strategy
        with strategy:
            try:
                result = strategy.run(built.train_loader)
            except ResumeError as err:
                raise plan.loaded.error(f"cannot resume: {_with_model_changes(str(err), built)}", ("hooks",)) from None
        seconds = time.perf_counter() - started
        code = EXIT_OK
        saved = None
        if result.preempted:
            saved = _saved_checkpoint(plan.hooks)
            code = EXIT_PREEMPTED if saved is not None else EXIT_PREEMPTED_UNSAVED
        if rank == 0:
            _finish(plan, result, seconds, out, built.watch, saved, resumed=built.resume_from is not None)
    finally:
        if manager is not None:
            from nvtrain.distributed import DistributedManager

            DistributedManager.cleanup()
    return TrainOutcome(exit_code=code, run_dir=plan.run_dir, result=result, seconds=seconds)


def _announce(plan: Plan, built: Built) -> None:
    """Rank 0's messages before the first step: a preemption that would save nothing, resume changes."""
    signals = plan.config.trainer.preemption_signal
    if signals and not any(isinstance(h, SavesCheckpoints) for h in plan.hooks):
        names = ", ".join(str(s) for s in (signals if isinstance(signals, tuple) else (signals,)))
        logger.warning(
            "a preemption signal (%s) will stop the run but nothing will be saved: add the checkpoint hook "
            "(hooks: [checkpoint]) to resume after one",
            names,
        )
    if built.resume_from is not None and built.changes:
        logger.info("resuming from %s with a changed config:", built.resume_from)
        for change in built.changes:
            logger.info("  %s", change.describe())


def _with_model_changes(message: str, built: Built) -> str:
    model = [c.describe() for c in built.changes if c.key.startswith("model.")]
    return message + (f" (model config changed since the checkpoint: {'; '.join(model)})" if model else "")


def _saved_checkpoint(hooks: Sequence[object]) -> tuple[int, Path] | None:
    """The newest checkpoint a checkpoint hook reports complete on disk (its ``last_saved``), or None."""
    found = [saved for h in hooks if isinstance(h, SavesCheckpoints) and (saved := h.last_saved) is not None]
    return max(found, key=lambda item: item[0]) if found else None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def _finish(
    plan: Plan,
    result: Any,
    seconds: float,
    out: TextIO,
    watch: _RunWatch,
    saved: tuple[int, Path] | None,
    *,
    resumed: bool,
) -> None:
    config = plan.config
    metrics_file = plan.run_dir / "metrics.csv"
    if config.logging.plot and config.logging.csv and metrics_file.exists():
        from nvtrain.plotting import PLOT_NAME, plot_metrics, read_metrics

        if read_metrics(metrics_file):
            plot_metrics(metrics_file, plan.run_dir / PLOT_NAME, title=config.name)
    epoch = watch.last_step_epoch if watch.last_step_epoch is not None else result.epoch
    total = config.trainer.num_epochs
    summary = [
        f"run {plan.run_dir}",
        f"step {result.step_count}",
        f"epoch {epoch + 1}" + (f"/{total}" if total else ""),
        f"{seconds:.1f} s",
    ]
    if watch.start_step:  # from a checkpoint, or from trainer.start_step alone
        summary.insert(2, f"{'resumed' if resumed else 'started'} at step {watch.start_step}")
    prefix = "val_ema_" if plan.use_ema else "val_"
    for key, value in (result.validation or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            summary.append(f"{prefix}{key} {value.item():.4f}")
    if result.preempted:
        if saved is not None:
            summary.append(
                f"preempted: checkpoint saved at step {saved[0]} ({saved[1]}), rerun to resume "
                f"(exit status {EXIT_PREEMPTED})"
            )
        else:
            summary.append(
                f"preempted: nothing was saved (no checkpoint hook), a rerun starts from step 0 "
                f"(exit status {EXIT_PREEMPTED_UNSAVED})"
            )
    elif result.stop_reason is not None:
        summary.append(f"stopped early: {result.stop_reason}")
    print(" | ".join(summary), file=out, flush=True)


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with naming_file(path), os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
