"""Bytes per rank of parameters, gradients and AdamW state, DDP against FSDP, on 1, 2 and 4 CPU ranks.

    python benchmarks/fsdp_memory.py                      # the table of docs/benchmarks.md (about a minute)
    python benchmarks/fsdp_memory.py --ranks 1 2 --width 512 --depth 2    # smaller, for a quick look

For each world size and each of DDPHook / FSDPHook, ``torch.multiprocessing.spawn`` starts
that many ranks (gloo on the CPU, a free port each time). Every rank trains the same
MLP (``depth`` square Linear layers of ``width``, about 52.5M parameters by default) for
two AdamW steps through a TrainingStrategy, then counts the bytes of the tensors it
holds: each parameter's local part (a DTensor's shard under FSDP), its gradient, and the
optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``). Those are exact and the same on
every run. Beside them: the rank's peak resident set size (``ru_maxrss``), which also
holds the Python and torch runtime, the full model each rank builds before FSDP shards
it, DDP's gradient buckets and the activations, so it is an upper bound, and noisy.

The ranks run with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``,
unless it is set already or ``--glibc-default`` is given): with glibc's default, which
rises after large blocks are freed, FSDP's gather-and-free of every unit each step
fragments the heap, and the RSS of the run above grows to about 2 GiB per rank instead
of about 1.1 GiB. The tensors' bytes do not depend on it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nvtrain.testing import free_port

MIB = 1 << 20


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _rank(rank: int, world_size: int, port: int, mode: str, width: int, depth: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        import nvtrain
        from nvtrain.plugins import load

        hook = load(mode)
        model = make_model(width, depth)
        batch = 8
        generator = torch.Generator().manual_seed(rank)
        data = [(torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator))] * 2
        strategy = nvtrain.TrainingStrategy(
            model,
            functools.partial(torch.optim.AdamW, lr=1e-4),
            torch.nn.functional.mse_loss,
            hooks=[hook],
            device="cpu",
        )
        with strategy:
            for item in data:
                strategy.train_batch(item)
            trained = strategy.ctx.models["main"]
            params = list(trained.parameters())
            optimizer = strategy.ctx.optimizers["main"]
            result = {
                "parameters": sum(_local(p).numel() for p in params),
                "param_bytes": _bytes(params),
                "grad_bytes": _bytes([p.grad for p in params if p.grad is not None]),
                "optimizer_bytes": _bytes(
                    [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
                ),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
            }
        Path(out, f"{mode}-{world_size}-{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(modes: list[str], ranks: list[int], width: int, depth: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for world_size in ranks:
            for mode in modes:
                mp.spawn(_rank, args=(world_size, free_port(), mode, width, depth, out), nprocs=world_size, join=True)
                per_rank = [json.loads(Path(out, f"{mode}-{world_size}-{r}.json").read_text()) for r in range(world_size)]
                worst = max(per_rank, key=lambda r: r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
                rows.append(
                    {
                        "mode": mode,
                        "ranks": world_size,
                        "model_parameters": sum(r["parameters"] for r in per_rank) // (world_size if mode == "ddp" else 1),
                        **{k: worst[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")},
                        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in per_rank),
                    }
                )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | plugin | parameters | gradients | AdamW state | sum | peak RSS |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        total = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
        cells = [row["param_bytes"], row["grad_bytes"], row["optimizer_bytes"], total, row["peak_rss_bytes"]]
        name = {"ddp": "DDP", "fsdp": "FSDP"}[row["mode"]]
        lines.append(f"| {row['ranks']} | {name} | " + " | ".join(f"{c / MIB:,.1f} MiB" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's mmap threshold dynamic")
    args = parser.parse_args(argv)
    if not args.glibc_default:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # the spawned ranks read it at start
    rows = measure(args.modes, args.ranks, args.width, args.depth)
    print(f"MLP of {args.depth} Linear({args.width}, {args.width}) layers: {rows[0]['model_parameters']:,} parameters, "
          "float32, AdamW; bytes per rank (the largest rank), peak RSS of the largest process")
    print(markdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
