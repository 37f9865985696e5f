"""StageTimingHook: a CSV row per timed stage with plausible figures, flushed on cadence."""

from __future__ import annotations

import csv
import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.hooks import StageTimingHook
from nvtrain.stages import BATCH_STAGES, TrainingStage
from nvtrain.validators import FieldTypeError, FieldValueError

S = TrainingStage


def make_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(count)]


def make_strategy(hooks: Sequence[object], device: str = "cpu", **fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device=device,
        **fields,
    )


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def assert_plausible(row: dict[str, str]) -> None:
    mean, p50, p95 = float(row["mean_ms"]), float(row["p50_ms"]), float(row["p95_ms"])
    assert 0.0 <= p50 <= p95, row
    assert mean >= 0.0, row
    assert p95 < 60_000.0, row  # milliseconds, not seconds or nanoseconds


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": [S.SETUP]}, r"StageTimingHook\.stages must be a non-empty set of batch stages"),
        ({"stages": []}, r"StageTimingHook\.stages must be a non-empty set of batch stages"),
        ({"stages": ["forward"]}, r"StageTimingHook\.stages must be TrainingStage values"),
        ({"flush_every_n_steps": 0}, r"StageTimingHook\.flush_every_n_steps must be an int >= 1"),
        ({"max_samples": 0}, r"StageTimingHook\.max_samples must be an int >= 1"),
    ],
)
def test_bad_configuration_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StageTimingHook(**kwargs)


def test_stages_are_taken_by_member_name_in_any_case_or_value() -> None:
    # a config can only spell them as strings: BEFORE_FORWARD was once refused as "not TrainingStage values"
    hook = StageTimingHook(stages=["BEFORE_FORWARD", "after_forward", 7, S.AFTER_BATCH])
    assert hook.stages == (S.BEFORE_FORWARD, S.AFTER_FORWARD, S.BEFORE_LOSS, S.AFTER_BATCH)
    assert StageTimingHook(stages="do_backward").stages == (S.DO_BACKWARD,)


@pytest.mark.parametrize("stages", [["BEFORE_FORWARD", "forward"], [True], None])
def test_a_stage_that_is_none_lists_the_names(stages: Any) -> None:
    with pytest.raises(FieldValueError) as caught:
        StageTimingHook(stages=stages)
    assert caught.value.owner == "StageTimingHook" and caught.value.field == "stages"
    names = ", ".join(stage.name for stage in sorted(BATCH_STAGES))
    assert str(caught.value).endswith(f"; batch stage names: {names})")
    assert str(caught.value).startswith("StageTimingHook.stages must be TrainingStage values, their names or numbers")


def test_stage_names_pass_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    from nvtrain.cli import main

    entry = "hooks=[{name: stage_timing, stages: [BEFORE_FORWARD, after_forward]}]"
    assert main(["validate", "--set", entry, "--set", "device=cpu"]) == 0, capsys.readouterr().err


def test_an_existing_directory_as_output_is_refused_when_built(tmp_path: Path) -> None:
    # it used to be refused by a bare IsADirectoryError at the first flush, after the whole run
    with pytest.raises(FieldValueError) as caught:
        StageTimingHook(output=tmp_path)
    assert (caught.value.owner, caught.value.field) == ("StageTimingHook", "output")
    assert str(caught.value) == (
        "StageTimingHook.output must be a CSV file path, neither an existing directory nor under a file "
        f"(got '{tmp_path}', a directory)"
    )
    assert StageTimingHook(output=tmp_path / "new" / "t.csv").output == tmp_path / "new" / "t.csv"


def test_an_output_under_a_file_or_no_path_is_refused_when_built(tmp_path: Path) -> None:
    """Under a file it passed nvtrain validate and failed at the first flush (FileExistsError, mid-run); None
    said only "expected str, bytes or os.PathLike object, not NoneType"."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FieldValueError) as caught:
        StageTimingHook(output=tmp_path / "afile" / "t.csv")
    assert (caught.value.owner, caught.value.field) == ("StageTimingHook", "output")
    assert f"'{tmp_path / 'afile'}' is a file" in str(caught.value)
    with pytest.raises(FieldTypeError, match=r"^StageTimingHook\.output must be a path \(a str or os\.PathLike\) \(got None\)$"):
        StageTimingHook(output=None)  # type: ignore[arg-type]


# -- the report -----------------------------------------------------------------------------------


def test_run_writes_a_row_per_batch_stage(tmp_path: Path) -> None:
    output = tmp_path / "timing.csv"
    hook = StageTimingHook(output=output, flush_every_n_steps=2)
    strategy = make_strategy([hook], num_epochs=2)
    strategy.run(make_batches(5))
    columns, rows = read_rows(output)
    assert columns == ["stage", "count", "mean_ms", "p50_ms", "p95_ms"]
    assert [row["stage"] for row in rows] == [stage.name for stage in sorted(BATCH_STAGES)]
    counts = {row["stage"]: int(row["count"]) for row in rows}
    # every stage of 10 micro-batches, except the interval after the last AFTER_BATCH of each epoch
    assert counts == {stage.name: 10 for stage in BATCH_STAGES} | {"AFTER_BATCH": 8}
    for row in rows:
        assert_plausible(row)
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left behind


def test_chosen_stages_only_and_no_wrapper_on_the_do_slots(tmp_path: Path) -> None:
    output = tmp_path / "timing.csv"
    hook = StageTimingHook(output=output, stages=[S.AFTER_FORWARD, S.BEFORE_FORWARD])
    strategy = make_strategy([hook])
    for stage in (S.DO_BACKWARD, S.DO_OPTIMIZER_STEP):
        assert [impl.plugin for impl in strategy.bus.implementations(stage)] == [strategy.orchestrator]
    for batch in make_batches(3):
        strategy.train_batch(batch)
    strategy.close()
    _, rows = read_rows(output)
    assert [(row["stage"], row["count"]) for row in rows] == [("BEFORE_FORWARD", "3"), ("AFTER_FORWARD", "2")]
    for row in rows:
        assert_plausible(row)


def test_timing_the_do_slots_wraps_them_and_keeps_results(tmp_path: Path) -> None:
    hook = StageTimingHook(output=tmp_path / "t.csv", stages=[S.DO_BACKWARD, S.DO_OPTIMIZER_STEP, S.AFTER_BATCH])
    strategy = make_strategy([hook])
    assert [impl.wrapper for impl in strategy.bus.implementations(S.DO_BACKWARD)] == [True, False]
    for batch in make_batches(2):
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 2
    strategy.close()
    report = hook.report()
    assert (report["DO_BACKWARD"]["count"], report["DO_OPTIMIZER_STEP"]["count"]) == (2, 2)


def test_flushes_every_n_steps_before_the_end(tmp_path: Path) -> None:
    output = tmp_path / "timing.csv"
    strategy = make_strategy([StageTimingHook(output=output, flush_every_n_steps=2)])
    batches = make_batches(4)
    for batch in batches[:2]:
        strategy.train_batch(batch)
    assert not output.exists()
    strategy.train_batch(batches[2])  # step_count reached 2: its first stage flushes
    _, rows = read_rows(output)
    assert {row["stage"]: row["count"] for row in rows}["BEFORE_BATCH"] == "2"
    strategy.train_batch(batches[3])
    strategy.close()
    _, rows = read_rows(output)
    assert {row["stage"]: row["count"] for row in rows}["BEFORE_BATCH"] == "4"


def test_stage_without_samples_gets_an_empty_row(tmp_path: Path) -> None:
    output = tmp_path / "timing.csv"
    strategy = make_strategy([StageTimingHook(output=output, stages=[S.AFTER_BATCH])])
    strategy.train_batch(make_batches(1)[0])
    strategy.close()
    _, rows = read_rows(output)
    assert rows == [{"stage": "AFTER_BATCH", "count": "0", "mean_ms": "", "p50_ms": "", "p95_ms": ""}]


def test_logs_a_line_when_asked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nvtrain.hooks.timing")
    strategy = make_strategy([StageTimingHook(output=tmp_path / "t.csv", log=True)])
    strategy.run(make_batches(2))
    messages = [r.getMessage() for r in caplog.records if r.name == "nvtrain.hooks.timing"]
    assert len(messages) == 1 and messages[0].startswith("stage timing (ms, mean/p95): before_batch ")


def test_each_rank_writes_its_own_file(tmp_path: Path) -> None:
    strategy = make_strategy([StageTimingHook(output=tmp_path / "timing.csv")])
    strategy.ctx.rank, strategy.ctx.world_size = 1, 2
    strategy.run(make_batches(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.rank1.csv"]


def test_percentiles_come_from_a_bounded_sample(tmp_path: Path) -> None:
    hook = StageTimingHook(output=tmp_path / "t.csv", stages=[S.BEFORE_FORWARD, S.AFTER_FORWARD], max_samples=3)
    strategy = make_strategy([hook])
    strategy.run(make_batches(8))
    stats = hook._stats[S.BEFORE_FORWARD]
    assert stats.count == 8 and len(stats.sample) == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_the_stages(tmp_path: Path) -> None:
    # Its earlier ValueError ("Plugin name already registered: nvtrain.orchestrator=...") came from
    # pluggy < 1.7 skipping the falsy empty orchestrator in unregister, in every strategy without
    # update hooks, on any device; the bus no longer unregisters plugins to reorder them.
    # test_device_path_runs_a_whole_run_on_cpu runs this scenario through the CUDA code path.
    output = tmp_path / "timing.csv"
    strategy = make_strategy([StageTimingHook(output=output, flush_every_n_steps=2)], device="cuda")
    strategy.run(make_batches(5))
    _, rows = read_rows(output)
    assert len(rows) == len(BATCH_STAGES)
    for row in rows:
        assert int(row["count"]) >= 4
        assert_plausible(row)


class FakeEvent:
    """Stands in for torch.cuda.Event on CPU: records perf_counter, counts synchronisations."""

    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.time: float | None = None

    def record(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.time is not None and end.time is not None
        return (end.time - self.time) * 1000.0


def test_device_path_synchronises_only_when_flushing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CUDA code path with stand-ins for events and NVTX, so its bookkeeping runs on any machine
    ranges: list[str] = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", ranges.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", ranges.pop)
    monkeypatch.setattr(FakeEvent, "synchronized", 0)
    output = tmp_path / "timing.csv"
    hook = StageTimingHook(output=output, flush_every_n_steps=3)
    strategy = make_strategy([hook])
    strategy.ctx.device = torch.device("cuda")  # only the hook reads it; the model stays on CPU
    batches = make_batches(7)
    for index, batch in enumerate(batches):
        strategy.train_batch(batch)
        assert len(ranges) == 1  # one open NVTX range: the interval still running
        assert FakeEvent.synchronized == (1 if index >= 3 else 0) + (1 if index >= 6 else 0)
    strategy.close()
    assert ranges == [] and FakeEvent.synchronized == 3
    _, rows = read_rows(output)
    counts = {row["stage"]: int(row["count"]) for row in rows}
    # a flush at a micro-batch's first stage closes the open interval first; close() drops the last one
    assert counts == {stage.name: 7 for stage in BATCH_STAGES} | {"AFTER_BATCH": 6}
    for row in rows:
        assert_plausible(row)


def test_device_path_runs_a_whole_run_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # test_cuda_events_time_the_stages's scenario (run(), flushes on cadence and at the end) through the
    # CUDA code path, with stand-ins for events and NVTX
    ranges: list[str] = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", ranges.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", ranges.pop)
    monkeypatch.setattr(FakeEvent, "synchronized", 0)
    output = tmp_path / "timing.csv"
    hook = StageTimingHook(output=output, flush_every_n_steps=2)
    strategy = make_strategy([hook])
    strategy.ctx.device = torch.device("cuda")  # only the hook reads it; the model stays on CPU
    strategy.run(make_batches(5))
    assert ranges == [] and FakeEvent.synchronized >= 1
    _, rows = read_rows(output)
    assert len(rows) == len(BATCH_STAGES)
    for row in rows:
        assert int(row["count"]) >= 4
        assert_plausible(row)


def test_rows_count_micro_batches_under_accumulation(tmp_path: Path) -> None:
    # docs/update-hooks.md: the counts are micro-batches, so the optimizer step's cost is spread over K of them
    hook = StageTimingHook(output=tmp_path / "t.csv", stages=[S.DO_OPTIMIZER_STEP, S.AFTER_BATCH])
    strategy = make_strategy([hook, nvtrain.hooks.GradientAccumulationHook(steps=4)], num_epochs=1)
    strategy.run(make_batches(8))
    assert strategy.ctx.step_count == 2
    assert hook.report()["DO_OPTIMIZER_STEP"]["count"] == 8


class FailsOnceAfterLoss:
    fired = False

    @nvtrain.hookimpl
    def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.batch_count == 2 and not self.fired:
            self.fired = True
            raise RuntimeError("transient")


def test_the_time_between_a_failed_run_and_the_next_is_no_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that raised inside AFTER_LOSS left that stage's interval open; the next run drops it rather than
    count the pause between the runs (a fake clock: one microsecond a reading, an hour between the runs)."""
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(time, "perf_counter", clock)
    hook = StageTimingHook(output=tmp_path / "timing.csv")
    strategy, data = make_strategy([hook, FailsOnceAfterLoss()], num_epochs=1), make_batches(6)
    with strategy:
        with pytest.raises(RuntimeError, match="transient"):
            strategy.run(data)
        now[0] += 3600.0
        strategy.run(data)
    report = hook.report()
    assert report["AFTER_LOSS"]["count"] == 6  # two before the failure, four after it: the open one dropped
    assert max(stats["p95_ms"] for stats in report.values() if stats["count"]) < 1.0
