"""DistributedManager: the torchrun environment, single process defaults, a real 2-process
gloo job, the strategy's use of it, and unwrap_model."""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import nvtrain
from nvtrain.distributed import DistributedManager, TorchrunEnv, default_backend, unwrap_model
from nvtrain.testing import free_port

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    DistributedManager.cleanup()
    yield
    DistributedManager.cleanup()


def _expected_default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# -- the environment ----------------------------------------------------------------------------


def test_torchrun_environment_is_parsed() -> None:
    env = TorchrunEnv.from_environ(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500",
        }
    )
    assert env == TorchrunEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="node0", master_port=29500
    )


def test_no_environment_is_a_world_of_one() -> None:
    assert TorchrunEnv.from_environ({}) == TorchrunEnv()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "x"}, "RANK must be an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=2 must be smaller"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR and MASTER_PORT are not set"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "port"}, "MASTER_PORT must be"),
    ],
)
def test_bad_environment_names_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchrunEnv.from_environ(environ)


def test_bad_environment_fails_initialize(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match="LOCAL_RANK must be >= 0"):
        DistributedManager.initialize()
    assert not DistributedManager.is_initialized()


def test_default_backend_follows_the_device() -> None:
    assert default_backend(torch.device("cpu")) == "gloo"
    expected = "nccl" if dist.is_nccl_available() else "gloo"
    assert default_backend(torch.device("cuda", 0)) == expected


# -- one process --------------------------------------------------------------------------------------


def test_single_process_needs_no_environment() -> None:
    manager = DistributedManager.initialize()
    assert DistributedManager.is_initialized()
    assert (manager.rank, manager.local_rank, manager.world_size, manager.local_world_size) == (0, 0, 1, 1)
    assert manager.device == _expected_default_device()
    assert manager.backend is None and manager.process_group is None
    assert not manager.is_distributed and not dist.is_initialized()
    manager.barrier()  # a no-op
    DistributedManager.cleanup()
    assert not DistributedManager.is_initialized()


def test_instances_share_one_state() -> None:
    before = DistributedManager()
    assert before.rank == 0 and before.world_size == 1 and before.device == _expected_default_device()
    assert not DistributedManager.is_initialized()
    DistributedManager.initialize(find_unused_parameters=True)
    assert before.find_unused_parameters is True and before.broadcast_buffers is False
    DistributedManager().broadcast_buffers = True
    assert before.broadcast_buffers is True
    assert DistributedManager.initialize().find_unused_parameters is True  # a second initialize() keeps the state


def test_a_second_initialize_asking_for_other_settings_warns() -> None:
    import warnings

    first = DistributedManager.initialize(device="cpu", find_unused_parameters=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asking for what the manager has, or for nothing, is quiet
        assert DistributedManager.initialize().device == first.device
        DistributedManager.initialize(device="cpu", find_unused_parameters=True, broadcast_buffers=False)
    with pytest.warns(UserWarning, match=r"already initialised") as caught:
        again = DistributedManager.initialize(device="meta", backend="gloo", find_unused_parameters=False)
    message = str(caught[0].message)
    assert "device='meta' is ignored (the manager trains on 'cpu')" in message
    assert "backend='gloo' is ignored (the manager's is None)" in message
    assert "find_unused_parameters=False is ignored" in message and "cleanup()" in message
    assert again.device == torch.device("cpu") and again.find_unused_parameters is True


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="find_unused_parameters must be a bool"):
        DistributedManager.initialize(find_unused_parameters=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be a non-empty str"):
        DistributedManager.initialize(backend="")
    with pytest.raises(TypeError, match=r"DistributedManager\.broadcast_buffers must be a bool"):
        DistributedManager().broadcast_buffers = "yes"  # type: ignore[assignment]


@pytest.mark.usefixtures("world_of_one")
def test_an_existing_process_group_is_adopted_and_left_alone() -> None:
    manager = DistributedManager.initialize()
    assert manager.is_distributed and manager.backend == "gloo"
    assert manager.process_group is dist.group.WORLD
    manager.barrier()
    DistributedManager.cleanup()
    assert dist.is_initialized(), "cleanup() destroyed a process group it did not create"


def test_the_manager_does_not_keep_a_group_that_the_caller_destroys() -> None:
    # The manager's state is class-level and outlives the run: holding the group object there would keep it
    # past destroy_process_group() to interpreter exit, where tearing gloo down aborts a finished rank.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    manager = DistributedManager.initialize()
    assert manager.process_group is group
    dist.destroy_process_group()  # by the caller, without DistributedManager.cleanup()
    assert manager.process_group is None and not manager.is_distributed
    manager.barrier()  # nothing left to wait for
    # CPython counts getrefcount's own argument: 2 means only this test's variable still holds the group
    assert sys.getrefcount(group) == 2


def test_a_strategy_kept_after_its_run_does_not_hold_the_destroyed_group() -> None:
    # A script that keeps its strategy in a global until exit: the documented pattern (``with strategy:``,
    # then destroy the group) must leave nothing in it that holds the group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    strategy = nvtrain.TrainingStrategy(
        torch.nn.Linear(3, 2),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        device="cpu",
        distributed_manager=DistributedManager.initialize(),
        num_epochs=1,
    )
    with strategy:
        strategy.run([(torch.randn(2, 3), torch.randn(2, 2)) for _ in range(3)])
    dist.destroy_process_group()
    gc.collect()
    # CPython counts getrefcount's own argument: 2 means only this test's variable still holds the group
    assert sys.getrefcount(group) == 2
    assert strategy.ctx.step_count == 3


@pytest.mark.usefixtures("world_of_one")
def test_the_scheduler_agrees_over_the_managers_group() -> None:
    class Manager:  # a duck-typed manager training over a subgroup
        rank, world_size, process_group = 0, 1, dist.new_group([0])

    strategy = nvtrain.TrainingStrategy(
        torch.nn.Linear(3, 2),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        device="cpu",
        distributed_manager=Manager(),
        num_epochs=1,
    )
    strategy.run([(torch.randn(2, 3), torch.randn(2, 2))])
    assert strategy.ctx.scheduler.process_group is Manager.process_group
    strategy.distributed_manager = DistributedManager.initialize()  # the default group: None, torch's name for it
    strategy.run([(torch.randn(2, 3), torch.randn(2, 2))])
    assert strategy.ctx.scheduler.process_group is None


class _Cycle:
    """Garbage in a reference cycle that holds the default group, as a finished run leaves it."""

    def __init__(self, seen: list[bool]) -> None:
        self.group = dist.group.WORLD
        self.itself = self
        weakref.finalize(self, lambda: seen.append(dist.is_initialized()))


def test_cleanup_collects_what_holds_its_group_before_destroying_it(init_calls: list[dict[str, Any]]) -> None:
    # Collected only later (at interpreter exit at worst), such a cycle would destroy gloo's group
    # there, which aborts the process now and then
    DistributedManager.initialize(device="cpu")
    assert init_calls, "initialize() did not create the group this test needs it to own"
    gc.disable()  # no collection but the one under test
    try:
        collected_while_alive: list[bool] = []
        _Cycle(collected_while_alive)
        DistributedManager.cleanup()
    finally:
        gc.enable()
    assert collected_while_alive == [True]
    assert not dist.is_initialized()


# -- the strategy ---------------------------------------------------------------------------------------


class _Manager:
    """A duck-typed manager (any object with rank, world_size and optionally device)."""

    def __init__(self, rank: int, world_size: int, device: str | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        if device is not None:
            self.device = torch.device(device)


def _strategy(**kwargs: object) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        torch.nn.Linear(3, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        **kwargs,  # type: ignore[arg-type]
    )


def test_strategy_takes_device_rank_and_world_size_from_the_manager() -> None:
    strategy = _strategy(distributed_manager=_Manager(rank=2, world_size=4, device="meta"))
    assert strategy.device == torch.device("meta") and strategy.ctx.device == torch.device("meta")
    assert (strategy.ctx.rank, strategy.ctx.world_size) == (2, 4)
    assert _strategy(distributed_manager=_Manager(0, 1, "meta"), device="cpu").device == torch.device("cpu")
    assert _strategy(distributed_manager=_Manager(0, 1)).device == torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    assert _strategy(distributed_manager=DistributedManager.initialize()).device == _expected_default_device()


def test_global_step_count_advances_by_the_world_size() -> None:
    with _strategy(distributed_manager=_Manager(rank=1, world_size=3), device="cpu") as strategy:
        strategy.train_batch((torch.ones(2, 3), torch.zeros(2, 1)))
        strategy.train_batch((torch.ones(2, 3), torch.zeros(2, 1)))
    assert strategy.ctx.step_count == 2 and strategy.ctx.global_step_count == 6


# -- a real 2-process job ---------------------------------------------------------------------------------

_JOB = textwrap.dedent(
    """
    import functools, json, sys
    import torch, torch.distributed as dist
    import nvtrain

    manager = nvtrain.DistributedManager.initialize()
    total = torch.tensor([float(manager.rank + 1)])
    dist.all_reduce(total, group=manager.process_group)
    manager.barrier()
    strategy = nvtrain.TrainingStrategy(
        torch.nn.Linear(3, 1), functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss,
        distributed_manager=manager,
    )
    with strategy:
        strategy.train_batch((torch.ones(2, 3), torch.zeros(2, 1)))
    result = {
        "rank": manager.rank, "local_rank": manager.local_rank, "world_size": manager.world_size,
        "is_distributed": manager.is_distributed, "backend": manager.backend, "device": str(manager.device),
        "all_reduce": total.item(), "ctx_rank": strategy.ctx.rank, "ctx_world_size": strategy.ctx.world_size,
        "global_step_count": strategy.ctx.global_step_count, "strategy_device": str(strategy.device),
    }
    nvtrain.DistributedManager.cleanup()
    result["group_after_cleanup"] = dist.is_initialized()
    with open(sys.argv[1], "w") as handle:
        json.dump(result, handle)
    """
)


@pytest.mark.slow
def test_two_processes_initialise_gloo_from_the_torchrun_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env |= {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _JOB, str(tmp_path / f"rank{rank}.json")],
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "rank": rank,
            "local_rank": rank,
            "world_size": 2,
            "is_distributed": True,
            "backend": "gloo",
            "device": "cpu",
            "all_reduce": 3.0,
            "ctx_rank": rank,
            "ctx_world_size": 2,
            "global_step_count": 2,
            "strategy_device": "cpu",
            "group_after_cleanup": False,
        }


# -- unwrap_model ------------------------------------------------------------------------------------------


def test_unwrap_model_returns_plain_modules_unchanged() -> None:
    model = torch.nn.Linear(2, 2)
    assert unwrap_model(model) is model


def test_unwrap_model_removes_data_parallel_wrappers() -> None:
    model = torch.nn.Linear(2, 2)
    assert unwrap_model(torch.nn.DataParallel(model)) is model


@pytest.mark.usefixtures("world_of_one")
def test_unwrap_model_removes_distributed_data_parallel() -> None:
    model = torch.nn.Linear(2, 2)
    wrapped = DistributedDataParallel(model)
    assert unwrap_model(wrapped) is model
    assert list(unwrap_model(wrapped).state_dict()) == ["weight", "bias"]


# -- the group is released when it is destroyed --------------------------------------------------

_RELEASE_JOB = textwrap.dedent(
    """
    import datetime, gc, json, os, sys
    import torch, torch.distributed as dist
    import nvtrain

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.group.WORLD
    baseline = sys.getrefcount(group)
    # the first optimizer imports torch._dynamo, which imports torch.distributed.nn
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2), optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss, device="cpu",
    )
    strategy.setup()
    kept = sys.getrefcount(group) - baseline
    del strategy, group
    dist.destroy_process_group()
    gc.collect()
    threads = sorted(
        open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")
    ) if os.path.isdir("/proc/self/task") else None
    with open(sys.argv[1], "w") as handle:
        json.dump({"kept": kept, "threads": threads}, handle)
    """
)


@pytest.mark.slow
def test_a_destroyed_group_is_not_kept_alive_by_torch_distributed_nn(tmp_path: Path) -> None:
    # Imported while a group exists, torch.distributed.nn binds it into default arguments for
    # good: its gloo threads then outlive destroy_process_group() and are torn down at
    # interpreter exit, which aborted finished ranks now and then. nvtrain imports it first.
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS} | {"CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "release.json"
    proc = subprocess.run(
        [sys.executable, "-c", _RELEASE_JOB, str(out), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["kept"] == 0, "setting up a strategy added references to the process group"
    if result["threads"] is not None:  # Linux: the group's gloo threads have ended
        assert not [name for name in result["threads"] if "gloo" in name], result["threads"]
