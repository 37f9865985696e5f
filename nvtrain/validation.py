"""Validation: when to run it, and the hook-agnostic loop that computes the summary."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

from nvtrain.hook import AveragesWeights, ProvidesAutocast
from nvtrain.validators import FieldTypeError, a_callable, optional_int_at_least, refused, satisfies

__all__ = [
    "ValidationConfig",
    "ValidationLoop",
    "averages_to_validate",
    "cadence_never_fires",
    "check_batches",
    "validation_autocast",
    "validation_models",
]

AutocastFactory = Callable[[], contextlib.AbstractContextManager[Any]]
Metric = Callable[[Any, Any], torch.Tensor]

#: ValidationConfig.use_mixed_precision: True, False or "auto" (an int such as 1 is not True).
_true_false_or_auto = satisfies(
    "True, False or 'auto'",
    lambda v: v in (True, False, "auto") and not (isinstance(v, int) and not isinstance(v, bool)),
)


#: ValidationConfig.every_n_epochs: an int >= 1, None or "auto".
_bool_or_state_key = satisfies(
    "True, False or the state_key of the EMA hook whose average to evaluate ('auto' is the config file's)",
    lambda value: isinstance(value, bool) or (isinstance(value, str) and value not in ("", "auto")),
    error=FieldTypeError,
)

_epochs_none_or_auto = satisfies(
    "an int >= 1, None (never at epoch ends) or 'auto'",
    lambda v: v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
)


#: What ValidationConfig.metrics takes, as its errors say it.
_METRICS_EXPECTED = (
    "a dict of name -> callable fn(outputs, targets) -> tensor, e.g. {'accuracy': nvtrain.builtin.metrics.accuracy} "
    "(names such as 'accuracy' are resolved by a config file's validation.metrics, not here)"
)


#: The keys a validation summary holds besides its metrics: a metric by one of these names would overwrite them.
SUMMARY_KEYS = frozenset({"loss", "num_samples"})


def _check_metrics(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A mapping of str names to callables, refused at construction rather than mid-run at the first validation."""
    owner = type(instance).__name__
    if not isinstance(value, Mapping) or not all(isinstance(name, str) for name in value):
        raise refused(owner, attribute.name, value, _METRICS_EXPECTED, error=FieldTypeError)
    for name, metric in value.items():
        if name in SUMMARY_KEYS:
            raise refused(
                owner,
                attribute.name,
                value,
                _METRICS_EXPECTED,
                message=(
                    f"{owner}.{attribute.name}[{name!r}]: {name!r} is the validation summary's own "
                    f"{'loss' if name == 'loss' else 'sample count'}, which this metric would overwrite "
                    f"(and val_{name} with it); name it otherwise, e.g. {'my_' + name!r}"
                ),
            )
        if not callable(metric):
            expected = "callable as fn(outputs, targets) -> tensor"
            message = (
                f"{owner}.{attribute.name}[{name!r}] must be {expected} (got {metric!r}; names such as 'accuracy' "
                "are resolved by a config file's validation.metrics: in Python pass the function, "
                "e.g. nvtrain.builtin.metrics.accuracy)"
            )
            raise refused(owner, attribute.name, value, expected, message=message, error=FieldTypeError)


#: What ValidationConfig.data and strategy.validate(loader) take, as their errors say it.
_BATCHES_EXPECTED = "an iterable of batches (a DataLoader, a list of batches)"


def _iterable_of_batches(value: Any) -> bool:
    """What ``iter()`` takes (``__iter__``, or a sequence's ``__getitem__``), but no str or bytes, whose
    items would be characters, not batches."""
    if isinstance(value, (str, bytes)):
        return False
    return isinstance(value, Iterable) or hasattr(type(value), "__getitem__")


def check_batches(value: Any, owner: str, argument: str) -> None:
    """Refuse ``value`` as validation data unless it can be iterated for batches: ``owner(argument) must be ...``
    (``TrainingStrategy.validate(loader)``).

    Iterating a number raises ``'float' object is not iterable``, which names neither the call nor the argument.
    """
    if not _iterable_of_batches(value):
        message = f"{owner}({argument}) must be {_BATCHES_EXPECTED} (got {value!r})"
        raise refused(owner, argument, value, _BATCHES_EXPECTED, message=message, error=FieldTypeError)


def read_up_by_one_pass(value: Any) -> bool:
    """Whether iterating ``value`` uses it up for good: a generator, or one of Python's own iterators
    (``iter(list)``, ``map``, ``zip``, itertools'). An iterator class of a library's (one that restarts after
    its end, as some data pipelines' do) is taken at its word."""
    if isinstance(value, types.GeneratorType):
        return True
    return isinstance(value, Iterator) and type(value).__module__ in ("builtins", "itertools")


#: ValidationConfig.data: refused when built, not at the first validation after an epoch of training. A
#: generator is read up by the first validation, and every later one would find it empty.
_batches_or_none = satisfies(
    f"{_BATCHES_EXPECTED} that can be read again at every validation (a generator or iterator is used up by "
    "the first)",
    lambda value: _iterable_of_batches(value) and not read_up_by_one_pass(value),
    or_none=True,
    error=FieldTypeError,
)


@attrs.frozen
class ValidationConfig:
    """When and how ``TrainingStrategy`` validates.

    ``every_n_steps`` counts completed optimizer steps (vetoed micro-batches never
    trigger it); ``every_n_epochs`` counts completed epochs: an int, None (never at
    an epoch's end: only the step cadences validate), or ``"auto"`` (the default:
    every epoch unless ``every_n_steps`` is set). The step scheduler's own
    ``val_every_steps`` and ``validate_on_checkpoint`` validate as well.
    ``use_mixed_precision``: ``"auto"`` follows the registered mixed-precision hook,
    ``True`` / ``False`` force it. ``use_ema``: evaluate the EMA weights when an EMA
    hook is registered (True or False: ``"auto"`` is the config file's, which the CLI
    resolves); with two averages of one model (a fast and a slow EMA), the
    ``state_key`` of the one to evaluate. ``metrics`` maps names to ``fn(outputs, targets) -> tensor`` (a
    per-batch mean); names such as ``"accuracy"`` are resolved by the config file's
    ``validation.metrics`` only: in Python pass the function
    (``nvtrain.builtin.metrics.accuracy``). Both are checked when the config is built.
    """

    data: Iterable[Any] | None = attrs.field(default=None, validator=_batches_or_none)
    every_n_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    every_n_epochs: int | Literal["auto"] | None = attrs.field(default="auto", validator=_epochs_none_or_auto)
    use_mixed_precision: bool | Literal["auto"] = attrs.field(default="auto", validator=_true_false_or_auto)
    use_ema: bool | str = attrs.field(default=False, validator=_bool_or_state_key)
    metrics: Mapping[str, Metric] = attrs.field(factory=dict, validator=_check_metrics)

    @property
    def epoch_interval(self) -> int | None:
        """Epoch cadence in effect: ``"auto"`` is every epoch when no step cadence is set, else none."""
        if self.every_n_epochs == "auto":
            return 1 if self.every_n_steps is None else None
        return self.every_n_epochs


def cadence_never_fires(
    step_intervals: Sequence[int], epoch_interval: int | None, total_steps: int | None, num_epochs: int | None
) -> str | None:
    """Why a run's validation cadences never fire within its length (``every 500 steps in a run of 300 steps``),
    or None when one may (or the length is unknown, or no cadence is set: validating is then the caller's).

    The cadences count from the run's first step and epoch: a resumed run has the same ones.
    """
    if not step_intervals and epoch_interval is None:
        return None
    if any(total_steps is None or every <= total_steps for every in step_intervals):
        return None
    if epoch_interval is not None and (num_epochs is None or epoch_interval <= num_epochs):
        return None
    parts = [f"every {every} steps in a run of {total_steps} steps" for every in step_intervals]
    if epoch_interval is not None:
        parts.append(f"every {epoch_interval} epochs in a run of {num_epochs} epochs")
    return "; ".join(parts)


@attrs.define
class ValidationLoop:
    """Evaluates models over a loader; knows nothing about hooks.

    ``forward(models, batch) -> (outputs, targets, batch_size)`` and ``loss_fn(outputs,
    targets)`` come from the strategy; ``autocast`` is an explicit factory of a
    context manager (``contextlib.nullcontext`` for full precision). The summary's
    loss and metrics are weighted by sample count and stay tensors. The models run in
    ``eval()`` mode; afterwards every module gets its own mode back, so a submodule a
    hook froze in ``eval()`` stays frozen.
    """

    forward: Callable[[Mapping[str, torch.nn.Module], Any], tuple[Any, Any, int]] = attrs.field(
        validator=a_callable("callable as forward(models, batch) -> (outputs, targets, batch_size)")
    )
    loss_fn: Callable[[Any, Any], torch.Tensor] = attrs.field(
        validator=a_callable("callable as loss_fn(outputs, targets) -> tensor")
    )
    autocast: AutocastFactory = attrs.field(
        default=contextlib.nullcontext,
        validator=a_callable("callable as autocast() -> context manager, e.g. contextlib.nullcontext"),
    )
    metrics: Mapping[str, Metric] = attrs.field(factory=dict, validator=_check_metrics)

    def run(self, models: Mapping[str, torch.nn.Module], loader: Iterable[Any]) -> dict[str, Any]:
        check_batches(loader, "ValidationLoop.run", "loader")
        modes = _module_modes(models)
        tops = [(model, model.training) for model in models.values()]
        for model in models.values():
            model.eval()
        totals: dict[str, torch.Tensor] = {}
        num_samples = 0
        try:
            with torch.no_grad():
                for batch in loader:
                    num_samples += self._add_batch(models, batch, totals)
        finally:
            _restore_modes(tops, modes)
        if num_samples == 0:
            raise ValueError(
                "validation: the validation data yielded no samples (an empty loader, batches of size 0, or an "
                "iterator already read up)"
            )
        summary: dict[str, Any] = {name: total / num_samples for name, total in totals.items()}
        summary["num_samples"] = num_samples
        return summary

    def _add_batch(self, models: Mapping[str, torch.nn.Module], batch: Any, totals: dict[str, torch.Tensor]) -> int:
        """Add one batch's size-weighted values to ``totals``; returns its size. A function of its own so that
        its outputs are freed on return, not kept through the next batch's forward (twice the peak memory)."""
        with self.autocast():
            outputs, targets, size = self.forward(models, batch)
            values = {"loss": self.loss_fn(outputs, targets)}
            for name, metric in self.metrics.items():
                values[name] = metric(outputs, targets)
        for name, value in values.items():
            weighted = value.detach().float() * size
            totals[name] = totals[name] + weighted if name in totals else weighted
        return size


def _module_modes(models: Mapping[str, torch.nn.Module]) -> list[tuple[torch.nn.Module, bool]]:
    """Every module's own mode, submodules included: a backbone frozen in ``eval()`` must stay so after a
    validation, which ``model.train(mode)`` (it sets every child alike) would not keep."""
    return [(module, module.training) for model in models.values() for module in model.modules()]


def _restore_modes(
    tops: list[tuple[torch.nn.Module, bool]], modes: list[tuple[torch.nn.Module, bool]]
) -> None:
    """``model.train(mode)`` on each model, as before the validation (a ``train()`` override runs: a module
    that fuses its branches on ``eval()`` unfuses), then each submodule's own flag where it differed."""
    for model, training in tops:
        model.train(training)
    for module, training in modes:
        if module.training != training:
            module.training = training


# -- what a strategy's hooks contribute to a validation -------------------------------------------


def validation_models(
    models: Mapping[str, torch.nn.Module], hooks: Iterable[object], config: ValidationConfig
) -> dict[str, torch.nn.Module]:
    """The models to evaluate: the trained ones, or with ``use_ema`` each chosen averaging hook's copy in its place."""
    chosen = dict(models)
    for hook in averages_to_validate(hooks, config):
        chosen[hook.model_key] = hook.get_averaged_model()
    return chosen


def averages_to_validate(hooks: Iterable[object], config: ValidationConfig) -> list[AveragesWeights]:
    """The averaging hooks whose copies ``use_ema`` evaluates: one per model, never a guess between two.

    Raises ValueError when ``use_ema`` asks for an average there is none of, or when two
    hooks average one model and ``use_ema`` does not name one by its ``state_key``.
    """
    wanted = config.use_ema
    if wanted is False:
        return []
    averaging = [h for h in hooks if isinstance(h, AveragesWeights)]
    if isinstance(wanted, str):
        named = [h for h in averaging if getattr(h, "state_key", None) == wanted]
        if not named:
            keys = sorted(str(getattr(h, "state_key", None)) for h in averaging)
            raise ValueError(
                f"ValidationConfig.use_ema={wanted!r} names no EMA hook by its state_key "
                f"(the EMA hooks' state_keys: {', '.join(keys) or 'none: no EMA hook is registered'})"
            )
        return named
    if not averaging:
        raise ValueError("ValidationConfig.use_ema=True but no EMA hook is registered")
    by_model: dict[str, list[AveragesWeights]] = {}
    for hook in averaging:
        by_model.setdefault(hook.model_key, []).append(hook)
    for model_key, several in by_model.items():
        if len(several) > 1:
            labels = ", ".join(f"{type(h).__name__}(state_key={getattr(h, 'state_key', None)!r})" for h in several)
            raise ValueError(
                f"ValidationConfig.use_ema=True, but {len(several)} EMA hooks average model {model_key!r} "
                f"({labels}): set use_ema to the state_key of the one to evaluate (give each a state_key)"
            )
    return [several[0] for several in by_model.values()]


def validation_autocast(hooks: Iterable[object], config: ValidationConfig) -> AutocastFactory:
    """The autocast of the first mixed-precision hook, unless ``use_mixed_precision`` says otherwise."""
    if config.use_mixed_precision is False:
        return contextlib.nullcontext
    precision = [h for h in hooks if isinstance(h, ProvidesAutocast)]
    if not precision:
        if config.use_mixed_precision is True:
            raise ValueError("ValidationConfig.use_mixed_precision=True but no mixed-precision hook is registered")
        return contextlib.nullcontext
    return precision[0].autocast
