"""Property: what the CSV logger writes does not depend on whether the run was stopped and resumed.

A run trained straight through, and the same run stopped once or twice (by ``max_steps``, a stop request
or a preemption signal), checkpointed and resumed from its checkpoint directory into the same run
directory, end with the same ``metrics.csv``: a resumed run drops the rows after the step it resumed
from (docs/cli.md, "What a run writes": "so the file describes one continuous run") and restores the
loggers' smoothing state from the checkpoint, so ``train_loss`` and ``train_loss_avg`` are the straight
run's to the last bit ("Logging without host syncs"), and so are ``epoch``, ``lr`` and ``val_loss``.

The only rows the straight run lacks are each stopped run's own end, at its stop step: the row of its
last step (a run's last step is logged however the run ends, also off the logging cadence) and a
validation of its final weights (a run validates its last step when a checkpoint hook saves it,
``validate_on_checkpoint``, and a last step inside an epoch under an epoch cadence). Both describe a step
the straight run also passed; what each later step logs is the straight run's.
"""

from __future__ import annotations

import csv
import functools
import math
import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nvtrain
from nvtrain.hooks import GradientAccumulationHook
from nvtrain.logging_hooks import CSVLoggerHook
from nvtrain.step_scheduler import StepSchedulerConfig
from nvtrain.validation import ValidationConfig

nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")

pytestmark = [
    pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals"),
    # Capture is a class of this test module, which the checkpoint names as a plugin of no installed version.
    pytest.mark.filterwarnings("ignore:checkpoint .* was written by other versions"),
]

#: The columns a resumed run must reproduce (``step_time`` and ``samples_per_s`` are wall-clock measurements).
COMPARED = ("step", "epoch", "train_loss", "train_loss_avg", "lr", "val_loss")
#: The preemption signal of these runs (SIGTERM and SIGINT belong to the test runner).
PREEMPTION_SIGNAL = "SIGUSR1"

Batch = tuple[torch.Tensor, torch.Tensor]
Row = tuple[Any, ...]


class Capture(CSVLoggerHook):
    """The CSV logger, keeping each record it writes as the floats it had (no rounding by the file)."""

    records: list[dict[str, float]]

    def _write(self, record: dict[str, float]) -> None:
        self.records.append(dict(record))
        super()._write(record)


def samples(count: int, *, partial: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for ``count`` batches of 4 samples; with ``partial`` the last batch has 2."""
    generator = torch.Generator().manual_seed(seed)
    n = 4 * count - (2 if partial else 0)
    return torch.randn(n, 3, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def loader(count: int, *, partial: bool, kind: str, seed: int = 0) -> Any:
    """A list of batches, or a DataLoader (without ``drop_last``) yielding the same batches."""
    inputs, targets = samples(count, partial=partial, seed=seed)
    if kind == "dataloader":
        dataset = torch.utils.data.TensorDataset(inputs, targets)
        return torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    return [(inputs[i : i + 4], targets[i : i + 4]) for i in range(0, len(inputs), 4)]


class Failure(RuntimeError):
    """What ends a run by an exception."""


class StopAt:
    """Ends a run at step ``step``: a stop request at its AFTER_BATCH, or a preemption signal sent at the
    BEFORE_BATCH of its first micro-batch (the step's boundary polls it); or at the first validation from
    step ``step`` on (as early stopping does, or a signal arriving during validation), if there is one; or
    by an exception before the next step (``fail``: a crash, resumed from the last checkpoint saved)."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how
        self.done = False

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count >= self.step and not self.done:
            if self.how == "request_stop_at_validation":
                self.done = True
                ctx.request_stop(f"stop at the validation of step {ctx.step_count}")
            elif self.how == "signal_at_validation":
                self.done = True
                os.kill(os.getpid(), getattr(signal, PREEMPTION_SIGNAL))

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if self.how == "signal" and ctx.step_count == self.step - 1 and ctx.window_position == 0:
            os.kill(os.getpid(), getattr(signal, PREEMPTION_SIGNAL))
        if self.how == "fail" and ctx.step_count == self.step and ctx.window_position == 0:
            raise Failure(f"failed after step {self.step}")

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if self.how == "request_stop" and ctx.sync_gradients and ctx.step_count == self.step:
            ctx.request_stop(f"stop at {self.step}")


def train(case: dict[str, Any], run_dir: Path, *, stop: tuple[int, str] | None, resume: str) -> tuple[Capture, int]:
    """One strategy, built as a fresh process would build it, run once into ``run_dir``: its CSV logger and
    the step the run ended at."""
    max_steps = case["max_steps"]
    hooks: list[object] = []
    if stop is not None and stop[1] == "max_steps":
        max_steps = stop[0]
    elif stop is not None:
        hooks.append(StopAt(*stop))
    csv_logger = Capture(run_dir / "metrics.csv", log_every_n_steps=case["every"])
    csv_logger.records = []
    hooks += [csv_logger, nvtrain_checkpoint.CheckpointHook(run_dir / "checkpoints", resume=resume)]
    if case["accumulate"] > 1:
        hooks.append(GradientAccumulationHook(steps=case["accumulate"]))
    validation = None
    if case["validation"] != "none":
        validation = ValidationConfig(
            data=loader(2, partial=True, kind="list", seed=5),
            every_n_steps=case["validation"] if isinstance(case["validation"], int) else None,
            every_n_epochs=1 if case["validation"] == "epochs" else None,
        )
    config = StepSchedulerConfig(
        ckpt_every_steps=None,
        loss_average_window_steps=case["average"],
        preemption_signal=PREEMPTION_SIGNAL,
    )
    torch.manual_seed(0)
    with nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        # a learning rate that changes every other step, so the lr column says where the schedule was
        lr_schedulers=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.7),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        device="cpu",
        num_epochs=case["num_epochs"],
        max_steps=max_steps,
        validation=validation,
        step_scheduler=config,
    ) as strategy:
        try:
            result = strategy.run(loader(case["batches"], partial=case["partial"], kind=case["loader"]))
        except Failure:
            assert stop is not None and stop[1] == "fail"
            return csv_logger, strategy.ctx.step_count
    if stop is None or not stop[1].endswith("_at_validation"):
        assert result.step_count == (stop[0] if stop is not None else case["total"])
    return csv_logger, result.step_count


def file_rows(path: Path) -> list[Row]:
    """``metrics.csv`` as written (the compared columns, as strings)."""
    with path.open(newline="", encoding="utf-8") as file:
        return [tuple(row[column] for column in COMPARED) for row in csv.DictReader(file)]


def record_rows(records: list[dict[str, float]]) -> list[Row]:
    """The logger's records (the compared columns, as the floats it had; None where a row has no value)."""
    return [tuple(record.get(column) for column in COMPARED) for record in records]


def is_training(row: Row) -> bool:
    return row[COMPARED.index("train_loss")] not in ("", None)


def assert_same_run(straight: list[Row], resumed: list[Row], stops: list[int], every: int) -> None:
    """``resumed`` is ``straight`` plus, at each stop step, at most the stopped run's own end."""

    def step_of(row: Row) -> int:
        return int(row[0])

    # Every step but the stop steps: the same rows, in the same order.
    assert [r for r in resumed if step_of(r) not in stops] == [r for r in straight if step_of(r) not in stops]
    steps = [step_of(r) for r in resumed]
    assert steps == sorted(steps)
    for stop in stops:
        expected = [r for r in straight if step_of(r) == stop]
        got = [r for r in resumed if step_of(r) == stop]
        assert any(is_training(r) for r in got), f"the end of the run stopped at step {stop} is not logged"
        remaining = iter(got)  # the straight run's rows of that step, in their order, among them
        assert all(any(row == other for other in remaining) for row in expected), (stop, expected, got)
        extra = list(got)  # and the rest: the stopped run's end, at most one row of each kind
        for row in expected:
            extra.remove(row)
        assert len([r for r in extra if is_training(r)]) <= (1 if stop % every else 0), (stop, expected, got)
        validated = any(not is_training(r) for r in expected)
        assert len([r for r in extra if not is_training(r)]) <= (0 if validated else 1), (stop, expected, got)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    accumulate = draw(st.integers(1, 3))
    count = draw(st.integers(2, 7))
    steps_per_epoch = math.ceil(count / accumulate)
    bound = draw(st.sampled_from(["num_epochs", "max_steps", "both"]))
    # at least two steps in all, so that there is a step to stop at before the end
    num_epochs = draw(st.integers(1 if steps_per_epoch > 1 else 2, 3)) if bound != "max_steps" else None
    by_epochs = (num_epochs or 3) * steps_per_epoch  # max_steps alone: drawn within three epochs
    max_steps = draw(st.integers(2, max(2, by_epochs))) if bound != "num_epochs" else None
    total = min(n for n in (max_steps, num_epochs and by_epochs) if n)
    validation = draw(st.sampled_from(["none", "epochs", "steps"]))
    if validation == "steps":
        validation = draw(st.integers(1, 4))
    # one or two stops, each at a step before the run's end
    stop_steps = [draw(st.integers(1, total - 1))]
    if stop_steps[0] < total - 1 and draw(st.booleans()):
        stop_steps.append(draw(st.integers(stop_steps[0] + 1, total - 1)))
    modes = ["max_steps", "request_stop", "signal"]
    if validation != "none":
        modes += ["request_stop_at_validation", "signal_at_validation"]
    modes.append("fail")
    how = st.sampled_from(modes)
    return {
        "every": draw(st.integers(1, 4)),
        "average": draw(st.integers(1, 5)),
        "accumulate": accumulate,
        "batches": count,
        "partial": draw(st.booleans()),
        "loader": draw(st.sampled_from(["list", "dataloader"])),
        "num_epochs": num_epochs,
        "max_steps": max_steps,
        "total": total,
        "validation": validation,
        "resume": draw(st.sampled_from(["auto", "path"])),
        "stops": [(step, draw(how)) for step in stop_steps],
    }


def latest_step(checkpoints: Path) -> int:
    """The step of the checkpoint a resume continues from (0: none, a fresh start)."""
    latest = nvtrain_checkpoint.storage.latest_checkpoint(checkpoints) if checkpoints.exists() else None
    return 0 if latest is None else int(latest.name.removeprefix("step_"))


def check(case: dict[str, Any]) -> None:
    total = case["total"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        straight, _ = train(case, root / "straight", stop=None, resume="never")
        run_dir, checkpoints = root / "resumed", root / "resumed" / "checkpoints"
        # What the file holds, as the loggers' records: each run adds to the rows up to the step it starts at.
        resumed_records: list[dict[str, float]] = []
        stops: list[int] = []  # the steps a stopped run ended at, and a later one continued from
        start = 0
        for stop in [*case["stops"], None]:
            if stop is not None and stop[0] <= start:
                continue  # a stop at a validation went past this one
            resume = "never"
            if start:  # the latest checkpoint, found by the hook or named by its path
                resume = "auto" if case["resume"] == "auto" else str(checkpoints / f"step_{start}")
            logger, ended = train(case, run_dir, stop=stop, resume=resume)
            resumed_records = [r for r in resumed_records if r["step"] <= start] + logger.records
            if ended == total:
                break  # a stop at a validation found none before the end: the run is complete
            start = latest_step(checkpoints)  # the step it ended at, or after a failure the last one saved
            assert start == ended or (stop is not None and stop[1] == "fail" and start < ended)
            if start == ended:
                stops.append(start)
        straight_file, resumed_file = file_rows(root / "straight" / "metrics.csv"), file_rows(run_dir / "metrics.csv")
        # Resumed once more at its end, the run has nothing to train, and the file stays as it is.
        written = (run_dir / "metrics.csv").read_bytes()
        assert train(case, run_dir, stop=None, resume="auto")[0].records == []
        assert (run_dir / "metrics.csv").read_bytes() == written
    every = case["every"]
    assert_same_run(straight_file, resumed_file, stops, every)
    # The same, as the floats the loggers had.
    assert_same_run(record_rows(straight.records), record_rows(resumed_records), stops, every)


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_a_stopped_and_resumed_run_writes_the_straight_runs_metrics(case: dict[str, Any]) -> None:
    check(case)
