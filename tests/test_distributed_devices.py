"""DistributedManager on nodes with fewer GPUs than processes, simulated on the CPU.

torchrun starts ``--nproc-per-node`` processes whatever the node holds. With NCCL each
process needs a GPU of its own (two ranks on one device fail inside NCCL with "invalid
usage"), so the manager refuses such a launch on every rank, before any process group
exists, and says what to change; ``device="cpu"`` (``--set device=cpu``) trains with gloo.

The device count, NCCL's availability, ``set_device`` and ``init_process_group`` are
monkeypatched: no GPU and no rendezvous are needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nvtrain.cli import main
from nvtrain.distributed import DeviceAssignmentError, DistributedManager, backend_for

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class FakeNode:
    """What initialize() asked of torch: the current device it set and the process group it created."""

    def __init__(self) -> None:
        self.current: list[torch.device] = []
        self.groups: list[dict[str, Any]] = []

    def set_device(self, device: torch.device) -> None:
        self.current.append(torch.device(device))

    def init_process_group(self, backend: str, **kwargs: Any) -> None:
        self.groups.append({"backend": backend, **kwargs})


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    DistributedManager.cleanup()
    yield
    DistributedManager._state = None  # no real group was created: nothing to destroy


def simulate(monkeypatch: pytest.MonkeyPatch, *, gpus: int, nccl: bool = True) -> FakeNode:
    node = FakeNode()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", node.set_device)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", node.init_process_group)
    return node


def torchrun_env(monkeypatch: pytest.MonkeyPatch, *, rank: int, nprocs: int = 2) -> None:
    """The variables ``torchrun --standalone --nproc-per-node=NPROCS`` gives rank ``rank``."""
    for name, value in {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": nprocs,
        "LOCAL_WORLD_SIZE": nprocs,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": 29500,
    }.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.parametrize("rank", [0, 1])
def test_more_ranks_than_gpus_is_refused_on_every_rank_with_the_fix(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    node = simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=rank)
    with pytest.raises(DeviceAssignmentError) as caught:
        DistributedManager.initialize()
    message = str(caught.value)
    assert "2 processes on this node" in message and "1 CUDA device(s) visible" in message
    assert "--nproc-per-node=1" in message and "--set device=cpu" in message
    assert "DistributedManager.initialize(device='cpu')" in message
    # refused before anything was set up: no rank waits at a rendezvous the other never joins
    assert node.current == [] and node.groups == []
    assert not DistributedManager.is_initialized()


def test_device_cpu_trains_with_gloo_where_gpus_are_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    node = simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=1)
    manager = DistributedManager.initialize(device="cpu")
    assert manager.device == torch.device("cpu") and manager.backend == "gloo"
    assert node.current == []
    assert [group["backend"] for group in node.groups] == ["gloo"]
    assert (node.groups[0]["rank"], node.groups[0]["world_size"]) == (1, 2)


def test_one_gpu_per_rank_is_used_with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    node = simulate(monkeypatch, gpus=2)
    torchrun_env(monkeypatch, rank=1)
    manager = DistributedManager.initialize()
    assert manager.device == torch.device("cuda", 1) and manager.backend == "nccl"
    assert node.current == [torch.device("cuda", 1)]


@pytest.mark.parametrize("device", [None, "auto", "cuda"])
def test_cuda_without_an_index_means_the_local_rank(monkeypatch: pytest.MonkeyPatch, device: str | None) -> None:
    simulate(monkeypatch, gpus=4)
    torchrun_env(monkeypatch, rank=3, nprocs=4)
    assert DistributedManager.initialize(device=device).device == torch.device("cuda", 3)


def test_more_ranks_than_gpus_is_refused_for_device_cuda_too(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=0)
    with pytest.raises(DeviceAssignmentError, match="NCCL needs a GPU of its own"):
        DistributedManager.initialize(device="cuda")


def test_an_explicit_gloo_backend_may_share_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    node = simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=1)
    manager = DistributedManager.initialize(backend="gloo")
    assert manager.device == torch.device("cuda", 0) and manager.backend == "gloo"
    assert [group["backend"] for group in node.groups] == ["gloo"]


def test_without_nccl_the_ranks_share_gpus_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    # a torch build without NCCL picks gloo, which has no one-GPU-per-process rule
    simulate(monkeypatch, gpus=1, nccl=False)
    torchrun_env(monkeypatch, rank=1)
    manager = DistributedManager.initialize()
    assert manager.device == torch.device("cuda", 0) and manager.backend == "gloo"


def test_a_single_process_is_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    node = simulate(monkeypatch, gpus=1)
    manager = DistributedManager.initialize()
    assert manager.device == torch.device("cuda", 0) and manager.backend is None
    assert node.groups == []


@pytest.mark.parametrize(
    ("gpus", "device", "message"),
    [
        (0, "cuda", "asks for CUDA, which this process does not have"),
        (2, "cuda:2", "but 2 CUDA device"),
        (2, "gpu", "is not a torch device"),
        (2, "", "device must be a torch device"),
    ],
)
def test_bad_devices_are_named(monkeypatch: pytest.MonkeyPatch, gpus: int, device: str, message: str) -> None:
    simulate(monkeypatch, gpus=gpus)
    torchrun_env(monkeypatch, rank=0)
    with pytest.raises(ValueError, match=message):
        DistributedManager.initialize(device=device)
    assert not DistributedManager.is_initialized()


def test_an_explicit_index_is_used_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    node = simulate(monkeypatch, gpus=2)
    torchrun_env(monkeypatch, rank=0)
    assert DistributedManager.initialize(device="cuda:1").device == torch.device("cuda", 1)
    assert node.current == [torch.device("cuda", 1)]


# -- the command line -------------------------------------------------------------------------------


def test_nvtrain_train_under_torchrun_with_one_gpu_exits_2_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    node = simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=0)
    out = tmp_path / "out"
    assert main(["train", "--set", "trainer.max_steps=2", "--set", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvtrain train: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "--set device=cpu" in err and "--nproc-per-node=1" in err
    assert node.groups == [] and not out.exists()


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo", "cuda:nccl"])
def test_more_ranks_than_gpus_is_refused_when_nccl_is_the_cuda_half_of_a_pair(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A ``device:backend`` pair naming NCCL for CUDA needs a GPU per process as plain "nccl" does (the pair
    ``cpu:gloo,cuda:nccl`` is the documented way to keep the step poll off the device)."""
    node = simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=0)
    with pytest.raises(DeviceAssignmentError, match="NCCL needs a GPU of its own"):
        DistributedManager.initialize(backend=backend)
    assert node.groups == []


def test_a_pair_with_gloo_for_cuda_may_share_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    node = simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=1)
    manager = DistributedManager.initialize(backend="cpu:gloo,cuda:gloo")
    assert manager.device == torch.device("cuda", 0)
    assert [group["backend"] for group in node.groups] == ["cpu:gloo,cuda:gloo"]


@pytest.mark.parametrize(
    ("spec", "cpu", "cuda"),
    [
        ("gloo", "gloo", "gloo"),
        ("nccl", None, "nccl"),
        ("NCCL", None, "nccl"),
        ("mpi", "mpi", "mpi"),
        ("cpu:gloo,cuda:nccl", "gloo", "nccl"),
        ("cuda:nccl, cpu:gloo", "gloo", "nccl"),
        ("cuda:nccl", None, "nccl"),
        ("cpu:gloo", "gloo", None),
    ],
)
def test_backend_for_reads_a_backend_or_a_pair_per_device_type(spec: str, cpu: str | None, cuda: str | None) -> None:
    assert (backend_for(spec, "cpu"), backend_for(spec, "cuda")) == (cpu, cuda)


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ([], ("auto", None)),
        (["--set", "device=cpu"], ("cpu", None)),
        (["--set", "backend=cpu:gloo,cuda:nccl"], ("auto", "cpu:gloo,cuda:nccl")),
    ],
)
def test_nvtrain_train_under_torchrun_passes_the_configs_device_and_backend_to_the_manager(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setting: list[str], expected: tuple[str, str | None]
) -> None:
    simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=0)
    seen: list[Any] = []

    def initialize(**kwargs: Any) -> Any:
        seen.append((kwargs.get("device"), kwargs.get("backend")))
        raise DeviceAssignmentError("stop here")  # the rest of the launch is not simulated

    monkeypatch.setattr(DistributedManager, "initialize", initialize)
    main(["train", *setting, "--set", "trainer.max_steps=2", "--set", f"output_dir={tmp_path}"])
    assert seen == [expected]


def test_nvtrain_train_with_a_backend_pair_and_too_few_gpus_names_the_backend(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    simulate(monkeypatch, gpus=1)
    torchrun_env(monkeypatch, rank=0)
    setting = ["--set", "backend=cpu:gloo,cuda:nccl", "--set", f"output_dir={tmp_path}"]
    assert main(["train", *setting]) == 2
    err = capsys.readouterr().err
    assert "backend" in err.split("NCCL needs")[0] and "NCCL needs a GPU of its own" in err


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("glo", "did you mean 'gloo'?"),
        ("cpu:gloo,cuda:ncl", "did you mean 'nccl'?"),
        ("''", "(got ''); it is empty"),
        ("'cpu:gloo, cuda:nccl'", "; it holds whitespace"),
        ("'gloo '", "; it holds whitespace"),
        ("':gloo'", "; ':gloo' is not a device:backend pair"),
        ("cpu:gloo,cpu:mpi", "; device 'cpu' is named twice"),
        ("nccl,gloo", "; ',' joins device:backend pairs, not backends"),
    ],
)
def test_a_backend_typo_is_refused_by_nvtrain_validate_in_one_process(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str, says: str
) -> None:
    """Refused when the config is read, naming the key: not first on the cluster, when the group is made."""
    assert main(["validate", "--set", f"backend={value}", "--set", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvtrain validate: error: --set backend=") and "backend: RunConfig.backend must be" in err
    assert says in err and "'device:backend' pairs such as 'cpu:gloo,cuda:nccl'" in err
