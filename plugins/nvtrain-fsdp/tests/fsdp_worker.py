"""Ranks of the multi-process nvtrain-fsdp tests: ``python fsdp_worker.py OUT_DIR SCENARIO [SCENARIO ...]``.

Launched by the tests with the environment variables torchrun sets (never forked). The
scenarios run one after another in the same processes (starting processes is the slow
part), each with its own process group; a scenario writes ``OUT_DIR/<scenario>/rank<R>.pt``
on every rank, and rank 0 also writes the single-process reference the test compares
against (``reference.pt``), computed with plain torch on the same global batches.
``NVTRAIN_TEST_PORTS`` (comma separated) gives each scenario its own ``MASTER_PORT``.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvtrain_ema import EMAHook, ShardedAverage
from nvtrain_fsdp import FSDPHook
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook, SpikeSkipHook
from nvtrain.testing import scenario_ports

LR = 0.01
LOCAL_BATCH = 4


def make_model(outputs: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, outputs))


def make_data(n: int, outputs: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(n, 4, generator=generator), torch.randn(n, outputs, generator=generator)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def global_batches(x: torch.Tensor, y: torch.Tensor, count: int, world_size: int) -> list[torch.Tensor]:
    """Micro-batch k of the global batch: every rank's k-th shard batch, in rank order.

    An unshuffled DistributedSampler gives rank r the samples r, r + W, r + 2W, ...
    """
    shards = [torch.arange(rank, x.shape[0], world_size) for rank in range(world_size)]
    return [torch.cat([shard[k * LOCAL_BATCH : (k + 1) * LOCAL_BATCH] for shard in shards]) for k in range(count)]


def reference(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    world_size: int,
    accumulation: int = 1,
    max_norm: float | None = None,
    skip: tuple[int, ...] = (),
    ema_decay: float | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] = adamw,
    norm_type: float = 2.0,
    outputs: int = 3,
) -> dict[str, Any]:
    """One process on the global batches, by hand: parameters, pre-clip norms and the EMA weights."""
    model = make_model(outputs)
    opt = optimizer(model.parameters())
    batches = global_batches(x, y, steps * accumulation, world_size)
    norms, ema = [], None
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            index = batches[step * accumulation + micro]
            loss = torch.nn.functional.mse_loss(model(x[index]), y[index]) / accumulation
            loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type).detach().clone())
        if step in skip:
            continue
        opt.step()
        if ema_decay is not None:
            weights = [p.detach().clone() for p in model.parameters()]
            if ema is None:
                ema = weights
            else:
                torch._foreach_lerp_(ema, weights, 1.0 - ema_decay)
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "ema": ema}


class CountReduceScatters:
    """Counts FSDP's gradient reduce-scatters (``dist.reduce_scatter_single``) per micro-batch."""

    def __init__(self) -> None:
        self.calls = 0
        self.per_micro_batch: list[int] = []
        self._seen = 0
        original = dist.reduce_scatter_single

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counting  # type: ignore[assignment]
        self._restore = functools.partial(setattr, dist, "reduce_scatter_single", original)

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        self.per_micro_batch.append(self.calls - self._seen)
        self._seen = self.calls

    def close(self) -> None:
        self._restore()


class RecordNorms:
    """The gradient norm the clipping hook published, per real step (as the hook stored it)."""

    def __init__(self) -> None:
        self.norms: list[torch.Tensor] = []

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if "grad_norm" in ctx.metrics and ctx.sync_gradients:
            self.norms.append(ctx.metrics["grad_norm"])


class CommCountingEMA(EMAHook):
    """EMAHook that records how many collectives each of its updates issued."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.comms: list[int] = []

    def __call__(self, ctx: Any, stage: Any, will_skip: bool) -> Any:
        with CommDebugMode() as mode:
            result = super().__call__(ctx, stage, will_skip)
        if not will_skip:
            self.comms.append(mode.get_total_counts())
        return result


def save(out: Path, name: str, payload: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out / name)


def gathered(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for p in model.parameters()]


def finish(manager: nvtrain.DistributedManager | None) -> None:
    # Tear the group down together: a rank that destroys it while the other is still inside
    # gloo (rank 0 computes the reference) can abort that rank.
    if dist.is_initialized():
        dist.barrier()
    if manager is not None:
        nvtrain.DistributedManager.cleanup()


def strategy_for(manager: Any, hooks: list[Any], outputs: int = 3, **kwargs: Any) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        make_model(outputs),
        kwargs.pop("optimizers", adamw),
        torch.nn.functional.mse_loss,
        hooks=hooks,
        distributed_manager=manager,
        device="cpu",
        num_epochs=1,
        **kwargs,
    )


# -- scenarios ----------------------------------------------------------------------------------------


def equivalence(out: Path) -> None:
    """2 ranks x batch 4 with AdamW == 1 process x batch 8; DTensor parameters held by the optimizer."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32)
    counter = CountReduceScatters()
    hook = FSDPHook()
    strategy = strategy_for(manager, [hook, counter])
    with strategy:
        result = strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        model = strategy.ctx.models["main"]
        params = list(model.parameters())
        optimizer = strategy.ctx.optimizers["main"]
        payload = {
            "params": gathered(model),
            "sharded": isinstance(model, FSDPModule),
            "param_types": sorted({type(p).__name__ for p in params}),
            "local_rows": [p.to_local().shape[0] for p in params],
            "optimizer_holds_the_shards": [id(p) for p in optimizer.param_groups[0]["params"]]
            == [id(p) for p in params],
            "optimizer_state_types": sorted({type(v).__name__ for s in optimizer.state.values() for v in s.values()}),
            "units": hook.units,
            "sampler": type(strategy.ctx.train_loader.sampler).__name__,
            "rank": strategy.ctx.rank,
            "world_size": strategy.ctx.world_size,
            "step_count": result.step_count,
            "global_step_count": result.global_step_count,
            "reduce_scatters": counter.per_micro_batch,
        }
    counter.close()
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        save(out, "reference.pt", reference(x, y, steps=4, world_size=manager.world_size))
    finish(manager)


def accumulation(out: Path) -> None:
    """The hook initialises the group itself; K=2 over 8 micro-batches: reduce-scatters only on the 2nd."""
    x, y = make_data(64)
    counter = CountReduceScatters()
    strategy = strategy_for(None, [GradientAccumulationHook(steps=2), FSDPHook(), counter])
    with strategy:
        result = strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        rank, world_size = strategy.ctx.rank, strategy.ctx.world_size
        payload = {
            "params": gathered(strategy.ctx.models["main"]),
            "rank": rank,
            "world_size": world_size,
            "step_count": result.step_count,
            "batch_count": result.batch_count,
            "reduce_scatters": counter.per_micro_batch,
            "initialised_during_run": dist.is_initialized(),
        }
        if dist.is_initialized():
            dist.barrier()  # the hook destroys the group on close: nobody may still be inside gloo
    counter.close()
    payload["process_group_alive"] = dist.is_initialized()
    save(out, f"rank{rank}.pt", payload)
    if rank == 0:
        save(out, "reference.pt", reference(x, y, steps=4, world_size=world_size, accumulation=2))


def clipping(out: Path) -> None:
    """GradientClippingHook over DTensor gradients clips by the global norm (the unsharded model's)."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32)
    record = RecordNorms()
    strategy = strategy_for(manager, [FSDPHook(), GradientClippingHook(max_norm=0.05), record])
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        payload = {
            "params": gathered(strategy.ctx.models["main"]),
            "norms": [n.detach().clone() for n in record.norms],
            "norm_types": sorted({type(n).__name__ for n in record.norms}),
        }
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        save(out, "reference.pt", reference(x, y, steps=4, world_size=manager.world_size, max_norm=0.05))
    finish(manager)


def clipping_inf(out: Path) -> None:
    """The infinity norm over shards, with a one-output head: rank 1 holds empty shards of its weight and bias."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32, outputs=1)
    record = RecordNorms()
    clip = GradientClippingHook(max_norm=0.05, norm_type=math.inf)
    strategy = strategy_for(manager, [FSDPHook(), clip, record], outputs=1)
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        model = strategy.ctx.models["main"]
        payload = {
            "params": gathered(model),
            "norms": [n.detach().clone() for n in record.norms],
            "local_rows": [p.to_local().shape[0] for p in model.parameters()],
        }
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        ref = reference(x, y, steps=4, world_size=manager.world_size, max_norm=0.05, norm_type=math.inf, outputs=1)
        save(out, "reference.pt", ref)
    finish(manager)


def spike_skip(out: Path) -> None:
    """A loss spike in rank 1's shard only: both ranks skip that step (loss and the global grad norm)."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(48)
    spike_step = 4
    rank1_batch = torch.arange(1, 48, 2)[spike_step * LOCAL_BATCH : (spike_step + 1) * LOCAL_BATCH]
    y[rank1_batch] *= 1000.0
    spike = SpikeSkipHook(monitor=("loss", "grad_norm"), warmup_steps=3, threshold_sigmas=6.0)
    strategy = strategy_for(manager, [FSDPHook(), GradientClippingHook(max_norm=1e6), spike])
    with strategy:
        result = strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        payload = {
            "params": gathered(strategy.ctx.models["main"]),
            "skipped_steps": spike.skipped_steps,
            "step_count": result.step_count,
            "batch_count": result.batch_count,
        }
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        ref = reference(x, y, steps=6, world_size=manager.world_size, skip=(spike_step,), max_norm=1e6)
        save(out, "reference.pt", ref)
    finish(manager)


def ema(out: Path) -> None:
    """EMA of a sharded model: sharded average, no collective per update, gathered and validated."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32)
    averaging = CommCountingEMA(decay=0.5)
    strategy = strategy_for(manager, [FSDPHook(), averaging], validation=nvtrain.ValidationConfig(use_ema=True))
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        averaged = averaging.get_averaged_model()
        before = gathered(strategy.ctx.models["main"])
        summary = strategy.validate(DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8))
        payload = {
            "kind": type(averaged).__name__,
            "shard_types": sorted({type(t).__name__ for t in averaged.averaged_parameters})
            if isinstance(averaged, ShardedAverage)
            else [],
            "comms_per_update": averaging.comms,
            "num_updates": averaging.num_updates,
            "weights": averaging.averaged_weights(),
            "validation_loss": summary["loss"],
            "model_untouched_by_validation": all(
                torch.equal(a, b) for a, b in zip(before, gathered(strategy.ctx.models["main"]), strict=True)
            ),
        }
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        ref = reference(x, y, steps=4, world_size=manager.world_size, ema_decay=0.5)
        plain = make_model()
        with torch.no_grad():
            for param, value in zip(plain.parameters(), ref["ema"], strict=True):
                param.copy_(value)
            ref["validation_loss"] = torch.nn.functional.mse_loss(plain(x[:8]), y[:8])
        save(out, "reference.pt", ref)
    finish(manager)


class RecordValidationLosses:
    """The validation loss of every validation, in order."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.losses.append(torch.as_tensor(ctx.validation["loss"]).detach().clone())


def ema_loss(x: torch.Tensor, y: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """The loss on the validation batch of the plain model holding ``weights``."""
    plain = make_model()
    with torch.no_grad():
        for param, value in zip(plain.parameters(), weights, strict=True):
            param.copy_(value)
        return torch.nn.functional.mse_loss(plain(x[:8]), y[:8])


def ema_without_reshard(out: Path) -> None:
    """EMA validation every 2 steps under ``reshard_after_forward=False``, where FSDP keeps the parameters it
    gathered after a forward: training after a validation must not use the average, and validating the average
    must not use weights the model's own forward left gathered."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32)
    averaging, record = EMAHook(decay=0.5), RecordValidationLosses()
    validation = nvtrain.ValidationConfig(data=[(x[:8], y[:8])], every_n_steps=2, use_ema=True)
    strategy = strategy_for(manager, [FSDPHook(reshard_after_forward=False), averaging, record], validation=validation)
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        model = strategy.ctx.models["main"]
        params, in_run = gathered(model), list(record.losses)
        with torch.no_grad():
            model(x[:8])  # the model's own forward: its weights stay gathered
        left_gathered = not any(isinstance(p, DTensor) for p in model.parameters())
        summary = strategy.validate()
        payload = {
            "params": params,
            "left_gathered": left_gathered,
            "validation_losses": in_run,
            "validation_loss_after_own_forward": summary["loss"],
            "model_untouched_by_validation": all(
                torch.equal(a, b) for a, b in zip(params, gathered(model), strict=True)
            ),
        }
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        ref = reference(x, y, steps=4, world_size=manager.world_size, ema_decay=0.5)
        at_step_2 = reference(x, y, steps=2, world_size=manager.world_size, ema_decay=0.5)
        ref["validation_losses"] = [ema_loss(x, y, at_step_2["ema"]), ema_loss(x, y, ref["ema"])]
        save(out, "reference.pt", ref)
    finish(manager)


class RecordOutputs:
    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()

    @nvtrain.hookimpl
    def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
        self.dtypes.add(ctx.outputs.dtype)


class RecordGradients:
    """Each parameter's local gradient shard after the first backward (reduced; the optimizer has not used it)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        if self.grads is None:
            self.grads = [p.grad.to_local().detach().clone() for p in ctx.models["main"].parameters()]


def bf16(out: Path) -> None:
    """FSDP's MixedPrecisionPolicy: bf16 compute, fp32 shards and gradients, fp32 outputs for the loss; the
    first step's gradients reduced in fp32 (``reduce_dtype``), and again in bf16 (its default: ``param_dtype``)."""
    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32)
    outputs, fp32_reduced, bf16_reduced = RecordOutputs(), RecordGradients(), RecordGradients()
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    hooks = [FSDPHook(param_dtype="bf16", reduce_dtype="fp32"), outputs, fp32_reduced]
    strategy = strategy_for(manager, hooks, optimizers=sgd)
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        params = list(strategy.ctx.models["main"].parameters())
        payload = {
            "params": gathered(strategy.ctx.models["main"]),
            "output_dtypes": sorted(str(d) for d in outputs.dtypes),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
        }
    # One step of the same model on the same first batch, the gradients reduced in bf16.
    with strategy_for(manager, [FSDPHook(param_dtype="bf16"), bf16_reduced], optimizers=sgd) as again:
        again.run(DataLoader(TensorDataset(x[:8], y[:8]), batch_size=LOCAL_BATCH))
    payload |= {"grads_reduced_in_fp32": fp32_reduced.grads, "grads_reduced_in_bf16": bf16_reduced.grads}
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        save(out, "reference.pt", reference(x, y, steps=4, world_size=manager.world_size, optimizer=sgd))
    finish(manager)


def fp16(out: Path) -> None:
    """The amp plugin's fp16 under FSDP: an inf in rank 1's batch only makes both ranks skip that step, through
    a ShardedGradScaler whose inf check is all-reduced; the scale backs off alike and the shards stay in step."""
    from nvtrain_amp import MixedPrecisionHook

    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(32)
    spike_step = 2
    rank1_batch = torch.arange(1, 32, 2)[spike_step * LOCAL_BATCH : (spike_step + 1) * LOCAL_BATCH]
    x[rank1_batch[0], 0] = float("inf")
    amp = MixedPrecisionHook(precision="fp16", init_scale=2.0**10)
    steps = RecordSteps()
    strategy = strategy_for(manager, [FSDPHook(), amp, steps])
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        payload = {
            "params": gathered(strategy.ctx.models["main"]),
            "scaler": [cls.__name__ for cls in type(amp.scaler).__mro__],
            "scale": float(amp.scaler.get_scale()) if amp.scaler is not None else None,
            "skipped": steps.skipped,
            "overflow_skips": float(strategy.ctx.metrics["overflow_skips"]),
            "finite": all(bool(torch.isfinite(p).all()) for p in gathered(strategy.ctx.models["main"])),
        }
    save(out, f"rank{manager.rank}.pt", payload)
    finish(manager)


class RecordSteps:
    """Which micro-batches' optimizer steps were skipped (``ctx.step_skipped``)."""

    def __init__(self) -> None:
        self.skipped: list[int] = []

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_skipped:
            self.skipped.append(ctx.batch_count - 1)


def hsdp(out: Path) -> None:
    """4 ranks as 2 replicas x 2 shards (HSDP) with clipping and EMA == 1 process on the global batches;
    the sharded checkpoint it writes holds each replicated shard once and exports the same weights."""
    from nvtrain_checkpoint import CheckpointHook

    manager = nvtrain.DistributedManager.initialize(device="cpu")
    x, y = make_data(64)
    hook = FSDPHook(replicate_degree=2)
    record, averaging = RecordNorms(), CommCountingEMA(decay=0.5)
    checkpoint = CheckpointHook(out / "checkpoints")
    strategy = strategy_for(manager, [hook, GradientClippingHook(max_norm=0.05), record, averaging, checkpoint])
    with strategy:
        strategy.run(DataLoader(TensorDataset(x, y), batch_size=LOCAL_BATCH))
        params = list(strategy.ctx.models["main"].parameters())
        assert hook.mesh is not None
        payload = {
            "params": gathered(strategy.ctx.models["main"]),
            "mesh": hook.mesh.mesh.tolist(),
            "mesh_dims": hook.mesh.mesh_dim_names,
            "placements": sorted({str(p.placements) for p in params}),  # type: ignore[attr-defined]
            "local_rows": [p.to_local().shape[0] for p in params],  # type: ignore[attr-defined]
            "norms": [n.detach().clone() for n in record.norms],
            "ema": list(averaging.averaged_weights().values()),
            "ema_comms_per_update": averaging.comms,
        }
    # The same layout for a model built on the meta device: each shard initialised from a stream of its own
    # on the CPU, the replicas of one shard alike, and the training stream left as it was.
    before = torch.get_rng_state()
    with torch.device("meta"):
        meta_model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    meta = nvtrain.TrainingStrategy(
        meta_model, adamw, torch.nn.functional.mse_loss, hooks=[FSDPHook(replicate_degree=2)], device="cpu"
    )
    with meta:
        meta.setup()
        payload["meta_init"] = gathered(meta.ctx.models["main"])
    payload["rng_kept"] = torch.equal(before, torch.get_rng_state())
    save(out, f"rank{manager.rank}.pt", payload)
    if manager.rank == 0:
        ref = reference(x, y, steps=4, world_size=manager.world_size, max_norm=0.05, ema_decay=0.5)
        save(out, "reference.pt", ref)
    finish(manager)


SCENARIOS = {
    f.__name__: f
    for f in (equivalence, accumulation, clipping, clipping_inf, spike_skip, ema, ema_without_reshard, bf16, fp16, hsdp)
}


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
