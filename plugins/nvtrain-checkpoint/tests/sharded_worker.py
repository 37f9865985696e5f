"""Ranks of the sharded-checkpoint tests: ``python sharded_worker.py OUT_DIR SCENARIO[=ARG] ...``.

Models are sharded with the FSDP plugin's FSDPHook (DTensor parameters), so CheckpointHook
writes sharded (DCP) checkpoints. Started by the tests with the variables torchrun sets
(never forked); every scenario gets its own process group (``NVTRAIN_TEST_PORTS``).
Each writes ``OUT_DIR/<scenario>/rank<R>.pt``.

    save            8 steps, checkpoints at 4 and 8 (the uninterrupted run)
    async           the same with async_save=True, keep_last_n=2, checkpoints every 2 steps
    resume=DIR      resume from the checkpoint DIR and finish the 8 steps
    resume_auto=DIR resume="auto" in the checkpoint root DIR (after a kill) and finish, keep_last_n=3
    per_rank        rank_zero_only=False, which sharded checkpoints refuse
    fault=POINT     save every 2 steps; the second save stops for good at POINT (the test kills the ranks)
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from nvtrain_checkpoint import CheckpointHook
from nvtrain_ema import EMAHook
from nvtrain_fsdp import FSDPHook
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.step_scheduler import StepSchedulerConfig
from nvtrain.testing import full_tensors, run_scenarios

STEPS = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_loader(world_size: int) -> DataLoader[Any]:
    """Shuffled, so a resume must restore the data position; 8 steps per epoch on every world size."""
    generator = torch.Generator().manual_seed(1234)
    samples = STEPS * 4 * world_size
    data = TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples, 3, generator=generator))
    return DataLoader(data, batch_size=4, shuffle=True)




def snapshot_of(strategy: nvtrain.TrainingStrategy, ema: EMAHook) -> dict[str, Any]:
    """Gathered weights, optimizer state by parameter name, LR schedule, EMA weights and counters."""
    ctx = strategy.ctx
    model = ctx.models["main"]
    optimizer = ctx.optimizers["main"]
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        "weights": full_tensors(model.state_dict()),
        "optimizer": {names[id(p)]: full_tensors(state) for p, state in optimizer.state.items()},
        "lr": [group["lr"] for group in optimizer.param_groups],
        "ema": full_tensors(ema.averaged_weights()),
        "step_count": ctx.step_count,
        "batch_count": ctx.batch_count,
    }


class Record:
    """Snapshots at the steps named, and the state right after a resume (at the first micro-batch)."""

    def __init__(self, ema: EMAHook, at_steps: tuple[int, ...]) -> None:
        self.ema = ema
        self.at_steps = at_steps
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.first: dict[str, Any] | None = None

    @nvtrain.hookimpl(tryfirst=True)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if self.first is None:
            assert ctx.strategy is not None
            self.first = snapshot_of(ctx.strategy, self.ema)

    @nvtrain.hookimpl(trylast=True)
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count in self.at_steps and ctx.step_count not in self.snapshots:
            assert ctx.strategy is not None
            self.snapshots[ctx.step_count] = snapshot_of(ctx.strategy, self.ema)


def make_strategy(checkpoint: CheckpointHook, ema: EMAHook, record: Record) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        make_model(),
        functools.partial(torch.optim.AdamW, lr=0.01),
        torch.nn.functional.mse_loss,
        lr_schedulers=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
        hooks=[FSDPHook(), ema, checkpoint, record],
        distributed_manager=nvtrain.DistributedManager(),
        device="cpu",
        step_scheduler=StepSchedulerConfig(num_epochs=1, ckpt_every_steps=None, validate_on_checkpoint=False),
    )


def train(checkpoint: CheckpointHook, at_steps: tuple[int, ...] = (4, 8)) -> dict[str, Any]:
    ema = EMAHook(decay=0.5)
    record = Record(ema, at_steps)
    torch.manual_seed(5)
    with make_strategy(checkpoint, ema, record) as strategy:
        result = strategy.run(make_loader(dist.get_world_size()))
    return {
        "snapshots": record.snapshots,
        "first": record.first,
        "step_count": result.step_count,
        "last_checkpoint_index": checkpoint.last_checkpoint_index,
    }


def save(out: Path, name: str, payload: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out / name)


# -- scenarios --------------------------------------------------------------------------------------------


def scenario_save(out: Path, arg: str) -> None:
    save(out, f"rank{dist.get_rank()}.pt", train(CheckpointHook(out / "checkpoints", step_interval=4)))


def scenario_async(out: Path, arg: str) -> None:
    hook = CheckpointHook(out / "checkpoints", step_interval=2, async_save=True, keep_last_n=2)
    save(out, f"rank{dist.get_rank()}.pt", train(hook))


def scenario_resume(out: Path, arg: str) -> None:
    hook = CheckpointHook(out / "unused", resume=arg)
    save(out, f"rank{dist.get_rank()}.pt", train(hook))


def scenario_fault(out: Path, point: str) -> None:
    """Checkpoints every 2 steps; the second save stops for good at ``point`` on one rank, which writes its
    pid to ``marker``; the test then kills both ranks (the other waits in a collective)."""
    from nvtrain_checkpoint import sharded, storage

    saves = [0]
    original_save = sharded.ShardedSaver.save

    def counting_save(self: Any, *args: Any, **kwargs: Any) -> Any:
        saves[0] += 1
        return original_save(self, *args, **kwargs)

    sharded.ShardedSaver.save = counting_save  # type: ignore[method-assign]

    def stop_here() -> None:
        (out / "marker").write_text(str(os.getpid()))
        while True:
            time.sleep(1)

    if point == "during_shards" and dist.get_rank() == 1:
        original_write = torch.distributed.checkpoint.FileSystemWriter.write_data

        def half_written(self: Any, plan: Any, planner: Any) -> Any:
            if saves[0] >= 2:  # a shard file cut off half-way, as a kill mid-write leaves it
                with open(Path(self.path) / "__1_0.distcp", "wb") as file:
                    file.write(b"half of rank 1's shards")
                stop_here()
            return original_write(self, plan, planner)

        torch.distributed.checkpoint.FileSystemWriter.write_data = half_written  # type: ignore[method-assign]
    elif point in ("before_rename", "before_latest") and dist.get_rank() == 0:
        name = "publish" if point == "before_rename" else "write_latest"
        original = getattr(storage, name)

        def hang(*args: Any, **kwargs: Any) -> Any:
            if saves[0] >= 2:
                stop_here()
            return original(*args, **kwargs)

        setattr(storage, name, hang)
    train(CheckpointHook(out / "checkpoints", step_interval=2))
    raise SystemExit(f"the fault point {point} was never reached")


def scenario_resume_auto(out: Path, arg: str) -> None:
    """Continue the job a kill interrupted: resume="auto" in its checkpoint directory, keeping the last 3
    (synchronous saves: rank 0's writer thread deletes what retention drops)."""
    hook = CheckpointHook(Path(arg), step_interval=2, resume="auto", keep_last_n=3)
    save(out, f"rank{dist.get_rank()}.pt", train(hook))


def scenario_load_checkpoint(out: Path, arg: str) -> None:
    """TrainingStrategy.load_checkpoint of a sharded checkpoint: restored on return, before any run."""
    ema = EMAHook(decay=0.5)
    strategy = nvtrain.TrainingStrategy.load_checkpoint(
        Path(arg),
        hooks=[FSDPHook(), ema, CheckpointHook(out / "unused")],
        models=make_model(),
        optimizers=functools.partial(torch.optim.AdamW, lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
        lr_schedulers=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
        distributed_manager=nvtrain.DistributedManager(),
        device="cpu",
    )
    with strategy:
        save(out, f"rank{dist.get_rank()}.pt", {"loaded": snapshot_of(strategy, ema)})


def scenario_per_rank(out: Path, arg: str) -> None:
    """rank_zero_only=False cannot write a sharded checkpoint: the error is recorded."""
    try:
        train(CheckpointHook(out / "checkpoints", step_interval=4, rank_zero_only=False))
    except ValueError as err:
        save(out, f"rank{dist.get_rank()}.pt", {"error": str(err), "field": getattr(err, "field", None)})
    else:
        raise SystemExit("rank_zero_only=False wrote a sharded checkpoint")


SCENARIOS = {
    "save": scenario_save,
    "async": scenario_async,
    "resume": scenario_resume,
    "resume_auto": scenario_resume_auto,
    "fault": scenario_fault,
    "per_rank": scenario_per_rank,
    "load_checkpoint": scenario_load_checkpoint,
}


def main(out_dir: Path, scenarios: list[str]) -> None:
    started = iter(range(len(scenarios)))

    def run(name: str, arg: str, manager: Any) -> None:
        index = next(started)
        out = out_dir / {"fault": f"fault-{arg}", "resume": f"resume-{index}", "resume_auto": f"resume-{index}"}.get(
            name, name
        )
        out.mkdir(parents=True, exist_ok=True)
        SCENARIOS[name](out, arg)

    run_scenarios(scenarios, run)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
