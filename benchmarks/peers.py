"""The tiny-MLP workload through other training frameworks, when they are installed.

    python benchmarks/peers.py                 # a table
    python benchmarks/peers.py --json          # for CI
    python benchmarks/peers.py --markdown      # rows for docs/benchmarks.md

Runs the same training (MLP 32->64->1, batch 8, SGD lr 0.01, MSE, the same
pre-made batches, CPU, one intra-op thread) hand-written, through nvtrain, and
through PyTorch Lightning and PyTorch Ignite if they can be imported, in the same
process and round-robin. Neither is a dependency of nvtrain: a framework that is
not installed is listed as skipped, and the script still exits 0.

A framework's run has start-up costs of very different sizes (a Lightning
``Trainer.fit`` takes much longer to start than a loop), so the figure here is the
time between consecutive step starts: every framework reads its batches from the
same iterable, which stamps ``time.perf_counter_ns()`` as it hands out each batch.
The first interval of a run is dropped. Reported per framework: the median, the
10th percentile and the minimum over all measured steps (on a busy machine the
median moves with the load; the low percentiles much less), and each as a ratio
of the hand-written loop's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import nvtrain

from harness import TINY_MLP, make_batches, make_model

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Runner = Callable[["Stamped"], None]


class Stamped:
    """The batches, stamping the clock as each one is handed out (and once more at the end)."""

    def __init__(self, batches: Batches, stamps: list[int]) -> None:
        self.batches, self.stamps = batches, stamps

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        clock, stamp = time.perf_counter_ns, self.stamps.append
        for batch in self.batches:
            stamp(clock())
            yield batch
        stamp(clock())


def hand_written(batches: Stamped) -> None:
    model = make_model(TINY_MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()


def nvtrain_strategy(batches: Stamped) -> None:
    with nvtrain.TrainingStrategy(
        models=make_model(TINY_MLP),
        optimizers=functools.partial(torch.optim.SGD, lr=0.01),
        loss_fn=torch.nn.functional.mse_loss,
        num_epochs=1,
        device="cpu",
    ) as strategy:
        strategy.run(batches)


def lightning(batches: Stamped) -> None:
    import pytorch_lightning as pl

    _quiet()  # Lightning sets its loggers' levels on import

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(TINY_MLP)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.model(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), train_dataloaders=batches)


def ignite(batches: Stamped) -> None:
    from ignite.engine import create_supervised_trainer

    model = make_model(TINY_MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = create_supervised_trainer(model, optimizer, torch.nn.functional.mse_loss)
    trainer.run(batches, max_epochs=1)


#: Framework label -> (module that must be importable, runner).
CANDIDATES: dict[str, tuple[str | None, Runner]] = {
    "hand-written loop": (None, hand_written),
    "nvtrain": (None, nvtrain_strategy),
    "PyTorch Lightning": ("pytorch_lightning", lightning),
    "PyTorch Ignite": ("ignite", ignite),
}


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "ignite"):
        logging.getLogger(name).setLevel(logging.ERROR)


def measure(steps: int, rounds: int) -> dict[str, Any]:
    """Per-step times of every importable candidate, round-robin; skipped ones with the reason."""
    torch.set_num_threads(1)
    _quiet()
    batches = make_batches(TINY_MLP, steps)
    runners: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    for label, (module, runner) in CANDIDATES.items():
        if module is not None and importlib.util.find_spec(module) is None:
            skipped[label] = f"{module} is not installed"
            continue
        runners[label] = runner
    intervals: dict[str, list[int]] = {label: [] for label in runners}
    labels = list(runners)
    for index in range(rounds + 1):  # the first round warms up (imports, first-call costs)
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            stamps: list[int] = []
            runners[label](Stamped(batches, stamps))
            if index:
                intervals[label].extend(b - a for a, b in itertools.pairwise(stamps))
    base = _figures(intervals["hand-written loop"])
    results = {}
    for label, values in intervals.items():
        figures = _figures(values)
        results[label] = {
            **{f"{key}_us": value / 1e3 for key, value in figures.items()},
            **{f"ratio_{key}": value / base[key] for key, value in figures.items()},
            "steps_measured": len(values),
        }
    return {
        "workload": f"MLP {TINY_MLP.label}, SGD, CPU, 1 thread, {steps} steps per run, {rounds} runs each",
        "results": results,
        "skipped": skipped,
        "versions": _versions(runners),
    }


def _figures(values: list[int]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10], "min": ordered[0]}


def _versions(runners: dict[str, Runner]) -> dict[str, str]:
    versions = {"torch": torch.__version__, "nvtrain": nvtrain.__version__}
    for label, module in (("PyTorch Lightning", "pytorch_lightning"), ("PyTorch Ignite", "ignite")):
        if label in runners:
            versions[label] = getattr(sys.modules.get(module), "__version__", "?")
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument("--rounds", type=int, default=5, help="runs per framework after a warm-up run (default 5)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON")
    output.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        parser.error("--steps must be >= 3 and --rounds >= 1")
    report = measure(args.steps, args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = report["results"]
    if args.markdown:
        print("| framework | per step: median | p10 | min | ratio: median | p10 | min |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for label, row in rows.items():
            print(
                f"| {label} | {row['median_us']:.1f} us | {row['p10_us']:.1f} us | {row['min_us']:.1f} us | "
                f"{row['ratio_median']:.2f}x | {row['ratio_p10']:.2f}x | {row['ratio_min']:.2f}x |"
            )
    else:
        print(report["workload"])
        print(f"  {'':20s} {'us per step: median':>20s} {'p10':>8s} {'min':>8s}   ratio: median   p10    min")
        for label, row in rows.items():
            print(
                f"  {label:20s} {row['median_us']:20.1f} {row['p10_us']:8.1f} {row['min_us']:8.1f}   "
                f"{row['ratio_median']:12.2f}x {row['ratio_p10']:5.2f}x {row['ratio_min']:5.2f}x"
            )
    for label, why in report["skipped"].items():
        print(f"skipped {label}: {why}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
