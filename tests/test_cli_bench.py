"""`nvtrain bench dispatch` and its measurement (nvtrain.commands.bench_stack): structure and semantics, never timings."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.cli import main
from nvtrain.commands import bench_stack
from nvtrain.commands.bench import add_arguments, device_problem, stack_builder
from nvtrain.stages import BATCH_STAGES, TrainingStage

TINY = ["--quick", "--json", "--steps", "4", "--rounds", "1"]


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any] | None, str]:
    code = main(["bench", "dispatch", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and "--json" in args else None), err


def bench_folders(scratch: Path) -> list[Path]:
    """The bench's temporary folders left in ``scratch`` (torch's own cache folder, made there by whichever
    test first builds an optimizer while ``tempfile.tempdir`` points at it, is not the bench's)."""
    return list(scratch.glob("nvtrain-bench-*"))


# -- the command -------------------------------------------------------------------------------------


def test_report_lists_every_stage_with_its_implementations_and_calls(capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = bench(capsys, *TINY, "--hooks", "ema,clip")
    assert code == 0 and report is not None
    stages = {row["stage"]: row for row in report["stages"]}
    assert list(stages) == [stage.hook_name for stage in TrainingStage]
    for stage in TrainingStage:
        row = stages[stage.hook_name]
        if stage in BATCH_STAGES:
            assert row["calls"] == 4 and row["per_micro_batch"] is True
            assert row["median_ns"] is not None and row["min_ns"] <= row["median_ns"]
    assert stages["after_validation"]["calls"] == 0 and stages["after_validation"]["median_ns"] is None
    assert stages["setup"]["calls"] == stages["before_training"]["calls"] == stages["after_training"]["calls"] == 1
    # the orchestrator owns the update stages; the update hooks it runs are listed per stage
    assert stages["after_optimizer_step"]["update_hooks"] == ["ema"]
    assert stages["do_optimizer_step"]["update_hooks"] == ["clip"]
    assert stages["do_backward"]["implementations"] == ["nvtrain.orchestrator"]
    assert stages["do_backward"]["includes"] == "backward()"
    assert stages["do_optimizer_step"]["includes"] == "optimizer step"
    assert stages["before_forward"]["implementations"] == [] and stages["before_forward"]["includes"] is None
    assert "ema" in stages["setup"]["implementations"]  # EMAHook also observes SETUP and BEFORE_TRAINING
    assert [h["name"] for h in report["hooks"]] == ["ema", "clip"]
    assert {h["kind"] for h in report["hooks"]} == {"update hook"}


def test_report_compares_bare_loop_framework_and_stack(capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = bench(capsys, *TINY, "--hooks", "clip")
    assert code == 0 and report is not None
    assert list(report["per_step_us"]) == ["bare loop", "nvtrain, no hooks", "nvtrain, your hooks"]
    assert set(report["ratios"]) == {"nvtrain, no hooks", "nvtrain, your hooks"}
    for name, figures in report["per_step_us"].items():
        assert figures["run_us"]["min"] <= figures["run_us"]["median"], name
        assert figures["step_us"]["min"] <= figures["step_us"]["p10"] <= figures["step_us"]["median"], name
    assert set(report["ratios"]["nvtrain, no hooks"]) == {"run_median", "run_min", "step_median", "step_p10"}
    yours, framework = report["per_step_us"]["nvtrain, your hooks"], report["per_step_us"]["nvtrain, no hooks"]
    assert report["hooks_overhead_us"]["run_median"] == pytest.approx(
        yours["run_us"]["median"] - framework["run_us"]["median"]
    )
    assert set(report["sweep_ns"]) == {"observer_stages", "update_stages", "do_slots", "once_per_run"}
    assert (report["steps"], report["rounds"], report["threads"], report["device"]) == (4, 1, 1, "cpu")


def test_no_hooks_measures_the_framework_alone(capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = bench(capsys, *TINY)
    assert code == 0 and report is not None
    assert report["hooks"] == [] and report["source"] == "no hooks"
    assert list(report["per_step_us"]) == ["bare loop", "nvtrain, no hooks"]
    assert "hooks_overhead_us" not in report


def test_threads_are_restored(capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_num_threads()
    code, report, _ = bench(capsys, *TINY, "--threads", "1")
    assert code == 0 and report is not None and report["threads"] == 1
    assert torch.get_num_threads() == before


def test_text_output_has_the_stage_table_and_the_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "dispatch", "--quick", "--steps", "4", "--rounds", "1", "--hooks", "clip"])
    out = capsys.readouterr().out
    assert code == 0
    assert "before_batch" in out and "includes backward()" in out
    assert "bare loop" in out and "nvtrain, your hooks" in out and "your hooks add" in out


def test_unknown_hook_is_a_usage_error_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, *TINY, "--hooks", "clip,no_such_hook")
    assert code == 2
    assert "--hooks clip,no_such_hook" in err and "no_such_hook" in err and "hooks[1]" in err


def test_bad_setting_is_refused_by_the_hook_validator(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, *TINY, "--hooks", "ema", "--set", "hooks.ema.decay=1.5")
    assert code == 2
    assert "EMAHook.decay must be in [0.0, 1.0) (got 1.5)" in err


def test_required_settings_get_bench_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    code, report, _ = bench(capsys, *TINY, "--hooks", "clip")  # clip needs max_norm or max_value
    assert code == 0 and report is not None
    code, _, err = bench(capsys, *TINY, "--hooks", "accumulate")
    assert code == 2 and "steps" in err


def test_config_hooks_are_built_like_a_run_and_write_nothing_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    config = tmp_path / "job.yaml"
    config.write_text(
        "model: {factory: 'torch.nn:Linear', kwargs: {in_features: 4, out_features: 1}}\n"
        "data: {factory: 'builtins:dict'}\n"
        f"output_dir: {json.dumps(str(runs))}\n"
        "logging: {csv: true, tensorboard: false, plot: false, progress_bar: true}\n"
        "hooks:\n  - {name: ema, decay: 0.9}\n",
        encoding="utf-8",
    )
    code, report, _ = bench(capsys, *TINY, "--config", str(config), "--hooks", "clip")
    assert code == 0 and report is not None
    names = [h["name"] for h in report["hooks"]]
    assert names[:2] == ["ema", "clip"]  # the config's hooks, then --hooks
    assert "csv_logger" in names and "progress_bar" not in names
    assert report["source"] == f"config {config} + --hooks clip"
    assert not runs.exists()  # the run directory went to a temporary folder
    code, _, err = bench(capsys, *TINY, "--config", str(config), "--set", "hooks.ema.decay=2")
    assert code == 2 and "EMAHook.decay" in err


DIGITS_JOB = """\
model: {factory: 'nvtrain.builtin.digits:make_classifier'}
data: {factory: 'nvtrain.builtin.digits:make_loaders'}
device: cpu
hooks:
  - {name: checkpoint, checkpoint_dir: my_ckpts, step_interval: 10, resume: auto}
"""


def test_config_output_folders_and_resume_stay_inside_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a checkpoint hook with its own checkpoint_dir and resume: auto used to write ./my_ckpts and then
    # resume the timed runs from the warm-up run's checkpoint (a ResumeError traceback, exit 1)
    work, scratch = tmp_path / "work", tmp_path / "scratch"
    work.mkdir()
    scratch.mkdir()
    (work / "job.yaml").write_text(DIGITS_JOB, encoding="utf-8")
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the bench's temporary folder goes
    code, report, err = bench(capsys, *TINY, "--config", "job.yaml")
    assert code == 0, err
    assert report is not None and report["hooks"][0]["name"] == "checkpoint"
    assert sorted(p.name for p in work.rglob("*")) == ["job.yaml"]
    assert bench_folders(scratch) == []  # the temporary folder is gone, with the checkpoints in it


def test_stack_builder_points_output_settings_into_the_scratch_folder_and_turns_resume_off(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    config = tmp_path / "job.yaml"
    config.write_text(
        DIGITS_JOB.replace("resume: auto", f"resume: {json.dumps(str(outside / 'step_4'))}")
        + f"  - {{name: profiler, output_dir: {json.dumps(str(outside / 'profiles'))}}}\n",
        encoding="utf-8",
    )
    scratch = tmp_path / "scratch"
    build = stack_builder(str(config), [], ["hooks.checkpoint.checkpoint_dir=elsewhere"], scratch)
    checkpoint, profiler = build()[:2]
    assert type(checkpoint).__name__ == "CheckpointHook" and type(profiler).__name__ == "TorchProfilerHook"
    # each build gets a fresh run directory; the folders default into it as for a run that sets none
    assert checkpoint.checkpoint_dir == scratch / "run0" / "job" / "checkpoints"  # type: ignore[attr-defined]
    assert checkpoint.resume == "never"  # type: ignore[attr-defined]
    assert checkpoint.step_interval == 10  # type: ignore[attr-defined]  # other settings are kept
    assert profiler.output_dir == scratch / "run0" / "job" / "profiler"  # type: ignore[attr-defined]
    again = build()[0]
    assert again.checkpoint_dir == scratch / "run1" / "job" / "checkpoints"  # type: ignore[attr-defined]


def test_a_setting_the_hook_does_not_take_is_still_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(DIGITS_JOB.replace("hooks:\n", "hooks:\n  - {name: ema, output_dir: x}\n"), encoding="utf-8")
    code, _, err = bench(capsys, *TINY, "--config", str(config))
    assert code == 2 and "output_dir" in err and "hooks[0]" in err


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("foo", "--device 'foo' is not a torch device (expected e.g. cpu, cuda or cuda:1)"),
        ("meta", "--device 'meta' holds no data to train on"),
    ],
)
def test_a_device_torch_does_not_know_is_a_usage_error(
    device: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = bench(capsys, *TINY, "--device", device)
    assert code == 2
    assert err.startswith("nvtrain bench: error: " + expected) and err.count("\n") == 1
    assert "Traceback" not in err


def test_cuda_without_cuda_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        code, _, err = bench(capsys, *TINY, "--device", device)
        assert code == 2
        assert err == (
            f"nvtrain bench: error: --device {device!r} asked for CUDA, which this machine does not have "
            "(use --device cpu)\n"
        )


def test_a_cuda_index_past_the_device_count_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code, _, err = bench(capsys, *TINY, "--device", "cuda:2")
    assert code == 2
    assert err == (
        "nvtrain bench: error: --device 'cuda:2' names CUDA device 2, but this machine has 2 (cuda:0 to cuda:1)\n"
    )
    assert device_problem("cuda:1") is None and device_problem("cuda") is None


def test_missing_config_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, *TINY, "--config", str(tmp_path / "absent.yaml"))
    assert code == 2 and "absent.yaml" in err


def test_bad_counts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, "--steps", "2")
    assert code == 2 and "--steps" in err


# -- the measurement behind it ------------------------------------------------------------------------


def test_every_measured_model_is_a_model_choice() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = list(bench_stack.MODELS)
    assert [parser.parse_args(["dispatch", "--model", name]).model for name in names] == names == ["tiny", "larger"]


def test_loops_are_timed_round_robin_after_an_untimed_round(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    order: list[str] = []

    def loop(name: str) -> bench_stack.Loop:
        def start() -> tuple[Any, None]:
            order.append(name)
            return (lambda batches: list(batches)), None

        return start

    result = bench_stack.compare_loops({n: loop(n) for n in "abc"}, list(range(5)), 2, torch.device("cpu"))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # per round: a clock read before the run, one per batch handed out, one after: 6000 ns over 5 steps
    assert result["loops"]["a"]["run_us"] == {"median": 1.2, "min": 1.2}
    # 3 intervals per pass (the first of each pass dropped), the untimed round's left out
    assert result["loops"]["a"]["step_us"] == {"median": 1.0, "p10": 1.0, "min": 1.0}
    assert result["ratios"]["c"] == {"run_median": 1.0, "run_min": 1.0, "step_median": 1.0, "step_p10": 1.0}


def test_stamps_time_each_step_from_one_hand_out_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([0, 10, 30, 60, 100])
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(ticks))
    stamps = bench_stack._Stamps(["a", "b", "c", "d", "e"])
    assert len(stamps) == 5 and list(stamps) == ["a", "b", "c", "d", "e"]
    assert stamps.intervals == [20, 30, 40]  # the first interval of the pass is dropped


def test_stage_timing_restores_the_bus_callers() -> None:
    from nvtrain.bus import HookBus

    bus = HookBus(trace=False)
    before = {stage: getattr(bus, stage.hook_name) for stage in TrainingStage}
    with bench_stack._timing_stages(bus) as recorded:
        bus.before_batch(None)
        bus.do_backward(None)
    assert len(recorded[TrainingStage.BEFORE_BATCH]) == len(recorded[TrainingStage.DO_BACKWARD]) == 1
    assert all(getattr(bus, stage.hook_name) is caller for stage, caller in before.items())


def test_the_models_train_on_seeded_batches() -> None:
    mlp = bench_stack.MODELS["tiny"]
    first, again = mlp.batches(3, torch.device("cpu")), mlp.batches(3, torch.device("cpu"))
    assert [tuple(t.shape) for t in first[0]] == [(8, 32), (8, 1)]
    assert all(
        torch.equal(a, b) for pair, twin in zip(first, again, strict=True) for a, b in zip(pair, twin, strict=True)
    )
    assert mlp.build(torch.device("cpu"))(first[0][0]).shape == (8, 1)
    assert mlp.label == "32->64->1, batch 8"


@pytest.mark.parametrize("name", ["csv_logger", "nvtrain.logging_hooks:CSVLoggerHook"])
def test_a_csv_logger_of_the_config_writes_inside_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    work, scratch = tmp_path / "work", tmp_path / "scratch"
    work.mkdir()
    scratch.mkdir()
    job = DIGITS_JOB.replace(
        "  - {name: checkpoint, checkpoint_dir: my_ckpts, step_interval: 10, resume: auto}",
        f"  - {{name: '{name}', path: leaked/metrics.csv}}",
    )
    (work / "job.yaml").write_text(job + "logging: {csv: false, plot: false}\n", encoding="utf-8")
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, _, err = bench(capsys, *TINY, "--config", "job.yaml")
    assert code == 0, err
    assert sorted(p.name for p in work.rglob("*")) == ["job.yaml"]
    assert bench_folders(scratch) == []


def test_stage_timing_writes_inside_the_temporary_folder_and_overwrites_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # its CSV used to land in the working directory (over a real run's file), or where a config's output said
    work, scratch, elsewhere = tmp_path / "work", tmp_path / "scratch", tmp_path / "elsewhere"
    work.mkdir()
    scratch.mkdir()
    (work / "stage_timing.csv").write_text("REAL RUN DATA\n", encoding="utf-8")
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, _, err = bench(capsys, *TINY, "--hooks", "stage_timing")
    assert code == 0, err
    entry = json.dumps([{"name": "stage_timing", "output": str(elsewhere / "x.csv")}])
    code, _, err = bench(capsys, *TINY, "--set", f"hooks={entry}")
    assert code == 0, err
    assert sorted(p.name for p in work.rglob("*")) == ["stage_timing.csv"]
    assert (work / "stage_timing.csv").read_text(encoding="utf-8") == "REAL RUN DATA\n"
    assert not elsewhere.exists()
    assert bench_folders(scratch) == []


def test_stack_builder_moves_a_declared_output_file_into_the_run_directory(tmp_path: Path) -> None:
    build = stack_builder(None, ["stage_timing"], ["hooks.stage_timing.output=/elsewhere/x.csv"], tmp_path)
    (timing,) = build()
    assert timing.output == tmp_path / "run0" / "digits" / "stage_timing.csv"  # type: ignore[attr-defined]


def test_a_hook_refusing_the_model_at_setup_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    # it used to be a 35-line traceback and exit 1, from the middle of the measurement
    code, _, err = bench(
        capsys, *TINY, "--hooks", "trainable_params", "--set", "hooks.trainable_params.trainable=[nonexistent]"
    )
    assert code == 2
    assert err.startswith(
        "nvtrain bench: error: --hooks trainable_params: hook 'trainable_params' at SETUP: "
        "TrainableParameterHook.trainable pattern 'nonexistent' matches no parameter of ['main']"
    )
    assert err.count("\n") == 1 and "Traceback" not in err


def test_trial_step_names_the_stage_and_the_hook() -> None:
    from nvtrain.hooks import TrainableParameterHook

    hooks = [TrainableParameterHook(trainable=["0.*"], frozen=["9.*"])]
    with pytest.raises(bench_stack.StackRefused) as caught:
        bench_stack.trial_step(hooks, device="cpu")
    assert (caught.value.where, caught.value.hook) == ("SETUP", "trainable_params")
    assert isinstance(caught.value.cause, ValueError)
    bench_stack.trial_step([TrainableParameterHook(trainable=["0.*"])], device="cpu")  # a stack that fits passes


class RefusesTheBatch:
    plugin_name = "refuses"

    @nvtrain.hookimpl
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        raise TypeError("RefusesTheBatch: inputs must be images")


def test_trial_step_takes_one_step_too() -> None:
    with pytest.raises(bench_stack.StackRefused) as caught:
        bench_stack.trial_step([RefusesTheBatch()], device="cpu")
    assert str(caught.value) == "hook 'refuses' at the first step: RefusesTheBatch: inputs must be images"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "huge"], "argument --model: invalid choice: 'huge' (choose from 'tiny', 'larger')"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ],
)
def test_a_usage_error_is_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "dispatch", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err == f"nvtrain bench: error: {message} (see nvtrain bench dispatch --help)\n"
