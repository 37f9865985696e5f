"""`nvtrain train` / `validate` / `plot` on the failure paths: each says what happened, in one line.

In-process (``nvtrain.cli.main``) so the suite stays quick: a preemption is a signal
the process sends itself from a hook, a diverging run a loss that is NaN.
"""

from __future__ import annotations

import csv
import logging
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from nvtrain.app import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    EXIT_USAGE,
)
from nvtrain.cli import main

HELPERS = '''\
import os, signal
import torch
import nvtrain
from torch.utils.data import DataLoader, TensorDataset


class SendSignal:
    """Sends this process ``signal_name`` ``times`` times after optimizer step ``at``."""

    def __init__(self, at=3, signal_name="SIGTERM", times=1):
        self.at, self.name, self.times, self.sent = at, signal_name, times, False

    @nvtrain.hookimpl
    def after_batch(self, ctx):
        if ctx.sync_gradients and ctx.step_count == self.at and not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), getattr(signal, self.name))


def loss(outputs, targets):
    """A metric named like the validation summary's own loss."""
    return (outputs.argmax(1) == targets).float().mean()


def nan_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets) * float("nan")


def nan_after(outputs, targets, step=[0]):
    step[0] += 1
    loss = torch.nn.functional.cross_entropy(outputs, targets)
    return loss * float("nan") if step[0] > 6 else loss


def empty_loaders():
    data = TensorDataset(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))
    return DataLoader(data, batch_size=8), None


def train_only():
    data = TensorDataset(torch.zeros(16, 64), torch.zeros(16, dtype=torch.long))
    return DataLoader(data, batch_size=8), None


def batch_sampler_loaders():
    from torch.utils.data import BatchSampler, SequentialSampler
    data = TensorDataset(torch.zeros(64, 64), torch.zeros(64, dtype=torch.long))
    return DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 8, drop_last=False)), None


def needs_a_missing_package():
    raise ImportError("this data set needs the 'notinstalled' package: pip install notinstalled")


def imports_a_sibling_when_called():
    from failure_sibling import WIDTH  # a module beside the config, imported only now
    data = TensorDataset(torch.zeros(16, WIDTH), torch.zeros(16, dtype=torch.long))
    return DataLoader(data, batch_size=8), None


class F1Seed(nvtrain.Hook):
    """A seed-style hook that adds a key to the validation summary."""

    stages = (nvtrain.TrainingStage.AFTER_VALIDATION,)

    def __call__(self, ctx, stage):
        ctx.validation["f1"] = torch.tensor(0.5)
'''

#: A third-party plugin package named as docs/writing-plugins.md suggests (nvtrain_<name>).
THIRD_PARTY = '''
import torch
import nvtrain


class F1Hook:
    @nvtrain.hookimpl
    def after_validation(self, ctx):
        ctx.validation["f1"] = torch.tensor(0.5)
'''


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small digits job in ``tmp_path`` (helpers module beside it); returns the config path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "failure_helpers.py").write_text(HELPERS, encoding="utf-8")
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / 'out'}
            device: cpu
            model: {{factory: nvtrain.builtin.digits:make_classifier, kwargs: {{hidden: 16, depth: 1}}}}
            data: {{factory: nvtrain.builtin.digits:make_loaders, kwargs: {{batch_size: 64}}}}
            trainer: {{max_steps: 8}}
            validation: {{every_n_epochs: null}}
            logging: {{log_every_n_steps: 2, tensorboard: false, plot: false, progress_bar: false}}
            """
        ),
        encoding="utf-8",
    )
    return config


def sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


# -- 3. validate builds what train builds -----------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "where", "message"),
    [
        ("hooks=[{name: amp, precision: auto}, {name: amp, precision: auto}]", "hooks", "exclusive key"),
        ("hooks=[{name: accumulate, steps: 2}, {name: accumulate, steps: 2}]", "hooks", "exclusive key"),
        ("optimizer.kwargs.lr=-1", "optimizer.kwargs.lr", "Invalid learning rate: -1"),
        ("data.kwargs.batch_size=0", "data.kwargs.batch_size", "batch_size must be an int from 1 to the data set's"),
        ("data.kwargs.val_fraction=1.5", "data.kwargs.val_fraction", "val_fraction must be in (0, 1)"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_construction_errors_are_one_line_exit_2_and_write_nothing(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, override: str, where: str, message: str
) -> None:
    assert main([command, str(job), *sets(override)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain {command}: error: --set {override}: {where}: "), err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (job.parent / "out").exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("raise RuntimeError('boom at import')\n", "raised RuntimeError: boom at import"),
        ("def build(:\n", "raised SyntaxError: "),
        ("import sys\nsys.exit('no')\n", "raised SystemExit: no"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_user_module_that_raises_on_import_is_one_line_exit_2(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, source: str, message: str
) -> None:
    module = f"broken_{command}_{abs(hash(source))}"
    (job.parent / f"{module}.py").write_text(source, encoding="utf-8")
    override = f"model.factory={module}:build"
    assert main([command, str(job), *sets(override, "model.kwargs={}")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain {command}: error: --set {override}: model.factory: importing module {module!r}")
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (job.parent / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "where", "message"),
    [
        (
            ["validation.use_mixed_precision=true"],
            "validation.use_mixed_precision",
            "use_mixed_precision is true but no mixed-precision hook is configured",
        ),
        (
            ["lr_scheduler={factory: plateau, monitor: acuracy}", "validation.metrics=[accuracy]"],
            "lr_scheduler.monitor",
            "monitor 'acuracy' is not a key of the validation summary, which has: loss, accuracy, num_samples; "
            "did you mean 'accuracy'?",
        ),
        (
            ["hooks=[{name: early_stopping, monitor: val_accuracy}]", "validation.metrics=[accuracy]"],
            "hooks[0].monitor",
            "monitor 'val_accuracy' is not a key of the validation summary, which has: loss, accuracy, "
            "num_samples; did you mean 'accuracy'?",
        ),
        (
            ["trainer.global_batch_size=128", "hooks=[{name: accumulate, steps: 4}]"],
            "trainer.global_batch_size",
            "global_batch_size=128 with a local batch size of 64 (the training loader's) and 1 process(es) means 2 "
            "micro-batch(es) per optimizer step, but hooks[0].steps (accumulate) accumulates over 4",
        ),
        (
            ["hooks=[{name: trainable_params, trainable: [nonexistent]}]"],
            "hooks",
            "SETUP: TrainableParameterHook.trainable pattern 'nonexistent' matches no parameter",
        ),
        (
            ["trainer.global_batch_size=100"],
            "trainer.global_batch_size",
            "StepScheduler: global_batch_size=100 is not a multiple of local_batch_size=64 * dp_size=1 (= 64)",
        ),
        (["seed=18446744073709551616"], "seed", "seed: must be an integer from -2**63 to 2**63 - 1"),
        (["cpu_threads=100000000000"], "cpu_threads", "cpu_threads: must be from 1 to 2**31 - 1, or null"),
        (["device=meta"], "device", "device 'meta' holds no data, so nothing can train on it"),
        pytest.param(
            ["device=mps"],
            "device",
            "device 'mps' asked for MPS, which this machine does not have",
            marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS"),
        ),
        (
            ["trainer.start_epoch=2", "trainer.num_epochs=2"],
            "trainer.start_epoch",
            "trainer.start_epoch=2 is not before trainer.num_epochs=2: the run would train nothing",
        ),
        (
            ["trainer.start_step=3", "trainer.max_steps=3"],
            "trainer.start_step",
            "trainer.start_step=3 is not before trainer.max_steps=3: the run would train nothing",
        ),
        (
            ["lr_scheduler={factory: plateau}"],
            "lr_scheduler.monitor",
            "plateau is stepped after each validation with validation value 'loss', but the run never validates: "
            "no validation cadence is set",
        ),
        (
            ["validation.metrics=[accuracy, 'failure_helpers:loss']"],
            "validation.metrics[1]",
            "a metric named 'loss' would overwrite the validation loss (val_loss); give the function another name",
        ),
        (["validation.metrics=[math:pi]"], "validation.metrics[0]", "math:pi is not callable as fn(outputs, targets)"),
        (["hooks=[{name: ema, model_key: nope}]"], "hooks", "SETUP: EMAHook.model_key: no model named 'nope'"),
        (
            ["hooks=[{name: checkpoint, checkpoint_dir: ck}, {name: checkpoint, checkpoint_dir: ck, keep_last_n: 1}]"],
            "hooks",
            "SETUP: CheckpointHook.checkpoint_dir: two checkpoint hooks write to",
        ),
        (
            ["lr_scheduler={factory: step, kwargs: {step_size: '10'}}"],
            "lr_scheduler.kwargs",
            "step fails when stepped with these kwargs: TypeError: unsupported operand type(s)",
        ),
        (
            ["lr_scheduler={factory: cosine, kwargs: {T_max: 0}}"],
            "lr_scheduler.kwargs",
            "cosine fails when stepped with these kwargs: ZeroDivisionError",
        ),
        (
            ["optimizer.factory=torch.optim:LBFGS"],
            "optimizer.factory",
            "torch.optim:LBFGS.step() needs 'closure' (a closure that re-evaluates the model), which the training "
            "loop does not pass",
        ),
        (
            ["lr_scheduler={factory: plateau, monitor: loss}", "validation.every_n_steps=2",
             "data={factory: failure_helpers:train_only}"],
            "lr_scheduler.monitor",
            "but the run never validates: failure_helpers:train_only returns no validation loader",
        ),
    ],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_what_would_fail_at_the_first_validation_or_step_is_refused_up_front(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, overrides: list[str], where: str, message: str
) -> None:
    assert main([command, str(job), *sets(*overrides)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain {command}: error: --set {overrides[0]}: {where}: "), err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (job.parent / "out").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["lr_scheduler={factory: plateau, monitor: accuracy}", "validation={every_n_steps: 2, metrics: [accuracy]}"],
        ["hooks=[{name: early_stopping, monitor: num_samples}]"],
        ["trainer.global_batch_size=256", "hooks=[{name: accumulate, steps: 4}]"],
        ["lr_scheduler={factory: plateau}", "validation.every_n_epochs=null", "trainer.val_every_steps=3"],
        ["lr_scheduler={factory: onecycle, kwargs: {max_lr: 0.1}}"],  # stepped once on a long placeholder horizon
        ["lr_scheduler={factory: cosine}", "optimizer={factory: torch.optim:SGD, kwargs: {lr: 0.1, momentum: 0.9}}"],
    ],
)
def test_monitors_accumulation_and_cadences_that_agree_validate(
    job: Path, capsys: pytest.CaptureFixture[str], overrides: list[str]
) -> None:
    assert main(["validate", str(job), *sets(*overrides)]) == EXIT_OK, capsys.readouterr().err


@pytest.mark.parametrize("hook", ["failure_helpers:F1Seed", "nvtrain_f1ext:F1Hook"])
def test_a_monitor_a_third_party_hook_may_add_to_the_summary_validates(
    job: Path, capsys: pytest.CaptureFixture[str], hook: str
) -> None:
    """Only nvtrain and its shipped plugins are known not to add keys; a seed-style Hook at AFTER_VALIDATION and
    a plugin package named nvtrain_<name> may."""
    package = job.parent / "nvtrain_f1ext"
    package.mkdir()
    (package / "__init__.py").write_text(THIRD_PARTY, encoding="utf-8")
    overrides = sets(f"hooks=[{{name: '{hook}'}}, {{name: early_stopping, monitor: f1, mode: max}}]")
    assert main(["validate", str(job), *overrides]) == EXIT_OK, capsys.readouterr().err


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_run_directory_under_a_file_is_refused_at_output_dir(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (tmp_path / "afile").write_text("not a folder")
    overrides = sets(f"output_dir={tmp_path / 'afile' / 'runs'}", "hooks=[]")
    assert main([command, str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "output_dir: the run directory" in err and "lies under" in err and "which is a file" in err


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_folder_where_the_metrics_file_goes_is_refused_at_logging_csv(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (tmp_path / "out" / "job" / "metrics.csv").mkdir(parents=True)
    assert main([command, str(job)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "logging.csv" in err and "CSVLoggerHook.path" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_factory_needing_a_missing_package_is_one_line_at_its_section(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    assert main([command, str(job), *sets("data={factory: failure_helpers:needs_a_missing_package}")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "data: failure_helpers:needs_a_missing_package: this data set needs the 'notinstalled' package" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_module_beside_the_config_may_import_its_siblings_when_called(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "failure_sibling.py").write_text("WIDTH = 64\n", encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the config's folder is not the working one
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    overrides = sets("data={factory: failure_helpers:imports_a_sibling_when_called}")
    assert main(["validate", str(job), *overrides]) == EXIT_OK, capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_at_logging_plot(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["validate", str(job), *sets("logging.plot=true")]) == EXIT_USAGE
    assert "logging.plot: plot needs matplotlib, which is not installed" in capsys.readouterr().err


def test_a_loader_given_a_batch_sampler_counts_its_batch_size(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """global_batch_size 16 over batches of 8 from a BatchSampler is 2 micro-batches a step, as the hook says."""
    overrides = sets(
        "data={factory: failure_helpers:batch_sampler_loaders}",
        "trainer={global_batch_size: 16, num_epochs: 1}",
        "hooks=[{name: accumulate, steps: 2}]",
    )
    assert main(["validate", str(job), *overrides]) == EXIT_OK, capsys.readouterr().err


def test_a_plot_that_fails_after_the_run_warns_and_the_run_succeeds(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the figure could not be drawn")

    monkeypatch.setattr("nvtrain.plotting.plot_metrics", broken)
    assert main(["train", str(job), *sets("logging.plot=true")]) == EXIT_OK
    assert "| step 8 |" in capsys.readouterr().out
    assert "curves.png was not drawn: RuntimeError: the figure could not be drawn" in caplog.text


def test_an_empty_training_loader_is_named(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = sets(
        "data={factory: failure_helpers:empty_loaders}",
        "lr_scheduler={factory: 'torch.optim.lr_scheduler:CosineAnnealingLR'}",
    )
    assert main(["validate", str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "returned an empty training loader (len() == 0)" in err and "has no len()" not in err


# -- 1. preemption tells the truth ----------------------------------------------------------------


def test_preemption_without_a_checkpoint_hook_warns_and_exits_76(
    job: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    overrides = sets("trainer.max_steps=1000", "hooks=[{name: 'failure_helpers:SendSignal', at: 3}]")
    assert main(["train", str(job), *overrides]) == EXIT_PREEMPTED_UNSAVED
    out = capsys.readouterr().out
    assert "checkpoint saved" not in out
    assert "| step 4 |" in out and "preempted: nothing was saved (no checkpoint hook)" in out
    assert f"(exit status {EXIT_PREEMPTED_UNSAVED})" in out
    assert "will stop the run but nothing will be saved: add the checkpoint hook with resume: auto" in caplog.text


def test_preemption_with_a_checkpoint_names_it_and_exits_75(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = sets(
        "trainer.max_steps=1000",
        "hooks=[{name: 'failure_helpers:SendSignal', at: 3}, {name: checkpoint, resume: auto}]",
    )
    assert main(["train", str(job), *overrides]) == EXIT_PREEMPTED
    saved = job.parent / "out" / "job" / "checkpoints" / "step_4"  # sent after step 3, agreed at step 4
    assert f"preempted: checkpoint saved at step 4 ({saved}), rerun to resume" in capsys.readouterr().out
    assert (saved / "manifest.json").is_file()


def test_preemption_with_a_checkpoint_hook_that_does_not_resume_says_how_to(
    job: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """resume: never (the hook's default) saves, but a rerun of the config would start again from step 0."""
    caplog.set_level(logging.INFO)
    overrides = sets(
        "trainer.max_steps=1000", "hooks=[{name: 'failure_helpers:SendSignal', at: 3}, {name: checkpoint}]"
    )
    assert main(["train", str(job), *overrides]) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    assert "checkpoint saved at step 4" in out and "set resume: auto on the checkpoint hook to resume" in out
    assert "rerun to resume" not in out
    assert "has resume: never, so rerunning this config would start again from step 0" in caplog.text


def test_ctrl_c_preempts_and_a_second_one_aborts(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    signal_hook = "{name: 'failure_helpers:SendSignal', at: 2, signal_name: SIGINT, times: %d}"
    overrides = sets("trainer.max_steps=1000", "hooks=[%s]" % (signal_hook % 1))
    assert main(["train", str(job), *overrides]) == EXIT_PREEMPTED_UNSAVED  # stopped cleanly, no KeyboardInterrupt
    captured = capsys.readouterr()
    assert "| step 3 |" in captured.out and "Traceback" not in captured.err
    overrides = sets("trainer.max_steps=1000", "hooks=[%s]" % (signal_hook % 2))
    assert main(["train", str(job), *overrides]) == EXIT_INTERRUPTED
    assert "nvtrain train: interrupted" in capsys.readouterr().err


# -- 2. divergence ------------------------------------------------------------------------------------


def test_a_permanently_nan_loss_with_spike_skip_stops_within_the_limit(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = sets(
        "loss.function=failure_helpers:nan_loss",
        "trainer={num_epochs: 200, max_consecutive_skipped_steps: 5}",
        "hooks=[spike_skip]",
    )
    assert main(["train", str(job), *overrides]) == EXIT_DIVERGED
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("nvtrain train: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("nvtrain train: error: training diverged: 5 optimizer steps in a row were skipped")
    assert "(none since step 0, epoch 1)" in errors[0]


def test_a_nan_training_loss_is_reported_at_the_next_logging_step(
    job: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert main(["train", str(job), *sets("loss.function=failure_helpers:nan_after")]) == EXIT_OK
    warnings = [r.getMessage() for r in caplog.records if "training loss is nan" in r.getMessage()]
    assert len(warnings) == 1 and "at step 8" in warnings[0]  # NaN from step 7; logged every 2 steps


def test_a_nan_validation_loss_is_reported(job: Path, caplog: pytest.LogCaptureFixture) -> None:
    overrides = sets("loss.function=failure_helpers:nan_loss", "validation.every_n_steps=4")
    assert main(["train", str(job), *overrides]) == EXIT_OK
    assert "validation loss is nan at step 4" in caplog.text


# -- 6. one-line errors --------------------------------------------------------------------------------


def test_plot_of_a_config_file_is_one_line(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(job)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"nvtrain plot: error: {job} is a file, not a run directory or a metrics CSV (e.g. nvtrain plot runs/digits)\n"


def test_a_full_disk_is_one_line_naming_the_checkpoint(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from nvtrain_checkpoint import storage

    class FullDisk:
        """The state file as a full disk shows it: every write fails with ENOSPC."""

        def __init__(self, file: Any) -> None:
            self._file = file

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

    def open_on_a_full_disk(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = open(path, mode, *args, **kwargs)  # noqa: SIM115 (the caller closes it)
        return FullDisk(handle) if "w" in mode and str(path).endswith(storage.STATE_NAME) else handle

    # torch.save then fails with "[enforce fail at ...]" around the ENOSPC
    monkeypatch.setattr(storage, "open", open_on_a_full_disk, raising=False)
    assert main(["train", str(job), *sets("hooks=[checkpoint]", "trainer.max_steps=2")]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("nvtrain train: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("nvtrain train: error: no space left on device")
    assert str(job.parent / "out" / "job" / "checkpoints" / "step_2") in errors[0]


def _full_disk(*args: Any, **kwargs: Any) -> None:
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")  # as a write to an open file raises it: no file name


@pytest.mark.parametrize(
    ("target", "name", "overrides"),
    [
        ("csv.DictWriter.writerow", "metrics.csv", []),
        ("matplotlib.figure.Figure.savefig", "curves.png", ["logging.plot=true"]),
    ],
)
def test_a_full_disk_is_one_line_naming_the_run_file(
    job: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    name: str,
    overrides: list[str],
) -> None:
    pytest.importorskip(target.partition(".")[0])
    monkeypatch.setattr(target, _full_disk)
    assert main(["train", str(job), *sets("trainer.max_steps=2", *overrides)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("nvtrain train: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0] == f"nvtrain train: error: no space left on device writing {job.parent / 'out' / 'job' / name}"


def test_an_allow_listed_plugin_that_is_missing_is_not_called_installed(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NVTRAIN_PLUGINS", "amp,nosuch_plugin_for_tests")
    assert main(["validate", str(job), *sets("hooks=[{name: amp, precision: auto}, ema]")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "hook 'ema' is an installed plugin that NVTRAIN_PLUGINS=amp,nosuch_plugin_for_tests does not allow" in err
    assert main(["validate", str(job), *sets("hooks=[emma]")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "installed plugins: amp;" in err and "not installed: nosuch_plugin_for_tests" in err


# -- 4. resuming with a changed config -----------------------------------------------------------------

CHECKPOINTED = (
    "hooks=[{name: checkpoint, resume: auto, step_interval: 2}]",
    "optimizer.kwargs.lr=0.003",
    "lr_scheduler={factory: 'torch.optim.lr_scheduler:CosineAnnealingLR'}",
)


def first_run(job: Path, *extra: str) -> Path:
    assert main(["train", str(job), *sets(*CHECKPOINTED, "trainer.max_steps=4", *extra)]) == EXIT_OK
    return job.parent / "out" / "job"


def snapshot_files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def checkpoint_state(run: Path, step: int) -> dict[str, object]:
    from nvtrain_checkpoint import read_checkpoint

    return read_checkpoint(run / "checkpoints" / f"step_{step}")


def test_a_changed_learning_rate_is_applied_on_resume_and_recorded(
    job: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = first_run(job)
    caplog.set_level(logging.INFO)
    assert main(["train", str(job), *sets(*CHECKPOINTED, "trainer.max_steps=6", "optimizer.kwargs.lr=0.5")]) == 0
    assert "optimizer.kwargs.lr: 0.003 -> 0.5 (applied on resume" in caplog.text
    assert "trainer.max_steps: 4 -> 6 (takes effect" in caplog.text
    group = checkpoint_state(run, 6)["optimizers"]["main"]["param_groups"][0]
    assert group["initial_lr"] == 0.5  # the cosine schedule now starts from 0.5: at step 4 of 6 it is 0.125
    assert "optimizer 'main': lr at step 4 is now 0.125 (was " in caplog.text
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["kwargs"]["lr"] == 0.5


def test_a_longer_run_re_derives_the_cosine_horizon(job: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = first_run(job, "trainer.max_steps=null", "trainer.num_epochs=1", "hooks.0.step_interval=null")
    first = checkpoint_state(run, 23)  # 1437 training images / 64 per batch: 23 steps an epoch
    assert first["lr_schedulers"]["main"]["T_max"] == 23
    caplog.set_level(logging.INFO)
    longer = sets(*CHECKPOINTED, "trainer.max_steps=null", "trainer.num_epochs=2", "hooks.0.step_interval=null")
    assert main(["train", str(job), *longer]) == EXIT_OK
    assert "T_max 23 -> 46" in caplog.text
    final = checkpoint_state(run, 46)
    assert final["lr_schedulers"]["main"]["T_max"] == 46
    assert final["optimizers"]["main"]["param_groups"][0]["lr"] < 1e-6  # the schedule ends at its end, not climbing


def test_another_optimizer_class_is_refused_before_anything_is_written(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = first_run(job)
    before = snapshot_files(run)
    capsys.readouterr()
    overrides = sets(*CHECKPOINTED, "trainer.max_steps=6", "optimizer={factory: 'torch.optim:SGD', kwargs: {lr: 0.1}}")
    assert main(["train", str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "KeyError" not in err
    assert f"cannot resume from {run / 'checkpoints' / 'step_4'} with this config: optimizer.factory: " in err
    assert "'torch.optim:AdamW' -> 'torch.optim:SGD' (refused: an optimizer's state cannot move" in err
    assert snapshot_files(run) == before


@pytest.mark.parametrize("command", ["validate", "train"])
def test_another_model_architecture_is_refused_in_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """validate reads the checkpoint's weight shapes (not their data) and refuses as train would."""
    run = first_run(job)
    before = snapshot_files(run)
    capsys.readouterr()
    assert main([command, str(job), *sets(*CHECKPOINTED, "trainer.max_steps=6", "model.kwargs.hidden=24")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith(f"nvtrain {command}: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "cannot resume: the checkpoint's weights for model 'main' do not fit this model" in errors[0]
    assert "model config changed since the checkpoint: model.kwargs.hidden: 16 -> 24" in errors[0]
    assert snapshot_files(run) == before


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_data_position_the_run_cannot_continue_is_refused_by_validate_too(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Another batch size: the checkpoint's position (micro-batches into the epoch) means other samples now."""
    run = first_run(job)
    before = snapshot_files(run)
    capsys.readouterr()
    overrides = sets(*CHECKPOINTED, "trainer.max_steps=6", "data.kwargs.batch_size=32")
    assert main([command, str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot resume: StepScheduler.load_state_dict:" in err and "Traceback" not in err
    assert snapshot_files(run) == before


def test_max_steps_at_the_checkpoint_trains_nothing_and_touches_nothing(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = first_run(job)
    before = snapshot_files(run)
    capsys.readouterr()
    assert main(["train", str(job), *sets(*CHECKPOINTED, "trainer.max_steps=3")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "already at step 4" in out and "nothing to train" in out
    assert "(trainer.max_steps=3 ends the run at step 3: raise it)" in out
    assert snapshot_files(run) == before


def test_nothing_to_train_names_the_bound_that_ends_the_run(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run stops at whichever of max_steps and num_epochs comes first: raising max_steps past an epoch
    bound trains nothing, and the line says to raise num_epochs instead."""
    epoch = sets(*CHECKPOINTED, "trainer.max_steps=null", "trainer.num_epochs=1", "data.kwargs.batch_size=256")
    assert main(["train", str(job), *epoch]) == EXIT_OK
    capsys.readouterr()
    assert main(["train", str(job), *epoch, "--set", "trainer.max_steps=400"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "nothing to train (trainer.num_epochs=1 ends the run at step 6, before trainer.max_steps=400: raise " \
        "trainer.num_epochs)" in out


def test_config_yaml_records_only_what_is_in_effect(job: Path) -> None:
    run = first_run(job)
    assert main(["train", str(job), *sets(*CHECKPOINTED, "trainer.max_steps=6", "seed=7")]) == EXIT_OK
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["seed"] == 0 and recorded["trainer"]["max_steps"] == 6  # the RNG streams came from the checkpoint


# -- 5. a corrupt checkpoint ------------------------------------------------------------------------------


def corrupt(state: Path) -> None:
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))


def test_auto_resume_passes_over_a_corrupt_latest_checkpoint(
    job: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    run = first_run(job)
    corrupt(run / "checkpoints" / "step_4" / "state.pt")
    capsys.readouterr()
    assert main(["train", str(job), *sets(*CHECKPOINTED, "trainer.max_steps=6")]) == EXIT_OK
    warning = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: passing over")]
    assert len(warning) == 1
    assert str(run / "checkpoints" / "step_4" / "state.pt") in warning[0] and "sha256" in warning[0]
    assert warning[0].endswith(f"resuming from {run / 'checkpoints' / 'step_2'} instead")
    assert "| resumed at step 2 |" in capsys.readouterr().out


def test_a_start_step_without_a_checkpoint_is_not_called_a_resume(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", str(job), *sets("trainer.start_step=3", "trainer.max_steps=6")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "| started at step 3 |" in out and "resumed" not in out


def test_an_explicit_corrupt_checkpoint_is_one_line_exit_2(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = first_run(job)
    corrupt(run / "checkpoints" / "step_4" / "state.pt")
    shutil.copytree(run / "checkpoints" / "step_4", job.parent / "saved")
    capsys.readouterr()
    overrides = sets(*CHECKPOINTED, f"hooks.0.resume={job.parent / 'saved'}", "name=other", "trainer.max_steps=6")
    assert main(["train", str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("nvtrain train: error: --set hooks.0.resume=") and err.count("\n") == 1
    assert "cannot resume: " in err and "does not match the sha256 in its manifest" in err
    assert not (job.parent / "out" / "other").exists()


# -- 7. what the numbers describe --------------------------------------------------------------------


def test_validation_of_ema_weights_is_named_and_epochs_are_1_based(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = sets(
        "hooks=[{name: ema, decay: 0.9}]", "validation={every_n_steps: 4, metrics: [accuracy]}", "trainer.max_steps=30"
    )
    assert main(["train", str(job), *overrides]) == EXIT_OK
    out = capsys.readouterr().out
    assert "| epoch 2 |" in out and "val_ema_accuracy " in out  # 23 steps an epoch: step 30 is in the 2nd
    metrics = rows(job.parent / "out" / "job" / "metrics.csv")
    validated = [row for row in metrics if row.get("val_ema_loss")]
    assert validated and all(row["val_ema_accuracy"] and not row["val_loss"] for row in validated)
    assert {row["epoch"] for row in metrics} == {"1", "2"}


# -- a run a hook stopped says so -------------------------------------------------------------------


def test_a_run_stopped_by_early_stopping_says_why_and_exits_0(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = sets(
        "trainer.max_steps=null",
        "trainer.num_epochs=20",
        "validation.every_n_epochs=1",
        "optimizer.kwargs.lr=0",
        "hooks=[{name: early_stopping, monitor: loss, patience: 1}]",
    )
    assert main(["train", str(job), *overrides]) == 0
    out = capsys.readouterr().out
    assert "stopped early: early stopping" in out


def test_a_resume_lists_the_keys_a_filled_in_mapping_gained_not_the_mapping() -> None:
    """``model.kwargs: {}`` saved, ``hidden: 16`` now: one change, model.kwargs.hidden (no "{} -> (absent)")."""
    from nvtrain.resuming import config_changes

    saved, now = {"model": {"kwargs": {}}}, {"model": {"kwargs": {"hidden": 16}}}
    assert [c.key for c in config_changes(saved, now, derives_horizon=False)] == ["model.kwargs.hidden"]
    assert [c.key for c in config_changes(now, saved, derives_horizon=False)] == ["model.kwargs.hidden"]
    assert [c.key for c in config_changes(saved, {"model": {}}, derives_horizon=False)] == ["model.kwargs"]


def test_a_resume_compares_hooks_by_name_and_lists_one_added_or_removed_as_one_change() -> None:
    """Removing ema between amp and checkpoint: one change, not checkpoint's settings compared with ema's."""
    from nvtrain.resuming import TAKES_EFFECT, config_changes

    amp, checkpoint = {"name": "amp", "precision": "auto"}, {"name": "checkpoint", "resume": "auto"}
    fast, slow = {"name": "ema", "decay": 0.9, "state_key": "fast"}, {"name": "ema", "decay": 0.999, "state_key": "slow"}
    saved = {"hooks": [amp, fast, slow, checkpoint]}
    now = {"hooks": [{**amp, "precision": "bf16"}, slow, checkpoint, {"name": "clip", "max_norm": 1.0}]}
    changes = config_changes(saved, now, derives_horizon=False)
    assert [(c.key, c.effect) for c in changes] == [
        ("hooks[amp].precision", TAKES_EFFECT),
        ("hooks[clip]", TAKES_EFFECT),
        ("hooks[ema:fast]", TAKES_EFFECT),
    ]
    assert changes[1].describe() == (
        "hooks[clip]: (absent) -> {'name': 'clip', 'max_norm': 1.0} "
        "(takes effect: a hook the checkpoint's run did not have; it starts afresh)"
    )
    assert changes[2].saved == fast and "what the checkpoint saved for it is left unused" in changes[2].note
    twins = {"hooks": [{"name": "ema", "decay": 0.9}, {"name": "ema", "decay": 0.99}]}  # one label: counted
    assert [c.key for c in config_changes(twins, {"hooks": twins["hooks"][:1]}, derives_horizon=False)] == [
        "hooks[ema#2]"
    ]


def test_a_factory_refusal_quoting_a_value_is_placed_at_the_kwarg_in_the_file(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch says "Invalid learning rate: -1", not "lr": the one kwarg whose value it quotes is blamed."""
    text = job.read_text(encoding="utf-8")
    job.write_text(text + "optimizer: {factory: 'torch.optim:SGD', kwargs: {lr: -1, momentum: 0.9}}\n", encoding="utf-8")
    assert main(["validate", str(job)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{job}:" in err and ": optimizer.kwargs.lr: torch.optim:SGD: Invalid learning rate: -1" in err


# -- main() called in-process leaves the process as it found it -------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "train"])
def test_an_in_process_command_leaves_the_root_logger_and_threads_as_they_were(
    job: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A notebook or a test calling main() keeps its logging and its torch thread count (cpu_threads is the run's)."""
    import logging

    root = logging.getLogger()
    handlers, level, threads = list(root.handlers), root.level, torch.get_num_threads()
    other = 2 if threads != 2 else 3
    assert main([command, str(job), *sets(f"cpu_threads={other}", "trainer.max_steps=2")]) == EXIT_OK
    assert (list(root.handlers), root.level, torch.get_num_threads()) == (handlers, level, threads)


def test_a_failure_while_closing_the_hooks_is_part_of_the_error_line(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's error carries the hooks' close failures as notes; the one line printed kept only the error."""
    (tmp_path / "closing.py").write_text(
        textwrap.dedent(
            """\
            import errno
            import nvtrain
            from nvtrain.errors import TrainingDivergedError

            class DivergesThenFailsToClose:
                @nvtrain.hookimpl
                def after_batch(self, ctx):
                    raise TrainingDivergedError("training diverged: at once", skipped=1, step=0, epoch=0)

                def close(self):
                    raise OSError(errno.ENOSPC, "No space left on device", "final-upload")
            """
        ),
        encoding="utf-8",
    )
    assert main(["train", str(job), *sets("hooks=[{name: 'closing:DivergesThenFailsToClose'}]")]) == 3
    err = capsys.readouterr().err
    assert "training diverged: at once (also: while closing hooks, OSError: [Errno 28] No space left on device" in err


def test_a_generator_as_the_validation_loader_is_refused_at_data(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "oneshot.py").write_text(
        textwrap.dedent(
            """\
            from nvtrain.builtin.digits import make_loaders

            def loaders(**kwargs):
                train, validation = make_loaders(**kwargs)
                return train, (batch for batch in validation)
            """
        ),
        encoding="utf-8",
    )
    assert main(["validate", str(job), *sets("data.factory=oneshot:loaders")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "oneshot:loaders returned a generator as the validation loader, which the first validation reads up" in err


def test_a_bug_in_a_factory_names_its_kind_and_where_it_was_raised(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyError inside the user's factory printed as "model: mods:build: 'out'": no kind, no place."""
    (tmp_path / "buggy.py").write_text("def build(**kwargs):\n    return {}['out']\n", encoding="utf-8")
    assert main(["validate", str(job), *sets("model={factory: 'buggy:build'}")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "model: buggy:build: KeyError: 'out' (at buggy.py:2 in build)" in err


@pytest.mark.parametrize("count", [2, 3])
def test_a_data_factory_returning_a_list_of_batches_trains_on_it(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], count: int
) -> None:
    """Two batches were taken for (train, validation) and the model's forward was blamed; three were "3 items;
    expected (train, validation)", though one loader is accepted."""
    (tmp_path / "listed.py").write_text(
        textwrap.dedent(
            f"""\
            import torch

            def batches(**kwargs):
                generator = torch.Generator().manual_seed(0)
                return [(torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator))
                        for _ in range({count})]
            """
        ),
        encoding="utf-8",
    )
    assert main(["train", str(job), *sets("data={factory: 'listed:batches'}", "trainer.max_steps=2")]) == EXIT_OK


def test_a_clipping_model_key_typo_is_refused_by_validate(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """validate said valid; train crashed at the first optimizer step with a traceback."""
    overrides = sets("hooks=[{name: clip, max_norm: 1.0, model_keys: [enc]}]")
    assert main(["validate", str(job), *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "GradientClippingHook.model_keys: no optimizer for model 'enc' (models with an optimizer: ['main'])" in err
