"""What single features cost next to the floor of the work they do.

- EMA: one EMAHook update (called as the orchestrator calls it, after a real step)
  against ``torch._foreach_lerp_`` over the same parameters, the floor of any EMA
  update, and against ``AveragedModel.update_parameters`` with torch's EMA function.
- Gradient all-reduces per optimizer step under accumulation: DDPHook with
  GradientAccumulationHook(steps=4) in a single-process gloo group, counted by a
  DDP comm hook, against a hand-written DDP loop that accumulates without
  ``no_sync()``. The count is the point (one all-reduce per gradient bucket per
  step, not per micro-batch); the times of a one-process group are not.

Checkpoint save blocking (sync against async) is measured in test_checkpoint_blocking.py.

    python -m pytest benchmarks/test_feature_costs.py
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import nvtrain
from nvtrain import plugins
from nvtrain.hooks import GradientAccumulationHook

from harness import LARGE_MLP, TINY_MLP, make_batches, make_model

MODELS = {"tiny": TINY_MLP, "larger": LARGE_MLP}
DECAY = 0.999
ACCUMULATION = 4


def _installed(name: str) -> bool:
    return name in {info.name for info in plugins.available() if info.ok}


# -- EMA ---------------------------------------------------------------------------------------


def _ema_group(model: str) -> str:
    spec = MODELS[model]
    params = sum(p.numel() for p in make_model(spec).parameters())
    return f"ema update: {model} MLP, {params:,} parameters"


@pytest.mark.parametrize("model", list(MODELS))
def test_ema_foreach_lerp_floor_baseline(benchmark: Any, scale: Any, model: str) -> None:
    source = make_model(MODELS[model])
    params = list(source.parameters())
    averaged = [p.detach().clone() for p in params]
    benchmark.group = _ema_group(model)
    benchmark.extra_info.update(suite="ema", model=model, kind="foreach_lerp")

    @torch.no_grad()
    def update() -> None:
        torch._foreach_lerp_(averaged, params, 1.0 - DECAY)

    benchmark.pedantic(update, rounds=scale.pick(30, 6), iterations=scale.pick(200, 20), warmup_rounds=1)


@pytest.mark.skipif(not _installed("ema"), reason="needs the nvtrain-ema plugin")
@pytest.mark.parametrize("model", list(MODELS))
def test_ema_hook_update(benchmark: Any, scale: Any, model: str) -> None:
    hook = plugins.load("ema", decay=DECAY)
    ctx = nvtrain.TrainingContext(models={"main": make_model(MODELS[model])})
    ctx.step_count = 1
    hook.before_training(ctx)  # the averaged copy is made here, as in a run
    stage = nvtrain.TrainingStage.AFTER_OPTIMIZER_STEP
    hook(ctx, stage, False)  # the first update copies the weights; later ones lerp
    benchmark.group = _ema_group(model)
    benchmark.extra_info.update(suite="ema", model=model, kind="EMAHook")
    benchmark.pedantic(
        hook, args=(ctx, stage, False), rounds=scale.pick(30, 6), iterations=scale.pick(200, 20), warmup_rounds=1
    )
    assert hook.num_updates > 1


@pytest.mark.parametrize("model", list(MODELS))
def test_ema_averaged_model_update_parameters(benchmark: Any, scale: Any, model: str) -> None:
    source = make_model(MODELS[model])
    averaged = AveragedModel(source, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    averaged.update_parameters(source)
    benchmark.group = _ema_group(model)
    benchmark.extra_info.update(suite="ema", model=model, kind="AveragedModel")
    benchmark.pedantic(
        averaged.update_parameters,
        args=(source,),
        rounds=scale.pick(30, 6),
        iterations=scale.pick(200, 20),
        warmup_rounds=1,
    )


# -- gradient all-reduces under accumulation -----------------------------------------------------


class _AllReduceCounter:
    """Registers a counting comm hook on every DDP model at BEFORE_TRAINING (before any backward)."""

    plugin_name = "allreduce_counter"

    def __init__(self) -> None:
        self.calls = 0

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses non-GradBucket annotations
        self.calls += 1
        return _all_reduce_mean(bucket)

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        for model in ctx.models.values():
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                model.register_comm_hook(state=None, hook=self.hook)


def _all_reduce_mean(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)  # type: ignore[arg-type]


STEPS = 8  # optimizer steps per round: STEPS * ACCUMULATION micro-batches


def _group() -> str:
    return f"ddp accumulation: all-reduces per step, {ACCUMULATION} micro-batches per step (gloo, 1 process)"


@pytest.mark.skipif(not _installed("ddp"), reason="needs the nvtrain-ddp plugin")
@pytest.mark.filterwarnings("ignore:DDPHook. no distributed sampler was injected")  # a list of batches, one rank
def test_ddp_accumulation_allreduces(benchmark: Any, scale: Any, world_of_one: None) -> None:
    batches = make_batches(TINY_MLP, STEPS * ACCUMULATION)
    counters: list[_AllReduceCounter] = []

    def setup() -> tuple[tuple[Any], dict[str, Any]]:
        counter = _AllReduceCounter()
        counters.append(counter)
        strategy = nvtrain.TrainingStrategy(
            models=make_model(TINY_MLP),
            optimizers=functools.partial(torch.optim.SGD, lr=0.01),
            loss_fn=torch.nn.functional.mse_loss,
            hooks=[plugins.load("ddp"), GradientAccumulationHook(steps=ACCUMULATION), counter],
            num_epochs=1,
            device="cpu",
        )
        return (strategy,), {}

    def run(strategy: nvtrain.TrainingStrategy) -> None:
        strategy.run(batches)

    benchmark.group = _group()
    benchmark.pedantic(run, setup=setup, teardown=nvtrain.TrainingStrategy.close, rounds=scale.pick(10, 3))
    per_step = counters[-1].calls / STEPS
    benchmark.extra_info.update(suite="allreduce", kind="nvtrain", allreduces_per_step=per_step, buckets=1)
    assert per_step == 1.0, f"expected one all-reduce per optimizer step, counted {per_step}"


def test_ddp_accumulation_without_no_sync_baseline(benchmark: Any, scale: Any, world_of_one: None) -> None:
    """A hand-written DDP loop that accumulates without no_sync(): an all-reduce per micro-batch."""
    batches = make_batches(TINY_MLP, STEPS * ACCUMULATION)
    counters: list[_AllReduceCounter] = []

    def setup() -> tuple[tuple[Any, Any], dict[str, Any]]:
        counter = _AllReduceCounter()
        counters.append(counter)
        model = torch.nn.parallel.DistributedDataParallel(make_model(TINY_MLP))
        model.register_comm_hook(state=None, hook=counter.hook)
        return (model, torch.optim.SGD(model.parameters(), lr=0.01)), {}

    def run(model: Any, optimizer: torch.optim.Optimizer) -> None:
        for index, (inputs, targets) in enumerate(batches):
            loss = torch.nn.functional.mse_loss(model(inputs), targets) / ACCUMULATION
            loss.backward()
            if (index + 1) % ACCUMULATION == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    benchmark.group = _group()
    benchmark.pedantic(run, setup=setup, rounds=scale.pick(10, 3))
    per_step = counters[-1].calls / STEPS
    benchmark.extra_info.update(suite="allreduce", kind="naive", allreduces_per_step=per_step, buckets=1)
    assert per_step == float(ACCUMULATION)
