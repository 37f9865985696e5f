"""Ranks of the multi-process nvtrain-ddp tests: ``python ddp_worker.py OUT_DIR SCENARIO [SCENARIO ...]``.

Launched by the tests (directly with the torchrun environment variables, or through
torchrun itself). The scenarios run one after another in the same processes (starting
processes is the slow part), each with its own process group; a scenario writes
``OUT_DIR/<scenario>/rank<R>.pt`` on every rank, and rank 0 also writes the
single-process reference the test compares against (``reference.pt``), computed with
plain torch on the same global batches. ``NVTRAIN_TEST_PORTS`` (comma separated)
gives each scenario its own ``MASTER_PORT``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvtrain_ddp import DDPHook
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset, default_collate

import nvtrain
from nvtrain.testing import scenario_ports

LR = 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def reference(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    local_batch: int,
    world_size: int,
    accumulation: int = 1,
    skip: tuple[int, ...] = (),
) -> list[torch.Tensor]:
    """One process on the global batches: micro-batch k is every rank's k-th shard batch, in rank order.

    An unsharded DistributedSampler(shuffle=False) gives rank r the samples r, r + W, r + 2W, ...
    """
    model = make_model()
    optimizer = sgd(model.parameters())
    shards = [torch.arange(rank, x.shape[0], world_size) for rank in range(world_size)]
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            k = step * accumulation + micro
            index = torch.cat([shard[k * local_batch : (k + 1) * local_batch] for shard in shards])
            loss = torch.nn.functional.mse_loss(model(x[index]), y[index]) / accumulation
            loss.backward()
        if step not in skip:
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


class CountAllReduces:
    """Counts DDP gradient all-reduces through a communication hook (one call per bucket)."""

    def __init__(self) -> None:
        self.calls = 0

    @nvtrain.hookimpl
    def before_training(self, ctx: nvtrain.TrainingContext) -> None:
        model = ctx.models["main"]
        assert isinstance(model, DistributedDataParallel), type(model)
        model.register_comm_hook(state=None, hook=self._allreduce)

    def _allreduce(self, state, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP checks them at runtime and would reject the postponed (string) ones.
        self.calls += 1
        return default_hooks.allreduce_hook(state, bucket)


class RecordIndices:
    """Records which samples (column 0 of the inputs) each epoch's micro-batches held."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    @nvtrain.hookimpl
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen.setdefault(ctx.epoch, []).extend(int(v) for v in ctx.batch[0][:, 0].tolist())


def tagged_collate(samples: list[Any]) -> Any:
    return default_collate(samples)


def save(out: Path, name: str, payload: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out / name)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


# -- scenarios ------------------------------------------------------------------------------


def equivalence(out: Path) -> None:
    """Plain DDP through a DistributedManager: 2 ranks x batch 4 == 1 process x batch 8."""
    manager = nvtrain.DistributedManager.initialize()
    x, y = make_data(32)
    model = make_model()
    counter = CountAllReduces()
    hook = DDPHook()
    strategy = nvtrain.TrainingStrategy(
        model, sgd, torch.nn.functional.mse_loss, hooks=[hook, counter], distributed_manager=manager, num_epochs=1
    )
    with strategy:
        result = strategy.run(DataLoader(TensorDataset(x, y), batch_size=4))
        wrapped = isinstance(strategy.ctx.models["main"], DistributedDataParallel)
        sampler = type(strategy.ctx.train_loader.sampler).__name__
        optimizer_holds_model_params = all(
            any(p is q for q in model.parameters()) for p in strategy.ctx.optimizers["main"].param_groups[0]["params"]
        )
    payload = {
        "params": params_of(model),
        "wrapped": wrapped,
        "unwrapped_after_close": strategy.ctx.models["main"] is model,
        "optimizer_holds_model_params": optimizer_holds_model_params,
        "sampler": sampler,
        "rank": strategy.ctx.rank,
        "world_size": strategy.ctx.world_size,
        "device": str(strategy.device),
        "step_count": result.step_count,
        "global_step_count": result.global_step_count,
        "allreduce_calls": counter.calls,
        "process_group_alive": dist.is_initialized(),
    }
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        ref = reference(x, y, steps=4, local_batch=4, world_size=manager.world_size)
        save(out, "reference.pt", {"params": ref})
    # Tear the group down together: a rank that destroys it while the other is still inside
    # gloo (rank 0 computes the reference) can abort that rank ("terminate called without an
    # active exception").
    manager.barrier()
    nvtrain.DistributedManager.cleanup()


def accumulation(out: Path) -> None:
    """DDPHook initialises the group itself; K=4 over 8 micro-batches: 2 steps, 2 all-reduces."""
    from nvtrain.hooks.accumulation import GradientAccumulationHook

    x, y = make_data(64)
    model = make_model()
    counter = CountAllReduces()
    hook = DDPHook()
    strategy = nvtrain.TrainingStrategy(
        model,
        sgd,
        torch.nn.functional.mse_loss,
        hooks=[GradientAccumulationHook(steps=4), hook, counter],
        num_epochs=1,
    )
    with strategy:
        result = strategy.run(DataLoader(TensorDataset(x, y), batch_size=4))
        rank, world_size = strategy.ctx.rank, strategy.ctx.world_size
        owned_during_run = dist.is_initialized()
    payload = {
        "params": params_of(model),
        "rank": rank,
        "world_size": world_size,
        "step_count": result.step_count,
        "batch_count": result.batch_count,
        "allreduce_calls": counter.calls,
        "initialised_during_run": owned_during_run,
        "process_group_alive": dist.is_initialized(),
    }
    save(out, f"rank{rank}.pt", payload)
    if rank == 0:
        ref = reference(x, y, steps=2, local_batch=4, world_size=world_size, accumulation=4)
        save(out, "reference.pt", {"params": ref})


def sampler(out: Path) -> None:
    """Sampler injection into a shuffling loader, and set_epoch: a new rank-disjoint order each epoch."""
    manager = nvtrain.DistributedManager.initialize()
    n = 20
    x = torch.zeros(n, 4)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    y = torch.zeros(n, 2)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True, collate_fn=tagged_collate, drop_last=True)
    recorder = RecordIndices()
    strategy = nvtrain.TrainingStrategy(
        make_model(),
        sgd,
        torch.nn.functional.mse_loss,
        hooks=[DDPHook(), recorder],
        distributed_manager=manager,
        num_epochs=3,
    )
    with strategy:
        strategy.run(loader)
        injected = strategy.ctx.train_loader
        payload = {
            "seen": recorder.seen,
            "replaced": injected is not loader,
            "sampler": type(injected.sampler).__name__,
            "shuffle": getattr(injected.sampler, "shuffle", None),
            "num_replicas": getattr(injected.sampler, "num_replicas", None),
            "sampler_rank": getattr(injected.sampler, "rank", None),
            "sampler_drop_last": getattr(injected.sampler, "drop_last", None),
            "sampler_epoch": getattr(injected.sampler, "epoch", None),
            "batch_size": injected.batch_size,
            "drop_last": injected.drop_last,
            "collate_kept": injected.collate_fn is tagged_collate,
        }
    save(out, f"rank{manager.rank}.pt", payload)
    manager.barrier()  # tear the group down together (see equivalence)
    nvtrain.DistributedManager.cleanup()


def spike_skip(out: Path) -> None:
    """A loss spike on rank 1 only: the spike-skip hook makes both ranks skip the same step."""
    from nvtrain.hooks.spike_skip import SpikeSkipHook

    manager = nvtrain.DistributedManager.initialize()
    x, y = make_data(48)
    spike_step = 4
    rank1_batch = torch.arange(1, 48, 2)[spike_step * 4 : (spike_step + 1) * 4]
    y[rank1_batch] *= 1000.0
    model = make_model()
    spike = SpikeSkipHook(monitor="loss", warmup_steps=3, threshold_sigmas=6.0)
    strategy = nvtrain.TrainingStrategy(
        model,
        sgd,
        torch.nn.functional.mse_loss,
        hooks=[DDPHook(), spike],
        distributed_manager=manager,
        num_epochs=1,
    )
    with strategy:
        result = strategy.run(DataLoader(TensorDataset(x, y), batch_size=4))
    save(
        out,
        f"rank{manager.rank}.pt",
        {
            "params": params_of(model),
            "skipped_steps": spike.skipped_steps,
            "step_count": result.step_count,
            "batch_count": result.batch_count,
        },
    )
    if manager.rank == 0:
        ref = reference(x, y, steps=6, local_batch=4, world_size=manager.world_size, skip=(spike_step,))
        save(out, "reference.pt", {"params": ref})
    manager.barrier()  # tear the group down together (see equivalence)
    nvtrain.DistributedManager.cleanup()


def checkpoint(out: Path) -> None:
    """CheckpointHook(rank_zero_only=True) under DDP: rank 0 writes each checkpoint once, unwrapped
    weights; both ranks read it and load it into a plain model."""
    from nvtrain_checkpoint import CheckpointHook, latest_checkpoint, list_checkpoints, read_checkpoint

    manager = nvtrain.DistributedManager.initialize()
    x, y = make_data(32)
    model = make_model()
    root = out / "checkpoints"
    strategy = nvtrain.TrainingStrategy(
        model,
        sgd,
        torch.nn.functional.mse_loss,
        hooks=[DDPHook(), CheckpointHook(root, step_interval=2, rank_zero_only=True)],
        distributed_manager=manager,
        num_epochs=1,
    )
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=4))
    manager.barrier()
    latest = latest_checkpoint(root)
    state = read_checkpoint(root)
    weights = state["models"]["main"]
    plain = make_model()
    plain.load_state_dict(weights)  # strict: the keys carry no "module." prefix
    save(
        out,
        f"rank{manager.rank}.pt",
        {
            "params": params_of(model),
            "loaded": params_of(plain),
            "keys": sorted(weights),
            "steps": [info.step for info in list_checkpoints(root)],
            "latest": latest.name if latest is not None else None,
            "entries": sorted(entry.name for entry in root.iterdir()),
        },
    )
    manager.barrier()
    nvtrain.DistributedManager.cleanup()


def settings(out: Path) -> None:
    """static_graph with accumulation is refused before any backward (DDP would hit an internal assert under
    no_sync()); the injected sampler shuffles with the loader's generator seed."""
    from nvtrain.hooks.accumulation import GradientAccumulationHook

    manager = nvtrain.DistributedManager.initialize()
    x, y = make_data(16)
    refusals = []
    for extra, scheduler in (
        ([GradientAccumulationHook(steps=2)], None),
        ([], nvtrain.StepSchedulerConfig(global_batch_size=16)),
    ):
        strategy = nvtrain.TrainingStrategy(
            make_model(),
            sgd,
            torch.nn.functional.mse_loss,
            hooks=[DDPHook(static_graph=True), *extra],
            distributed_manager=manager,
            num_epochs=1,
            step_scheduler=scheduler,
        )
        try:
            with strategy:
                strategy.run(DataLoader(TensorDataset(x, y), batch_size=4))
            refusals.append("trained")
        except Exception as err:  # the test asserts which
            refusals.append(f"{type(err).__name__}: {err}")
    orders = {}
    n = 16
    data = torch.zeros(n, 4)
    data[:, 0] = torch.arange(n, dtype=torch.float32)
    for seed in (5, 7, "per_rank"):  # per_rank: a generator seeded per process, as generator.seed() does
        recorder = RecordIndices()
        loader = DataLoader(
            TensorDataset(data, torch.zeros(n, 2)),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(100 + manager.rank if seed == "per_rank" else seed),
        )
        strategy = nvtrain.TrainingStrategy(
            make_model(),
            sgd,
            torch.nn.functional.mse_loss,
            hooks=[DDPHook(), recorder],
            distributed_manager=manager,
            num_epochs=1,
        )
        with strategy:
            strategy.run(loader)
            orders[seed] = (recorder.seen[0], strategy.ctx.train_loader.sampler.seed)
    save(out, f"rank{manager.rank}.pt", {"refusals": refusals, "orders": orders})
    manager.barrier()
    nvtrain.DistributedManager.cleanup()


SCENARIOS = {f.__name__: f for f in (equivalence, accumulation, sampler, spike_skip, checkpoint, settings)}


def main(out_dir: Path, scenarios: list[str]) -> None:
    ports = scenario_ports()
    torch.set_num_threads(1)
    for index, name in enumerate(scenarios):
        if ports:
            os.environ["MASTER_PORT"] = str(ports[index])
        out = out_dir / name
        out.mkdir(parents=True, exist_ok=True)
        SCENARIOS[name](out)
        if dist.is_initialized():
            raise RuntimeError(f"scenario {name!r} left a process group behind")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
