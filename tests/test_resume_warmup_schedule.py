"""`nvtrain train` resumed with a changed LR schedule behind a warmup (``lr_scheduler.warmup_steps > 0``).

The warmup makes the scheduler a ``SequentialLR`` of a ``LinearLR`` ramp and the configured
schedule, which keeps its ``T_max``, ``eta_min`` and base LRs in its children. A resume with a
changed horizon, LR, schedule setting or warmup length must follow the schedule a fresh run of
the new config has at each resumed step; adding or removing the warmup is refused. In-process
(``nvtrain.cli.main``) on a small digits job.
"""

from __future__ import annotations

import json
import logging
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest

from nvtrain.app import EXIT_OK, EXIT_USAGE
from nvtrain.cli import main

RECORDER = '''\
import json
import nvtrain


class RecordLR:
    """Appends to ``path`` a line when built (a run starts), the LR each optimizer update uses, and the LR
    after each optimizer step: {"event": ..., "step": ctx.step_count, "lr": rate}."""

    def __init__(self, path):
        self.path = path
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps({"event": "run"}) + "\\n")

    @nvtrain.hookimpl
    def before_optimizer_step(self, ctx):
        self.write(ctx, "update")

    @nvtrain.hookimpl
    def after_batch(self, ctx):
        if ctx.sync_gradients:
            self.write(ctx, "stepped")

    def write(self, ctx, event):
        lr = ctx.optimizers["main"].param_groups[0]["lr"]
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps({"event": event, "step": ctx.step_count, "lr": lr}) + "\\n")
'''

LR = 0.003  # the job's optimizer.kwargs.lr
START_FACTOR = 1e-3  # nvtrain.schedules.warmup's default


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small digits job with a checkpoint hook that resumes and a hook that records the LR."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr_record.py").write_text(RECORDER, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / "out"}
            device: cpu
            model: {{factory: nvtrain.builtin.digits:make_classifier, kwargs: {{hidden: 16, depth: 1}}}}
            data: {{factory: nvtrain.builtin.digits:make_loaders, kwargs: {{batch_size: 64}}}}
            optimizer: {{factory: 'torch.optim:AdamW', kwargs: {{lr: {LR}}}}}
            lr_scheduler: {{factory: cosine}}
            trainer: {{max_steps: 8}}
            validation: {{every_n_epochs: null}}
            logging: {{log_every_n_steps: 100, tensorboard: false, plot: false, progress_bar: false}}
            hooks:
              - {{name: checkpoint, resume: auto}}
              - {{name: 'lr_record:RecordLR', path: {tmp_path / "lr.jsonl"}}}
            """
        ),
        encoding="utf-8",
    )
    return config


def sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def train(job: Path, *overrides: str) -> int:
    return main(["train", str(job), *sets(*overrides)])


def resumed_lrs(job: Path, resumed_at: int) -> dict[int, float]:
    """The LR at each scheduler position of the resumed run: the one the first update after the resume used
    (position ``resumed_at``), then the one after every optimizer step."""
    records = [json.loads(line) for line in (job.parent / "lr.jsonl").read_text(encoding="utf-8").splitlines()]
    runs = [index for index, record in enumerate(records) if record["event"] == "run"]
    later = records[runs[-1] :]  # the resumed run's records, after the first run's
    first_update = next(r for r in later if r["event"] == "update")
    assert first_update["step"] == resumed_at
    return {resumed_at: first_update["lr"], **{r["step"]: r["lr"] for r in later if r["event"] == "stepped"}}


def schedule(
    step: int, *, warmup: int, horizon: int, lr: float = LR, eta_min: float = 0.0, factory: str = "cosine"
) -> float:
    """The LR of a fresh run after ``step`` scheduler steps: the linear ramp, then the cosine (or the ``linear``
    decay to 0) over ``horizon``."""
    if step < warmup:
        return lr * (START_FACTOR + (1 - START_FACTOR) * step / warmup)
    if factory == "linear":
        return lr * (1 - min(step - warmup, horizon) / horizon)
    return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * (step - warmup) / horizon)) / 2


def assert_follows(got: dict[int, float], steps: range, **new_schedule: Any) -> None:
    want = {step: schedule(step, **new_schedule) for step in steps}
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-12), (step, got, want)


def resume_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]


@pytest.mark.parametrize(
    ("factory", "warmup", "horizon_key"),
    [
        ("cosine", 2, "T_max"),
        ("linear", 2, "total_iters"),  # the linear schedule's total_steps, kept as its LinearLR's total_iters
        ("linear", 0, "total_iters"),
    ],
)
def test_a_longer_run_re_derives_the_horizon_with_or_without_a_warmup(
    job: Path, caplog: pytest.LogCaptureFixture, factory: str, warmup: int, horizon_key: str
) -> None:
    same = (f"lr_scheduler.factory={factory}", f"lr_scheduler.warmup_steps={warmup}")
    assert train(job, *same, "trainer.max_steps=8") == EXIT_OK  # the schedule ends at 0 at step 8
    caplog.set_level(logging.INFO)
    assert train(job, *same, "trainer.max_steps=16") == EXIT_OK
    assert "trainer.max_steps: 8 -> 16 (takes effect: the run length; the LR schedule's horizon" in caplog.text
    new: dict[str, Any] = {"warmup": warmup, "horizon": 16 - warmup, "factory": factory}
    assert_follows(resumed_lrs(job, resumed_at=8), range(8, 17), **new)  # not back up from the old end
    assert resume_lines(caplog) == [
        f"resume: LR scheduler 'main': {horizon_key} {8 - warmup} -> {16 - warmup}",
        f"resume: optimizer 'main': lr at step 8 is now {schedule(8, **new):.3g} (was 0)",
    ]


def test_a_changed_lr_and_eta_min_reach_the_schedule_behind_a_warmup(
    job: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``T_max`` given in the config (no horizon to re-derive): only the LR and the schedule's setting change."""
    fixed = ("lr_scheduler.warmup_steps=4", "lr_scheduler.kwargs.T_max=16")
    assert train(job, *fixed, "trainer.max_steps=12") == EXIT_OK
    caplog.set_level(logging.INFO)
    changed = ("optimizer.kwargs.lr=0.001", "lr_scheduler.kwargs.eta_min=0.0001")
    assert train(job, *fixed, *changed, "trainer.max_steps=20") == EXIT_OK
    new: dict[str, Any] = {"warmup": 4, "horizon": 16, "lr": 1e-3, "eta_min": 1e-4}
    assert_follows(resumed_lrs(job, resumed_at=12), range(12, 21), **new)  # 0.00055 at 12, eta_min at 20
    assert resume_lines(caplog) == [
        "resume: optimizer 'main': lr = 0.001",
        "resume: LR scheduler 'main': eta_min 0.0 -> 0.0001",
        "resume: optimizer 'main': lr at step 12 is now 0.00055 (was 0.0015)",
    ]


@pytest.mark.parametrize(
    ("before", "after", "first_steps"),
    [
        (2, 6, 4),  # resumed inside the new, longer warmup: the ramp continues to its new end
        (6, 2, 8),  # resumed past both warmups: on the cosine of the new horizon, two steps further in
    ],
)
def test_another_warmup_length_is_applied_as_a_fresh_run_of_it_has_the_schedule(
    job: Path, caplog: pytest.LogCaptureFixture, before: int, after: int, first_steps: int
) -> None:
    assert train(job, f"lr_scheduler.warmup_steps={before}", f"trainer.max_steps={first_steps}") == EXIT_OK
    caplog.set_level(logging.INFO)
    assert train(job, f"lr_scheduler.warmup_steps={after}", "trainer.max_steps=12") == EXIT_OK
    assert f"lr_scheduler.warmup_steps: {before} -> {after} (applied on resume: the warmup's length" in caplog.text
    assert_follows(resumed_lrs(job, resumed_at=first_steps), range(first_steps, 13), warmup=after, horizon=12 - after)
    lines = resume_lines(caplog)
    assert lines[:2] == [
        f"resume: LR scheduler 'main': warmup_steps {before} -> {after}",
        f"resume: LR scheduler 'main': T_max {first_steps - before} -> {12 - after}",
    ]
    assert lines[2].startswith(f"resume: optimizer 'main': lr at step {first_steps} is now ") and len(lines) == 3


@pytest.mark.parametrize(("before", "after"), [(0, 2), (2, 0)])
@pytest.mark.parametrize("command", ["validate", "train"])
def test_adding_or_removing_the_warmup_is_refused_in_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, before: int, after: int
) -> None:
    """Another scheduler class (a SequentialLR or not): refused where the setting is, before anything is written."""
    assert train(job, f"lr_scheduler.warmup_steps={before}", "trainer.max_steps=4") == EXIT_OK
    run = job.parent / "out" / "job"
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    capsys.readouterr()
    overrides = sets(f"lr_scheduler.warmup_steps={after}", "trainer.max_steps=8")
    assert main([command, str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"nvtrain {command}: error: --set lr_scheduler.warmup_steps={after}: lr_scheduler.warmup_steps: "
        f"cannot resume from {run / 'checkpoints' / 'step_4'} with this config: lr_scheduler.warmup_steps: "
        f"{before} -> {after} (refused: adding or removing a warmup changes the LR scheduler's class"
    ), err
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == files
