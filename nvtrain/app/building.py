"""The second phase: from a checked :class:`~nvtrain.app.Plan` to a strategy ready to run (:func:`build`).

Model, loaders, optimizer, LR scheduler and strategy are built, and the run's
length and the config's cross-checks that need the loader (accumulation against
``global_batch_size``, the scheduler's horizon) are settled. Nothing is trained
or written.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import sysconfig
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nvtrain.app.resume_plan import check_saved_weights, plan_resume, saved_state, with_model_changes
from nvtrain.app.run_watch import RunWatch
from nvtrain.atomic_files import name_max
from nvtrain.batching import loader_batch_size
from nvtrain.config import LoadedConfig, RunConfig
from nvtrain.hook import SavesCheckpoints, accumulating_hook
from nvtrain.validation import read_up_by_one_pass

if TYPE_CHECKING:
    from nvtrain.app.checking import Plan


@attrs.define
class Built:
    """Everything ``train`` builds before the first step: the strategy, its loaders, the resume decision."""

    strategy: Any
    train_loader: Any
    watch: RunWatch
    #: Optimizer steps of the whole run (None when the loader has no len() and no max_steps is set).
    run_length: int | None
    #: The checkpoint the run resumes from, its step, and the config changes since it was written.
    resume_from: Path | None = None
    resume_step: int = 0
    changes: list[Any] = attrs.field(factory=list)
    #: The resolved config as written to ``config.yaml`` (changes of no effect reverted).
    effective_config: dict[str, Any] = attrs.field(factory=dict)


def build(
    plan: Plan,
    manager: Any = None,
    *,
    strategy_cls: type | None = None,
    overrides: Mapping[str, Any] | None = None,
    extra_hooks: Sequence[object] = (),
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
    if rank == 0 and strategy_cls is None:  # the writer of the run directory; load_checkpoint may load read-only
        check_outputs(plan)
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
        field = getattr(err, "field", "")  # placed at the setting it names, where that setting came from
        raise loaded.error(str(err), ("trainer", field) if hasattr(config.trainer, field) else ("trainer",)) from None
    _check_accumulation(plan, train_loader, world_size)
    if plan.scheduler_total_steps:
        _check_horizon(plan, run_length, run_epochs)
    elif plan.config.lr_scheduler is not None:
        _check_warmup(plan, run_length, run_epochs)
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
    for hook in extra_hooks:  # load_checkpoint's own hooks: registered before SETUP, as the config's are
        strategy.register_hook(hook)
    # SETUP now, not at the first step: what the hooks check against the model (a trainable-parameter
    # pattern that matches nothing, a patch naming no submodule) is a located config error for
    # ``validate`` and ``train`` alike, and the run's start finds the strategy set up.
    _constructing(loaded, ("hooks",), "SETUP", lambda: strategy.setup(train_loader))
    if any(isinstance(h, SavesCheckpoints) for h in plan.hooks):  # what the first save would refuse, refused now
        from nvtrain.state import checkpointable_hooks, strategy_hooks

        _constructing(
            loaded, ("hooks",), "the checkpointed hooks", lambda: checkpointable_hooks(strategy_hooks(strategy))
        )
    watch = RunWatch(plan, rank)
    strategy.register_hook(watch)
    built = Built(strategy=strategy, train_loader=train_loader, watch=watch, run_length=run_length)
    plan_resume(plan, built, rank, world_size, fresh)
    state = saved_state(plan, built)
    check_saved_weights(plan, built, state)
    _check_saved_position(plan, built, state, world_size)
    watch.effective_config = built.effective_config
    return built


def check_outputs(plan: Plan) -> None:
    """Refuse a run directory, or a hook's output path (``output``, ``checkpoint_dir``...), that cannot be
    created, so ``validate`` says so and ``train`` fails before its first step, not when it first writes there.

    Each component still to create must fit the file system's name limit (``NAME_MAX``), and
    the nearest existing folder must take a new entry. That is tried, not read from mode bits
    (which root ignores, and ``/proc`` does not tell): an empty probe directory is made and
    removed at once, so nothing is left behind.
    """
    from nvtrain.app.hook_stack import output_parameters

    run_dir = plan.run_dir
    _check_creatable(plan, run_dir, f"the run directory {str(run_dir)!r}", ("output_dir",), last_key=("name",))
    for index, hook in enumerate(plan.hooks[: len(plan.config.hooks)]):  # the config's hooks, in its order
        for parameter in output_parameters(type(hook)):
            value = getattr(hook, parameter, None)
            if isinstance(value, (str, os.PathLike)) and str(value):
                what = f"hook {plan.config.hooks[index].name!r}: {parameter} {str(value)!r}"
                _check_creatable(plan, Path(value), what, ("hooks", index, parameter))


def _check_creatable(
    plan: Plan, target: Path, what: str, key: tuple[str | int, ...], last_key: tuple[str | int, ...] | None = None
) -> None:
    """``target`` (a folder or a file) can be created or written: see :func:`check_outputs`."""
    _, existing = folders_to_create(target)
    if not existing.is_dir():  # a file in the way (prepare() and the hooks' validators name it), or the file itself
        return
    limit = name_max(existing)
    to_create = target.parts[len(existing.parts) :]
    for position, part in enumerate(to_create, start=1):
        size = len(os.fsencode(part))
        if size > limit:
            raise plan.loaded.error(
                f"{_shortened(what)} cannot be created: expected names of at most {limit} bytes, got one of "
                f"{size} bytes ({_shortened(part)!r})",
                last_key if last_key is not None and position == len(to_create) else key,
            )
    if not to_create:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise plan.loaded.error(f"{_shortened(what)} must be a writable folder, and it is not", key)
        return
    probe = existing / f".nvtrain-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as err:
        raise plan.loaded.error(
            f"{_shortened(what)} cannot be created: expected a writable folder at {str(existing)!r}, got "
            f"{err.strerror or type(err).__name__}",
            key,
        ) from None
    probe.rmdir()


def folders_to_create(path: Path) -> tuple[list[Path], Path]:
    """``path`` and the folders above it that do not exist yet (deepest first), and the nearest one that does;
    a path the OS cannot even look up (a name too long, a symlink loop) counts as not existing."""
    missing = []
    for candidate in (path, *path.parents):
        try:
            os.stat(candidate)
        except (OSError, ValueError):
            missing.append(candidate)
            continue
        return missing, candidate
    return missing, Path(".")


def _shortened(text: str, keep: int = 40) -> str:
    """A long name cut in the middle, so the message stays one readable line."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def _constructing(loaded: LoadedConfig, path: tuple[str | int, ...], what: str, make: Callable[[], Any]) -> Any:
    """Call ``make``; a ValueError / TypeError / ImportError... it raises becomes one located line naming ``what``."""
    from nvtrain.config import ConfigError

    try:
        return make()
    except ConfigError:
        raise
    except NOT_REFUSALS:  # out of memory, a failing device or process group: the run's failure, with its traceback
        raise
    except REFUSALS as err:
        # ImportError: a factory needing what is not installed (the digits job without scikit-learn);
        # RuntimeError: what torch raises for an argument it refuses (manual_seed('abc')), as factories do too
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        kind = "" if isinstance(err, _SAID_REFUSALS) or text == type(err).__name__ else f"{type(err).__name__}: "
        raise loaded.error(f"{what}: {kind}{text}{_where_raised(err)}", _blame(loaded, path, text)) from None


#: What a factory raises on purpose to refuse its arguments; other kinds (a KeyError, an IndexError, an
#: AssertionError) are more likely a bug in it, so the line names the kind and where it was raised.
_SAID_REFUSALS = (ValueError, TypeError, ImportError, RuntimeError)


def _where_raised(err: BaseException) -> str:
    """`` (at mods.py:12 in build)``: the innermost frame of ``err`` in the user's code (outside nvtrain, torch and
    the Python installation), or "" when it was raised elsewhere (torch refusing an argument)."""
    paths = sysconfig.get_paths()
    libraries = [Path(__file__).parents[1], Path(os.__file__).parent, Path(paths["purelib"]), Path(paths["platlib"])]
    libraries.append(Path(torch.__file__).parent)  # installed elsewhere in an editable or system setup
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        filename = Path(frame.filename)
        if not any(filename.is_relative_to(library) for library in libraries) and not frame.filename.startswith("<"):
            return f" (at {filename.name}:{frame.lineno} in {frame.name})"
    return ""


def _not_refusals() -> tuple[type[BaseException], ...]:
    """RuntimeErrors that say nothing about the config: memory, the accelerator, the process group."""
    kinds: list[type[BaseException]] = [torch.OutOfMemoryError, torch.cuda.OutOfMemoryError]
    for owner, name in ((torch, "AcceleratorError"), (torch.distributed, "DistError")):
        kind = getattr(owner, name, None)
        if isinstance(kind, type) and issubclass(kind, BaseException):
            kinds.append(kind)
    return tuple(dict.fromkeys(kinds))


#: RuntimeErrors that are the run's failure, never the config's: they propagate with their traceback.
NOT_REFUSALS = _not_refusals()


#: What a factory or a hook raises to refuse what it is given (one line, not a traceback). Catch
#: :data:`NOT_REFUSALS` first: those RuntimeErrors are the run's failure, never a refusal.
REFUSALS: tuple[type[Exception], ...] = (
    ValueError, TypeError, KeyError, IndexError, AssertionError, ImportError, RuntimeError
)


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
    # torch names the value, not the key ("Invalid learning rate: -1"): the one kwarg whose value it quotes
    quoted = [
        key
        for key, value in kwargs.items()
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and str(value)
        and re.search(rf"(?<![\w.-]){re.escape(str(value))}(?![\w.])", message)
    ]
    if len(quoted) == 1:
        return (*path, "kwargs", quoted[0])
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


def _check_saved_position(plan: Plan, built: Built, state: Mapping[str, Any] | None, world: int) -> None:
    """In one process, a data position the run's step scheduler would refuse (another global batch size, data
    set or sample order) is refused now, by a scheduler built as the run's is, so ``validate`` says so too.
    Under several ranks the loaders are re-sampled at SETUP and the run's own check decides."""
    saved = state.get("scheduler") if state is not None else None
    if world != 1 or not isinstance(saved, Mapping):
        return
    scheduler = _run_scheduler(plan.config, built.train_loader, built.train_loader, 1, _accumulation(plan))
    try:
        scheduler.check_state_dict(dict(saved))
    except ValueError as err:
        raise plan.loaded.error(f"cannot resume: {with_model_changes(str(err), built)}", ("hooks",)) from None


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
    batches = _length(loader)
    local_batch = loader_batch_size(loader)  # its batch_sampler's for a DataLoader given batch_sampler=
    local = local_batch or 1
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
    scheduler = _run_scheduler(config, loader, counted, world, accumulation)
    steps = scheduler.total_steps
    return (max(1, steps) if steps is not None else None), scheduler.num_epochs


def _run_scheduler(config: RunConfig, loader: Any, counted: Any, world: int, accumulation: int) -> Any:
    """A step scheduler configured as the run's will be, reading ``counted`` (``loader``, or its estimated
    share of one rank), to ask what the run's would answer."""
    trainer = config.trainer
    local = loader_batch_size(loader) or 1
    return trainer.create(
        global_batch_size=trainer.global_batch_size or local * world * accumulation,
        local_batch_size=local,
        dp_size=world,
        dataloader=counted,
        preemption_signal=None,
        synchronized_stream=bool(getattr(loader, "synchronized_stream", False)),
    )


def _check_accumulation(plan: Plan, loader: Any, world: int) -> None:
    """``trainer.global_batch_size`` and an accumulation hook's ``steps`` must agree, as the strategy
    checks in ``run()``: refused here, before anything is written."""
    gbs = plan.config.trainer.global_batch_size
    hook = accumulating_hook(plan.hooks, strict=False)  # two are refused at the strategy, naming hooks
    if gbs is None or hook is None:
        return
    index = next(i for i, h in enumerate(plan.hooks) if h is hook)
    local = loader_batch_size(loader) or 1
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


def _schedule_length(plan: Plan, steps: int | None, epochs: int | None) -> tuple[int | None, str]:
    """How many times the LR scheduler steps over the run (None: unknown), and in what unit.

    ``steps`` and ``epochs`` are absolute, like ``max_steps``; a scheduler built fresh starts
    counting at ``trainer.start_step`` (``start_epoch`` for an epoch interval), so that is taken off.
    """
    section, trainer = plan.config.lr_scheduler, plan.config.trainer
    assert section is not None
    if section.interval == "epoch":
        return (None if epochs is None else max(1, epochs - trainer.start_epoch)), "epochs"
    return (None if steps is None else max(1, steps - trainer.start_step)), "optimizer steps"


def _check_horizon(plan: Plan, steps: int | None, epochs: int | None) -> None:
    """The scheduler's horizon (``T_max`` / ``total_steps`` left out) must be known and longer than the warmup."""
    section = plan.config.lr_scheduler
    assert section is not None
    names = " / ".join(plan.scheduler_total_steps)
    length, _ = _schedule_length(plan, steps, epochs)
    if length is None:
        unknown = (
            "the run's epoch count is unknown; set trainer.num_epochs"
            if section.interval == "epoch"
            else "the run's step count is unknown (the training loader has no len()); set trainer.max_steps"
        )
        raise plan.loaded.error(f"{unknown} or give {names} in lr_scheduler.kwargs", ("lr_scheduler",))
    _check_warmup(plan, steps, epochs, f"; lower warmup_steps or give {names} in lr_scheduler.kwargs")


def _check_warmup(plan: Plan, steps: int | None, epochs: int | None, advice: str = "; lower warmup_steps") -> None:
    """A warmup as long as the run (where its length is known) never reaches the base rate: refused."""
    section = plan.config.lr_scheduler
    assert section is not None
    length, unit = _schedule_length(plan, steps, epochs)
    if section.warmup_steps and length is not None and section.warmup_steps >= length:
        raise plan.loaded.error(
            f"warmup_steps={section.warmup_steps} leaves no {unit} for {section.factory}: the run has {length} "
            f"{unit}{advice}",
            ("lr_scheduler", "warmup_steps"),
        )


def _horizon(plan: Plan, steps: int | None, epochs: int | None) -> dict[str, int]:
    """``T_max`` / ``total_steps`` the kwargs leave out: the run's length in the schedule's interval
    (optimizer steps, or epochs, from ``start_step`` / ``start_epoch``), less the warmup."""
    section = plan.config.lr_scheduler
    if section is None or not plan.scheduler_total_steps:
        return {}
    length, _ = _schedule_length(plan, steps, epochs)
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
    """Accept ``(train, val)``, ``{"train": ..., "validation": ...}`` or a lone train loader.

    A training loader that is None or not iterable is refused here, so ``validate`` says so, not the run's start.
    """
    if isinstance(result, Mapping):
        unknown = set(result) - {"train", "validation", "val"}
        if "train" not in result or unknown:
            raise TypeError(
                f"{spec} returned a mapping with keys {sorted(result)}; expected 'train' and optionally 'validation'"
            )
        train, val = result["train"], result.get("validation", result.get("val"))
    elif isinstance(result, (tuple, list)) and result and all(map(_looks_like_a_batch, result)):
        train, val = result, None  # a list of batches is one loader (two of them were taken for train and val)
    elif isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise TypeError(
                f"{spec} returned a {type(result).__name__} of {len(result)} items; expected (train_loader, "
                "validation_loader), {'train': ..., 'validation': ...} or one loader (a list of batches is one)"
            )
        train, val = result
    else:
        train, val = result, None
    _check_iterable(train, spec, "training loader", required=True)
    _check_iterable(val, spec, "validation loader", required=False)
    return train, val


def _looks_like_a_batch(item: Any) -> bool:
    """A tensor, or a tuple / list / mapping of tensors: a batch, not a loader."""
    if isinstance(item, torch.Tensor):
        return True
    if isinstance(item, Mapping):
        item = list(item.values())
    if not isinstance(item, (tuple, list)) or not item:
        return False
    return all(isinstance(value, torch.Tensor) for value in item)


def _check_iterable(loader: Any, spec: str, role: str, *, required: bool) -> None:
    """A loader must be iterable (a DataLoader, a list of batches); the validation loader may be None."""
    if loader is None and not required:
        return
    if loader is None or not (hasattr(type(loader), "__iter__") or hasattr(type(loader), "__getitem__")):
        got = "None" if loader is None else f"a {type(loader).__name__}, which is not iterable"
        raise TypeError(f"{spec} returned {got} as the {role}; expected a loader or an iterable of batches")
    if not required and read_up_by_one_pass(loader):  # the validation data is read at every validation
        raise TypeError(
            f"{spec} returned a {type(loader).__name__} as the {role}, which the first validation reads up (every "
            "later one would find it empty); return a DataLoader or a list of batches"
        )


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
