"""Per-step time of the standard plugin stack against a hand-written loop doing the same work.

The stack: mixed precision (fp32, or bf16 autocast), EMA (decay 0.999, every
step), gradient clipping (total norm 1.0) and a checkpoint every 100 steps
(synchronous, into a temporary directory). The hand-written baseline does the
same work by hand: autocast, ``clip_grad_norm_``, one ``torch._foreach_lerp_`` per
step for the EMA, and every 100 steps (and at the end of the run, as the hook
does) ``torch.save`` of model, optimizer and EMA weights to a temporary file that
is fsynced and renamed into place. The checkpoint hook writes more than that (RNG
states, data position, a manifest with a sha256, a ``latest`` pointer), so the
checkpoint steps cost it more.

A round builds a fresh model, stack and temporary directory, takes one untimed
warm-up step, then times a run over STEPS batches (the tiny model: saves at steps
100 and 200 and at the end; the larger one: the end-of-run save only). Per-step
figures from ``StampedBatches`` are in ``extra_info["step_us"]``; the checkpoint
steps are among them (single steps, so they do not move the median).

    python -m pytest benchmarks/test_loop_stacks.py
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nvtrain import plugins
from nvtrain.hooks import GradientClippingHook

from harness import (
    LARGE_MLP,
    TINY_MLP,
    MLPSpec,
    StampedBatches,
    Workload,
    compare_loops,
    hand_written_workload,
    make_batches,
    strategy_workload,
)

for _plugin in ("amp", "ema", "checkpoint"):
    if _plugin not in {info.name for info in plugins.available() if info.ok}:
        pytest.skip(f"the standard stack needs the nvtrain-{_plugin} plugin installed", allow_module_level=True)

MODELS = {"tiny": TINY_MLP, "larger": LARGE_MLP}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECKPOINT_EVERY = 100
EMA_DECAY = 0.999
MAX_NORM = 1.0


def _steps_and_rounds(model: str, scale: Any) -> tuple[int, int]:
    if model == "tiny":
        return scale.pick(200, 50), scale.pick(20, 4)
    return scale.pick(10, 3), scale.pick(6, 2)


def standard_stack(precision: str, checkpoint_dir: Path) -> list[object]:
    """The stack as a user would configure it, loaded through the plugin registry."""
    return [
        plugins.load("amp", precision=precision),
        plugins.load("ema", decay=EMA_DECAY),
        GradientClippingHook(max_norm=MAX_NORM),
        plugins.load("checkpoint", checkpoint_dir=checkpoint_dir, step_interval=CHECKPOINT_EVERY),
    ]


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def hand_written_stack(
    precision: str, directory: Path, last_step: int
) -> Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[Any, Any, int], None]]:
    """The same work as :func:`standard_stack`, written out by hand."""
    dtype = PRECISIONS[precision]

    def make(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Any, Any, int], None]:
        params = list(model.parameters())
        averaged = [p.detach().clone() for p in params]
        mse_loss = torch.nn.functional.mse_loss
        clip = torch.nn.utils.clip_grad_norm_

        def autocast() -> Any:
            if dtype == torch.float32:
                return contextlib.nullcontext()
            return torch.autocast("cpu", dtype=dtype)

        def step(inputs: Any, targets: Any, number: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = mse_loss(model(inputs), targets)
            loss.backward()
            clip(params, MAX_NORM)
            optimizer.step()
            with torch.no_grad():
                torch._foreach_lerp_(averaged, params, 1.0 - EMA_DECAY)
            if number % CHECKPOINT_EVERY == 0 or number == last_step:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "ema": averaged,
                    "step": number,
                }
                _save(directory / f"step_{number}.pt", state)

        return step

    return make


def _group(model: str, spec: MLPSpec, precision: str) -> str:
    return f"stack: {model} MLP {spec.label}, {precision}"


def _fresh(directory: Path) -> Callable[[], None]:
    """Before each round: an empty checkpoint directory, so every round saves the same files."""

    def empty() -> None:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)

    return empty


@pytest.fixture
def scratch() -> Any:
    directory = Path(tempfile.mkdtemp(prefix="nvtrain-bench-"))
    yield directory / "run"
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("model", list(MODELS))
def test_hand_written_stack_baseline(
    benchmark: Any, time_loop: Any, scale: Any, scratch: Path, model: str, precision: str
) -> None:
    steps, rounds = _steps_and_rounds(model, scale)
    spec = MODELS[model]
    batches = StampedBatches(make_batches(spec, steps))
    benchmark.group = _group(model, spec, precision)
    make_step = hand_written_stack(precision, scratch, last_step=steps + 1)
    workload = hand_written_workload(spec, batches, make_step=make_step)
    info = {"suite": "stack", "model": model, "precision": precision, "kind": "hand stack"}
    time_loop(workload, batches, rounds, _fresh(scratch), **info)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("model", list(MODELS))
def test_strategy_standard_stack(
    benchmark: Any, time_loop: Any, scale: Any, scratch: Path, model: str, precision: str
) -> None:
    steps, rounds = _steps_and_rounds(model, scale)
    spec = MODELS[model]
    batches = StampedBatches(make_batches(spec, steps))
    benchmark.group = _group(model, spec, precision)
    workload = strategy_workload(spec, batches, lambda: standard_stack(precision, scratch))
    info = {"suite": "stack", "model": model, "precision": precision, "kind": "nvtrain stack"}
    time_loop(workload, batches, rounds, _fresh(scratch), **info)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("model", list(MODELS))
def test_interleaved_comparison(benchmark: Any, scale: Any, scratch: Path, model: str, precision: str) -> None:
    """Bare loop, hand-written stack and nvtrain stack round-robin in one test (``extra_info["comparison"]``)."""
    steps, rounds = _steps_and_rounds(model, scale)
    spec = MODELS[model]

    def fresh(name: str) -> Path:
        folder = scratch / name
        _fresh(folder)()
        return folder

    loops: dict[str, Callable[[StampedBatches], Workload]] = {
        "hand-written stack": lambda data: hand_written_workload(
            spec,
            data,
            make_step=lambda model, optimizer: hand_written_stack(precision, fresh("hand"), steps + 1)(
                model, optimizer
            ),
        ),
        "nvtrain, standard stack": lambda data: strategy_workload(
            spec, data, lambda: standard_stack(precision, fresh("nvtrain"))
        ),
        "bare hand-written loop": lambda data: hand_written_workload(spec, data),
    }
    benchmark.group = "interleaved " + _group(model, spec, precision)
    result = benchmark.pedantic(
        compare_loops, args=(loops, make_batches(spec, steps)), kwargs={"rounds": rounds}, rounds=1, iterations=1
    )
    benchmark.extra_info.update(suite="stack-interleaved", model=model, precision=precision, comparison=result)
