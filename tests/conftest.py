"""Shared fixtures for the core tests: a tiny model, small batches, a recording observer.

Helper classes live here and reach the tests through fixtures, so test modules
need not import this file (tests are collected with ``--import-mode=importlib``).
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.stages import REPLACEMENT_STAGES, TrainingStage

Batch = tuple[torch.Tensor, torch.Tensor]

#: The sixteen stages an observer may implement as plain hooks.
OBSERVER_STAGES: tuple[TrainingStage, ...] = tuple(s for s in TrainingStage if s not in REPLACEMENT_STAGES)

#: Hook names of one micro-batch, in firing order.
BATCH_SEQUENCE: tuple[str, ...] = (
    "before_batch",
    "before_forward",
    "after_forward",
    "before_loss",
    "after_loss",
    "before_backward",
    "do_backward",
    "after_backward",
    "before_optimizer_step",
    "do_optimizer_step",
    "after_optimizer_step",
    "after_batch",
)


def _recording_impl(name: str) -> Callable[[Any, nvtrain.TrainingContext], None]:
    def impl(self: RecordingObserver, ctx: nvtrain.TrainingContext) -> None:
        self.record(name, ctx)

    impl.__name__ = name
    return nvtrain.hookimpl(impl)


class RecordingObserver:
    """Implements the sixteen observer stages and wraps both DO slots; records every firing.

    ``calls`` holds hook names in firing order; ``entries`` holds
    ``(name, ctx.stage, step_count, batch_count)`` for finer checks.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.entries: list[tuple[str, TrainingStage | None, int, int]] = []
        self.validations: list[Any] = []

    def record(self, name: str, ctx: nvtrain.TrainingContext) -> None:
        self.calls.append(name)
        self.entries.append((name, ctx.stage, ctx.step_count, ctx.batch_count))
        if name == "after_validation":
            self.validations.append(ctx.validation)

    @nvtrain.hookimpl(wrapper=True)
    def do_backward(self, ctx: nvtrain.TrainingContext) -> Any:
        self.record("do_backward", ctx)
        result = yield
        return result

    @nvtrain.hookimpl(wrapper=True)
    def do_optimizer_step(self, ctx: nvtrain.TrainingContext) -> Any:
        self.record("do_optimizer_step", ctx)
        result = yield
        return result


for _stage in OBSERVER_STAGES:
    setattr(RecordingObserver, _stage.hook_name, _recording_impl(_stage.hook_name))
del _stage


class VetoStep(nvtrain.TrainingUpdateHook):
    """Vetoes DO_OPTIMIZER_STEP on the micro-batches whose 0-based index is in ``veto_batches``."""

    stages = frozenset({TrainingStage.DO_OPTIMIZER_STEP})
    uses_gradients = False  # it decides from the batch index alone

    def __init__(self, veto_batches: Iterable[int] | Callable[[int], bool], priority: int = 50) -> None:
        self.priority = priority
        self._veto = veto_batches if callable(veto_batches) else frozenset(veto_batches).__contains__

    def __call__(
        self, ctx: nvtrain.TrainingContext, stage: TrainingStage, will_skip: bool
    ) -> tuple[bool, torch.Tensor | None]:
        return not self._veto(ctx.batch_count), ctx.loss


def make_batches(count: int, batch_size: int = 4, seed: int = 1, sizes: Iterable[int] | None = None) -> list[Batch]:
    """Deterministic ``(inputs[b, 3], targets[b, 2])`` pairs; ``sizes`` gives uneven batches."""
    generator = torch.Generator().manual_seed(seed)
    sizes = list(sizes) if sizes is not None else [batch_size] * count
    return [(torch.randn(n, 3, generator=generator), torch.randn(n, 2, generator=generator)) for n in sizes]


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


@pytest.fixture
def model() -> torch.nn.Module:
    """A seeded ``Linear(3, 2)``."""
    return tiny_model()


@pytest.fixture
def batches() -> Callable[..., list[Batch]]:
    """Factory of deterministic batches: ``batches(count, batch_size=4, seed=1, sizes=None)``."""
    return make_batches


@pytest.fixture
def recorder() -> RecordingObserver:
    """A fresh observer recording every stage (DO slots through ``wrapper=True``)."""
    return RecordingObserver()


@pytest.fixture
def recorder_cls() -> type[RecordingObserver]:
    return RecordingObserver


@pytest.fixture
def veto_step() -> type[VetoStep]:
    """The class of an update hook vetoing DO_OPTIMIZER_STEP on chosen micro-batches."""
    return VetoStep


@pytest.fixture
def batch_sequence() -> tuple[str, ...]:
    return BATCH_SEQUENCE


@pytest.fixture
def make_strategy() -> Callable[..., nvtrain.TrainingStrategy]:
    """Build a CPU strategy over a tiny model: ``make_strategy(hooks, **fields)``.

    Defaults: ``models=Linear(3, 2)`` (seed 0), SGD with ``lr=0.1``, MSE loss.
    """

    def make(hooks: Iterable[object] = (), **fields: Any) -> nvtrain.TrainingStrategy:
        fields.setdefault("models", tiny_model())
        fields.setdefault("optimizers", functools.partial(torch.optim.SGD, lr=0.1))
        fields.setdefault("loss_fn", torch.nn.functional.mse_loss)
        fields.setdefault("device", "cpu")
        return nvtrain.TrainingStrategy(hooks=list(hooks), **fields)

    return make


@pytest.fixture
def fallback_handlers() -> Iterator[list[int]]:
    """Python handlers for SIGTERM / SIGUSR1 while a test runs, so a signal nothing caught cannot kill pytest.

    Yields the list of signals those handlers received.
    """
    caught: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        caught.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@pytest.fixture
def site(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A :class:`tests.fake_plugin_site.FakePluginSite` under ``tmp_path``, forgotten after the test."""
    from tests.fake_plugin_site import FakePluginSite

    fake = FakePluginSite(tmp_path / "site", monkeypatch)
    yield fake
    fake.close()
