"""``nvtrain validate``'s last check: one batch through the user's code (:func:`check_one_batch`).

Building the strategy checks what a config names, not what its functions do with real
data: a loss that cannot take the model's outputs (class-index targets of the wrong
shape), a loss that returns a vector or a float, a ``forward_fn`` that fails on the
batch, or a metric that fails or returns a string would pass, and fail at the run's
first step, or at its first validation hours later. So one training micro-batch goes
through the forward and the loss, and one validation batch through the forward, the
loss and every metric, as the run computes them (the strategy's forward, its models
after SETUP, on its device, under its autocast), with no gradient, no backward, no
optimizer step and no hook stage fired: nothing is trained and nothing is written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from nvtrain.app.building import NOT_REFUSALS
from nvtrain.batching import device_mover
from nvtrain.config import ConfigError
from nvtrain.errors import one_line
from nvtrain.run_release import LiveData
from nvtrain.validation import ValidationConfig, ValidationLoop, validation_autocast, validation_models

if TYPE_CHECKING:
    from nvtrain.app.building import Built
    from nvtrain.app.checking import Plan

__all__ = ["BatchCheck", "check_one_batch"]

ConfigPath = tuple[str | int, ...]
_NOTHING = object()
#: What a failing call lets through as it is: an inner check's ConfigError, memory, the accelerator.
_PROPAGATED: tuple[type[BaseException], ...] = (ConfigError, MemoryError, *NOT_REFUSALS)


@attrs.frozen
class BatchCheck:
    """What one batch gave: the training loss, one validation batch's summary, the forward's time."""

    loss: float
    #: The validation loss and metrics of one validation batch; None without validation data.
    validation: Mapping[str, float] | None
    forward_ms: float

    def describe(self, *, resumes: bool = False) -> str:
        """``one batch: loss 2.3026, validation loss 2.3011, accuracy 0.125 (forward 12 ms)``; ``resumes``: the
        run starts from a checkpoint, which the check (on the weights as built) does not load."""
        parts = [f"loss {self.loss:.5g}"]
        if self.validation is not None:
            parts += [f"{'validation loss' if name == 'loss' else name} {v:.5g}" for name, v in self.validation.items()]
        weights = ", on the weights as built, not the checkpoint's" if resumes else ""
        return f"one batch: {', '.join(parts)} (forward {self.forward_ms:.0f} ms{weights})"


def check_one_batch(plan: Plan, built: Built) -> BatchCheck:
    """Run one training and one validation batch through the forward, the loss and the metrics; raise a
    located :class:`~nvtrain.config.ConfigError` naming the function that failed or returned something the
    run cannot use.

    Out of memory, a failing accelerator and KeyboardInterrupt propagate. The models' buffers (a
    BatchNorm's running statistics, which the training-mode forward updates) are put back afterwards.
    """
    strategy = built.strategy
    hooks = strategy.registry.hooks()
    move = _mover(strategy.device)
    loader = strategy.ctx.train_loader if strategy.ctx.train_loader is not None else built.train_loader
    batch = move(_first_batch(plan, loader, "training"))
    # the autocast a mixed-precision hook trains under ("auto" follows the first such hook)
    training_autocast = validation_autocast(hooks, ValidationConfig(use_mixed_precision="auto"))
    with _buffers_kept(strategy.ctx.models), torch.no_grad(), training_autocast():
        started = _clock(strategy.device)
        outputs, targets, _ = _forward(plan, strategy, strategy.ctx.models, batch, "training")
        forward_ms = (_clock(strategy.device) - started) * 1000
        loss = _checked_loss(plan, strategy.loss_fn, "training")(outputs, targets)
    return BatchCheck(loss=float(loss), validation=_one_validation_batch(plan, strategy, move), forward_ms=forward_ms)


def _one_validation_batch(plan: Plan, strategy: Any, move: Callable[[Any], Any]) -> dict[str, float] | None:
    """The validation loop's summary of the validation loader's first batch (None without validation data)."""
    config: ValidationConfig | None = strategy.validation
    if config is None or config.data is None:
        return None
    batch = move(_first_batch(plan, config.data, "validation"))
    hooks = strategy.registry.hooks()
    loop = ValidationLoop(
        forward=lambda models, b: _forward(plan, strategy, models, b, "validation"),
        loss_fn=_checked_loss(plan, strategy.loss_fn, "validation"),
        autocast=validation_autocast(hooks, config),
        metrics={
            name: _checked_metric(plan, index, name, metric)
            for index, (name, metric) in enumerate(plan.metrics.items())
        },
    )
    models = validation_models(strategy.ctx.models, hooks, config)
    summary = _calling(plan, ("data",), "the validation loop on one batch", lambda: loop.run(models, [batch]))
    return {name: float(value) for name, value in summary.items() if name != "num_samples"}


# -- the user's functions, called and judged --------------------------------------------------------


def _forward(plan: Plan, strategy: Any, models: Mapping[str, torch.nn.Module], batch: Any, role: str) -> Any:
    """The strategy's own forward (``forward_fn``, or ``models['main'](inputs)``): ``(outputs, targets, size)``."""
    config = plan.config
    if config.model.forward_fn is not None:
        where: ConfigPath = ("model", "forward_fn")
        who = f"forward_fn {config.model.forward_fn}"
    else:
        where, who = ("model",), f"the forward of model {config.model.factory}"
    what = f"{who} failed on one {role} batch ({_describe(batch)})"
    return _calling(plan, where, what, lambda: strategy._validation_forward(models, batch))


def _checked_loss(plan: Plan, loss_fn: Callable[[Any, Any], Any], role: str) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` that raises a ConfigError at ``loss`` when it fails, or returns what backward() cannot take."""
    spec = plan.config.loss.function

    def loss(outputs: Any, targets: Any) -> torch.Tensor:
        what = f"loss {spec} failed on one {role} batch ({_pair(outputs, targets)})"
        value = _calling(plan, ("loss",), what, lambda: loss_fn(outputs, targets))
        problem = _not_a_loss(value)
        if problem is not None:
            raise plan.loaded.error(f"loss {spec} returned {problem}", ("loss",))
        return value  # type: ignore[no-any-return]  # checked just above

    return loss


def _checked_metric(
    plan: Plan, index: int, name: str, metric: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], torch.Tensor]:
    """``metric`` that raises a ConfigError at ``validation.metrics[index]`` when it fails, or returns what the
    validation summary cannot average."""
    from nvtrain.builtin.metrics import BUILTIN_METRICS

    written = plan.config.validation.metrics[index]
    who = f"metric {name!r} ({BUILTIN_METRICS.get(written, written)})"
    where: ConfigPath = ("validation", "metrics", index)

    def checked(outputs: Any, targets: Any) -> torch.Tensor:
        what = f"{who} failed on one validation batch ({_pair(outputs, targets)})"
        value = _calling(plan, where, what, lambda: metric(outputs, targets))
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex():
            raise plan.loaded.error(
                f"{who} returned {_describe(value)}, expected a one-element real tensor (the batch's value, "
                "which the validation summary averages over the batches)",
                where,
            )
        return value

    return checked


def _not_a_loss(value: Any) -> str | None:
    """What ``value`` is when the training loop cannot back-propagate it (a scalar floating-point tensor)."""
    if not isinstance(value, torch.Tensor):
        return f"{_describe(value)}, expected a scalar floating-point tensor (backward() needs one)"
    if value.numel() != 1:
        return f"{_describe(value)}, expected a scalar: backward() needs one number (reduce it, e.g. with .mean())"
    if not value.is_floating_point():
        return f"{_describe(value)}, expected a floating-point tensor: backward() cannot differentiate it"
    return None


def _calling(plan: Plan, where: ConfigPath, what: str, call: Callable[[], Any]) -> Any:
    """``call()``; what it raises becomes one located line ``what: Type: first line``. A ConfigError (an
    inner check's), memory, the accelerator and KeyboardInterrupt propagate as they are."""
    try:
        return call()
    except _PROPAGATED:
        raise
    except Exception as err:  # the user's code may raise anything: each is that function's failure
        # placed at the section: a runtime message that happens to hold a kwarg's name or value is no pointer
        raise plan.loaded.error(f"{what}: {_error_line(err)}", where) from None


def _error_line(err: Exception) -> str:
    """``Type: first line``; for an error a DataLoader worker raised, the worker's own error line rather than
    torch's "Caught ValueError in DataLoader worker process 0." that heads the worker's traceback."""
    text = str(err)
    if text.startswith("Caught ") and "Original Traceback" in text:
        prefix = f"{type(err).__name__}: "
        raised = [line for line in text.splitlines() if line.startswith(prefix)]
        if raised:
            return f"{raised[-1]} (in a DataLoader worker)"
    return one_line(err)


# -- data, device, state ----------------------------------------------------------------------------


def _first_batch(plan: Plan, loader: Any, role: str) -> Any:
    """The first batch of ``loader``; its iterator, and the worker processes behind it, end at once (a loader
    with persistent workers keeps its iterator itself: let go of it too). The run makes its own later."""
    factory = plan.config.data.factory

    def take() -> Any:
        iterator = iter(loader)
        try:
            return next(iterator, _NOTHING)
        except Exception as err:  # its traceback runs through the iterator's methods: dropped, or the error
            raise err.with_traceback(None) from None  # would keep the iterator and its workers alive
        finally:
            del iterator

    try:
        batch = _calling(plan, ("data",), f"the {role} loader of {factory} failed on its first batch", take)
    finally:
        LiveData(loaders=[loader]).release()
    if batch is _NOTHING:
        raise plan.loaded.error(f"{factory} returned a {role} loader that yields no batch", ("data",))
    return batch


def _mover(device: torch.device) -> Callable[[Any], Any]:
    """How the strategy puts a batch on its device (on the CPU it takes the batch as it is)."""
    return (lambda batch: batch) if device.type == "cpu" else device_mover(device)


def _clock(device: torch.device) -> float:
    """Seconds, once the device's queued work is done (a CUDA forward returns before it ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def _buffers_kept(models: Mapping[str, torch.nn.Module]) -> Iterator[None]:
    """Put every buffer back afterwards: a training-mode forward updates BatchNorm's running statistics."""
    saved = [(buffer, buffer.detach().clone()) for model in models.values() for buffer in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _pair(outputs: Any, targets: Any) -> str:
    return f"outputs {_describe(outputs)}, targets {_describe(targets)}"


def _describe(value: Any, *, nested: bool = False) -> str:
    """A short account of a batch, an output or a return value: ``tensor [4, 10] float32``, ``str 'abc'``."""
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)) and not nested and 0 < len(value) <= 4:
        return f"{type(value).__name__} ({', '.join(_describe(item, nested=True) for item in value)})"
    if isinstance(value, Mapping):
        keys = [str(key) for key in list(value)[:5]]
        return f"{type(value).__name__} with keys {', '.join(keys) or 'none'}"
    if isinstance(value, (str, int, float, bool)) and not nested:
        text = repr(value)
        return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
    return type(value).__name__
