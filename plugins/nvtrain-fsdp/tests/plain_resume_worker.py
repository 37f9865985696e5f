"""Ranks of the one-process-to-sharded resume tests: ``python plain_resume_worker.py OUT_DIR SCENARIO=ARG ...``.

In one process FSDPHook is inactive, so CheckpointHook writes a plain (single-file)
checkpoint of full tensors; the tests write one in their own process
(:func:`one_process_run`). Here two ranks shard the same model with FSDPHook and load
it. Started with the variables torchrun sets (never forked); every scenario gets its
own process group (``NVTRAIN_TEST_PORTS``) and writes ``OUT_DIR/<scenario>/rank<R>.pt``.

    load_into=CKPT    setup, then CheckpointHook.load_into(..., data_position=False): what was loaded
    too_wide=CKPT     the same into a wider model: the ResumeError's message
    two_groups=CKPT   the same into an optimizer with two param groups (the checkpoint's has one): the message
    resume_auto=ROOT  resume="auto" from the checkpoint root ROOT and train to the end: what was
                      loaded (at the first micro-batch) and the final weights
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nvtrain_checkpoint import CheckpointHook
from nvtrain_fsdp import FSDPHook
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nvtrain
from nvtrain.errors import ResumeError
from nvtrain.step_scheduler import StepSchedulerConfig
from nvtrain.testing import full_tensors, run_scenarios

LOCAL_BATCH = 4
#: One global batch size on every world size: 2 micro-batches per step in one process, 1 on two ranks.
GLOBAL_BATCH = 8
SAMPLES = 64
STEPS = SAMPLES // GLOBAL_BATCH
#: The one-process run's checkpoint, from which the two ranks continue.
SAVED_AT = 3


def make_model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 3, generator=generator))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def adamw_two_groups(params: Any) -> torch.optim.Optimizer:
    """Weights and biases in groups of their own."""
    params = list(params)
    return torch.optim.AdamW([{"params": params[0::2]}, {"params": params[1::2], "weight_decay": 0.0}], lr=0.01)


def make_strategy(
    hooks: list[Any], manager: Any = None, *, width: int = 16, max_steps: int | None = None, optimizer: Any = adamw
) -> Any:
    """AdamW (a state per parameter that a resume must carry) and a fixed global batch size."""
    return nvtrain.TrainingStrategy(
        make_model(width),
        optimizer,
        torch.nn.functional.mse_loss,
        hooks=hooks,
        distributed_manager=manager,
        device="cpu",
        step_scheduler=StepSchedulerConfig(
            global_batch_size=GLOBAL_BATCH,
            num_epochs=1,
            max_steps=max_steps,
            ckpt_every_steps=None,
            validate_on_checkpoint=False,
        ),
    )


def one_process_loader() -> DataLoader[Any]:
    """A DistributedSampler of one replica reads the global order that two ranks' injected samplers split,
    so the data position carries over to them."""
    dataset = make_dataset()
    return DataLoader(
        dataset, batch_size=LOCAL_BATCH, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)
    )


def one_process_run(root: Path | None, steps: int) -> list[torch.Tensor]:
    """One process with FSDPHook (inactive) for ``steps`` steps; with ``root``, a plain checkpoint at SAVED_AT."""
    hooks: list[Any] = [FSDPHook()]
    if root is not None:
        hooks.append(CheckpointHook(root, step_interval=SAVED_AT))
    with make_strategy(hooks, max_steps=steps) as strategy:
        strategy.run(one_process_loader())
        return [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]


def snapshot_of(strategy: Any) -> dict[str, Any]:
    """Gathered weights, the optimizer state by parameter name, its param groups and the counters."""
    ctx = strategy.ctx
    model, optimizer = ctx.models["main"], ctx.optimizers["main"]
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "weights": full_tensors(model.state_dict()),
        "optimizer": {names[id(p)]: full_tensors(state) for p, state in optimizer.state.items()},
        "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        "step_count": ctx.step_count,
        "epoch_step_count": ctx.epoch_step_count,
    }


class FirstBatch:
    """The state a resume left, taken at the first micro-batch (after every restore)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    @nvtrain.hookimpl(tryfirst=True)
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if self.snapshot is None:
            self.snapshot = snapshot_of(ctx.strategy)


def save(out: Path, payload: dict[str, Any]) -> None:
    tmp = out / f".rank{dist.get_rank()}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out / f"rank{dist.get_rank()}.pt")


def make_loader() -> DataLoader[Any]:
    return DataLoader(make_dataset(), batch_size=LOCAL_BATCH, shuffle=True)  # FSDPHook injects the sampler


# -- scenarios --------------------------------------------------------------------------------------------


def scenario_load_into(out: Path, manager: Any, checkpoint: str) -> None:
    hook = CheckpointHook(out / "unused")
    with make_strategy([FSDPHook(), hook], manager) as strategy:
        strategy.setup(make_loader())
        hook.load_into(strategy, Path(checkpoint), data_position=False)
        save(out, snapshot_of(strategy))


def refused(out: Path, manager: Any, checkpoint: str, **kwargs: Any) -> None:
    """Load ``checkpoint`` into a strategy it does not fit (``kwargs``): the ResumeError's message."""
    hook = CheckpointHook(out / "unused")
    with make_strategy([FSDPHook(), hook], manager, **kwargs) as strategy:
        strategy.setup(make_loader())
        try:
            hook.load_into(strategy, Path(checkpoint), data_position=False)
        except ResumeError as err:
            save(out, {"error": str(err)})
        else:
            raise SystemExit(f"the checkpoint loaded into a strategy built with {kwargs}")


def scenario_too_wide(out: Path, manager: Any, checkpoint: str) -> None:
    refused(out, manager, checkpoint, width=32)


def scenario_two_groups(out: Path, manager: Any, checkpoint: str) -> None:
    refused(out, manager, checkpoint, optimizer=adamw_two_groups)


def scenario_resume_auto(out: Path, manager: Any, root: str) -> None:
    first = FirstBatch()
    with make_strategy([FSDPHook(), CheckpointHook(Path(root), resume="auto"), first], manager) as strategy:
        result = strategy.run(make_loader())
        final = full_tensors(list(strategy.ctx.models["main"].parameters()))
    save(out, {"first": first.snapshot, "final": final, "step_count": result.step_count})


SCENARIOS = {
    "load_into": scenario_load_into,
    "too_wide": scenario_too_wide,
    "two_groups": scenario_two_groups,
    "resume_auto": scenario_resume_auto,
}


def main(out_dir: Path, scenarios: list[str]) -> None:
    def run(name: str, arg: str, manager: Any) -> None:
        out = out_dir / name
        out.mkdir(parents=True, exist_ok=True)
        SCENARIOS[name](out, manager, arg)

    run_scenarios(scenarios, run)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
