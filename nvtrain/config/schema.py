"""The run config's schema: the frozen attrs classes of every section, their validators and help.

Each field's ``help`` metadata is its line in the reference (:mod:`nvtrain.config.reference`);
the ``trainer`` section is :class:`~nvtrain.step_scheduler.StepSchedulerConfig` itself, whose
help is :data:`TRAINER_HELP`. A validator that refuses a value raises
:class:`~nvtrain.config.errors.FieldError`, which carries the field, value and expectation.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import attrs

from nvtrain.config.errors import FieldError
from nvtrain.step_scheduler import StepSchedulerConfig

__all__ = [
    "IMPORT_PATH",
    "SECTIONS",
    "TRAINER_HELP",
    "Auto",
    "DataConfig",
    "EmaChoice",
    "HookConfig",
    "LRSchedulerConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "ValidationSection",
]

Auto = Literal[True, False, "auto"]
#: ``validation.use_ema``: ``auto``, true, false, or the ``state_key`` of the EMA hook to evaluate.
EmaChoice = Literal[True, False, "auto"] | str

#: ``package.module:name`` (dotted on both sides of the colon).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


# -- field validators --------------------------------------------------------------------------


def _refused(
    instance: Any, attribute: attrs.Attribute[Any], value: Any, expected: str, message: str | None = None
) -> FieldError:
    """The error for ``value``; the message is ``Owner.field must be <expected> (got value)`` unless given."""
    owner = type(instance).__name__
    if message is None:
        message = f"{owner}.{attribute.name} must be {expected} (got {value!r})"
    return FieldError(attribute.name, message, owner=owner, value=value, expected=expected)


def _import_path(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is None or IMPORT_PATH.match(value):
        return
    hint = ""
    if ":" not in value and "." in value:
        module, _, name = value.rpartition(".")
        hint = f"; did you mean '{module}:{name}'?"
    expected = "an import path 'package.module:name'"
    message = f"{type(instance).__name__}.{attribute.name} must be {expected} (got {value!r}){hint}"
    raise _refused(instance, attribute, value, expected, message)


def _positive_or_none(instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise _refused(instance, attribute, value, ">= 1 or null")


def _seed_range(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    """What torch.manual_seed takes, with room for the rank added on ranks > 0."""
    if not -(2**63) <= value < 2**63:
        raise _refused(instance, attribute, value, "an integer from -2**63 to 2**63 - 1")


def _thread_count(instance: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    """What torch.set_num_threads takes (a C int)."""
    if value is not None and not 1 <= value < 2**31:
        raise _refused(instance, attribute, value, "from 1 to 2**31 - 1, or null")


def _backend(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """A torch.distributed backend name, or ``device:backend`` pairs; a typo fails here, not on the cluster."""
    if value is None:
        return
    from nvtrain.distributed import malformed_backend, unknown_backend

    unknown, known = unknown_backend(value)
    malformed = malformed_backend(value)
    expected = f"null, one of {known}, or 'device:backend' pairs such as 'cpu:gloo,cuda:nccl'"
    if malformed is not None or unknown is not None:
        close = difflib.get_close_matches(unknown, known, n=1) if unknown and malformed is None else []
        hint = f"; {malformed}" if malformed is not None else f"; did you mean {close[0]!r}?" if close else ""
        message = f"{type(instance).__name__}.{attribute.name} must be {expected} (got {value!r}){hint}"
        raise _refused(instance, attribute, value, expected, message)


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 1:
        raise _refused(instance, attribute, value, ">= 1")


def _not_negative(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise _refused(instance, attribute, value, ">= 0")


def _non_empty(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value.strip():
        message = f"{type(instance).__name__}.{attribute.name} must not be empty"
        raise _refused(instance, attribute, value, "a non-empty string", message)


def _metric_name(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value.strip():
        message = f"{type(instance).__name__}.{attribute.name} must be a metric name or null"
        raise _refused(instance, attribute, value, "a metric name or null", message)


def _run_name(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """A name the run directory can be created under: one path component (no NUL, which no OS path holds)."""
    if value is None:
        return
    if not value.strip() or "/" in value or "\\" in value or "\0" in value or value in (".", ".."):
        raise _refused(instance, attribute, value, "a plain directory name without slashes or NUL characters")


def _folder(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    """A non-empty folder path without NUL characters: the OS refuses those in any path, at the first mkdir."""
    _non_empty(instance, attribute, value)
    if "\0" in value:
        raise _refused(instance, attribute, value, "a folder path without NUL characters")


def _scheduler_factory(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    from nvtrain.schedules import ALIASES

    if value in ALIASES or IMPORT_PATH.match(value):
        return
    close = difflib.get_close_matches(value, list(ALIASES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    expected = f"a schedule name ({', '.join(ALIASES)}) or an import path 'package.module:name'"
    message = f"{type(instance).__name__}.{attribute.name} must be {expected} (got {value!r}){hint}"
    raise _refused(instance, attribute, value, expected, message)


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
    init_device: Literal["meta"] | None = attrs.field(
        default=None,
        metadata=_doc(
            "`meta`: call the factory under `torch.device(\"meta\")`, allocating nothing; the `fsdp` hook shards "
            "the model, then allocates and initialises each rank's shards (its `meta_init`), so no process holds "
            "the whole model. null: where the factory builds it."
        ),
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
            "epoch`), then follow `factory` (0: no warmup). Not with `onecycle`, which ramps up itself, nor "
            "with a metric-driven schedule."
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
            "else not metric-driven); only for schedulers whose `step(metrics)` takes it."
        ),
    )


#: Help text of the ``trainer`` section, which is :class:`~nvtrain.step_scheduler.StepSchedulerConfig`
#: itself (a test checks that every field has an entry).
TRAINER_HELP: dict[str, str] = {
    "global_batch_size": "Samples per optimizer step across all processes (null: one loader batch per process). "
    "A multiple of batch size x processes; larger means gradient accumulation.",
    "num_epochs": "Epochs to train (null: derived from `max_steps`; both null: one epoch).",
    "max_steps": "Stop after this many optimizer steps (null: run all epochs).",
    "ckpt_every_steps": "Checkpoint every N optimizer steps (null: only at the last step, on preemption, and at "
    "epoch ends when `save_checkpoint_every_epoch` is true).",
    "save_checkpoint_every_epoch": "Also checkpoint at every epoch end.",
    "validate_on_checkpoint": "Also validate at every checkpoint step (only with a hook that writes checkpoints, "
    "such as `checkpoint`).",
    "val_every_steps": "Validate every N optimizer steps, whatever `validation` sets (null: no trainer cadence).",
    "log_remote_every_steps": "Cadence of experiment loggers (TensorBoard; `ctx.scheduler.is_remote_logging_step`).",
    "loss_average_window_steps": "Steps the smoothed loss (`train_loss_avg`, the progress bar's loss) covers.",
    "gc_every_steps": "Run `gc.collect()` every N steps, with automatic gc off during the run (null: Python's own gc).",
    "start_step": "Step to start counting from (a resumed checkpoint overrides it); before `max_steps`.",
    "start_epoch": "Epoch to start from (a resumed checkpoint overrides it); before `num_epochs`.",
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
        default=1,
        validator=_positive_or_none,
        metadata=_doc("Validate after every N epochs (null: never at epoch ends; the step cadences still validate)."),
    )
    every_n_steps: int | None = attrs.field(
        default=None, validator=_positive_or_none, metadata=_doc("Also validate every N optimizer steps.")
    )
    use_ema: EmaChoice = attrs.field(
        default="auto",
        metadata=_doc(
            "Evaluate the EMA weights (`auto`: when an EMA hook is configured); with two EMA hooks on one model, "
            "the `state_key` of the one to evaluate."
        ),
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
            if name in BUILTIN_METRICS or IMPORT_PATH.match(name):
                continue
            close = difflib.get_close_matches(name, list(BUILTIN_METRICS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            expected = f"a built-in metric ({', '.join(BUILTIN_METRICS)}) or an import path 'package.module:function'"
            raise _refused(
                self,
                attribute,
                name,
                expected,
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
        default="runs", validator=_folder, metadata=_doc("Parent folder of run directories.")
    )
    seed: int = attrs.field(
        default=0,
        validator=_seed_range,
        metadata=_doc(
            "Seeds torch, numpy and random: every rank with `seed` while the model and data are built (the same "
            "weights and split), then rank r > 0 with `seed + r` for training (rank 0 draws on)."
        ),
    )
    device: str = attrs.field(
        default="auto",
        metadata=_doc("`auto` (cuda:LOCAL_RANK when CUDA is available, else cpu), `cpu`, `cuda`, `cuda:1`..."),
    )
    backend: str | None = attrs.field(
        default=None,
        validator=_backend,
        metadata=_doc(
            "Process-group backend under torchrun (null: `nccl` with CUDA, `gloo` otherwise). "
            "`cpu:gloo,cuda:nccl` keeps the per-step stop agreement on the CPU: no device sync per step "
            "(docs/distributed.md)."
        ),
    )
    cpu_threads: int | None = attrs.field(
        default=None,
        validator=_thread_count,
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
    validation: ValidationSection = attrs.field(factory=ValidationSection, metadata=_doc("Section `validation`."))
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
            raise _refused(self, attribute, value, "'auto' or a torch device like 'cpu', 'cuda:0'") from None

    @property
    def run_dir(self) -> Path:
        """``output_dir / name`` (``name`` is filled in by :func:`~nvtrain.config.load_config`)."""
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
