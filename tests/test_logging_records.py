"""What the loggers' records hold: validations outside a run append to the run's file, the window's loss
is summed in float32 whatever the loss's dtype, and ctx.metrics cannot overwrite the logged columns."""

from __future__ import annotations

import csv
import functools
import io
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook, TensorBoardHook, tensorboard_available
from nvtrain.step_log import StepLogReader
from nvtrain.validation import ValidationConfig

Batch = tuple[torch.Tensor, torch.Tensor]

needs_tensorboard = pytest.mark.skipif(not tensorboard_available(), reason="needs the tensorboard package")


def batches(count: int, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 3, generator=generator), torch.randint(0, 2, (4,), generator=generator)) for _ in range(count)
    ]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def make(hooks: list[object], **fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        device="cpu",
        validation=ValidationConfig(data=batches(2, seed=5), every_n_epochs=1, metrics={"accuracy": accuracy}),
        **fields,
    )


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def tensorboard_steps(log_dir: Path) -> dict[str, list[int]]:
    """The steps of every scalar written, file by file in the order the files were made.

    Read without TensorBoard's accumulator: it orders files by name, where the writer's
    process-wide counter is not zero-padded (a file numbered 10 sorts before 9 when both
    were made within one second, as short test runs are), and then purges what looks
    like a restart.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    def made(path: Path) -> tuple[int, int]:  # events.out.tfevents.<seconds>.<host>.<pid>.<counter>
        parts = path.name.split(".")
        return int(parts[3]), int(parts[-1])

    steps: dict[str, list[int]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*"), key=made):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    return steps


# -- a validation outside run() --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "epoch"),
    [({"num_epochs": 1}, "1"), ({"num_epochs": 2}, "2"), ({"max_steps": 6}, "1")],
    ids=["one-epoch", "two-epochs", "stopped-inside-the-epoch"],
)
def test_a_validation_after_run_appends_its_row_at_the_runs_last_epoch(
    tmp_path: Path, fields: dict[str, Any], epoch: str
) -> None:
    path = tmp_path / "metrics.csv"
    with make([CSVLoggerHook(path, log_every_n_steps=4)], **fields) as strategy:
        result = strategy.run(batches(8))
        before = read_rows(path)
        strategy.validate()
    rows = read_rows(path)
    assert rows[:-1] == before  # nothing truncated or dropped
    last_training = [row for row in before if row["train_loss"]][-1]
    assert last_training["epoch"] == epoch  # the epoch of the run's last step
    assert rows[-1]["step"] == str(result.step_count) and rows[-1]["epoch"] == epoch
    assert rows[-1]["val_loss"] and rows[-1]["val_accuracy"] and not rows[-1]["train_loss"]


def test_a_validation_after_a_continued_run_keeps_the_rows_after_its_start(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    with make([CSVLoggerHook(path, log_every_n_steps=2)], max_steps=4) as strategy:
        strategy.run(batches(8))
        strategy.max_steps = 8
        strategy.run(batches(8))  # continues at step 4: its start step
        before = read_rows(path)
        strategy.validate()
    assert [row["step"] for row in before if row["train_loss"]] == ["2", "4", "6", "8"]
    assert read_rows(path)[:-1] == before


@needs_tensorboard
@pytest.mark.parametrize("continued", [False, True], ids=["fresh", "continued"])
def test_a_validation_after_run_adds_its_events_and_keeps_the_runs(tmp_path: Path, continued: bool) -> None:
    with make([TensorBoardHook(tmp_path, log_every_n_steps=2)], max_steps=4 if continued else 8) as strategy:
        strategy.run(batches(8))
        if continued:
            strategy.max_steps = 8
            strategy.run(batches(8))
        before = tensorboard_steps(tmp_path)
        strategy.validate()
    after = tensorboard_steps(tmp_path)
    assert before["train/loss"] == [2, 4, 6, 8] and after["train/loss"] == before["train/loss"]
    assert after["val/loss"] == [*before["val/loss"], 8]


def test_a_validation_before_any_run_writes_nothing(tmp_path: Path) -> None:
    path, stream = tmp_path / "metrics.csv", io.StringIO()
    with make([CSVLoggerHook(path, log_every_n_steps=4), ProgressBarHook(stream=stream)], num_epochs=1) as strategy:
        strategy.validate()
        assert not path.exists() and stream.getvalue() == ""
        strategy.run(batches(8))
    assert [row["step"] for row in read_rows(path)] == ["4", "8", "8"]


# -- the window's loss in float32 ------------------------------------------------------------------


def observe(reader: StepLogReader, ctx: nvtrain.TrainingContext, losses: list[torch.Tensor]) -> dict[str, float] | None:
    """Feed one micro-batch per loss, one step each; the record of the last one."""
    record = None
    for loss in losses:
        ctx.loss, ctx.batch, ctx.step_count = loss, batches(1)[0], ctx.step_count + 1
        record = reader.observe_batch(ctx)
    return record


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_loss_is_summed_in_float32(dtype: torch.dtype) -> None:
    # 600 losses of 3.5: a bf16 sum stops growing near 1024 (its spacing there is 8), an fp16 one at 8192.
    reader = StepLogReader(600 if dtype == torch.bfloat16 else 3000)
    ctx = nvtrain.TrainingContext()
    reader.start(ctx)
    reader.begin(ctx)
    count = reader.every or 0
    record = observe(reader, ctx, [torch.tensor(3.5, dtype=dtype)] * count)
    assert record is not None and record["train_loss"] == 3.5 and record["train_loss_avg"] == 3.5


def test_the_checkpointed_loss_sum_is_float32_and_an_old_low_precision_one_loads() -> None:
    reader = StepLogReader(4)
    ctx = nvtrain.TrainingContext()
    reader.start(ctx)
    reader.begin(ctx)
    observe(reader, ctx, [torch.tensor(1.5, dtype=torch.bfloat16)] * 2)
    state = reader.state_dict()
    assert state["loss_sum"].dtype == torch.float32 and state["loss_sum"].item() == 3.0

    old = {**state, "loss_sum": torch.tensor(1000.0, dtype=torch.bfloat16), "loss_batches": 250}
    resumed = StepLogReader(4)
    resumed.load_state_dict(old)
    ctx = nvtrain.TrainingContext(step_count=2)
    resumed.start(ctx)
    resumed.begin(ctx)
    assert resumed.state_dict()["loss_sum"].dtype == torch.float32
    record = observe(resumed, ctx, [torch.tensor(4.0, dtype=torch.bfloat16)] * 2)
    assert record is not None and record["step"] == 4 and record["train_loss"] == pytest.approx(1008.0 / 252)


# -- ctx.metrics must not overwrite the logged columns ----------------------------------------------


class SetMetric:
    """Puts ``ctx.metrics[name]`` at AFTER_LOSS from step ``from_step`` on (a hook's own scalar)."""

    def __init__(self, name: str, from_step: int = 0) -> None:
        self.name, self.from_step = name, from_step

    @nvtrain.hookimpl
    def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count >= self.from_step:
            ctx.metrics[self.name] = ctx.loss.detach() * 2


RESERVED = ["train_loss", "train_loss_avg", "step", "epoch", "lr", "lr/head", "step_time", "samples_per_s", "val_loss"]


@pytest.mark.parametrize("name", RESERVED)
def test_a_metric_with_a_logged_columns_name_is_refused_at_the_logging_step(tmp_path: Path, name: str) -> None:
    path = tmp_path / "metrics.csv"
    strategy = make([SetMetric(name, from_step=4), CSVLoggerHook(path, log_every_n_steps=4)], max_steps=8)
    with pytest.raises(ValueError) as info, strategy:
        strategy.run(batches(8))
    message = str(info.value)
    assert f"ctx.metrics[{name!r}]" in message and "CSVLoggerHook" in message
    assert f"ctx.metrics['my_{name}']" in message  # what to rename it to
    assert "step 8" in message  # the first logging step that saw it (step 4's row was written before it)
    rows = read_rows(path)
    assert [(row["step"], row["epoch"]) for row in rows] == [("4", "1"), ("8", "1")]  # the failed run's end too
    assert float(rows[1]["lr"]) == 0.1 and float(rows[1]["train_loss"]) < 2  # the columns are the loggers' own


def test_the_docs_example_metric_is_logged_under_its_own_column(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    with make([SetMetric("my_loss"), CSVLoggerHook(path, log_every_n_steps=4)], max_steps=8) as strategy:
        strategy.run(batches(8))
    rows = [row for row in read_rows(path) if row["train_loss"]]
    assert [row["step"] for row in rows] == ["4", "8"] and all(float(row["my_loss"]) > 0 for row in rows)


@needs_tensorboard
@pytest.mark.parametrize(("name", "tag"), [("loss", "train/loss"), ("loss_avg", "train/loss_avg")])
def test_a_metric_whose_tensorboard_tag_is_taken_is_refused_by_the_tensorboard_logger(
    tmp_path: Path, name: str, tag: str
) -> None:
    strategy = make([SetMetric(name), TensorBoardHook(tmp_path / "tb", log_every_n_steps=4)], max_steps=4)
    with pytest.raises(ValueError, match=rf"TensorBoardHook: ctx.metrics\[{name!r}\] .*tag {tag!r}"), strategy:
        strategy.run(batches(4))
    # the CSV logger has no such tag: the same metric is an ordinary column there
    with make([SetMetric(name), CSVLoggerHook(tmp_path / "m.csv", log_every_n_steps=4)], max_steps=4) as strategy:
        strategy.run(batches(4))
    assert read_rows(tmp_path / "m.csv")[0][name]
