"""`nvtrain bench dispatch` guards: JSON alone on stdout, hook refusals as one line, bounded options, and no
refusal from the built-in job's validation checks when the user gave no config."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.cli import main
from nvtrain.commands import bench_stack
from nvtrain.commands.bench import max_threads
from nvtrain.config.loading import BUILTIN_SOURCE
from nvtrain.stages import TrainingStage

TINY = ["--quick", "--steps", "3", "--rounds", "1"]
CPU = torch.device("cpu")

HOOKS_MODULE = "bench_guard_hooks"
HOOKS_SOURCE = """\
from typing import ClassVar

import attrs

import nvtrain

print("imported: bench_guard_hooks")


@attrs.define(eq=False)
class Chatty:
    plugin_name: ClassVar[str] = "chatty"

    @nvtrain.hookimpl
    def after_batch(self, ctx):
        print("[chatty] step done")


@attrs.define(eq=False)
class SetupBoom:
    plugin_name: ClassVar[str] = "setup_boom"

    @nvtrain.hookimpl
    def setup(self, ctx):
        raise RuntimeError("cannot set up on this model")
"""


@pytest.fixture
def hooks_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of hooks importable by path (``bench_guard_hooks:Chatty``), imported afresh by each test."""
    (tmp_path / f"{HOOKS_MODULE}.py").write_text(HOOKS_SOURCE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(HOOKS_MODULE, None)
    yield HOOKS_MODULE
    sys.modules.pop(HOOKS_MODULE, None)


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", "dispatch", *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- --json: the document alone on stdout ----------------------------------------------------------------


def test_json_is_the_only_stdout_while_hooks_print(hooks_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    # the plugin template's monitor printing "[gradnorm] step 100: ..." used to make the file unreadable
    code, out, err = bench(capsys, *TINY, "--json", "--hooks", f"{hooks_module}:Chatty")
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
    assert [hook["name"] for hook in report["hooks"]] == ["chatty"]
    assert "imported: bench_guard_hooks" in err  # printed at import: also kept off stdout
    assert "[chatty] step done" in err


# -- a hook's refusal at SETUP or the first step ----------------------------------------------------------


def test_a_runtime_error_at_setup_is_one_line_and_exit_2(hooks_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, *TINY, "--hooks", f"{hooks_module}:SetupBoom")
    assert code == 2
    assert err == (
        f"nvtrain bench: error: --hooks {hooks_module}:SetupBoom: hook 'setup_boom' at SETUP: "
        "RuntimeError: cannot set up on this model\n"
    )


class RaisesAtFirstStep:
    plugin_name = "step_boom"

    def __init__(self, error: Exception) -> None:
        self.error = error

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (KeyError("missing thing"), "KeyError: 'missing thing'"),
        (IndexError("list index out of range"), "IndexError: list index out of range"),
        (AssertionError(), "AssertionError"),
        (ImportError("needs scipy"), "ImportError: needs scipy"),
    ],
)
def test_what_train_takes_for_a_refusal_is_one_at_the_first_step(error: Exception, text: str) -> None:
    with pytest.raises(bench_stack.StackRefused) as caught:
        bench_stack.trial_step([RaisesAtFirstStep(error)], device="cpu")
    # the hook is named from the traceback: the message does not open with its class
    assert str(caught.value) == f"hook 'step_boom' at the first step: {text}"
    assert caught.value.cause is error


class OutOfMemoryAtSetup:
    plugin_name = "oom"

    @nvtrain.hookimpl
    def setup(self, ctx: nvtrain.TrainingContext) -> None:
        raise torch.OutOfMemoryError("out of memory")


def test_out_of_memory_is_not_a_refusal() -> None:
    with pytest.raises(torch.OutOfMemoryError):
        bench_stack.trial_step([OutOfMemoryAtSetup()], device="cpu")


# -- bounded options ----------------------------------------------------------------------------------------


def test_threads_past_four_per_cpu_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --threads 20000 made libgomp fail to create them; --threads 100000 crashed the process
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert max_threads() == 8
    code, _, err = bench(capsys, *TINY, "--threads", "9")
    assert code == 2
    assert err == "nvtrain bench: error: --threads 9 is more than 8 (4 per CPU; this machine has 2)\n"


def test_a_long_run_cycles_a_fixed_pool_of_seeded_batches() -> None:
    # --steps 100000 --model larger used to allocate every batch up front (25 GiB) and run out of memory
    mlp = bench_stack.MODELS["tiny"]
    steps = bench_stack.BATCH_POOL * 2 + 5
    batches = mlp.batches(steps, CPU)
    handed_out = list(batches)
    assert len(batches) == len(handed_out) == steps
    assert len({id(inputs) for inputs, _ in handed_out}) == bench_stack.BATCH_POOL
    assert all(batch is batches[index] for index, batch in enumerate(handed_out))
    assert batches[bench_stack.BATCH_POOL] is batches[0] and batches[-1] is batches[4]
    fresh = mlp.batches(bench_stack.BATCH_POOL, CPU)  # the pool is the first BATCH_POOL seeded batches
    assert all(
        torch.equal(a, b) for pair, twin in zip(batches, fresh, strict=False) for a, b in zip(pair, twin, strict=True)
    )
    with pytest.raises(IndexError, match=f"step {steps} is outside the run's {steps} steps"):
        batches[steps]


def test_a_run_over_the_cycled_batches_takes_every_step() -> None:
    steps = bench_stack.BATCH_POOL + 6
    rows = bench_stack.stage_costs(bench_stack.MODELS["tiny"], bench_stack.MODELS["tiny"].batches(steps, CPU), [], CPU)
    calls = {row["stage"]: row["calls"] for row in rows}
    assert calls[TrainingStage.BEFORE_BATCH.hook_name] == calls[TrainingStage.AFTER_BATCH.hook_name] == steps


# -- the built-in job's validation checks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        # refused with "<built-in default.yaml>:39:3: validation.use_ema: use_ema: auto, but 2 EMA hooks ..."
        ["--hooks", "ema,ema", "--set", "hooks.0.state_key=a", "--set", "hooks.1.state_key=b"],
        # refused because 'top5' is not a key of the built-in job's validation summary
        ["--hooks", "early_stopping", "--set", "hooks.early_stopping.monitor=top5"],
    ],
)
def test_without_a_config_the_builtin_jobs_validation_does_not_refuse_the_stack(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = bench(capsys, *TINY, "--json", *args)
    assert code == 0, err
    names = [name for name in args[1].split(",")]
    assert [hook["name"] for hook in json.loads(out)["hooks"]] == names


JOB = """\
model: {factory: 'nvtrain.builtin.digits:make_classifier'}
data: {factory: 'nvtrain.builtin.digits:make_loaders'}
device: cpu
validation: {use_ema: auto}
hooks:
"""


@pytest.mark.parametrize(
    ("hooks", "at", "problem"),
    [
        (
            "  - {name: ema, state_key: a}\n  - {name: ema, state_key: b}\n",
            ":4:14: validation.use_ema: ",
            "use_ema: auto, but 2 EMA hooks average model 'main'",
        ),
        ("  - {name: early_stopping, monitor: top5}\n", ":6:28: hooks[0].monitor: ", "monitor 'top5' is not a key"),
    ],
)
def test_a_users_config_keeps_its_validation_checks_located_in_the_file(
    hooks: str, at: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(JOB + hooks, encoding="utf-8")
    code, _, err = bench(capsys, *TINY, "--config", str(config))
    assert code == 2
    assert err.startswith(f"nvtrain bench: error: {config}{at}{problem}") and err.count("\n") == 1
    assert BUILTIN_SOURCE not in err
