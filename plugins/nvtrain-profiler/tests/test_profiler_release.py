"""TorchProfilerHook never leaves torch's profiler recording once the hook is gone."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from nvtrain_profiler import TorchProfilerHook

import nvtrain


def _profiler_enabled() -> bool:
    """Is torch's profiler recording (every op run now is kept)?"""
    return bool(torch.autograd._profiler_enabled())


@pytest.fixture(autouse=True)
def _never_leave_the_profiler_on() -> Iterator[None]:
    """A failing test must not leave the profiler recording for the tests after it."""
    assert not _profiler_enabled()
    yield
    if _profiler_enabled():
        torch.autograd._disable_profiler()
        torch.autograd.profiler._is_profiler_enabled = False


class _RaiseAtStep:
    def __init__(self, step: int) -> None:
        self.step = step

    @nvtrain.hookimpl
    def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            raise RuntimeError("planned failure")


def _strategy(hooks: list[object]) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        max_steps=6,
        device="cpu",
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, generator=generator), torch.randn(2, 1, generator=generator)) for _ in range(6)]


def test_a_failed_run_stops_the_profiler_at_once_and_writes_its_trace(tmp_path: Path) -> None:
    """A script without ``with strategy:`` (a notebook cell): the run raises, the strategy stays open, and the
    profiler must not go on recording every operation the process runs next."""
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"])
    strategy = _strategy([profiler, _RaiseAtStep(2)])
    with pytest.raises(RuntimeError, match="planned failure"):
        strategy.run(_batches())
    assert not profiler.running and not _profiler_enabled()
    assert [path.parent for path in profiler.traces] == [tmp_path / "rank_0" / "torch"]  # the failed run's trace
    strategy.close()  # nothing left to stop: no second trace
    assert len(list((tmp_path / "rank_0" / "torch").iterdir())) == 1


def test_a_retried_run_profiles_again_from_its_first_micro_batch(tmp_path: Path) -> None:
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"])
    failing = _RaiseAtStep(2)
    with _strategy([profiler, failing]) as strategy:
        with pytest.raises(RuntimeError, match="planned failure"):
            strategy.run(_batches())
        failing.step = -1
        strategy.run(_batches())
        assert not profiler.running
    assert len(profiler.traces) == 2  # the failed run's, then the retry's


def _standalone_batches_without_closing(output_dir: Path) -> weakref.ref[TorchProfilerHook]:
    """``train_batch()`` calls outside any run start the profiler lazily; a script that never closes the
    strategy leaves it on. Return a reference to the hook that does not keep it."""
    profiler = TorchProfilerHook(output_dir=output_dir, activities=["cpu"])
    strategy = _strategy([profiler])
    for batch in _batches()[:2]:
        strategy.train_batch(batch)
    assert profiler.running and _profiler_enabled()
    return weakref.ref(profiler)


def test_a_profiler_never_closed_stops_once_its_hook_is_collected(tmp_path: Path) -> None:
    hook = _standalone_batches_without_closing(tmp_path)
    gc.collect()
    assert hook() is None
    assert not _profiler_enabled()
    assert list((tmp_path / "rank_0" / "torch").iterdir()) == []  # abandoned: no trace written from the collector


def test_close_after_a_failed_run_still_writes_its_trace(tmp_path: Path) -> None:
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"])
    with pytest.raises(RuntimeError, match="planned failure"), _strategy([profiler, _RaiseAtStep(2)]) as strategy:
        strategy.run(_batches())
    assert not _profiler_enabled()
    assert [path.parent for path in profiler.traces] == [tmp_path / "rank_0" / "torch"]
    gc.collect()  # the finalizer was detached by close(): collecting the hook writes nothing more
    assert len(list((tmp_path / "rank_0" / "torch").iterdir())) == 1
