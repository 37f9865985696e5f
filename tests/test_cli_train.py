"""`nvtrain train` / `nvtrain validate` end to end: files, overrides, one-line errors, preemption and resume."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import attrs
import pytest
import torch
import yaml

from nvtrain.app import EXIT_PREEMPTED, EXIT_USAGE
from nvtrain.cli import main
from nvtrain.config import dump_config, load_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUBPROCESS_TIMEOUT = 240


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def nvtrain(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m nvtrain ARGS`` in ``cwd`` (stdout and stderr captured)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("NVTRAIN_")}
    return subprocess.Popen(
        [sys.executable, "-m", "nvtrain", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# -- the built-in job -------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_train_end_to_end(tmp_path: Path) -> None:
    process = nvtrain(
        "train", "--set", "trainer.max_steps=60", "--set", f"output_dir={tmp_path / 'out'}", cwd=tmp_path
    )
    out, err = process.communicate(timeout=SUBPROCESS_TIMEOUT)
    assert process.returncode == 0, err
    run = tmp_path / "out" / "digits"
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["max_steps"] == 60
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_60"
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    metrics = rows(run / "metrics.csv")
    train_rows = [r for r in metrics if r["train_loss"]]
    assert [int(r["step"]) for r in train_rows] == list(range(10, 61, 10))
    assert float(train_rows[-1]["train_loss"]) < float(train_rows[0]["train_loss"])
    accuracy = [float(r["val_ema_accuracy"]) for r in metrics if r.get("val_ema_accuracy")]  # EMA weights
    assert len(accuracy) == 3 and accuracy[-1] > 0.2  # chance is 0.1
    assert out.startswith(f"run {run} | step 60 | ")
    assert "Traceback" not in err


def test_print_config_prints_the_resolved_builtin_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--set", "trainer.max_steps=200"]) == 0
    printed = capsys.readouterr().out
    # the built-in config's name is a default, printed as null (see the tests below)
    assert printed == dump_config(attrs.evolve(load_config(None, ["trainer.max_steps=200"]).config, name=None))
    assert yaml.safe_load(printed)["trainer"]["max_steps"] == 200


def test_printed_builtin_config_trains_under_the_saved_files_stem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # docs/cli.md's "start your own config" after the built-in run: the printed file used to carry
    # `name: digits`, so it resumed runs/digits' checkpoint and trained nothing
    monkeypatch.chdir(tmp_path)
    small = ["--set", "device=cpu", "--set", "trainer.max_steps=2"]
    assert main(["train", *small]) == 0
    assert (tmp_path / "runs" / "digits" / "checkpoints" / "latest").read_text().strip() == "step_2"
    capsys.readouterr()
    assert main(["train", "--print-config"]) == 0
    (tmp_path / "my-job.yaml").write_text(capsys.readouterr().out, encoding="utf-8")
    assert yaml.safe_load((tmp_path / "my-job.yaml").read_text())["name"] is None
    assert main(["validate", "my-job.yaml", *small]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"my-job.yaml: valid (run directory {Path('runs', 'my-job')}; ")
    assert "resumes from" not in out
    assert main(["train", "my-job.yaml", *small]) == 0
    out, err = capsys.readouterr()
    assert "nothing to train" not in out + err
    run = tmp_path / "runs" / "my-job"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert yaml.safe_load((run / "config.yaml").read_text())["name"] == "my-job"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["digits", "my-job"]


@pytest.mark.parametrize(
    ("config_text", "overrides", "printed_name"),
    [
        (None, ["name=mine"], "mine"),  # a --set name is the user's
        ("name: mine\n", [], "mine"),  # so is a name in the config file
        ("name: mine\n", ["name=other"], "other"),
        ("name: mine\n", ["name=null"], None),
        ("", [], None),  # the file's stem is a default
        (None, [], None),  # and so is the built-in config's digits
    ],
)
def test_print_config_keeps_only_a_name_the_user_gave(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config_text: str | None,
    overrides: list[str],
    printed_name: str | None,
) -> None:
    args = ["train", "--print-config", *(arg for o in overrides for arg in ("--set", o))]
    if config_text is not None:
        builtin = load_config(None).config
        text = config_text + dump_config(attrs.evolve(builtin, name=None)).replace("name: null\n", "")
        args.insert(1, str(write(tmp_path / "job.yaml", text)))
    assert main(args) == 0
    assert yaml.safe_load(capsys.readouterr().out)["name"] == printed_name


# -- a user's config --------------------------------------------------------------------------------


USER_MODULE = """\
import json, pathlib, torch

def build(width=8, marker="built.json"):
    pathlib.Path(marker).write_text(json.dumps({"width": width}))
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
"""


def user_config(tmp_path: Path, module: str) -> Path:
    write(tmp_path / f"{module}.py", USER_MODULE)
    return write(
        tmp_path / "user.yaml",
        f"""\
        output_dir: {tmp_path / 'out'}
        model:
          factory: {module}:build
          kwargs: {{width: 16, marker: {tmp_path / 'built.json'}}}
        data:
          factory: nvtrain.builtin.digits:make_loaders
          kwargs: {{batch_size: 32}}
        trainer: {{max_steps: 40}}
        validation: {{metrics: [accuracy]}}
        logging: {{log_every_n_steps: 5, tensorboard: false}}
        hooks: [{{name: clip, max_norm: 1.0}}]
        """,
    )


def test_user_config_with_a_model_factory_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = user_config(tmp_path, "factory_for_user_config")
    threads = torch.get_num_threads()
    wanted = 1 if threads != 1 else 2
    overrides = ["trainer.max_steps=12", "model.kwargs.width=24", f"cpu_threads={wanted}"]
    set_threads, calls = torch.set_num_threads, []

    def recording(count: int) -> None:
        calls.append(count)
        set_threads(count)

    monkeypatch.setattr(torch, "set_num_threads", recording)
    assert main(["train", str(config), *(arg for o in overrides for arg in ("--set", o))]) == 0
    assert calls == [wanted, threads]  # the run's, then the caller's back
    assert torch.get_num_threads() == threads
    assert (tmp_path / "built.json").read_text() == '{"width": 24}'  # the user's factory, with the override
    run = tmp_path / "out" / "user"
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["model"]["factory"] == "factory_for_user_config:build"
    assert resolved["trainer"]["max_steps"] == 12 and resolved["model"]["kwargs"]["width"] == 24
    metrics = rows(run / "metrics.csv")
    assert [r["step"] for r in metrics if r["train_loss"]] == ["5", "10", "12"]  # the last step flushed
    assert metrics[-1]["step"] == "12" and metrics[-1]["val_accuracy"]
    assert all(r["grad_norm"] for r in metrics if r["train_loss"])  # the clipping hook's metric is logged
    assert (run / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert not (run / "checkpoints").exists()  # no checkpoint hook configured
    assert capsys.readouterr().out.startswith(f"run {run} | step 12 | ")


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_step=3"], "trainer.max_step: unknown key 'max_step' in section 'trainer'; did you mean"),
        (["hooks=[emma]"], "hooks[0].name: unknown hook 'emma'"),
        (["model.kwargs.widht=3"], "factory_for_errors:build takes no argument 'widht'; did you mean 'width'?"),
    ],
)
def test_bad_config_exits_2_with_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    config = user_config(tmp_path, "factory_for_errors")
    args = [item for override in overrides for item in ("--set", override)]
    assert main(["train", str(config), *args]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.err.startswith(f"nvtrain train: error: --set {overrides[0]}: ")
    assert message in captured.err and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "built.json").exists()


def test_the_config_example_of_docs_cli_md_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The short config docs/cli.md shows (``hooks: [amp, ema]``: amp's precision left to its default)."""
    pytest.importorskip("nvtrain_amp")
    pytest.importorskip("nvtrain_ema")
    repo = Path(__file__).resolve().parents[1]
    text = (repo / "docs" / "cli.md").read_text(encoding="utf-8")
    example = text.split("defaults (the reference below), so a config can be short:\n\n```yaml\n", 1)[1]
    example = example.split("```", 1)[0]
    assert "hooks: [amp, ema]" in example
    (tmp_path / "my_model.py").write_text((repo / "examples" / "configs" / "my_model.py").read_text())
    config = write(tmp_path / "my-job.yaml", example)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(config)]) == 0, capsys.readouterr().err
    assert "hooks: MixedPrecisionHook, EMAHook" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()


def test_validate_good_and_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = user_config(tmp_path, "factory_for_validate")
    assert main(["validate", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{config}: valid (run directory {tmp_path / 'out' / 'user'}; hooks: GradientClippingHook")
    write(tmp_path / "bad.yaml", config.read_text() + "colour: blue\n")
    assert main(["validate", str(tmp_path / "bad.yaml")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == (
        f"nvtrain validate: error: {tmp_path / 'bad.yaml'}:12:1: colour: unknown key 'colour' in the top level "
        "(valid keys: name, output_dir, seed, device, backend, cpu_threads, model, data, loss, optimizer, lr_scheduler, "
        "trainer, validation, logging, hooks)\n"
    )
    assert not (tmp_path / "out").exists()  # validating writes nothing (it does build the model)


# -- preemption ------------------------------------------------------------------------------------


SLOW_MODULE = """\
import time, torch

class Slow(torch.nn.Module):
    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x):
        time.sleep(self.delay)
        return self.linear(x)

def build(delay=0.0):
    return Slow(delay)
"""


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_the_rerun_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # output_dir "runs" is relative: both runs must share it
    write(tmp_path / "slow_model_for_preemption.py", SLOW_MODULE)
    config = write(
        tmp_path / "slow.yaml",
        """\
        model: {factory: slow_model_for_preemption:build, kwargs: {delay: 0.05}}
        data: {factory: nvtrain.builtin.digits:make_loaders}
        trainer: {max_steps: 1000, ckpt_every_steps: null, save_checkpoint_every_epoch: false, validate_on_checkpoint: false}
        validation: {every_n_epochs: null}
        logging: {log_every_n_steps: 1, tensorboard: false, plot: false, progress_bar: false}
        hooks: [{name: checkpoint, resume: auto}]
        """,
    )
    run = tmp_path / "runs" / "slow"
    process = nvtrain("train", str(config), cwd=tmp_path)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    try:
        while not ((run / "metrics.csv").exists() and len(rows(run / "metrics.csv")) >= 3):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == EXIT_PREEMPTED, err
    assert "preemption signal received (SIGTERM)" in err
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved >= 3
    assert f"step {saved} |" in out and "preempted" in out

    # The same command again (shorter, and fast): it continues from the checkpoint, not from step 0.
    code = main(["train", str(config), "--set", f"trainer.max_steps={saved + 4}", "--set", "model.kwargs.delay=0.0"])
    assert code == 0
    assert f" | resumed at step {saved} | " in capsys.readouterr().out
    steps = [int(r["step"]) for r in rows(run / "metrics.csv")]
    assert steps == list(range(1, saved + 5))  # rows of the first run up to the checkpoint, then the resumed ones
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{saved + 4}"


# -- the same job with DDP under torchrun -----------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_processes_train_the_builtin_job_with_ddp(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NVTRAIN_")}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "nvtrain", "train",
        "--set", "trainer.max_steps=12", "--set", f"output_dir={tmp_path / 'out'}",
        "--set", "device=cpu",  # gloo on the CPU: two ranks on a one-GPU machine would be refused (NCCL)
    ]  # fmt: skip
    process = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT
    )
    assert process.returncode == 0, process.stderr[-4000:]
    run = tmp_path / "out" / "digits"
    steps = [int(row["step"]) for row in rows(run / "metrics.csv") if row.get("train_loss")]
    assert steps == [10, 12]  # rank 0 alone writes the metrics (no row doubled by rank 1); the last step flushed
    assert len(steps) == len(set(steps))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_12"
    assert (run / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_the_summary_says_when_its_validation_is_older_than_the_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    common = ["--set", "device=cpu", "--set", "logging.progress_bar=false", "--set", "logging.tensorboard=false"]
    steps = ["--set", "validation.every_n_epochs=null", "--set", "validation.every_n_steps=4"]
    assert main(["train", *common, *steps, "--set", "trainer.max_steps=6", "--set", "name=older"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert " | step 6 | " in summary and summary.endswith(" | (validated at step 4)")
    assert "val_ema_accuracy" in summary
    assert main(["train", *common, *steps, "--set", "trainer.max_steps=8", "--set", "name=fresh"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert " | step 8 | " in summary and "validated at" not in summary


def test_a_run_that_only_makes_the_owed_validation_reports_its_epoch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fallback_handlers: list[int],
) -> None:
    """Preempted at epoch 2's last step (46), the rerun makes epoch 2's validation first; early stopping ends
    it there, before any step: the summary names epoch 2, where step 46 is, not the next one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "preempt.py").write_text(
        "import os, signal, nvtrain\n"
        "class AtStep46:\n"
        "    @nvtrain.hookimpl\n"
        "    def before_batch(self, ctx):\n"
        "        if ctx.step_count == 45 and not os.path.exists('sent'):\n"
        "            open('sent', 'w').close()\n"
        "            os.kill(os.getpid(), signal.SIGUSR1)\n",
        encoding="utf-8",
    )
    args = [
        "train",
        *("--set", "device=cpu", "--set", "trainer.num_epochs=4", "--set", "trainer.preemption_signal=SIGUSR1"),
        *("--set", "logging.progress_bar=false", "--set", "logging.tensorboard=false", "--set", "logging.plot=false"),
        "--set",
        "hooks=[ema, {name: early_stopping, monitor: accuracy, mode: min, patience: 0}, {name: checkpoint, resume: auto}, "
        "preempt:AtStep46]",
    ]
    assert main(args) == EXIT_PREEMPTED
    capsys.readouterr()
    assert main(args) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert " | step 46 | resumed at step 46 | epoch 2/4 | " in summary and "stopped early" in summary
    assert fallback_handlers == []
