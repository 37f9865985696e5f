"""async_writer="process": staging in shared memory, and the writer process's life, errors and signals."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import nvtrain_checkpoint.hook as hook_module
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nvtrain_checkpoint import CheckpointHook, WriterProcessError, list_checkpoints, storage, writer_process
from nvtrain_checkpoint.snapshot import snapshot
from nvtrain_checkpoint.staging import GRANULE, Stager, rebuild, shared_memory_supported
from nvtrain_checkpoint.writer_process import WriterProcess

import nvtrain

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="the writer process needs memfd (Linux)")

# -- staging ------------------------------------------------------------------------------------------

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor in one of the layouts state dicts hold: contiguous, transposed, expanded, strided, empty."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = (
        (torch.randn(*shape, 2, generator=generator) * 50).to(dtype)
        if dtype != torch.bool
        else (torch.rand(*shape, 2, generator=generator) > 0.5)
    )
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "expanded"]))
    tensor = base[..., 0]
    if layout == "contiguous":
        return tensor.contiguous()
    if layout == "transposed" and tensor.dim() >= 2:
        return tensor.transpose(0, -1)
    if layout == "expanded" and tensor.dim() >= 1 and tensor.shape[-1] >= 1:
        return tensor[..., :1].expand(*tensor.shape[:-1], 3)
    return tensor  # every other element of base: strided, not dense


@st.composite
def _states(draw: st.DrawFn) -> dict[str, Any]:
    tensors = draw(st.lists(_tensors(), min_size=1, max_size=6))
    tied = draw(st.integers(0, len(tensors) - 1))
    return {
        "model": {f"w{index}": tensor for index, tensor in enumerate(tensors)},
        "tied": tensors[tied],
        "nested": [(tensors[-1], 3, "x"), {"lr": 0.5, "steps": [1, 2]}],
    }


def _saved_bytes(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@settings(max_examples=60, deadline=None)
@given(_states())
def test_a_staged_state_rebuilds_to_the_bytes_an_in_process_snapshot_saves(state: dict[str, Any]) -> None:
    stager = Stager()
    try:
        staged = stager.stage(state)
        assert staged.arena.fd >= 0 and staged.arena.capacity >= GRANULE
        rebuilt = rebuild(staged.skeleton, staged.specs, staged.arena.buffer)
        for key, tensor in state["model"].items():
            assert rebuilt["model"][key].dtype == tensor.dtype and torch.equal(rebuilt["model"][key], tensor)
        assert rebuilt["tied"] is rebuilt["model"][next(k for k, v in state["model"].items() if v is state["tied"])]
        assert rebuilt["nested"][1] == {"lr": 0.5, "steps": [1, 2]} and type(rebuilt["nested"][0]) is tuple
        assert _saved_bytes(rebuilt) == _saved_bytes(snapshot(state))  # the same file as a thread writes
    finally:
        stager.release()


def test_the_arena_is_reused_while_the_state_fits_and_copies_are_taken_at_staging() -> None:
    live = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    stager = Stager()
    try:
        first = stager.stage(live)
        live["w"].add_(1)  # training goes on after the save point
        rebuilt = rebuild(first.skeleton, first.specs, first.arena.buffer)
        assert torch.equal(rebuilt["w"], torch.zeros(1000))
        second = stager.stage(live)
        assert second.arena is first.arena and torch.equal(
            rebuild(second.skeleton, second.specs, second.arena.buffer)["w"], live["w"]
        )
        grown = stager.stage({**live, "big": torch.ones(GRANULE)})  # 4 * GRANULE bytes: a bigger arena
        assert grown.arena is not first.arena and grown.arena.capacity >= 4 * GRANULE and first.arena.fd == -1
    finally:
        stager.release()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_into_a_page_locked_arena() -> None:
    live = {"w": torch.randn(256, 256, device="cuda"), "t": torch.randn(64, 32, device="cuda").t()}
    stager = Stager()
    try:
        staged = stager.stage(live)
        assert staged.arena.pinned
        expected = {key: tensor.cpu() for key, tensor in live.items()}
        live["w"].add_(1)
        rebuilt = rebuild(staged.skeleton, staged.specs, staged.arena.buffer)
        for key in expected:
            assert rebuilt[key].device.type == "cpu" and torch.equal(rebuilt[key], expected[key])
    finally:
        stager.release()


# -- the writer process in a run ------------------------------------------------------------------------


class _At:
    """Runs ``action(ctx)`` after the optimizer step that reaches ``step``."""

    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            self.action(ctx)


def _gone(pid: int, timeout: float) -> bool:
    """Has process ``pid`` exited (or become a zombie nobody reaped) within ``timeout`` seconds?"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in status:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_runs_save_through_a_writer_process_that_the_next_run_reuses(driver: ModuleType, tmp_path: Path) -> None:
    writer_process.close_idle()
    pids: list[int | None] = []

    def hook_in(root: Path) -> tuple[CheckpointHook, _At]:
        hook = CheckpointHook(root, step_interval=4, async_save=True, keep_last_n=2)
        return hook, _At(5, lambda ctx: pids.append(hook._process.pid if hook._process else None))

    reference = driver.straight("plain")
    first = driver.straight("plain", [*hook_in(tmp_path / "first")])
    driver.assert_same(reference["params"], first["params"])  # saving changed nothing in the run
    hook, spy = hook_in(tmp_path / "second")
    second = driver.straight("plain", [hook, spy])
    assert pids[0] is not None and pids[0] != os.getpid() and pids == [pids[0]] * 2  # one writer, kept
    assert hook._process is None and writer_process._idle and writer_process._idle[0].pid == pids[0]
    for root, run in ((tmp_path / "first", first), (tmp_path / "second", second)):
        assert [info.step for info in list_checkpoints(root)] == [16, 18]
        driver.assert_same(run["params"], storage.read_checkpoint(root)["models"]["main"])
    writer_process.close_idle()
    assert _gone(pids[0], 30) and not writer_process._idle


@pytest.mark.slow
def test_a_writer_that_dies_is_reported_and_nothing_half_written_is_published(
    driver: ModuleType, tmp_path: Path
) -> None:
    hook = CheckpointHook(tmp_path, step_interval=2, async_save=True)

    def kill_the_writer(ctx: nvtrain.TrainingContext) -> None:
        hook.flush()  # step_2 is on disk
        pid = hook._process.pid if hook._process else None
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid, 30)

    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, _At(3, kill_the_writer)]))
    with (
        pytest.raises(
            WriterProcessError,
            match=r"writer process \(pid \d+\) ended \(killed by SIGKILL\) before "
            r"finishing step_4",
        ) as info,
        strategy,
    ):
        strategy.run(driver.make_loader("plain"))
    assert any("while writing step_4 in the background" in note for note in info.value.__notes__)
    assert [info.step for info in list_checkpoints(tmp_path)] == [2]
    assert storage.latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_2"]
    assert all(writer.running for writer in writer_process._idle)  # the dead one was not kept


@pytest.mark.slow
def test_an_error_in_the_writer_reaches_the_training_thread_with_its_traceback(
    driver: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    hook = CheckpointHook(root, step_interval=2, async_save=True)
    in_the_way = _At(1, lambda ctx: root.write_text("a file where the checkpoints go"))  # only the write sees it
    strategy = nvtrain.TrainingStrategy(**driver.strategy_kwargs("plain", [hook, in_the_way]))
    with pytest.raises(FileExistsError, match="checkpoints") as info, strategy:
        strategy.run(driver.make_loader("plain"))
    notes = "\n".join(info.value.__notes__)
    assert "raised in the checkpoint writer process (pid" in notes and "save_checkpoint" in notes
    assert "while writing step_2 in the background" in notes


@pytest.mark.slow
def test_writers_ignore_interrupts_and_end_when_the_training_process_dies(tmp_path: Path) -> None:
    """Ctrl-C and a preemption SIGTERM are the training process's to handle; writers left alone, held or
    idle, exit when it does (here: SIGKILL, so no exit handler runs)."""
    script = textwrap.dedent(
        """
        import os, signal, sys, time, torch
        from pathlib import Path
        from nvtrain_checkpoint import writer_process
        from nvtrain_checkpoint.staging import Stager

        root, stager = Path(sys.argv[1]), Stager()
        held = writer_process.acquire()
        held.save(stager.stage({"w": torch.ones(3)}), root, 1, {}, None)
        os.kill(held.pid, signal.SIGINT)
        os.kill(held.pid, signal.SIGTERM)
        time.sleep(0.2)
        held.save(stager.stage({"w": torch.full((3,), 2.0)}), root, 2, {}, None)
        writer_process.release(held)
        assert writer_process.acquire() is held  # an idle writer is handed out again
        idle = writer_process.WriterProcess()
        idle.wait_until_ready()
        writer_process.release(idle)
        print(held.pid, idle.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit handler
        """
    )
    process = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert process.returncode == -signal.SIGKILL, process.stderr
    for pid in process.stdout.split():
        assert _gone(int(pid), 30), "a writer outlived the training process"
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 2]
    assert torch.equal(storage.load_state_file(tmp_path / "step_2" / storage.STATE_NAME)["w"], torch.full((3,), 2.0))


def test_without_shared_memory_background_saves_fall_back_to_a_thread(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hook_module, "shared_memory_supported", lambda: False)
    hook_module._warn_no_process_writer.cache_clear()
    hook = CheckpointHook(tmp_path, step_interval=6, async_save=True)
    with pytest.warns(UserWarning, match=r"async_writer='process' needs memfd shared memory"):
        driver.straight("plain", [hook])
    assert hook._process is None and [info.step for info in list_checkpoints(tmp_path)] == [6, 12, 18]


def test_a_writer_process_that_was_never_started_closes_quietly() -> None:
    writer = WriterProcess()
    writer.close()
    assert writer.pid is None and not writer.running
    writer_process.release(writer)  # not running: not kept
    assert writer not in writer_process._idle


def test_a_writer_that_cannot_start_says_so_and_how_to_do_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_process, "_ENTRY", "import sys; sys.exit(3)")  # e.g. its imports fail
    writer, stager = WriterProcess(), Stager()
    try:
        with pytest.raises(
            WriterProcessError,
            match=r"writer process \(pid \d+\) ended \(exit status 3\) while starting, before step_1 could be "
            r"handed to it .*async_writer='thread'",
        ):
            writer.save(stager.stage({"w": torch.ones(2)}), tmp_path, 1, {}, None)
        assert not writer.running and list(tmp_path.iterdir()) == []
    finally:
        writer.close()
        stager.release()


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_saves_through_the_writer_process_from_a_page_locked_arena(
    driver: ModuleType, tmp_path: Path
) -> None:
    hook = CheckpointHook(tmp_path, step_interval=3, async_save=True)
    pinned: list[bool] = []

    def look(ctx: nvtrain.TrainingContext) -> None:
        assert hook._stager.arena is not None
        pinned.append(hook._stager.arena.pinned)

    kwargs = driver.strategy_kwargs("plain", [hook, _At(4, look)])
    kwargs["device"] = "cuda"
    with nvtrain.TrainingStrategy(**kwargs) as strategy:
        strategy.run(driver.make_loader("plain"))
        final = {key: value.detach().cpu() for key, value in strategy.ctx.models["main"].state_dict().items()}
    assert pinned == [True] and hook._stager.arena is None  # released when the strategy closed
    saved = storage.read_checkpoint(tmp_path)
    assert saved["counters"]["step_count"] == 18
    driver.assert_same(final, saved["models"]["main"])


def test_a_module_in_the_working_directory_does_not_shadow_the_writers_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training script started elsewhere, run from a folder holding a json.py and an enum.py: the writer
    process imports the standard library's, as the training process does (they were first on its path)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in ("json", "enum"):
        (cwd / f"{name}.py").write_text(f"raise ImportError('the working directory {name}.py was imported')\n")
    monkeypatch.chdir(cwd)
    writer, stager = WriterProcess(), Stager()
    try:
        writer.save(stager.stage({"w": torch.ones(2)}), tmp_path / "checkpoints", 1, {}, None)
    finally:
        writer.close()
    assert [info.step for info in list_checkpoints(tmp_path / "checkpoints")] == [1]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_an_arena_never_released_gives_its_memory_back_when_collected() -> None:
    """A hook never closed (a strategy used without ``with``) must not keep a state-sized block to process exit:
    the arena's file descriptor alone would keep the memory allocated."""
    import gc

    from nvtrain_checkpoint.staging import SharedArena

    arena = SharedArena(GRANULE)
    fd = arena.fd
    assert _is_open(fd)
    del arena
    gc.collect()
    assert not _is_open(fd)


def test_a_released_arena_is_closed_once() -> None:
    import gc

    from nvtrain_checkpoint.staging import SharedArena

    arena = SharedArena(GRANULE)
    fd = arena.fd
    arena.release()
    assert not _is_open(fd) and arena.fd == -1
    reused = os.open(os.devnull, os.O_RDONLY)  # may take the same number: a second close would close it
    try:
        arena.release()
        del arena
        gc.collect()
        assert _is_open(reused)
    finally:
        os.close(reused)
