"""benchmarks/gpu_check.py: skips cleanly without CUDA, runs on the CPU, resolves a bare ``cuda``."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import nvtrain

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
TIMEOUT_S = 300


def run_script(*args: str, hide_cuda: bool = False) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NVTRAIN_")}
    env["OMP_NUM_THREADS"] = "1"
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # where its harness is, as when it runs as a script
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_skips_with_status_0() -> None:
    process = run_script(hide_cuda=True)
    assert process.returncode == 0, process.stderr[-4000:]
    lines = process.stdout.splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "no CUDA device" in lines[0]


def test_a_bare_cuda_device_gets_the_current_index(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.set_device(torch.device("cuda")) raises "Expected a torch.device with a specified index"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert gpu_check.resolve_device("cuda") == torch.device("cuda", 3)
    assert gpu_check.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert gpu_check.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.resolve_device("cuda") is None


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("bogus", "--device 'bogus' is not a torch device (expected e.g. cpu, cuda or cuda:1)"),
        ("meta", "--device 'meta' holds no data to train on (expected e.g. cpu, cuda or cuda:1)"),
    ],
)
def test_a_device_that_cannot_be_measured_is_a_usage_error(
    gpu_check: ModuleType, device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # these were a traceback and exit 1, the status of a found synchronisation
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--device", device, "--model", "tiny", "--steps", "3", "--rounds", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f": error: {message}\n")  # argparse: usage, then the error


def test_cuda_without_cuda_is_still_a_skip_not_a_usage_error(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.device_problem("cuda") is None and gpu_check.device_problem("cuda:1") is None
    assert gpu_check.device_problem("cpu") is None


def test_durable_save_leaves_only_the_published_file(gpu_check: ModuleType, tmp_path: Path) -> None:
    size = gpu_check.durable_save({"weight": torch.ones(4)}, tmp_path / "step_1.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["step_1.pt"]
    assert size == (tmp_path / "step_1.pt").stat().st_size
    assert torch.equal(torch.load(tmp_path / "step_1.pt", weights_only=True)["weight"], torch.ones(4))


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("batches_per_epoch", [4, 6])
def test_the_save_stopwatch_times_a_save_wherever_the_hook_writes_it(
    gpu_check: ModuleType, tmp_path: Path, batches_per_epoch: int, async_save: bool
) -> None:
    """A due step that ends its epoch is saved at AFTER_EPOCH: that stage is timed, not an empty AFTER_BATCH."""
    from nvtrain_checkpoint import CheckpointHook

    log = gpu_check.SaveLog()
    stopwatch = gpu_check._SaveStopwatch(torch.device("cpu"), 2, log)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(2, 1),
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        # async: the save is taken in the stage, while the write (and last_checkpoint_index) lags behind
        hooks=[
            CheckpointHook(tmp_path, step_interval=2, async_save=async_save, async_writer="thread"),
            stopwatch,
            stopwatch.stop,
        ],
        device="cpu",
        num_epochs=2,
    )
    saved_at: list[str] = []
    took_ns: list[int] = []
    real_save = CheckpointHook._save

    def save(self: CheckpointHook, ctx: nvtrain.TrainingContext) -> None:
        saved_at.append(ctx.stage.name)
        start = time.perf_counter_ns()
        real_save(self, ctx)
        took_ns.append(time.perf_counter_ns() - start)

    from nvtrain_checkpoint import storage

    real_write = storage.save_checkpoint

    def slow_write(*args: Any, **kwargs: Any) -> Any:  # the background write ends after the stage, always
        time.sleep(0.05)
        return real_write(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CheckpointHook, "_save", save)
        patch.setattr(storage, "save_checkpoint", slow_write)
        strategy.run([(torch.ones(3, 2), torch.zeros(3, 1))] * batches_per_epoch)
    due_saves = [stage for stage in saved_at if stage != "AFTER_TRAINING"]
    assert "AFTER_EPOCH" in due_saves
    # the run's first save apart (what a run sets up once), the later ones as its steady cost
    assert len(log.first_blocked_ns) == 1
    assert len(log.first_blocked_ns + log.blocked_ns) == len(due_saves) == 2 * batches_per_epoch // 2
    for elapsed, save_ns in zip(log.first_blocked_ns + log.blocked_ns, took_ns, strict=False):  # each timed stage
        assert elapsed >= save_ns  # held its save
    assert not stopwatch.pending


def test_cpu_smoke_run_reports_loop_and_checkpoint_cost_apart(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    process = run_script("--device", "cpu", "--model", "tiny", "--steps", "20", "--json-out", str(out))
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-4000:]
    assert "loop cost, no checkpoints" in process.stdout and "checkpoint cost" in process.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and list(report["models"]) == ["tiny"]
    model = report["models"]["tiny"]
    assert "sync_check" not in model  # CUDA only
    loop = model["loop"]
    assert set(loop["per_step"]) == {
        "bare loop",
        "nvtrain, no plugins",
        "hand-written stack",
        "nvtrain, standard stack",
    }
    assert loop["ratio_no_plugins"]["median"] > 0 and loop["ratio_standard_stack"]["median"] > 0
    calls = loop["python_calls_per_step"]
    assert set(calls) == set(loop["per_step"])
    # the count is exact: every loop makes calls, and a stack makes more than the same loop without it
    assert 0 < calls["bare loop"] < calls["hand-written stack"]
    assert 0 < calls["nvtrain, no plugins"] < calls["nvtrain, standard stack"]
    assert "host work (Python calls per step" in process.stdout
    checkpoint = model["checkpoint"]
    assert checkpoint["every"] == 10  # capped at half the steps, so a short run still saves
    for name, save in checkpoint["saves"].items():
        assert save["saves"] > 0, name
        assert save["bytes_per_save"] > 0 and save["writer_ms_per_save"] > 0 and save["write_mb_per_s"] > 0, name
        assert save["blocked_ms_per_save"] > 0, name
    assert checkpoint["saves"]["nvtrain, checkpoint (async)"]["end_of_run_ms"] is not None
    assert checkpoint["ratio_sync_vs_hand_written_durable"]["median"] > 0
    assert checkpoint["ratio_async_vs_hand_written_durable"]["median"] > 0
    assert "steps_during_writes" in checkpoint["async_steps_during_writes"]
    assert "steps_during_writes" in checkpoint["async_thread_steps_during_writes"]
    assert checkpoint["ratio_async_thread_vs_hand_written_durable"]["median"] > 0
    assert checkpoint["saves"]["nvtrain, checkpoint (async, thread)"]["saves"] > 0
    # gpu_suite.sh's summary reads this report: its line names every target figure
    summary = subprocess.run(
        [sys.executable, "-c", _suite_summary_code(), str(out)], capture_output=True, text=True, timeout=60, check=False
    )
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.startswith("gpu_check tiny: no plugins ") and "(writer thread " in summary.stdout
    assert "steps during a write" in summary.stdout and "target <= 1.05x" in summary.stdout


def _suite_summary_code() -> str:
    """The Python that gpu_suite.sh runs over gpu_check.json (its last embedded snippet)."""
    text = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    return text.rsplit("<<'PY' || true\n", 1)[1].split("\nPY\n", 1)[0]


# -- benchmarks/gpu_suite.sh ------------------------------------------------------------------------------

SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def test_gpu_suite_parses() -> None:
    process = subprocess.run(["bash", "-n", str(SUITE)], capture_output=True, text=True, timeout=60, check=False)
    assert process.returncode == 0, process.stderr


def test_gpu_suite_without_cuda_exits_0_and_writes_nothing(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NVTRAIN_")}
    env |= {"CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    process = subprocess.run(
        ["bash", str(SUITE), str(tmp_path / "yardsticks"), "report"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    assert process.stdout.startswith("gpu_suite: no CUDA device") and process.stdout.count("\n") == 1
    assert not (tmp_path / "report").exists()


# -- a report that survives a failing section or a time limit ------------------------------------------------


def _fake_sections(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, checkpoint: Any) -> None:
    """Sections that take no time: the loop's figures, and ``checkpoint`` as the checkpoint section."""
    monkeypatch.setattr(gpu_check, "loop_cost", lambda *args: {"measured": "loop"})
    monkeypatch.setattr(gpu_check, "checkpoint_cost", checkpoint)
    monkeypatch.setattr(gpu_check, "print_report", lambda report: None)


def test_a_failing_section_is_reported_and_the_next_ones_run(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []

    def broken(spec: Any, *args: Any) -> dict[str, Any]:
        calls.append(spec.label)
        raise RuntimeError("CUDA could not page-lock the staging block")

    _fake_sections(gpu_check, monkeypatch, broken)
    out = tmp_path / "gpu_check.json"
    status = gpu_check.main(["--device", "cpu", "--model", "tiny", "--model", "small", "--json-out", str(out)])
    assert status == 1  # a section failed
    report = json.loads(out.read_text())
    assert report["complete"] is True and len(calls) == 2  # the second model still ran after the first failed
    for model in report["models"].values():
        assert model["loop"] == {"measured": "loop"}
        assert model["checkpoint"]["error"] == "RuntimeError: CUDA could not page-lock the staging block"
        assert "Traceback" in model["checkpoint"]["traceback"]


def test_sigterm_keeps_the_sections_done_and_removes_the_scratch_folder(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The suite's time limit sends SIGTERM: what was measured so far is in the report, marked incomplete."""
    scratch: list[Path] = []

    def killed(spec: Any, device: Any, steps: int, rounds: int, every: int, directory: Path) -> dict[str, Any]:
        scratch.append(directory.parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        raise AssertionError("SIGTERM did not stop the section")

    _fake_sections(gpu_check, monkeypatch, killed)
    out = tmp_path / "gpu_check.json"
    previous = signal.getsignal(signal.SIGTERM)
    status = gpu_check.main(["--device", "cpu", "--model", "tiny", "--model", "small", "--json-out", str(out)])
    assert status == 1
    assert signal.getsignal(signal.SIGTERM) is previous  # the script's handler is gone again
    report = json.loads(out.read_text())
    assert report["complete"] is False and "SIGTERM" in report["stopped"]
    assert report["models"]["tiny"]["loop"] == {"measured": "loop"} and "small" not in report["models"]
    assert not scratch[0].exists()


def test_the_suites_summary_reads_a_partial_report(tmp_path: Path) -> None:
    """A section that failed, or a run a time limit stopped, still gives the summary line, saying so."""
    report = {
        "models": {"gpu": {"loop": {"ratio_no_plugins": {"median": 1.01}}, "checkpoint": {"error": "RuntimeError: x"}}},
        "complete": False,
        "stopped": "stopped by SIGTERM",
    }
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    summary = subprocess.run(
        [sys.executable, "-c", _suite_summary_code(), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert summary.returncode == 0, summary.stderr
    first, second = summary.stdout.splitlines()
    assert first.startswith("gpu_check gpu: no plugins 1.010x, standard stack nanx")
    assert first.endswith("FAILED checkpoint: RuntimeError: x")
    assert second.startswith("gpu_check: INCOMPLETE (stopped by SIGTERM)")
