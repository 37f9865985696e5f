"""GPU check: the standard stack's per-step overhead on a GPU-sized model, and no host sync per step.

    python benchmarks/gpu_check.py               # skips cleanly (exit 0) without CUDA
    python benchmarks/gpu_check.py --json
    python benchmarks/gpu_check.py --device cpu --model tiny --steps 20   # a smoke run on CPU (no sync check)

Two things, on ``cuda``:

1. Per-step time of ``TrainingStrategy`` with the standard stack (bf16 autocast,
   EMA, gradient clipping, a checkpoint every 100 steps) against a hand-written
   loop doing the same work, and of the strategy with no plugins against a bare
   hand-written loop; round-robin, ``torch.cuda.synchronize()`` before each clock
   stop. Model: MLP 2048->8192->2048, batch 512 (33.6 M parameters).
2. No host-device synchronisation on a step that neither logs nor checkpoints:
   those steps run under ``torch.cuda.set_sync_debug_mode("error")``, which raises
   on any synchronising call (``.item()``, ``.cpu()``, ``bool(tensor)``...). The
   mode is switched on at BEFORE_BATCH (before every other observer) and off at
   AFTER_BATCH (after every other) for every step of ``run()``, except checkpoint
   steps, which copy the state to the host by design. (The warm-up step before
   ``run()``, where the EMA copy is allocated, is not guarded.)

Exit status: 0 passed or skipped, 1 a synchronisation was found.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nvtrain
from nvtrain import plugins
from nvtrain.benchmarking import (
    TINY_MLP,
    MLPSpec,
    hand_written_workload,
    make_batches,
    measure,
    ratio,
    strategy_workload,
)
from nvtrain.hooks import GradientClippingHook

GPU_MLP = MLPSpec(2048, 8192, 2048, 512)
MODELS = {"gpu": GPU_MLP, "tiny": TINY_MLP}
CHECKPOINT_EVERY = 100
EMA_DECAY = 0.999
MAX_NORM = 1.0


def standard_stack(precision: str, checkpoint_dir: Path) -> list[object]:
    return [
        plugins.load("amp", precision=precision),
        plugins.load("ema", decay=EMA_DECAY),
        GradientClippingHook(max_norm=MAX_NORM),
        plugins.load("checkpoint", checkpoint_dir=checkpoint_dir, step_interval=CHECKPOINT_EVERY),
    ]


def hand_written_stack(
    device: torch.device, dtype: torch.dtype, directory: Path, last_step: int
) -> Callable[[torch.nn.Module, torch.optim.Optimizer], Callable[[Any, Any, int], None]]:
    def make(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[Any, Any, int], None]:
        params = list(model.parameters())
        averaged = [p.detach().clone() for p in params]
        mse_loss = torch.nn.functional.mse_loss

        def step(inputs: Any, targets: Any, number: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = mse_loss(model(inputs), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
            with torch.no_grad():
                torch._foreach_lerp_(averaged, params, 1.0 - EMA_DECAY)
            if number % CHECKPOINT_EVERY == 0 or number == last_step:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "ema": averaged}
                path = directory / f"step_{number}.pt"
                torch.save(state, path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)

        return step

    return make


class SyncGuard:
    """Raises on any host-device sync between BEFORE_BATCH and AFTER_BATCH of a non-checkpoint step."""

    plugin_name = "sync_guard"
    priority = -1000  # before every other observer

    def __init__(self) -> None:
        self.guarded_steps = 0

    @nvtrain.hookimpl(tryfirst=True)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.windowed and (ctx.step_count + 1) % CHECKPOINT_EVERY:
            torch.cuda.set_sync_debug_mode("error")
            self.guarded_steps += 1

    @nvtrain.hookimpl(trylast=True)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def close(self) -> None:
        torch.cuda.set_sync_debug_mode("default")


def check_no_sync(spec: MLPSpec, device: torch.device, steps: int, directory: Path) -> dict[str, Any]:
    """Train ``steps`` steps with the stack and the guard; a sync inside a guarded step raises."""
    guard = SyncGuard()
    batches = make_batches(spec, steps, device=device)
    workload = strategy_workload(spec, batches, lambda: [guard, *standard_stack("bf16", directory)], device=device)
    strategy = workload.prepare()
    try:
        workload.run(strategy)
    finally:
        strategy.close()
    return {"guarded_steps": guard.guarded_steps, "synchronisations": 0}


def overhead(spec: MLPSpec, device: torch.device, steps: int, rounds: int, directory: Path) -> dict[str, Any]:
    batches = make_batches(spec, steps, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    precision = "bf16" if device.type == "cuda" else "fp32"
    folders = {name: directory / name for name in ("hand", "nvtrain")}

    def fresh(path: Path) -> Path:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    timings = measure(
        {
            "bare loop": hand_written_workload(spec, batches, device=device),
            "nvtrain, no plugins": strategy_workload(spec, batches, device=device),
            "hand-written stack": hand_written_workload(
                spec,
                batches,
                make_step=lambda model, optimizer: hand_written_stack(
                    device, dtype, fresh(folders["hand"]), steps + 1
                )(model, optimizer),
                device=device,
            ),
            "nvtrain, standard stack": strategy_workload(
                spec, batches, lambda: standard_stack(precision, fresh(folders["nvtrain"])), device=device
            ),
        },
        rounds=rounds,
    )
    no_plugins = ratio(timings["nvtrain, no plugins"], timings["bare loop"])
    stack = ratio(timings["nvtrain, standard stack"], timings["hand-written stack"])
    return {
        "per_step_us": {name: {"median": t.median / 1e3, "min": t.min / 1e3} for name, t in timings.items()},
        "ratio_no_plugins": no_plugins.to_dict(),
        "ratio_standard_stack": stack.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpu", help="gpu (default) or tiny")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed run (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per candidate (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device (GPU figures are not measured on this machine)")
        return 0
    spec = MODELS[args.model]
    report: dict[str, Any] = {"device": str(device), "model": spec.label}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.set_device(device)
    directory = Path(tempfile.mkdtemp(prefix="nvtrain-gpu-check-"))
    status = 0
    try:
        if device.type == "cuda":
            try:
                report["sync_check"] = check_no_sync(spec, device, args.steps, directory / "sync")
            except RuntimeError as err:
                report["sync_check"] = {"error": str(err)}
                status = 1
            finally:
                torch.cuda.set_sync_debug_mode("default")
        report["overhead"] = overhead(spec, device, args.steps, args.rounds, directory)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(directory)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"device {report['device']} {report.get('gpu', '')}, model MLP {report['model']}")
        for name, figures in report["overhead"]["per_step_us"].items():
            print(f"  {name:26s} {figures['median']:10.1f} us/step (min {figures['min']:.1f})")
        for key in ("ratio_no_plugins", "ratio_standard_stack"):
            figures = report["overhead"][key]
            print(f"  {key}: {figures['median']:.3f}x (min {figures['min']:.3f}x)")
        if "sync_check" in report:
            print(f"  sync check: {report['sync_check']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
