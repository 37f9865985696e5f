"""Training set-ups shared by the checkpoint tests, also runnable as a separate process.

    python driver.py resume CONFIG=CHECKPOINT=OUT...    load checkpoints in a fresh process, finish, dump results
    python driver.py faults DIR POINT...                per POINT a process saving until POINT of its second save, then
                                                        hanging until killed (pid in DIR/POINT.marker)
    python driver.py preempt DIR MARKER OUT             resume="auto" run that a SIGTERM interrupts
    python driver.py gloo DIR PORT OUT                  two gloo ranks writing rank-zero-only and per-rank checkpoints

Everything is seeded, so a run here and one in the test process draw the same numbers.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from nvtrain_checkpoint import CheckpointHook

import nvtrain
from nvtrain.step_scheduler import StepSchedulerConfig

#: The set-ups: shuffling (global RNG or the loader's own generator), dropout, optional accumulation and EMA.
CONFIGS: dict[str, dict[str, Any]] = {
    # 9 micro-batches per epoch, one per step: 9 steps per epoch, 18 in all
    "plain": {"samples": 36, "batch_size": 4, "epochs": 2, "accumulate": 1, "ema": False, "generator": False},
    # windows of 2 over 9 micro-batches (2, 2, 2, 2, 1): 5 steps per epoch, 10 in all
    "accumulate": {"samples": 36, "batch_size": 4, "epochs": 2, "accumulate": 2, "ema": True, "generator": True},
}


class LossRecorder:
    """Keeps every micro-batch's loss (a tensor copy; no host sync) with its batch number."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, torch.Tensor]] = []

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        assert ctx.loss is not None
        self.losses.append((ctx.batch_count, ctx.loss.detach().clone()))


def make_loader(config: str) -> torch.utils.data.DataLoader[Any]:
    cfg = CONFIGS[config]
    data = torch.Generator().manual_seed(3)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(cfg["samples"], 3, generator=data), torch.randn(cfg["samples"], 2, generator=data)
    )
    generator = torch.Generator().manual_seed(7) if cfg["generator"] else None
    return torch.utils.data.DataLoader(dataset, batch_size=cfg["batch_size"], shuffle=True, generator=generator)


def strategy_kwargs(config: str, hooks: list[object], ckpt_every_steps: int | None = None) -> dict[str, Any]:
    """The constructor arguments of a set-up (also what ``load_checkpoint`` gets again)."""
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 2))
    extra: list[object] = []
    if cfg["accumulate"] > 1:
        from nvtrain.hooks.accumulation import GradientAccumulationHook

        extra.append(GradientAccumulationHook(steps=cfg["accumulate"]))
    if cfg["ema"]:
        from nvtrain_ema import EMAHook

        extra.append(EMAHook(decay=0.9))
    return {
        "models": model,
        "optimizers": functools.partial(torch.optim.AdamW, lr=0.01),
        "lr_schedulers": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5),
        "loss_fn": torch.nn.functional.mse_loss,
        "hooks": [*extra, *hooks],
        "device": "cpu",
        "step_scheduler": StepSchedulerConfig(
            num_epochs=cfg["epochs"], ckpt_every_steps=ckpt_every_steps, validate_on_checkpoint=False
        ),
    }


def summary(strategy: nvtrain.TrainingStrategy, recorder: LossRecorder) -> dict[str, Any]:
    """What the bitwise comparisons compare."""
    ctx = strategy.ctx
    hooks = {type(h).__name__: h for h in strategy.update_hooks()}
    ema = hooks.get("EMAHook")
    return {
        "params": {k: v.clone() for k, v in ctx.models["main"].state_dict().items()},
        "optimizer": ctx.optimizers["main"].state_dict(),
        "lr_scheduler": ctx.lr_schedulers["main"].state_dict(),
        "ema": None if ema is None else ema.state_dict(),  # type: ignore[attr-defined]
        "losses": recorder.losses,
        "counters": {k: getattr(ctx, k) for k in ("step_count", "global_step_count", "batch_count", "epoch")},
    }


def straight(config: str, hooks: list[object] = (), ckpt_every_steps: int | None = None) -> dict[str, Any]:
    """Train a whole set-up in this process; the reference of the bitwise tests."""
    recorder = LossRecorder()
    torch.manual_seed(1)
    with nvtrain.TrainingStrategy(**strategy_kwargs(config, [*hooks, recorder], ckpt_every_steps)) as strategy:
        strategy.run(make_loader(config))
    return summary(strategy, recorder)


def assert_same(expected: Any, actual: Any, path: str = "") -> None:
    """Bitwise equality of nested results: ``torch.equal`` for tensors, ``==`` for the rest."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: tensor vs {type(actual).__name__}"
        assert expected.dtype == actual.dtype and torch.equal(expected, actual), f"{path}: tensors differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(expected) == set(actual), f"{path}: keys differ"
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(expected) == len(actual), f"{path}: lengths differ"
        for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_same(a, b, f"{path}[{index}]")
    else:
        assert expected == actual, f"{path}: {expected!r} != {actual!r}"


# -- subprocess modes ---------------------------------------------------------------------------


def resume(*jobs: str) -> None:
    """Each job is ``CONFIG=CHECKPOINT=OUT``: load, finish the run, dump the results (a fresh strategy each)."""
    for index, job in enumerate(jobs):
        config, checkpoint, out = job.split("=")
        recorder = LossRecorder()
        torch.manual_seed(12345 + index)  # whatever this process drew before must not matter
        strategy = nvtrain.TrainingStrategy.load_checkpoint(checkpoint, **strategy_kwargs(config, [recorder]))
        with strategy:
            strategy.run(make_loader(config))
        torch.save(summary(strategy, recorder), out)


def fault(point: str, directory: str, marker: str) -> None:
    """Train with saves at steps 2, 4, 6...; the second save stops for good at ``point``."""
    from nvtrain_checkpoint import storage

    target = {"before_rename": "publish", "before_latest": "write_latest", "during_write": "write_state_file"}[point]
    original = getattr(storage, target)
    calls = [0]

    def hang(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            if point == "during_write":  # a partly written state file, as a kill mid-write leaves it
                with open(args[0], "wb") as file:
                    file.write(b"PK\x03\x04 half of a checkpoint")
                    file.flush()
                    os.fsync(file.fileno())
            Path(marker).write_text(str(os.getpid()))  # the test kills this pid
            while True:
                time.sleep(1)
        return original(*args, **kwargs)

    setattr(storage, target, hang)
    # during_write: a background thread dies with its process, half-way through; a writer process would
    # go on and finish the write (test_checkpoint_writer_process covers what becomes of that)
    hook = CheckpointHook(directory, step_interval=2, async_save=point == "during_write", async_writer="thread")
    with nvtrain.TrainingStrategy(**strategy_kwargs("plain", [hook])) as strategy:
        strategy.run(make_loader("plain"))


def faults(directory: str, *points: str) -> None:
    """One forked saving process per fault point (torch is imported once); wait until all are killed."""
    children = []
    for point in points:
        pid = os.fork()
        if pid == 0:
            try:
                fault(point, str(Path(directory) / point), str(Path(directory) / f"{point}.marker"))
            finally:
                os._exit(1)  # reached only if the fault point was never hit
        children.append(pid)
    failed = [pid for pid in children if os.waitpid(pid, 0)[1] != signal.SIGKILL]
    if failed:
        raise SystemExit(f"processes {failed} ended otherwise than by SIGKILL")


class WaitForSignal:
    """At step 5 write the marker, then wait until the test says it has sent SIGTERM."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count != 5:
            return
        self.marker.write_text("step 5")
        sent = self.marker.with_suffix(".sent")
        deadline = time.monotonic() + 60
        while not sent.exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def preempt(directory: str, marker: str, out: str) -> None:
    recorder = LossRecorder()
    torch.manual_seed(1)
    hooks = [WaitForSignal(marker), CheckpointHook(directory, resume="auto"), recorder]
    with nvtrain.TrainingStrategy(**strategy_kwargs("plain", hooks)) as strategy:
        result = strategy.run(make_loader("plain"))
    torch.save({**summary(strategy, recorder), "preempted": result.preempted}, out)


def _gloo_worker(rank: int, directory: str, port: int, out: str) -> None:
    from nvtrain_checkpoint import storage

    from nvtrain.state import capture_rng_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        written: list[int] = []
        original = storage.save_checkpoint

        def recording(root: Any, step: int, *args: Any, **kwargs: Any) -> Path:
            written.append(step)
            return original(root, step, *args, **kwargs)

        storage.save_checkpoint = recording  # type: ignore[assignment]
        from nvtrain_checkpoint.writer_process import WriterProcess

        handed_over = WriterProcess.save

        def recording_handover(process: WriterProcess, staged: Any, root: Any, step: int, *args: Any) -> Path:
            written.append(step)  # an async save, written by the writer process
            return handed_over(process, staged, root, step, *args)

        WriterProcess.save = recording_handover  # type: ignore[method-assign]
        report: dict[str, Any] = {}
        for mode, rank_zero_only in (("shared", True), ("per_rank", False)):
            written.clear()
            root = Path(directory) / mode
            torch.manual_seed(100 + rank)  # ranks draw different dropout masks: their RNG states differ
            hook = CheckpointHook(root, step_interval=3, rank_zero_only=rank_zero_only, async_save=rank_zero_only)
            with nvtrain.TrainingStrategy(**strategy_kwargs("plain", [hook])) as strategy:
                strategy.run(make_loader("plain"))
            final_rng = capture_rng_state()["torch"]
            torch.manual_seed(999)
            state = storage.read_checkpoint(root)  # rank_<r>/ of this rank in per_rank mode
            fresh = nvtrain.TrainingStrategy(**strategy_kwargs("plain", []))
            fresh.train_batch(next(iter(make_loader("plain"))))  # set up, so the state applies now
            fresh.load_state_dict(state)
            same = all(
                torch.equal(a, b)
                for a, b in zip(fresh.ctx.models["main"].state_dict().values(), strategy.ctx.models["main"].state_dict().values(), strict=True)
            )
            report[mode] = {
                "written": list(written),
                "loaded_step": int(state["counters"]["step_count"]),
                "weights_equal": same,
                "rng_restored": torch.equal(torch.get_rng_state(), final_rng),
                "rng_by_rank": len(state.get("rng_by_rank") or []),
                "last_checkpoint_index": hook.last_checkpoint_index,
            }
            # the same job started again with one more epoch: every rank resumes from step 18 and goes on
            written.clear()
            again = CheckpointHook(root, step_interval=3, rank_zero_only=rank_zero_only, resume="auto")
            kwargs = strategy_kwargs("plain", [again])
            kwargs["step_scheduler"] = StepSchedulerConfig(num_epochs=3, ckpt_every_steps=None)
            with nvtrain.TrainingStrategy(**kwargs) as extended:
                result = extended.run(make_loader("plain"))
            report[mode]["extended"] = {"step_count": result.step_count, "written": list(written)}
            torch.distributed.barrier()
        Path(f"{out}.{rank}").write_text(json.dumps(report))
    finally:
        torch.distributed.destroy_process_group()


def gloo(directory: str, port: str, out: str) -> None:
    torch.multiprocessing.spawn(_gloo_worker, args=(directory, int(port), out), nprocs=2, join=True)


if __name__ == "__main__":
    mode, *arguments = sys.argv[1:]
    {"resume": resume, "faults": faults, "preempt": preempt, "gloo": gloo}[mode](*arguments)
