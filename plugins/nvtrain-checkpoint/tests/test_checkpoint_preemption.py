"""SIGTERM mid-run, then the same command again: the run resumes and ends where an uninterrupted one does."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import list_checkpoints

pytestmark = pytest.mark.slow


def test_sigterm_then_the_same_command_again_is_lossless(
    tmp_path: Path,
    driver: ModuleType,
    start_driver: Callable[..., subprocess.Popen[str]],
    run_driver: Callable[..., str],
) -> None:
    command = ("preempt", str(tmp_path / "ckpt"), str(tmp_path / "marker"), str(tmp_path / "out.pt"))
    process = start_driver(*command)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "marker").exists():
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the run never reached step 5"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGTERM)
        (tmp_path / "marker.sent").touch()
        output, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    first: dict[str, Any] = torch.load(tmp_path / "out.pt", weights_only=True)
    assert first["preempted"] is True
    assert first["counters"]["step_count"] == 6  # the signal is acted on at the next step boundary
    assert [info.step for info in list_checkpoints(tmp_path / "ckpt")] == [6]  # before any epoch end

    run_driver(*command)  # the same command again
    second: dict[str, Any] = torch.load(tmp_path / "out.pt", weights_only=True)
    assert second["preempted"] is False

    reference = driver.straight("plain")
    driver.assert_same(reference["losses"], first["losses"] + second["losses"], "loss sequence")
    for key in ("params", "optimizer", "lr_scheduler", "counters"):
        driver.assert_same(reference[key], second[key], key)
    assert [info.step for info in list_checkpoints(tmp_path / "ckpt")] == [6, 9, 18]  # epoch end, last step
