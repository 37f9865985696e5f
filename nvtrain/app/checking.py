"""The first phase of ``nvtrain train`` and all of ``nvtrain validate``'s config check: :func:`prepare`.

It checks everything a config names without building a model or touching the
disk: import paths resolve, keyword arguments fit the factories' signatures,
hook names exist and their settings pass the hooks' own validators, monitors
name keys the validation summary will have.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from nvtrain.app.hook_stack import build_hooks, load_plugin, run_logging_hooks, signature_parameters
from nvtrain.config import LoadedConfig, RunConfig, resolve_import_path
from nvtrain.errors import first_line
from nvtrain.hook import AveragesWeights, Hook, ProvidesAutocast
from nvtrain.lr_schedule import steps_with_a_metric
from nvtrain.validation import SUMMARY_KEYS, ValidationConfig, averages_to_validate
from nvtrain.validators import blocking_file


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
    #: What the validation evaluates: the trained weights (False), every model's average (True), or the
    #: average of the EMA hook with this state_key.
    use_ema: bool | str

    @property
    def config(self) -> RunConfig:
        return self.loaded.config

    @property
    def run_dir(self) -> Path:
        return self.loaded.config.run_dir


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
    _check_stepping_needs_no_closure(loaded, optimizer_cls)
    optimizer_factory = functools.partial(optimizer_cls, **config.optimizer.kwargs)
    scheduler_factory: Callable[..., Any] | None = None
    fills: tuple[str, ...] = ()
    if config.lr_scheduler is not None:
        from nvtrain.schedules import ALIASES

        section = config.lr_scheduler
        scheduler_cls = resolve(ALIASES.get(section.factory, section.factory), ("lr_scheduler", "factory"))
        accepted = signature_parameters(scheduler_cls)
        fills = tuple(name for name in ("T_max", "total_steps") if name in accepted and name not in section.kwargs)
        filled = dict(section.kwargs, **{name: 1 for name in fills})
        _check_call(loaded, scheduler_cls, ("optimizer",), filled, ("lr_scheduler",), section.factory)
        _check_schedule(loaded, scheduler_cls)
        placeholders = dict.fromkeys(fills, 10**6)  # the run's length is known later; any long horizon steps alike
        _check_scheduler_steps(loaded, optimizer_factory, scheduler_cls, dict(section.kwargs, **placeholders))
        scheduler_factory = functools.partial(scheduler_cls, **section.kwargs)
    forward_fn = None
    if config.model.forward_fn is not None:
        forward_fn = resolve(config.model.forward_fn, ("model", "forward_fn"))
        if not callable(forward_fn):
            raise loaded.error(f"{config.model.forward_fn!r} is not callable", ("model", "forward_fn"))
    metrics = _metrics(loaded, resolve)
    blocking = blocking_file(config.run_dir)  # before the loggers, which refuse a path under a file themselves
    if blocking is not None:
        where = "is a file" if blocking == config.run_dir else f"lies under {str(blocking)!r}, which is a file"
        raise loaded.error(f"the run directory {str(config.run_dir)!r} {where}", ("output_dir",))
    hooks = list(build_hooks(loaded, search))
    if (world_size if world_size is not None else env_world_size()) > 1 and not any(
        getattr(h, "plugin_name", None) == "ddp" or getattr(h, "data_parallel", False) is True for h in hooks
    ):
        hooks.append(load_plugin(loaded, "ddp", {}, ("hooks",), for_what="a torchrun launch (WORLD_SIZE > 1)"))
    hooks += run_logging_hooks(loaded)
    averaging = any(isinstance(h, AveragesWeights) for h in hooks)
    use_ema = config.validation.use_ema
    if use_ema is True and not averaging:
        raise loaded.error(
            "use_ema is true but no EMA hook is configured (add `- ema` to hooks)", ("validation", "use_ema")
        )
    written = "use_ema: auto" if use_ema == "auto" else "use_ema=True"
    use_ema = averaging if use_ema == "auto" else use_ema
    try:  # which average a validation evaluates: one per model, named by state_key when there are two
        averages_to_validate(hooks, ValidationConfig(use_ema=use_ema))
    except ValueError as err:
        message = str(err).replace("ValidationConfig.use_ema=True", written).replace("ValidationConfig.use_ema", "use_ema")
        raise loaded.error(message, ("validation", "use_ema")) from None
    if config.validation.use_mixed_precision is True and not any(isinstance(h, ProvidesAutocast) for h in hooks):
        raise loaded.error(
            "use_mixed_precision is true but no mixed-precision hook is configured "
            "(add `- amp` to hooks, or set it to auto or false)",
            ("validation", "use_mixed_precision"),
        )
    _check_monitors(loaded, metrics, hooks)
    _check_start(loaded)
    _check_device(loaded)
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
        use_ema=use_ema,
    )


def _check_device(loaded: LoadedConfig) -> None:
    """Refuse a device the run cannot train on here, before anything is built on it."""
    device = loaded.config.device
    if device == "auto":
        return
    try:
        chosen = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise loaded.error(f"device {device!r} is not a torch device ({first_line(err)})", ("device",)) from None
    if chosen.type == "meta":
        raise loaded.error(
            "device 'meta' holds no data, so nothing can train on it (to build the model there first, set "
            "model.init_device: meta and train on cpu or cuda)",
            ("device",),
        )
    available: dict[str, tuple[str, Callable[[], bool]]] = {
        "cuda": ("CUDA", torch.cuda.is_available),
        "mps": ("MPS", torch.backends.mps.is_available),
    }
    name, is_available = available.get(chosen.type, (chosen.type, lambda: True))
    if not is_available():
        raise loaded.error(f"device {device!r} asked for {name}, which this machine does not have", ("device",))
    try:
        torch.empty(0, device=chosen)
    except Exception as err:  # another backend without its hardware, or an index past the devices there are
        reason = first_line(err).split(". ")[0]
        raise loaded.error(f"device {device!r} is not usable on this machine: {reason}", ("device",)) from None


def _check_start(loaded: LoadedConfig) -> None:
    """Refuse a start at or past the run's end: it would train nothing and exit 0, as if it had trained."""
    trainer = loaded.config.trainer
    for start, bound in (("start_epoch", "num_epochs"), ("start_step", "max_steps")):
        first, end = getattr(trainer, start), getattr(trainer, bound)
        if end is not None and first >= end:
            raise loaded.error(
                f"trainer.{start}={first} is not before trainer.{bound}={end}: the run would train nothing; "
                f"start earlier or raise {bound} (a resumed checkpoint sets where a run starts by itself)",
                ("trainer", start),
            )


def _check_schedule(loaded: LoadedConfig, scheduler_cls: Any) -> None:
    """Refuse what a scheduler cannot do: OneCycleLR or a metric-driven one after a warmup, a metric-driven
    one per epoch."""
    section = loaded.config.lr_scheduler
    assert section is not None
    one_cycle = isinstance(scheduler_cls, type) and issubclass(scheduler_cls, torch.optim.lr_scheduler.OneCycleLR)
    if one_cycle and section.warmup_steps:
        raise loaded.error(
            f"{section.factory} ramps the LR up itself (from max_lr / div_factor over pct_start of its steps) and "
            "overwrites the rate a warmup would ramp to: set warmup_steps to 0 and shape its ramp with "
            "lr_scheduler.kwargs (pct_start, div_factor), or follow the warmup with cosine or linear",
            ("lr_scheduler", "warmup_steps"),
        )
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
    if isinstance(scheduler_cls, type) and not steps_with_a_metric(scheduler_cls):
        raise loaded.error(
            f"monitor {section.monitor!r} makes {section.factory} step after each validation with that value, but "
            f"its step() takes no metric (its argument is an epoch number, so the value would set the rate): "
            "leave monitor out and step it per interval ('step' or 'epoch'), or use plateau",
            ("lr_scheduler", "monitor"),
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


def _check_stepping_needs_no_closure(loaded: LoadedConfig, optimizer_cls: Any) -> None:
    """The loop calls ``optimizer.step()`` without a closure; an optimizer whose step needs one (LBFGS) would
    fail at the first step, after the run had started."""
    try:
        parameters = list(inspect.signature(optimizer_cls.step).parameters.values())[1:]  # after self
    except (AttributeError, TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = [p.name for p in parameters if p.default is p.empty and p.kind in kinds]
    if required:
        raise loaded.error(
            f"{loaded.config.optimizer.factory}.step() needs {', '.join(map(repr, required))} (a closure that "
            "re-evaluates the model), which the training loop does not pass; use an optimizer that steps without one",
            ("optimizer", "factory"),
        )


def _check_scheduler_steps(
    loaded: LoadedConfig, optimizer_factory: Callable[..., Any], scheduler_cls: Any, kwargs: Mapping[str, Any]
) -> None:
    """Build the scheduler on a throwaway one-parameter optimizer and step it once: settings that construct
    but fail when stepped (``step_size: "10"``, ``T_max: 0``) are refused now, not at the first optimizer step.

    Only a scheduler's own failure counts: when the throwaway optimizer or the scheduler cannot be built so
    (an optimizer that needs more than parameters), nothing is concluded.
    """
    try:
        optimizer = optimizer_factory([torch.zeros(1, requires_grad=True)])
        scheduler = scheduler_cls(optimizer, **kwargs)
    except Exception:  # the real construction, with the real optimizer, reports its own errors
        return
    section = loaded.config.lr_scheduler
    assert section is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": nothing trains here
        try:
            if steps_with_a_metric(scheduler_cls):
                scheduler.step(1.0)
            else:
                scheduler.step()
        except Exception as err:  # whatever stepping raises is what the run would die of
            raise loaded.error(
                f"{section.factory} fails when stepped with these kwargs: {type(err).__name__}: {first_line(err)}",
                ("lr_scheduler", "kwargs"),
            ) from None


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
        where = ("validation", "metrics", index)
        if not callable(function):
            raise loaded.error(f"{spec} is not callable as fn(outputs, targets) (it is {function!r})", where)
        if key in metrics:
            raise loaded.error(f"two metrics are named {key!r}", where)
        if key in SUMMARY_KEYS:
            raise loaded.error(
                f"a metric named {key!r} would overwrite the validation {key} (val_{key}); give the function "
                "another name",
                where,
            )
        metrics[key] = function
    return metrics


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
