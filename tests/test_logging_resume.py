"""A resumed run smooths its loss exactly as the straight run does: the loggers' smoothing state (the open
logging window's loss sum and the windows ``train_loss_avg`` covers) travels in the checkpoint."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.logging_hooks import CSVLoggerHook, ProgressBarHook
from nvtrain.step_scheduler import StepSchedulerConfig

nvtrain_checkpoint = pytest.importorskip("nvtrain_checkpoint")

TOTAL = 30
EVERY = 5
#: Smaller than the run, so that old windows leave the average.
AVERAGE = 12


class Capture(CSVLoggerHook):
    """The CSV logger, keeping each record it writes as the floats it had (no rounding by the file)."""

    records: list[dict[str, float]]

    def _write(self, record: dict[str, float]) -> None:
        self.records.append(dict(record))
        super()._write(record)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, generator=generator), torch.randint(0, 2, (4,), generator=generator)) for _ in range(TOTAL)
    ]


def run(hooks: list[object], *max_steps: int) -> None:
    """One strategy; ``run()`` once per ``max_steps`` given, each continuing where the last one stopped."""
    torch.manual_seed(0)
    config = StepSchedulerConfig(ckpt_every_steps=None, loss_average_window_steps=AVERAGE)
    data = batches()
    with nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        device="cpu",
        max_steps=max_steps[0],
        step_scheduler=config,
    ) as strategy:
        for steps in max_steps:
            strategy.max_steps = steps
            strategy.run(data)


def logger(path: Path) -> Capture:
    hook = Capture(path, log_every_n_steps=EVERY)
    hook.records = []
    return hook


def training(records: list[dict[str, float]]) -> dict[int, tuple[Any, ...]]:
    return {int(r["step"]): (r["train_loss"], r["train_loss_avg"], r["lr"]) for r in records if "train_loss" in r}


def bar_losses(*streams: io.StringIO) -> dict[int, str]:
    """``{step: "loss 0.1234"}`` from progress lines (a later line for a step replaces an earlier one)."""
    losses = {}
    for stream in streams:
        for line in stream.getvalue().splitlines():
            fields = line.split("  ")
            if len(fields) > 2 and fields[2].startswith("loss "):
                losses[int(fields[1].split()[1].split("/")[0])] = fields[2]
    return losses


# Capture is a class of this test module, which the checkpoint names as a plugin of no installed version.
@pytest.mark.filterwarnings("ignore:checkpoint .* was written by other versions")
@pytest.mark.parametrize("resume_at", [10, 13, 1])  # on the logging cadence, inside a window, in the first one
def test_a_resumed_run_logs_the_straight_runs_losses_bitwise(tmp_path: Path, resume_at: int) -> None:
    straight = logger(tmp_path / "straight.csv")
    straight_bar = io.StringIO()
    run([straight, ProgressBarHook(log_every_n_steps=EVERY, stream=straight_bar)], TOTAL)

    checkpoints = tmp_path / "checkpoints"
    first, first_bar = logger(tmp_path / "resumed.csv"), io.StringIO()
    save = nvtrain_checkpoint.CheckpointHook(checkpoints)  # saves the last step
    run([first, ProgressBarHook(log_every_n_steps=EVERY, stream=first_bar), save], resume_at)
    second, second_bar = logger(tmp_path / "resumed.csv"), io.StringIO()
    resume = nvtrain_checkpoint.CheckpointHook(checkpoints, resume="auto")
    run([second, ProgressBarHook(log_every_n_steps=EVERY, stream=second_bar), resume], TOTAL)

    expected = training(straight.records)
    assert sorted(expected) == [5, 10, 15, 20, 25, 30]
    resumed = training(first.records) | training(second.records)
    # The first run also wrote its last step (off the cadence when inside a window); every step the
    # straight run logged has the same loss, smoothed loss and learning rate, to the last bit.
    assert sorted(resumed) == sorted({*expected, resume_at})
    assert {step: resumed[step] for step in expected} == expected
    # The file keeps the first run's rows up to the resume step, then the second run's.
    straight_rows = [line.split(",")[:4] for line in (tmp_path / "straight.csv").read_text().splitlines()]
    resumed_rows = [line.split(",")[:4] for line in (tmp_path / "resumed.csv").read_text().splitlines()]
    assert [row for row in resumed_rows if row[0] != str(resume_at) or resume_at % EVERY == 0] == straight_rows
    # The progress bar shows the same smoothed loss.
    expected_bar = bar_losses(straight_bar)
    assert {step: bar_losses(first_bar, second_bar)[step] for step in expected} == expected_bar
    assert expected_bar == {step: f"loss {avg:.4g}" for step, (_, avg, _) in expected.items()}


def test_a_second_run_call_continues_the_smoothing(tmp_path: Path) -> None:
    straight = logger(tmp_path / "straight.csv")
    run([straight], TOTAL)
    continued = logger(tmp_path / "continued.csv")
    run([continued], 13, TOTAL)  # one strategy, run() twice: the second continues at step 13
    expected = training(straight.records)
    assert {step: training(continued.records)[step] for step in expected} == expected


def test_a_state_of_another_step_is_not_continued(tmp_path: Path) -> None:
    """A smoothing state is only continued by a run that starts at its step; another one starts afresh."""
    hook = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=2)
    state = {"step": 3, "recent": [[9.0, 2]], "loss_sum": torch.tensor(100.0), "loss_batches": 1, "window_steps": 1}
    hook.load_state_dict(state)
    ctx = nvtrain.TrainingContext(step_count=4)  # a run resumed at step 4, not 3
    hook.before_training(ctx)
    hook.before_epoch(ctx)
    ctx.loss, ctx.batch, ctx.step_count = torch.tensor(0.5), batches()[0], 6
    hook.after_batch(ctx)
    hook.after_training(ctx)
    rows = (tmp_path / "metrics.csv").read_text(encoding="utf-8").splitlines()
    assert [row.split(",")[:4] for row in rows[1:]] == [["6", "1", "0.5", "0.5"]]


def test_a_malformed_state_is_refused_naming_the_logger(tmp_path: Path) -> None:
    hook = CSVLoggerHook(tmp_path / "metrics.csv", state_key="second")
    with pytest.raises(ValueError, match=r"CSVLoggerHook\(state_key='second'\): not a logger's smoothing state"):
        hook.load_state_dict({"recent": []})


def test_two_csv_loggers_of_other_file_names_are_checkpointed_apart(tmp_path: Path) -> None:
    """The default ``state_key`` is the file's name: a second CSV file needs no setting."""
    first, second = CSVLoggerHook(tmp_path / "a.csv", log_every_n_steps=EVERY), CSVLoggerHook(tmp_path / "b.csv")
    checkpoint = nvtrain_checkpoint.CheckpointHook(tmp_path / "ckpt", step_interval=10)
    run([first, second, checkpoint], 10)
    saved = checkpoint.last_saved
    assert saved is not None
    assert {"csv_logger:a.csv", "csv_logger:b.csv"} <= set(checkpoint.read_checkpoint(saved[1])["hooks"])


def test_two_loggers_sharing_a_state_key_are_refused_before_the_first_step(tmp_path: Path) -> None:
    """Refused where the run starts, not at its first save (possibly hours later), naming both."""
    trained: list[int] = []

    class Steps:
        @nvtrain.hookimpl
        def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
            trained.append(ctx.step_count)

    hooks = [
        CSVLoggerHook(tmp_path / "one" / "metrics.csv"),
        CSVLoggerHook(tmp_path / "two" / "metrics.csv"),
        nvtrain_checkpoint.CheckpointHook(tmp_path / "ckpt", step_interval=10),
        Steps(),
    ]
    with pytest.raises(ValueError, match=r"CSVLoggerHook.*and.*CSVLoggerHook.*under the key 'csv_logger:metrics.csv'"):
        run(hooks, 10)
    assert trained == []
    run(hooks[:2], 3)  # without a hook that saves checkpoints nothing is keyed: no refusal


def test_a_run_after_an_unclosed_failure_does_not_count_the_failed_micro_batches_twice() -> None:
    """A run that raised inside an accumulation window and was never closed: the next ``run()`` replays the
    window from its start, and its log row covers what it trained, without the failed run's partial sum."""
    losses: dict[int, list[float]] = {}

    class Fail:
        raised = False

        @nvtrain.hookimpl
        def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
            if ctx.step_count == 2 and ctx.window_position == 1 and not self.raised:
                self.raised = True
                raise RuntimeError("boom")
            if self.raised:  # the second run: each micro-batch's loss, by the step it belongs to
                losses.setdefault(ctx.step_count + 1, []).append(float(ctx.loss.detach()))

    logger = Capture(Path("unused.csv"), log_every_n_steps=4)
    logger.records = []
    logger._write = lambda record: logger.records.append(dict(record))  # type: ignore[method-assign]
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=[logger, Fail(), nvtrain.hooks.GradientAccumulationHook(steps=2)],
        device="cpu",
        max_steps=4,
        step_scheduler=StepSchedulerConfig(ckpt_every_steps=None),
    )
    data = batches()
    with pytest.raises(RuntimeError, match="boom"):
        strategy.run(data)
    strategy.run(data)  # no close() in between
    row = next(r for r in logger.records if r["step"] == 4 and "train_loss" in r)
    trained = losses[3] + losses[4]
    assert len(trained) == 4
    assert row["train_loss"] == pytest.approx(sum(trained) / len(trained), rel=1e-6)
