"""The in-memory training state a resume needs, captured from and applied to a strategy.

``capture_state(strategy)`` returns one nested dict: model weights (unwrapped from
DistributedDataParallel), optimizer and LR-scheduler states, the context counters,
the step scheduler's state (the data position), the global RNG states and the state
of every hook that satisfies :class:`~nvtrain.hook.CheckpointableHook`.
``apply_state(strategy, state)`` puts it back, also into models sharded with FSDP when
the state holds full tensors (one process wrote it): each rank takes its shards. The
on-disk format belongs to the ``nvtrain-checkpoint`` distribution; the core only finds
its reader through the ``checkpoint`` entry point (or a hook that has ``read_checkpoint``).

Tensors in a captured state are live references (as in ``nn.Module.state_dict()``):
copy them before the training loop continues if they must stay fixed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, final

import torch

from nvtrain.data_cursor import is_stateful_dataloader
from nvtrain.distributed import unwrap_model
from nvtrain.epoch_reader import loader_generators
from nvtrain.errors import ResumeError, first_line
from nvtrain.full_state import full_into_sharded, load_full_model, load_full_optimizer
from nvtrain.hook import CheckpointableHook, hook_label
from nvtrain.hookspecs import PROJECT_NAME, hookimpl
from nvtrain.host_rng import apply_host_rng, capture_host_rng
from nvtrain.stages import TrainingStage
from nvtrain.step_scheduler import stateful_loader_state

if TYPE_CHECKING:
    from nvtrain.context import TrainingContext
    from nvtrain.strategy import TrainingStrategy

__all__ = [
    "COUNTERS",
    "STATE_FORMAT",
    "apply_loader_generators",
    "apply_rng_state",
    "apply_state",
    "capture_rng_state",
    "capture_state",
    "check_model_fits",
    "check_restorable",
    "check_state",
    "checkpointable_hooks",
    "find_checkpoint_reader",
    "find_manifest_reader",
    "hook_state_key",
    "load_state",
    "strategy_hooks",
    "unwrap_model",
]

#: Version of the dict layout produced by :func:`capture_state`.
STATE_FORMAT = 1

#: The context counters a resume restores.
COUNTERS = ("step_count", "global_step_count", "batch_count", "epoch", "epoch_step_count")

#: Entry point (group ``nvtrain``) of the distribution that reads checkpoints from disk.
READER_ENTRY_POINT = "checkpoint"

_SECTIONS = ("models", "optimizers", "lr_schedulers", "counters", "scheduler", "hooks", "rng")


# -- capture ----------------------------------------------------------------------------------


def strategy_hooks(strategy: TrainingStrategy) -> list[object]:
    """Every hook given to the strategy (update hooks first), each once."""
    seen: set[int] = set()
    hooks: list[object] = []
    for hook in strategy.registry.hooks():
        if id(hook) not in seen:
            seen.add(id(hook))
            hooks.append(hook)
    return hooks


#: How :func:`capture_state` keys hook states (``state["hook_keys"]``); a state without it used
#: ``<name>:<index>`` keys, which follow the order the hooks were registered in.
HOOK_KEYS = "identity"


def hook_state_key(hook: object) -> str:
    """The key a hook's state is saved under: ``<plugin_name or class>`` plus its identity.

    The identity is the hook's ``state_key`` attribute when it has a non-empty string
    one, else the ``model_key`` it serves (``ema:main``); a hook with neither is keyed by
    its name alone (``amp``). Registration order plays no part.
    """
    name = getattr(hook, "plugin_name", None)
    base = name if isinstance(name, str) and name else type(hook).__qualname__
    for attribute in ("state_key", "model_key"):
        identity = getattr(hook, attribute, None)
        if isinstance(identity, str) and identity:
            return f"{base}:{identity}"
    return base


def checkpointable_hooks(hooks: Iterable[object]) -> dict[str, CheckpointableHook]:
    """Checkpointable hooks by a key that survives a restart and a reordering (:func:`hook_state_key`).

    Two EMA hooks for models ``main`` and ``teacher`` become ``ema:main`` and
    ``ema:teacher``. Two hooks that would share a key are refused with a ValueError
    naming both: give each a distinct ``state_key`` attribute.
    """
    keyed: dict[str, CheckpointableHook] = {}
    for hook in hooks:
        if isinstance(hook, type) or not isinstance(hook, CheckpointableHook):
            continue
        if getattr(hook, "saves_state", True) is False:  # state it keeps elsewhere (see SchedulerAccumulationHook)
            continue
        key = hook_state_key(hook)
        other = keyed.get(key)
        if other is not None:
            raise ValueError(
                f"hooks {hook_label(other)} and {hook_label(hook)} would both save their checkpoint state under "
                f"the key {key!r}, so a resume could not tell them apart; give each a distinct `state_key` "
                "attribute (a string, e.g. state_key='teacher')"
            )
        keyed[key] = hook
    return keyed


def _legacy_hook_keys(hooks: Iterable[object]) -> dict[str, CheckpointableHook]:
    """The keys of states written before :data:`HOOK_KEYS`: ``<name>:<index>`` in registration order."""
    counts: dict[str, int] = {}
    keyed: dict[str, CheckpointableHook] = {}
    for hook in hooks:
        if isinstance(hook, type) or not isinstance(hook, CheckpointableHook):
            continue
        name = getattr(hook, "plugin_name", None)
        base = name if isinstance(name, str) and name else type(hook).__qualname__
        index = counts.get(base, 0)
        counts[base] = index + 1
        keyed[f"{base}:{index}"] = hook
    return keyed


def capture_rng_state(loader: Any = None, *, loader_state: bool = True) -> dict[str, Any]:
    """Python, NumPy (when installed), torch CPU, every CUDA device (once CUDA is initialised) and the loader's
    generators.

    For a torchdata StatefulDataLoader, also the loader's own state at the data position of
    the step scheduler reading it (``"loader"``, as ``StepScheduler.state_dict()["loader"]``;
    None when no scheduler reads it or at an epoch's start), unless ``loader_state=False``:
    with the RNG states, what each rank contributes to a checkpoint that rank 0 writes for
    all of them (``rng_by_rank``).
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), **capture_host_rng()}
    # Only once CUDA is initialised: before that no CUDA draw has happened (its generators are as seeded), and
    # reading them would initialise CUDA, a context on the GPU for a run on the CPU (in every rank).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    state["generators"] = {path: gen.get_state() for path, gen in loader_generators(loader).items()}
    if loader_state and loader is not None and is_stateful_dataloader(loader):
        state["loader"] = stateful_loader_state(loader)
    return state


def capture_state(strategy: TrainingStrategy) -> dict[str, Any]:
    """Everything a bitwise resume of ``strategy`` needs, as one nested dict of live references."""
    ctx = strategy.ctx
    scheduler = ctx.scheduler
    scheduler_state = scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else None
    window = _open_window_gradients(ctx)
    return {
        **({"gradients": window} if window is not None else {}),
        "format": STATE_FORMAT,
        "models": {name: unwrap_model(model).state_dict() for name, model in ctx.models.items()},
        "optimizers": {name: optimizer.state_dict() for name, optimizer in ctx.optimizers.items()},
        "optimizer_classes": {name: _class_path(optimizer) for name, optimizer in ctx.optimizers.items()},
        "lr_schedulers": {name: _scheduler_state(name, sched) for name, sched in ctx.lr_schedulers.items()},
        "counters": {name: int(getattr(ctx, name)) for name in COUNTERS},
        "scheduler": scheduler_state,
        "hooks": {key: hook.state_dict() for key, hook in checkpointable_hooks(strategy_hooks(strategy)).items()},
        "hook_keys": HOOK_KEYS,
        # Last, so nothing captured above can have drawn from the generators afterwards. The loader's
        # own state is in "scheduler" already (rng_by_rank, when there is one, holds every rank's).
        "rng": capture_rng_state(ctx.train_loader, loader_state=False),
    }


def _open_window_gradients(ctx: TrainingContext) -> dict[str, dict[str, torch.Tensor]] | None:
    """The gradients accumulated so far when standalone ``train_batch()`` calls left a window open, else None.

    Resuming continues that window (the accumulation hook's counter is in its state), so its
    micro-batches' gradients are part of the state. A run's windows need none: a state captured
    inside one resumes at the window's start and replays it.
    """
    if ctx.sync_gradients or ctx.windowed:
        return None
    if ctx.world_size > 1:
        raise RuntimeError(
            f"capturing the training state inside an accumulation window (micro-batch {ctx.window_position + 1} of "
            f"{ctx.window_size}) with {ctx.world_size} ranks: each rank holds gradients of its own that the window "
            "has not reduced yet, and one state cannot carry them; capture it after the window's last micro-batch"
        )
    return {
        name: {key: param.grad for key, param in unwrap_model(model).named_parameters() if param.grad is not None}
        for name, model in ctx.models.items()
    }


def _apply_window_gradients(ctx: TrainingContext, saved: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Give the parameters the gradients of the window a state was captured in (``None`` where it had none)."""
    for name, model in ctx.models.items():
        grads = saved.get(name, {})
        for key, param in unwrap_model(model).named_parameters():
            grad = grads.get(key)
            param.grad = None if grad is None else torch.empty_like(param).copy_(grad)


def _scheduler_state(name: str, scheduler: Any) -> Any:
    if isinstance(scheduler, (list, tuple)):
        return [s.state_dict() for s in scheduler]
    return scheduler.state_dict()


# -- apply --------------------------------------------------------------------------------------


def check_state(state: Any, source: str = "state") -> None:
    """Refuse something that is not a state produced by :func:`capture_state`."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{source} must be a training state dict (got {type(state).__name__})")
    if "format" not in state:
        raise ValueError(
            f"{source}: not a training state: it has no 'format' key (expected the keys of strategy.state_dict(): "
            f"{sorted(('format', *_SECTIONS))}; got {_some_keys(state)})"
        )
    version = state["format"]
    if version != STATE_FORMAT:
        raise ValueError(
            f"{source}: training state format {version!r} is not supported by this nvtrain "
            f"(expected {STATE_FORMAT})"
        )
    missing = [section for section in _SECTIONS if section not in state]
    if missing:
        raise ValueError(f"{source}: training state lacks the section(s) {missing}")


def _some_keys(state: Mapping[Any, Any], shown: int = 8) -> str:
    """The first keys of ``state``, sorted, for a message: a model's state_dict given instead has hundreds."""
    keys = sorted(map(str, state))
    if not keys:
        return "an empty dict"
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"the keys {keys[:shown]}{more}"


def _class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_optimizer_classes(saved: Any, live: Mapping[str, torch.optim.Optimizer]) -> None:
    """Another optimizer class would take the saved param groups and fail at its first step (a raw KeyError)."""
    if not isinstance(saved, Mapping):
        return  # a state written before classes were recorded
    for name, optimizer in live.items():
        was, now = saved.get(name), _class_path(optimizer)
        if isinstance(was, str) and was != now:
            raise ResumeError(
                f"the checkpoint's optimizer {name!r} is {was} but this run builds {now}; an optimizer's state "
                "cannot move to another class: resume with the same optimizer, or start a fresh run"
            )


def _check_names(kind: str, saved: Mapping[str, Any], live: Mapping[str, Any]) -> None:
    if set(saved) != set(live):
        raise ResumeError(
            f"the checkpoint's {kind} are {sorted(saved)} but this strategy has {sorted(live)}; "
            "build the strategy with the same names as the one that saved it"
        )


def apply_rng_state(state: Mapping[str, Any], loader: Any = None) -> None:
    """Set the generators captured by :func:`capture_rng_state` back."""
    apply_host_rng(state)
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) != torch.cuda.device_count():
            warnings.warn(
                f"the checkpoint holds RNG states for {len(cuda_states)} CUDA device(s) but "
                f"{torch.cuda.device_count()} are visible; restoring the first "
                f"{min(len(cuda_states), torch.cuda.device_count())}, so random draws on the others differ",
                stacklevel=3,
            )
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    apply_loader_generators(state, loader)


def apply_loader_generators(state: Mapping[str, Any], loader: Any) -> None:
    """Set the loader's sampling generators from an RNG state of :func:`capture_rng_state`."""
    live = loader_generators(loader)
    for path, gen_state in (state.get("generators") or {}).items():
        generator = live.get(path)
        if generator is not None:
            generator.set_state(gen_state)


def apply_state(strategy: TrainingStrategy, state: Mapping[str, Any], *, scheduler: bool = True) -> None:
    """Restore ``state`` into a set-up ``strategy``; the global RNG states are set last.

    ``scheduler=False`` leaves the step scheduler's data position alone (it is applied
    at the start of the next run instead). A state written by rank 0 for several ranks
    may carry ``rng_by_rank``; each rank then takes its own entry.
    """
    # What can be refused is refused before anything is loaded: a refused state leaves the strategy as it was.
    check_restorable(strategy, state, scheduler=scheduler)
    ctx = strategy.ctx
    for name, model in ctx.models.items():
        _load_model(name, model, state["models"][name])
    for name, optimizer in ctx.optimizers.items():
        _load_optimizer(name, optimizer, state["optimizers"][name], ctx.models)
    for name, sched in ctx.lr_schedulers.items():
        saved = state["lr_schedulers"][name]
        if isinstance(sched, (list, tuple)):
            for one, one_state in zip(sched, saved, strict=True):
                one.load_state_dict(one_state)
        else:
            sched.load_state_dict(saved)
    for name in COUNTERS:
        setattr(ctx, name, int(state["counters"][name]))
    window = state.get("gradients")
    if window is not None:
        _apply_window_gradients(ctx, window)
    _apply_hook_states(strategy, state["hooks"], legacy=state.get("hook_keys") != HOOK_KEYS)
    if scheduler:
        apply_scheduler_state(strategy, state)
    apply_rng_state(_rank_rng(strategy, state), ctx.train_loader)


def check_restorable(
    strategy: TrainingStrategy, state: Mapping[str, Any], *, scheduler: bool = True, weights: bool = True
) -> None:
    """Refuse, changing nothing, a state :func:`apply_state` would refuse part of the way through.

    Every part that can be refused (names, weights, optimizer and LR scheduler states, counters,
    the step scheduler's data position when ``scheduler``, RNG states) is checked before any is
    loaded, so a refused state leaves the strategy as it was and a retried run refuses it again.
    ``weights=False`` leaves the models' and optimizers' states out: a sharded checkpoint checks
    the rest of its state with it before loading those through DCP.
    """
    check_state(state)
    ctx = strategy.ctx
    _check_names("models", state["models"], ctx.models)
    _check_names("optimizers", state["optimizers"], ctx.optimizers)
    _check_names("LR schedulers", state["lr_schedulers"], ctx.lr_schedulers)
    if state.get("gradients") is not None and ctx.world_size > 1:
        raise ResumeError(
            "the state was captured inside an open accumulation window, in one process, and holds that window's "
            f"gradients, which {ctx.world_size} ranks cannot share out; resume it in one process, or capture the "
            "state after the window's last micro-batch"
        )
    _check_optimizer_classes(state.get("optimizer_classes"), ctx.optimizers)
    for name, model in ctx.models.items() if weights else ():
        _check_weights(name, model, state["models"][name])
        check_model_fits(name, model, state["models"][name])
    for name, optimizer in ctx.optimizers.items() if weights else ():
        _check_mapping(f"optimizers[{name!r}]", state["optimizers"][name], "an optimizer state dict")
        _check_optimizer_fits(name, optimizer, state["optimizers"][name])
    for name, sched in ctx.lr_schedulers.items():
        _check_lr_scheduler_state(name, sched, state["lr_schedulers"][name])
    _check_counters(state["counters"])
    _check_mapping("hooks", state["hooks"], "a dict of hook states by key")
    if scheduler:
        _check_scheduler_state(strategy, state)
    _check_rng_state(_rank_rng(strategy, state), ctx.train_loader)


def _got(value: Any) -> str:
    """How a refusal names what it found: a short repr and its type."""
    text = repr(value)
    return f"{text[:60] + '...' if len(text) > 60 else text} ({type(value).__name__})"


def _check_mapping(key: str, value: Any, expected: str) -> None:
    if not isinstance(value, Mapping):
        raise ResumeError(f"the state's {key} must be {expected}; got {_got(value)}")


def _check_weights(name: str, model: torch.nn.Module, saved: Any) -> None:
    """A model's saved weights: a dict by name, with a tensor wherever the model holds one (what a module keeps
    otherwise, its ``_extra_state`` say, is left to it)."""
    _check_mapping(f"models[{name!r}]", saved, "a dict of tensors by parameter name")
    live = unwrap_model(model).state_dict()
    for key, value in saved.items():
        if not isinstance(key, str):
            raise ResumeError(f"the state's models[{name!r}] must be keyed by parameter name; got the key {_got(key)}")
        if isinstance(live.get(key), torch.Tensor) and not isinstance(value, torch.Tensor):
            raise ResumeError(f"the state's models[{name!r}][{key!r}] must be a tensor; got {_got(value)}")


def _check_lr_scheduler_state(name: str, live: Any, saved: Any) -> None:
    """A chained LR scheduler (a list) takes a list of as many states; each state is a dict where the live one's is."""
    if not isinstance(live, (list, tuple)):
        if isinstance(live.state_dict(), Mapping):
            _check_mapping(f"lr_schedulers[{name!r}]", saved, "an LR scheduler state dict")
        return
    if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
        raise ResumeError(
            f"the state's lr_schedulers[{name!r}] must be a list of {len(live)} LR scheduler states (this run chains "
            f"{len(live)}); got {_got(saved)}"
        )
    for index, (one, one_saved) in enumerate(zip(live, saved, strict=True)):
        if isinstance(one.state_dict(), Mapping):
            _check_mapping(f"lr_schedulers[{name!r}][{index}]", one_saved, "an LR scheduler state dict")


def _check_counters(counters: Any) -> None:
    """Every counter of :data:`COUNTERS`, an int >= 0 (as :func:`capture_state` writes them)."""
    _check_mapping("counters", counters, f"a dict of {list(COUNTERS)}")
    for name in COUNTERS:
        value = counters.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            shown = "nothing" if name not in counters else _got(value)
            raise ResumeError(f"the state's counters[{name!r}] must be an int >= 0; got {shown}")


def _check_scheduler_state(strategy: TrainingStrategy, state: Mapping[str, Any]) -> None:
    """The step scheduler's refusal of the data position (another batch configuration, data set, sample order),
    asked of a scheduler that can answer without loading (``check_state_dict``)."""
    saved = _scheduler_state_to_load(strategy, state)
    check = getattr(strategy.ctx.scheduler, "check_state_dict", None)
    if saved is None or not callable(check):
        return
    try:
        check(saved)
    except ValueError as err:
        raise ResumeError(str(err)) from None


def _check_rng_state(rng: Any, loader: Any) -> None:
    """Each saved RNG state, set into a scratch generator of its kind (the global ones stay untouched)."""
    _check_mapping("rng", rng, "a dict of RNG states")
    _try_rng("rng['torch']", lambda: torch.Generator().set_state(rng["torch"]))
    cuda_states = rng.get("cuda")
    if cuda_states and torch.cuda.is_available():
        _check_cuda_rng(cuda_states)
    _try_rng("rng['python'] / rng['numpy']", functools.partial(_try_host_rng, rng))
    generators = rng.get("generators") or {}
    _check_mapping("rng['generators']", generators, "a dict of generator states by loader attribute")
    for path, live in loader_generators(loader).items():
        if path in generators:
            scratch = torch.Generator(device=live.device)
            _try_rng(f"rng['generators'][{path!r}]", functools.partial(scratch.set_state, generators[path]))


def _check_cuda_rng(states: Any) -> None:
    """The CUDA RNG states :func:`apply_rng_state` restores: uint8 tensors, tried in a scratch generator once
    CUDA is initialised (restoring them does not initialise it, and neither does this check)."""
    if not isinstance(states, (list, tuple)):
        raise ResumeError(f"the state's rng['cuda'] must be a list of CUDA RNG states; got {_got(states)}")
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ResumeError(f"the state's rng['cuda'][{index}] must be a uint8 tensor; got {_got(state)}")
        if torch.cuda.is_initialized():
            generator = torch.Generator(device=f"cuda:{index}")
            _try_rng(f"rng['cuda'][{index}]", functools.partial(generator.set_state, state))


def _try_host_rng(rng: Mapping[str, Any]) -> None:
    """Set Python's and NumPy's saved states, then put the current ones back (no scratch object takes them as is)."""
    current = capture_host_rng()
    try:
        apply_host_rng(rng)
    finally:
        apply_host_rng(current)


def _try_rng(key: str, trial: Callable[[], object]) -> None:
    try:
        trial()
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError, OverflowError) as err:
        raise ResumeError(f"the state's {key} cannot be restored: {type(err).__name__}: {first_line(err)}") from None


def check_model_fits(name: str, model: torch.nn.Module, saved: Any) -> None:
    """Refuse saved weights whose names or shapes differ from the model's, as ``load_state_dict`` would (but
    before anything is loaded); full weights for a sharded model are checked as they load.

    What a module decides for itself is left to it: under a module with a load pre-hook (which may rename
    the saved keys) or its own ``_load_from_state_dict`` (BatchNorm accepts a state without
    ``num_batches_tracked``) names are not compared, and a lazy parameter not yet materialised takes any shape.
    """
    module = unwrap_model(model)
    if not isinstance(saved, Mapping) or full_into_sharded(module.parameters(), saved):
        return
    own_loaders = tuple(
        f"{prefix}." if prefix else ""
        for prefix, sub in module.named_modules()
        if sub._load_state_dict_pre_hooks or type(sub)._load_from_state_dict is not _MODULE_LOADER
    )
    live = module.state_dict()
    missing = [key for key in live if key not in saved and not key.startswith(own_loaders or ("\0",))]
    unexpected = [key for key in saved if key not in live and not key.startswith(own_loaders or ("\0",))]
    shapes = [
        f"{key}: saved {tuple(saved[key].shape)}, model {tuple(value.shape)}"
        for key, value in live.items()
        if key in saved
        and isinstance(value, torch.Tensor)
        and not torch.nn.parameter.is_lazy(value)
        and isinstance(saved[key], torch.Tensor)
        and saved[key].shape != value.shape
    ]
    problems = [
        *([f"missing {_first_few(missing)}"] if missing else []),
        *([f"unexpected {_first_few(unexpected)}"] if unexpected else []),
        *([f"size mismatch for {_first_few(shapes)}"] if shapes else []),
    ]
    if problems:
        raise ResumeError(f"the checkpoint's weights for model {name!r} do not fit this model: {'; '.join(problems)}")


#: ``torch.nn.Module``'s own state loader: a module that replaces it loads in its own way.
_MODULE_LOADER = torch.nn.Module._load_from_state_dict


def _check_optimizer_fits(name: str, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """Refuse a saved optimizer state whose parameter groups differ in number or size (as ``load_state_dict``
    would, after the models and the optimizers before it were loaded)."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list):
        return  # malformed: load_state_dict says how
    saved_sizes = [len(group.get("params", ())) for group in groups if isinstance(group, Mapping)]
    live_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != live_sizes:
        raise ResumeError(
            f"the checkpoint's state for optimizer {name!r} does not fit it: its parameter groups hold "
            f"{saved_sizes} parameters in the checkpoint but {live_sizes} in this optimizer"
        )


def _first_few(items: list[str], shown: int = 5) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _load_model(name: str, model: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    """Load the saved weights of model ``name``; full ones into a sharded model through
    :func:`~nvtrain.full_state.load_full_model`."""
    module = unwrap_model(model)
    if full_into_sharded(module.parameters(), saved):
        load_full_model(name, module, saved)
        return
    try:
        module.load_state_dict(saved)
    except RuntimeError as err:
        raise ResumeError(
            f"the checkpoint's weights for model {name!r} do not fit this model: {first_line(err)}"
        ) from None


def _load_optimizer(
    name: str, optimizer: torch.optim.Optimizer, saved: Any, models: Mapping[str, torch.nn.Module]
) -> None:
    """Load the saved state of optimizer ``name``; a full one into sharded parameters through
    :func:`~nvtrain.full_state.load_full_optimizer`."""
    params = (param for group in optimizer.param_groups for param in group["params"])
    if isinstance(saved, Mapping) and full_into_sharded(params, saved.get("state")):
        load_full_optimizer(name, optimizer, saved, models)
        return
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as err:
        raise ResumeError(f"the checkpoint's state for optimizer {name!r} does not fit it: {err}") from None


def _rank_rng(strategy: TrainingStrategy, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """This rank's RNG state: its entry of ``rng_by_rank`` when rank 0 wrote one per rank."""
    ctx = strategy.ctx
    by_rank = state.get("rng_by_rank")
    if isinstance(by_rank, (list, tuple)) and len(by_rank) == ctx.world_size:
        return by_rank[ctx.rank]  # type: ignore[no-any-return]
    return state["rng"]  # type: ignore[no-any-return]


def apply_scheduler_state(strategy: TrainingStrategy, state: Mapping[str, Any]) -> None:
    """Give the step scheduler of the current run its saved data position.

    A state captured outside a run (standalone ``train_batch()``) has no scheduler
    state; the scheduler then continues counting from the restored step and epoch.
    """
    saved = _scheduler_state_to_load(strategy, state)
    if saved is None:
        return
    try:
        strategy.ctx.scheduler.load_state_dict(saved)
    except ResumeError:
        raise
    except ValueError as err:  # a data position this job's loader cannot continue
        raise ResumeError(str(err)) from None


def _scheduler_state_to_load(strategy: TrainingStrategy, state: Mapping[str, Any]) -> Any:
    """What the current run's step scheduler is to load from ``state`` (None: nothing to load); a TypeError for a
    scheduler that cannot load one."""
    live = strategy.ctx.scheduler
    if live is None:
        return None
    saved = state.get("scheduler")
    if saved is None:
        if not callable(getattr(live, "state_dict", None)):
            return None
        counters = state["counters"]
        saved = {**live.state_dict(), "step": int(counters["step_count"]), "epoch": int(counters["epoch"]),
                 "position": 0, "epoch_rng": None}
    if not callable(getattr(live, "load_state_dict", None)):
        raise TypeError(f"the step scheduler {type(live).__qualname__} has no load_state_dict(); cannot resume")
    rank_rng = _rank_rng(strategy, state)
    if isinstance(rank_rng, Mapping) and "loader" in rank_rng and isinstance(saved, Mapping):
        # rank 0 wrote the checkpoint for every rank: each rank's StatefulDataLoader state is its own
        saved = {**saved, "loader": rank_rng["loader"]}
    return saved


def without_data_position(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without its data position: the epoch it would continue starts from its first micro-batch.

    For a resume that cannot carry the position over (another number of ranks). Dropping
    only ``"scheduler"`` would restart ``counters["epoch"]``, which after an epoch's last step
    is the epoch already finished; the saved scheduler state names the epoch to continue
    (the next one then), so the counters take it, at position 0 (``epoch_step_count``).
    Each rank's StatefulDataLoader state (in ``rng_by_rank``) is part of the position and
    goes too. ``state`` itself is not changed.
    """
    counters = dict(state["counters"])
    saved = state.get("scheduler")
    if isinstance(saved, Mapping) and "epoch" in saved:
        counters["epoch"] = int(saved["epoch"])
    counters["epoch_step_count"] = 0
    stripped: dict[str, Any] = {**state, "counters": counters, "scheduler": None}
    by_rank = state.get("rng_by_rank")
    if isinstance(by_rank, (list, tuple)):
        stripped["rng_by_rank"] = [
            {key: value for key, value in rng.items() if key != "loader"} if isinstance(rng, Mapping) else rng
            for rng in by_rank
        ]
    return stripped


def _apply_hook_states(strategy: TrainingStrategy, saved: Mapping[str, Any], *, legacy: bool = False) -> None:
    hooks = strategy_hooks(strategy)
    # A state written with order-based keys is mapped by order, as when it was written.
    live = _legacy_hook_keys(hooks) if legacy else checkpointable_hooks(hooks)
    for key, hook in live.items():
        if key not in saved:
            warnings.warn(
                f"hook {hook_label(hook)} has no state in the checkpoint (key {key!r}); it starts fresh",
                stacklevel=4,
            )
            continue
        try:
            hook.load_state_dict(saved[key])
        except Exception as err:
            err.add_note(f"while restoring the state of hook {hook_label(hook)} (key {key!r}) from a checkpoint")
            raise
    # A hook that keeps its state elsewhere now may find what it saved before it did: nothing to say.
    quiet = {hook_state_key(h) for h in hooks if getattr(h, "saves_state", True) is False}
    unused = sorted(set(saved) - set(live) - quiet)
    if unused:
        warnings.warn(
            f"the checkpoint holds state for hook(s) {unused} that this strategy does not have; ignored",
            stacklevel=4,
        )


# -- deferred application ---------------------------------------------------------------------


@final
class PendingRestore:
    """Applies a state at the start of the next run, before every other BEFORE_TRAINING hook.

    A strategy is restored before ``run()`` builds its optimizers and step scheduler;
    this plugin holds the state until both exist.
    """

    plugin_name = "nvtrain.restore"
    priority = -(2**31)

    def __init__(self, strategy: TrainingStrategy) -> None:
        self._strategy = strategy
        self.state: Mapping[str, Any] | None = None
        self.source: str = "state"
        self.scheduler_only = False

    def hold(self, state: Mapping[str, Any], source: str, *, scheduler_only: bool) -> None:
        """Keep ``state`` (or only its data position) for the next BEFORE_TRAINING, replacing anything held."""
        self.state, self.source, self.scheduler_only = state, source, scheduler_only

    @hookimpl
    def before_training(self, ctx: Any) -> None:
        state, self.state = self.state, None
        if state is None:
            return
        try:
            if self.scheduler_only:
                apply_scheduler_state(self._strategy, state)
                # The loader may be new since the restore (or there was none then): its generators too.
                apply_loader_generators(_rank_rng(self._strategy, state), ctx.train_loader)
            else:
                apply_state(self._strategy, state)
        except Exception as err:
            # held again: a retried run() refuses it again rather than training on without it
            self.hold(state, self.source, scheduler_only=self.scheduler_only)
            err.add_note(f"while restoring {self.source}")
            raise


def load_state(
    strategy: TrainingStrategy, state: Mapping[str, Any], source: str = "state", *, held: bool = False
) -> None:
    """Restore ``state`` now where possible, the rest at the next run's BEFORE_TRAINING.

    Before the strategy is set up (no optimizers yet) everything waits for the run.
    Once set up, everything is applied now and only the step scheduler's data
    position waits for the next run; called during BEFORE_TRAINING, nothing waits.
    """
    check_state(state, source)
    if not held:  # a state held from before the run is applied at its SETUP, where it belongs
        strategy.refuse_mid_run(
            f"{source}: loading a state", "the weights and counters would go back while the run's data goes on"
        )
    in_run_start = applies_data_position_now(strategy)
    if not strategy.is_set_up:
        _pending(strategy).hold(state, source, scheduler_only=False)
        return
    try:
        apply_state(strategy, state, scheduler=in_run_start)
    except Exception as err:
        err.add_note(f"while restoring {source}")
        raise
    if not in_run_start:
        _pending(strategy).hold(state, source, scheduler_only=True)


def applies_data_position_now(strategy: TrainingStrategy) -> bool:
    """Whether a state restored now takes its data position at once: at a run's start (BEFORE_TRAINING, its
    step scheduler built); otherwise the position waits for the next run."""
    ctx = strategy.ctx
    return ctx.stage == TrainingStage.BEFORE_TRAINING and ctx.scheduler is not None


def apply_held_state(strategy: TrainingStrategy) -> None:
    """Apply, now that ``strategy`` is set up, a state :func:`load_state` held from before; its data
    position still waits for the next run (``train_batch()`` and ``validate()`` would never reach one)."""
    for plugin in strategy.bus.plugins():
        if isinstance(plugin, PendingRestore) and plugin.state is not None and not plugin.scheduler_only:
            state, source, plugin.state = plugin.state, plugin.source, None
            try:
                load_state(strategy, state, source, held=True)
            except BaseException:
                plugin.hold(state, source, scheduler_only=False)  # a retry applies all of it, not the rest
                raise


def _pending(strategy: TrainingStrategy) -> PendingRestore:
    """The strategy's holder of a state for the next run (registered on first use, never during a stage)."""
    for plugin in strategy.bus.plugins():
        if isinstance(plugin, PendingRestore):
            return plugin
    pending = PendingRestore(strategy)
    strategy.bus.register(pending, PendingRestore.plugin_name)
    return pending


# -- the on-disk reader -------------------------------------------------------------------------


def restore_checkpoint(strategy: TrainingStrategy, path: str | os.PathLike[str]) -> None:
    """Restore the checkpoint at ``path`` into ``strategy``.

    Once the strategy is set up, a registered hook with ``load_into(strategy, path)`` does it
    (the checkpoint hook: a sharded checkpoint needs the sharded models and the optimizers
    built on their shards, and reshards to this job's ranks). Otherwise the state is read
    (:func:`find_checkpoint_reader`) and applied now, or at the next run's BEFORE_TRAINING.
    """
    hooks = strategy_hooks(strategy)
    if strategy.is_set_up:
        for hook in hooks:
            load_into = getattr(hook, "load_into", None)
            if callable(load_into) and not isinstance(hook, type):
                load_into(strategy, path)
                return
    state = find_checkpoint_reader(hooks)(path)
    load_state(strategy, state, source=f"checkpoint {str(path)!r}")


def find_checkpoint_reader(hooks: Iterable[object] = ()) -> Callable[[str | os.PathLike[str]], dict[str, Any]]:
    """``read_checkpoint(path) -> state`` from a hook that has one, else the ``checkpoint`` entry point."""
    for hook in hooks:
        reader = getattr(hook, "read_checkpoint", None)
        if callable(reader) and not isinstance(hook, type):
            return reader  # type: ignore[no-any-return]
    return checkpoint_plugin_function(
        "read_checkpoint", "reading a checkpoint", alternative="a hook with read_checkpoint(path) in TrainingStrategy.hooks"
    )


def find_manifest_reader(hooks: Iterable[object] = ()) -> Callable[[str | os.PathLike[str]], dict[str, Any]]:
    """``read_manifest(path) -> manifest`` (``path`` a checkpoint or a checkpoint root) from a hook that
    has one, else from the distribution behind the ``checkpoint`` entry point."""
    for hook in hooks:
        reader = getattr(hook, "read_manifest", None)
        if callable(reader) and not isinstance(hook, type):
            return reader  # type: ignore[no-any-return]
    return checkpoint_plugin_function("read_checkpoint_manifest", "reading a checkpoint's manifest")


def checkpoint_plugin_function(name: str, purpose: str, *, alternative: str = "") -> Callable[..., Any]:
    """The function ``name`` of the distribution behind the ``checkpoint`` entry point (nvtrain-checkpoint).

    Core nvtrain never imports that plugin by name: it may be replaced by another
    distribution registering the same entry point.

    :raises ImportError: saying that ``purpose`` needs the plugin (or ``alternative``),
        and why each registered entry point did not serve.
    """
    failures: list[str] = []
    for entry_point in importlib.metadata.entry_points(group=PROJECT_NAME, name=READER_ENTRY_POINT):
        try:
            module = entry_point.load()
        except Exception as err:
            failures.append(f"entry point {entry_point.value!r} failed to import: {type(err).__name__}: {err}")
            continue
        function = getattr(module, name, None)
        if callable(function):
            return function  # type: ignore[no-any-return]
        failures.append(f"entry point {entry_point.value!r} has no {name}()")
    detail = f" ({'; '.join(failures)})" if failures else ""
    instead = f", or {alternative}" if alternative else ""
    raise ImportError(
        f"{purpose} needs the nvtrain-checkpoint distribution (pip install nvtrain-checkpoint){instead}{detail}"
    )
