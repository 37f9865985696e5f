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


def _failed_run_without_closing(output_dir: Path) -> weakref.ref[TorchProfilerHook]:
    """Run until a hook raises, as a script would without ``with strategy:``; return a reference to the hook
    that does not keep it (the exception and its frames are gone on return)."""
    profiler = TorchProfilerHook(output_dir=output_dir, activities=["cpu"])
    strategy = _strategy([profiler, _RaiseAtStep(2)])
    try:
        strategy.run(_batches())
    except RuntimeError as err:
        assert str(err) == "planned failure"
    assert profiler.running and _profiler_enabled()
    return weakref.ref(profiler)


def test_a_failed_run_never_closed_stops_the_profiler_once_its_hook_is_collected(tmp_path: Path) -> None:
    hook = _failed_run_without_closing(tmp_path)
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
