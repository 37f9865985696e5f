"""From a :class:`~nvtrain.config.RunConfig` to a finished run: what ``nvtrain train`` does.

:func:`prepare` checks everything a config names without building a model or
touching the disk: import paths resolve, keyword arguments fit the factories'
signatures, hook names exist and their settings pass the hooks' own
validators. Only then does :func:`train` create the run directory, build the
model and loaders, and run a :class:`~nvtrain.TrainingStrategy`.

Exit statuses (documented in ``docs/cli.md``): :data:`EXIT_OK`,
:data:`EXIT_FAILURE` (training raised; the traceback is printed),
:data:`EXIT_USAGE` (bad config or arguments; one line on stderr) and
:data:`EXIT_PREEMPTED` (a preemption signal stopped the run after a
checkpoint; run the same command again to resume).
"""

from __future__ import annotations

import difflib
import functools
import inspect
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

from nvtrain.config import LoadedConfig, RunConfig, dump_config, resolve_import_path
from nvtrain.hookspecs import hookimpl

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_USAGE",
    "Plan",
    "TrainOutcome",
    "builtin_hook_classes",
    "prepare",
    "train",
]

#: The run finished (all epochs or ``max_steps``).
EXIT_OK = 0
#: Training raised an exception (its traceback is printed).
EXIT_FAILURE = 1
#: The config or the command line is wrong; nothing was trained or written.
EXIT_USAGE = 2
#: A preemption signal stopped the run after a checkpoint (``EX_TEMPFAIL``): requeue and rerun to resume.
EXIT_PREEMPTED = 75

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
        section = config.lr_scheduler
        scheduler_cls = resolve(section.factory, ("lr_scheduler", "factory"))
        accepted = _parameters(scheduler_cls)
        fills = tuple(name for name in ("T_max", "total_steps") if name in accepted and name not in section.kwargs)
        filled = dict(section.kwargs, **{name: 1 for name in fills})
        _check_call(loaded, scheduler_cls, ("optimizer",), filled, ("lr_scheduler",), section.factory)
        scheduler_factory = functools.partial(scheduler_cls, **section.kwargs)
    forward_fn = None
    if config.model.forward_fn is not None:
        forward_fn = resolve(config.model.forward_fn, ("model", "forward_fn"))
        if not callable(forward_fn):
            raise loaded.error(f"{config.model.forward_fn!r} is not callable", ("model", "forward_fn"))
    metrics = _metrics(loaded, resolve)
    hooks = list(_build_hooks(loaded, search))
    if (world_size if world_size is not None else _env_world_size()) > 1 and not any(
        getattr(h, "plugin_name", None) == "ddp" for h in hooks
    ):
        hooks.append(_load_plugin(loaded, "ddp", {}, ("hooks",), for_what="a torchrun launch (WORLD_SIZE > 1)"))
    hooks += _logging_hooks(loaded)
    averaging = any(callable(getattr(h, "get_averaged_model", None)) for h in hooks)
    use_ema = config.validation.use_ema
    if use_ema is True and not averaging:
        raise loaded.error(
            "use_ema is true but no EMA hook is configured (add `- ema` to hooks)", ("validation", "use_ema")
        )
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
    installed = {info.name for info in plugins.available()}
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
            known = sorted({*builtin, *installed})
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise loaded.error(
                f"unknown hook {name!r}{hint} (installed plugins: {', '.join(sorted(installed)) or 'none'}; "
                f"built-in hooks: {', '.join(sorted(builtin))}; or an import path 'package.module:HookClass')",
                (*path, "name"),
            )
    return hooks


def plugins_build(cls: type, settings: Mapping[str, Any], name: str) -> Any:
    """Build a built-in or import-path hook the way plugins are built (unknown settings named)."""
    from nvtrain.plugins._build import build_hook

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
    from nvtrain.plugins import PluginError

    try:
        return build()
    except PluginError as err:
        unknown = re.search(r"has no settings? '(\w+)'", str(err))
        raise loaded.error(str(err), (*path, unknown.group(1)) if unknown else path) from None
    except (TypeError, ValueError) as err:  # the hook's own validators: "EMAHook.decay must be ..."
        text = str(err)
        field = text.split(" ", 1)[0].partition(".")[2].rstrip(":")
        where = (*path, field) if field and field.isidentifier() else path
        raise loaded.error(f"hook {name!r}: {text}", where) from None


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
            hooks.append(TensorBoardHook(run_dir / "tensorboard", log_every_n_steps=every))
        except ImportError as err:
            raise loaded.error(str(err), ("logging", "tensorboard")) from None
    return hooks


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


# -- running --------------------------------------------------------------------------------------------


def train(plan: Plan, *, out: TextIO | None = None) -> TrainOutcome:
    """Run a prepared plan: write the resolved config, train, plot; return the exit status.

    Under torchrun (``WORLD_SIZE > 1``) the process group is set up here and torn
    down at the end; only rank 0 writes the config, the metrics and the plot.
    """
    out = out if out is not None else sys.stdout
    config = plan.config
    manager = None
    if _env_world_size() > 1:
        from nvtrain.distributed import DistributedManager

        manager = DistributedManager.initialize()
    rank = manager.rank if manager is not None else 0
    started = time.perf_counter()
    try:
        if rank == 0:
            plan.run_dir.mkdir(parents=True, exist_ok=True)
            _write_atomically(plan.run_dir / "config.yaml", dump_config(config))
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        _seed_everything(config.seed + rank)
        strategy, train_loader, start = _build(plan, manager)
        with strategy:
            result = strategy.run(train_loader)
        seconds = time.perf_counter() - started
        if rank == 0:
            _finish(plan, result, seconds, out, start.step)
    finally:
        if manager is not None:
            from nvtrain.distributed import DistributedManager

            DistributedManager.cleanup()
    code = EXIT_PREEMPTED if result.preempted else EXIT_OK
    return TrainOutcome(exit_code=code, run_dir=plan.run_dir, result=result, seconds=seconds)


def _build(plan: Plan, manager: Any) -> tuple[Any, Any, _RunStart]:
    from nvtrain.strategy import TrainingStrategy
    from nvtrain.validation import ValidationConfig

    config = plan.config
    model = plan.model_factory(**config.model.kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model.factory {config.model.factory} returned {type(model).__name__}, not a torch.nn.Module")
    train_loader, val_loader = _split_loaders(plan.data_factory(**config.data.kwargs), config.data.factory)
    validation = None
    section = config.validation
    if val_loader is not None and (section.every_n_epochs is not None or section.every_n_steps is not None):
        validation = ValidationConfig(
            data=val_loader,
            every_n_steps=section.every_n_steps,
            every_n_epochs=section.every_n_epochs,
            use_mixed_precision=section.use_mixed_precision,
            use_ema=plan.use_ema,
            metrics=plan.metrics,
        )
    holder: dict[str, Any] = {}
    schedulers = None
    if plan.scheduler_factory is not None:
        schedulers = _scheduler_factory(plan, holder)
    strategy = TrainingStrategy(
        models=model,
        optimizers=plan.optimizer_factory,
        loss_fn=plan.loss_fn,
        lr_schedulers=schedulers,
        forward_fn=plan.forward_fn,
        hooks=plan.hooks,  # type: ignore[arg-type]  # mypy misreads the field's converter=tuple
        device=None if config.device == "auto" else config.device,
        validation=validation,
        step_scheduler=config.trainer,
        distributed_manager=manager,
    )
    holder["strategy"] = strategy
    start = _RunStart()
    strategy.register_hook(start)
    return strategy, train_loader, start


class _RunStart:
    """Notes the step a run starts from (after a resume has been applied), for the summary line."""

    plugin_name = "nvtrain.app.run_start"

    def __init__(self) -> None:
        self.step: int | None = None

    @hookimpl
    def before_epoch(self, ctx: Any) -> None:
        if self.step is None:
            self.step = ctx.step_count


def _split_loaders(result: Any, spec: str) -> tuple[Any, Any]:
    """Accept ``(train, val)``, ``{"train": ..., "validation": ...}`` or a lone train loader."""
    if isinstance(result, Mapping):
        unknown = set(result) - {"train", "validation", "val"}
        if "train" not in result or unknown:
            raise TypeError(
                f"data.factory {spec} returned a mapping with keys {sorted(result)}; expected 'train' and "
                "optionally 'validation'"
            )
        return result["train"], result.get("validation", result.get("val"))
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError(f"data.factory {spec} returned {len(result)} items; expected (train, validation)")
        return result[0], result[1]
    return result, None


def _scheduler_factory(plan: Plan, holder: dict[str, Any]) -> Callable[[torch.optim.Optimizer], Any]:
    """Build the LR scheduler when the strategy asks (after SETUP), filling in the run's step count."""
    factory = plan.scheduler_factory
    assert factory is not None

    def build(optimizer: torch.optim.Optimizer) -> Any:
        extra = {}
        if plan.scheduler_total_steps:
            steps = _total_steps(holder["strategy"], plan.config)
            extra = {name: steps for name in plan.scheduler_total_steps}
        return factory(optimizer, **extra)

    return build


def _total_steps(strategy: Any, config: RunConfig) -> int:
    """Optimizer steps of the whole run, from the (possibly re-sampled) loader the strategy holds."""
    trainer = config.trainer
    loader = strategy.ctx.train_loader
    try:
        batches = len(loader)
    except TypeError:
        batches = None
    world = strategy.ctx.world_size
    local = getattr(loader, "batch_size", None) or 1
    accumulation = max(1, trainer.global_batch_size // (local * world)) if trainer.global_batch_size else 1
    epoch_len = math.ceil(batches / accumulation) if batches else None
    num_epochs = trainer.num_epochs if trainer.num_epochs is not None or trainer.max_steps is not None else 1
    candidates = [trainer.max_steps] if trainer.max_steps is not None else []
    if num_epochs is not None and epoch_len is not None:
        candidates.append(num_epochs * epoch_len)
    if not candidates:
        raise ValueError(
            "lr_scheduler: the run's step count is unknown (the loader has no len()); set trainer.max_steps "
            "or give the scheduler's T_max / total_steps in lr_scheduler.kwargs"
        )
    return max(1, min(candidates))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def _finish(plan: Plan, result: Any, seconds: float, out: TextIO, start_step: int | None) -> None:
    config = plan.config
    metrics_file = plan.run_dir / "metrics.csv"
    if config.logging.plot and config.logging.csv and metrics_file.exists():
        from nvtrain.plotting import PLOT_NAME, plot_metrics, read_metrics

        if read_metrics(metrics_file):
            plot_metrics(metrics_file, plan.run_dir / PLOT_NAME, title=config.name)
    summary = [f"run {plan.run_dir}", f"step {result.step_count}", f"epoch {result.epoch}", f"{seconds:.1f} s"]
    if start_step:
        summary.insert(2, f"resumed at step {start_step}")
    for key, value in (result.validation or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            summary.append(f"val_{key} {value.item():.4f}")
    if result.preempted:
        summary.append(f"preempted: checkpoint saved, rerun to resume (exit status {EXIT_PREEMPTED})")
    print(" | ".join(summary), file=out, flush=True)


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
