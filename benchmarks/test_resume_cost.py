"""Time to the first step after a resume, at 10% and at 90% of an epoch, over a dataset that costs ~1 ms a sample.

Target: resuming at 90% of the epoch costs at most 1.2x resuming at 10% (the resumed run reads only
the samples it trains). For comparison the same resumes through a loader nvtrain cannot open at an
offset (a DataLoader subclass), which replays the consumed micro-batches as nvtrain did before.

Each round builds a fresh strategy and loader (untimed), then times ``load_state_dict`` of the state
captured at the resume step plus a ``run()`` that trains exactly one step.

    python -m pytest benchmarks/test_resume_cost.py
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nvtrain
from nvtrain.step_scheduler import StepSchedulerConfig

nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")

SAMPLES = 400  # batch 4: 100 steps per epoch
BATCH = 4
SAMPLE_COST_S = 0.001  # a decode / tokenise / fetch per sample


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset whose every read takes about 1 ms, counting its reads."""

    def __init__(self) -> None:
        data = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 32, generator=data)
        self.y = torch.randn(SAMPLES, 4, generator=data)
        self.reads = 0

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        time.sleep(SAMPLE_COST_S)
        return self.x[index], self.y[index]


class OpaqueLoader(DataLoader[Any]):
    """A DataLoader subclass: nvtrain cannot tell how it samples, so a resume replays it."""


def _loader(replay: bool) -> DataLoader[Any]:
    cls = OpaqueLoader if replay else DataLoader
    return cls(SlowDataset(), batch_size=BATCH, shuffle=True)


def _strategy(hooks: list[object], max_steps: int) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.AdamW, lr=1e-3),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        step_scheduler=StepSchedulerConfig(max_steps=max_steps, ckpt_every_steps=None, validate_on_checkpoint=False),
    )


class _Grab:
    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps, self.states = steps, {}  # type: ignore[var-annotated]

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count in self.steps and ctx.step_count not in self.states:
            self.states[ctx.step_count] = nvtrain_checkpoint.snapshot(ctx.strategy.state_dict())  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def saved_states() -> dict[int, Any]:
    """The states of one run at steps 10 and 90 of its 100-step epoch (what the checkpoints would hold)."""
    grab = _Grab((10, 90))
    torch.manual_seed(1)
    with _strategy([grab], 91) as strategy:
        strategy.run(DataLoader(SlowDataset(), batch_size=BATCH, shuffle=True))
    return grab.states


def _time_resume(benchmark: Any, saved_states: dict[int, Any], scale: Any, step: int, replay: bool) -> None:
    state = saved_states[step]
    reads: list[int] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (_strategy([], step + 1), _loader(replay)), {}

    def resume(strategy: nvtrain.TrainingStrategy, loader: DataLoader[Any]) -> None:
        strategy.load_state_dict(state)
        with strategy:
            result = strategy.run(loader)
        assert result.step_count == step + 1
        reads.append(loader.dataset.reads)  # type: ignore[attr-defined]

    benchmark.pedantic(resume, setup=setup, rounds=scale.pick(7, 3), iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        resume_step=step, epoch_fraction=step / (SAMPLES // BATCH), samples_read=reads[-1], replay=replay
    )
    expected = (step + 1) * BATCH if replay else BATCH  # the replay reads the consumed part again
    assert reads[-1] == expected


@pytest.mark.benchmark(group="resume: time to the first step after a resume (1 ms per sample)")
def test_resume_at_10pct_baseline(benchmark: Any, saved_states: dict[int, Any], scale: Any) -> None:
    _time_resume(benchmark, saved_states, scale, 10, replay=False)


@pytest.mark.benchmark(group="resume: time to the first step after a resume (1 ms per sample)")
def test_resume_at_90pct(benchmark: Any, saved_states: dict[int, Any], scale: Any) -> None:
    _time_resume(benchmark, saved_states, scale, 90, replay=False)


@pytest.mark.benchmark(group="resume: time to the first step after a resume (1 ms per sample)")
def test_resume_at_10pct_replayed(benchmark: Any, saved_states: dict[int, Any], scale: Any) -> None:
    _time_resume(benchmark, saved_states, scale, 10, replay=True)


@pytest.mark.benchmark(group="resume: time to the first step after a resume (1 ms per sample)")
def test_resume_at_90pct_replayed(benchmark: Any, saved_states: dict[int, Any], scale: Any) -> None:
    _time_resume(benchmark, saved_states, scale, 90, replay=True)
