"""Crash consistency: a saving process killed with SIGKILL at any point leaves a loadable checkpoint,
``latest`` names a complete one, and the next save clears what the dead process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from nvtrain_checkpoint import CheckpointHook, latest_checkpoint, list_checkpoints, read_checkpoint
from nvtrain_checkpoint.storage import LATEST_NAME, TMP_PREFIX

import nvtrain

pytestmark = pytest.mark.slow

#: fault point -> complete checkpoints the killed process leaves, and whether a temporary directory remains
EXPECTED = {
    "before_rename": ([2], True),  # step 4 fully written under .tmp-..., never renamed
    "during_write": ([2], True),  # async_save: the background thread stopped half-way through step 4's state.pt
    "before_latest": ([2, 4], False),  # step 4 published, but latest still names step 2
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, start_driver: Callable[..., subprocess.Popen[str]]) -> Path:
    """A saving process per fault point (forked from one driver), each SIGKILLed once it reaches its point."""
    base = tmp_path_factory.mktemp("faults")
    driver_process = start_driver("faults", str(base), *EXPECTED)
    deadline = time.monotonic() + 100
    try:
        for point in EXPECTED:
            marker = base / f"{point}.marker"
            while not marker.exists() or not marker.read_text():
                if driver_process.poll() is not None:
                    pytest.fail(f"{point}: the driver exited early:\n{driver_process.communicate()[0]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{point}: the saving process did not reach the fault point in time")
                time.sleep(0.02)
            os.kill(int(marker.read_text()), signal.SIGKILL)  # no handler, no flush, no cleanup
        output, _ = driver_process.communicate(timeout=60)
        assert driver_process.returncode == 0, output
    finally:
        if driver_process.poll() is None:
            driver_process.kill()
            driver_process.wait(timeout=30)
    return base


@pytest.mark.parametrize("point", sorted(EXPECTED))
def test_a_kill_leaves_the_last_complete_checkpoint_loadable(point: str, killed: Path) -> None:
    root = killed / point
    steps, leftover = EXPECTED[point]
    assert [info.step for info in list_checkpoints(root)] == steps
    assert (root / LATEST_NAME).read_text().strip() == "step_2"  # latest only ever names a complete checkpoint
    assert latest_checkpoint(root) == root / "step_2"
    assert any(entry.name.startswith(TMP_PREFIX) for entry in root.iterdir()) is leftover
    state = read_checkpoint(root)
    assert state["counters"]["step_count"] == 2
    for step in steps:
        assert read_checkpoint(root / f"step_{step}")["counters"]["step_count"] == step


@pytest.mark.parametrize("point", sorted(EXPECTED))
def test_auto_resume_after_a_kill_cleans_up_and_matches_a_straight_run(
    point: str, killed: Path, driver: ModuleType
) -> None:
    root = killed / point
    reference = driver.straight("plain")
    hook = CheckpointHook(root, step_interval=2, resume="auto")
    recorder = driver.LossRecorder()
    with nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, recorder])) as strategy:
        strategy.run(driver.make_loader("plain"))
    assert recorder.losses[0][0] == 3  # resumed after step 2 (micro-batch 3 is the first trained)
    driver.assert_same(reference["params"], driver.summary(strategy, recorder)["params"])
    assert not [entry.name for entry in root.iterdir() if entry.name.startswith((TMP_PREFIX, ".trash-"))]
    assert [info.step for info in list_checkpoints(root)] == [2, 4, 6, 8, 10, 12, 14, 16, 18]
    assert (root / LATEST_NAME).read_text().strip() == "step_18"
    assert hook.last_checkpoint_index == 18
