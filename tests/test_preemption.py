"""Preemption signals: caught only during a run, polled once per boundary, agreed across ranks."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import StepScheduler
from nvtrain.preemption import PreemptionWatcher, collective_device, resolve_signals
from nvtrain.testing import free_port

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def send(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)


# -- naming signals ---------------------------------------------------------------------------------


def test_resolve_signals_accepts_names_numbers_and_lists() -> None:
    assert resolve_signals("SIGTERM") == (signal.SIGTERM,)
    assert resolve_signals("usr1") == (signal.SIGUSR1,)
    assert resolve_signals(int(signal.SIGUSR1)) == (signal.SIGUSR1,)
    assert resolve_signals(["SIGTERM", signal.SIGUSR1, 15]) == (signal.SIGTERM, signal.SIGUSR1)
    assert resolve_signals(None) == () and resolve_signals([]) == ()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("SIGBOGUS", r"cfg: 'SIGBOGUS' is not a signal name"),
        (10_000, r"cfg: 10000 is not a signal number"),
        (signal.SIGKILL, r"cfg: SIGKILL cannot be caught"),
        ("SIGCHLD", r"cfg: SIGCHLD means a child process ended \(every DataLoader worker sends it\), not a request"),
        (["SIGTERM", "WINCH"], r"cfg: SIGWINCH means the terminal was resized, not a request to stop"),
        (signal.SIGSEGV, r"cfg: SIGSEGV means a memory fault in this process"),
        (True, r"cfg must be a signal name, number or a list of them \(got bool True\)"),
    ],
)
def test_resolve_signals_refuses_bad_specs(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_signals(spec, "cfg")


# -- the handler's lifetime ------------------------------------------------------------------------


def test_handlers_are_installed_only_inside_the_scope_and_restored(fallback_handlers: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    watcher = PreemptionWatcher(resolve_signals(["SIGTERM", "SIGUSR1"]))
    with watcher:
        assert signal.getsignal(signal.SIGTERM) is not previous
        send(signal.SIGUSR1)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert watcher.received_signal == signal.SIGUSR1 and fallback_handlers == []
    send(signal.SIGTERM)  # after the scope: the previous handler sees it, the watcher does not
    assert fallback_handlers == [signal.SIGTERM] and watcher.received_signal == signal.SIGUSR1


def test_handlers_are_restored_after_an_error(fallback_handlers: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    scheduler = StepScheduler(1, 1, 1, [1, 2, 3])
    with pytest.raises(ZeroDivisionError), scheduler:
        for _ in scheduler.epochs:
            for _window in scheduler:
                1 / 0  # noqa: B018
    assert signal.getsignal(signal.SIGTERM) is previous


def test_epochs_without_a_with_block_scope_the_handler_to_the_loop(fallback_handlers: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    scheduler = StepScheduler(1, 1, 1, [1, 2])
    during = []
    for _ in scheduler.epochs:
        for _window in scheduler:
            during.append(signal.getsignal(signal.SIGTERM) is previous)
            scheduler.finish_step()
    assert during == [False, False]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_run_off_the_main_thread_warns_and_installs_nothing(fallback_handlers: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    outcome: dict[str, Any] = {}

    def train() -> None:
        scheduler = StepScheduler(1, 1, 1, [1, 2])
        with warnings.catch_warnings(record=True) as caught, scheduler:
            warnings.simplefilter("always")
            outcome["handler_kept"] = signal.getsignal(signal.SIGTERM) is previous
            outcome["steps"] = [scheduler.finish_step() or scheduler.step for _ in scheduler.epochs for _w in scheduler]
        outcome["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]

    thread = threading.Thread(target=train)
    thread.start()
    thread.join(timeout=30)
    assert outcome["handler_kept"] is True and outcome["steps"] == [1, 2]
    assert len(outcome["warnings"]) == 1
    assert outcome["warnings"][0].startswith(
        "RuntimeWarning: PreemptionWatcher: not catching SIGTERM because the run is not on the main thread"
    )


def test_disabled_preemption_installs_nothing_and_never_polls(fallback_handlers: list[int]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    scheduler = StepScheduler(1, 1, 1, [1, 2, 3], preemption_signal=None)
    with scheduler:
        for _ in scheduler.epochs:
            for _window in scheduler:
                assert signal.getsignal(signal.SIGTERM) is previous
                send(signal.SIGTERM)
                scheduler.finish_step()
    assert scheduler.step == 3 and not scheduler.sigterm_received
    assert fallback_handlers == [signal.SIGTERM] * 3


# -- real signals against the scheduler ------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_during_a_step_ends_the_run_with_a_checkpoint_step(
    sig: signal.Signals, fallback_handlers: list[int]
) -> None:
    scheduler = StepScheduler(2, 1, 1, list(range(20)), preemption_signal=["SIGTERM", "SIGUSR1"], ckpt_every_steps=100)
    boundaries = []
    with scheduler:
        for _ in scheduler.epochs:
            for _window in scheduler:
                if scheduler.step == 2:  # the third step is in progress
                    send(sig)
                    assert not scheduler.sigterm_received  # nothing is acted on before the poll
                scheduler.finish_step()
                boundaries.append((scheduler.step, scheduler.sigterm_received, scheduler.is_ckpt_step))
    assert boundaries == [(1, False, False), (2, False, False), (3, True, True)]
    assert not scheduler.is_last_step and not scheduler.is_val_step  # preemption is neither the end nor a validation
    assert fallback_handlers == []


def test_a_signal_at_an_epoch_boundary_is_not_lost(fallback_handlers: list[int]) -> None:
    scheduler = StepScheduler(
        1, 1, 1, list(range(3)), num_epochs=4, ckpt_every_steps=100, save_checkpoint_every_epoch=False
    )
    epochs = []
    with scheduler:
        for epoch in scheduler.epochs:
            epochs.append(epoch)
            for _window in scheduler:
                scheduler.finish_step()
                if scheduler.is_last_batch:
                    assert not scheduler.is_ckpt_step
                    send(signal.SIGTERM)  # after the epoch's last poll, before the next epoch
    assert epochs == [0]
    assert scheduler.step == 3 and scheduler.sigterm_received and scheduler.is_ckpt_step
    assert scheduler.state_dict()["epoch"] == 1 and scheduler.state_dict()["position"] == 0


def test_a_signal_during_validation_is_polled_before_the_next_step(fallback_handlers: list[int]) -> None:
    scheduler = StepScheduler(
        1, 1, 1, list(range(6)), val_every_steps=2, ckpt_every_steps=100, preemption_signal="SIGUSR1"
    )
    with scheduler:
        for _ in scheduler.epochs:
            for _window in scheduler:
                scheduler.finish_step()
                if scheduler.is_val_step:
                    send(signal.SIGUSR1)  # "validation" runs here
                    if scheduler.poll_preemption():
                        break
    assert scheduler.step == 2 and scheduler.sigterm_received and scheduler.is_ckpt_step


def test_a_signal_after_the_last_poll_is_reported_not_acted_on(
    fallback_handlers: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = StepScheduler(1, 1, 1, [1, 2])
    with caplog.at_level(logging.WARNING, logger="nvtrain.step_scheduler"), scheduler:
        for _ in scheduler.epochs:
            for _window in scheduler:
                scheduler.finish_step()
        send(signal.SIGTERM)
    assert not scheduler.sigterm_received
    assert "SIGTERM arrived after the last preemption poll" in caplog.text


# -- two ranks, one signal ------------------------------------------------------------------------


class _KillRankZero:
    """Sends SIGUSR1 to rank 0 itself while step ``at_step + 1`` is being computed."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    @nvtrain.hookimpl
    def after_backward(self, ctx: Any) -> None:
        if ctx.rank == 0 and ctx.step_count == self.at_step and ctx.sync_gradients:
            os.kill(os.getpid(), signal.SIGUSR1)


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import functools

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        killer = _KillRankZero(at_step=3)
        stops: list[tuple[int, bool, bool]] = []

        class Stops:
            @nvtrain.hookimpl
            def after_batch(self, ctx: Any) -> None:
                if ctx.sync_gradients and ctx.scheduler.is_ckpt_step:
                    stops.append((ctx.step_count, ctx.preempted, ctx.scheduler.sigterm_received))

        torch.manual_seed(0)
        data = [(torch.randn(2, 3), torch.randn(2, 2)) for _ in range(6)]
        strategy = nvtrain.TrainingStrategy(
            models=torch.nn.Linear(3, 2),
            optimizers=functools.partial(torch.optim.SGD, lr=0.1),
            loss_fn=torch.nn.functional.mse_loss,
            device="cpu",
            hooks=[killer, Stops()],
            num_epochs=5,
            step_scheduler=nvtrain.StepSchedulerConfig(preemption_signal="SIGUSR1", ckpt_every_steps=None),
        )
        result = strategy.run(data)

        class Stream:  # rank 0 holds 5 micro-batches, rank 1 holds 8
            def __iter__(self) -> Iterator[int]:
                return iter(range(5 if rank == 0 else 8))

        scheduler = nvtrain.StepScheduler(
            4, 1, world_size, Stream(), num_epochs=3, synchronized_stream=True, preemption_signal=None
        )
        windows = []
        for _ in scheduler.epochs:
            for window in scheduler:
                scheduler.finish_step()
                windows.append((window, scheduler.is_last_step))
        report = {
            "step_count": result.step_count,
            "preempted": result.preempted,
            "stops": stops,
            "windows": windows,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # no rank tears gloo down while the other still uses it (SIGABRT in gloo)
    finally:
        dist.destroy_process_group()


def _spawn_bounded(out_dir: str, timeout_s: float) -> None:
    context = torch.multiprocessing.spawn(_worker, args=(2, free_port(), out_dir), nprocs=2, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish within {timeout_s} s")


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step_when_only_rank_zero_is_signalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the spawned ranks import this module by name: make the repository root importable for them
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    for attempt in range(2):
        try:
            _spawn_bounded(str(tmp_path), timeout_s=120)
            break
        except torch.multiprocessing.ProcessRaisedException as err:
            transient = ("address already in use", "connection refused", "connection reset", "timed out")
            if attempt or not any(word in str(err).lower() for word in transient):
                raise  # only a rendezvous that lost a race for its port or socket is worth a second try
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        # rank 0 was signalled while computing step 4; both ranks agreed at that boundary and checkpointed
        assert report["step_count"] == 4 and report["preempted"] is True
        assert report["stops"] == [[4, True, True]]
    # synchronized stream: rank 0 runs out first; both take the same windows and stop together
    assert [[len(w), last] for w, last in reports[0]["windows"]] == [[2, False], [2, False], [1, True]]
    assert [[len(w), last] for w, last in reports[1]["windows"]] == [[2, False], [2, False], [1, True]]


@pytest.mark.parametrize(
    ("backend", "device"),
    [("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cpu"), ("cuda:nccl,cpu:gloo", "cpu"), ("gloo", "cpu")],
)
def test_the_step_poll_runs_on_the_cpu_whenever_the_group_can(
    backend: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group with a CPU backend polls with a CPU tensor: no device sync per step (docs/distributed.md, "The
    per-step stop agreement"); only a NCCL-only group needs the flag on the GPU."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(None) == torch.device(device)


def test_under_nccl_alone_a_given_cuda_device_is_used_not_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose script never called set_device: its own device, not cuda:0 on every rank."""
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collective_device(None, torch.device("cuda", 2)) == torch.device("cuda", 2)
    assert collective_device(None, torch.device("cpu")) == torch.device("cuda", 0)  # NCCL takes CUDA tensors only
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert collective_device(None, torch.device("cuda", 2)) == torch.device("cpu")
