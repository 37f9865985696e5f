"""Real 2-process DDP jobs (gloo on CPU): ``ddp_worker.py`` on two ranks.

The workers write their results to files; the assertions run here. Ranks are
launched through torchrun (the equivalence test) or directly with the variables
torchrun sets (one launch runs the SUITE scenarios in turn, since starting
processes dominates the time).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nvtrain.testing import rank_environment, run_ranks, wait_ranks

WORKER = Path(__file__).with_name("ddp_worker.py")
TIMEOUT_S = 90
#: Same global batches, different summation order (all-reduce of shard gradients vs one batch).
ATOL = 1e-6

pytestmark = pytest.mark.slow


def launch(out: Path, *scenarios: str, nprocs: int = 2) -> None:
    """Start ``nprocs`` ranks directly on the CPU, with the environment torchrun would give them."""
    run_ranks(WORKER, [str(out), *scenarios], nprocs=nprocs, scenarios=len(scenarios), timeout_s=TIMEOUT_S)


def launch_torchrun(out: Path, scenario: str, *, nprocs: int = 2, cuda: bool = False) -> None:
    """``torchrun --standalone --nproc-per-node=N ddp_worker.py OUT SCENARIO``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        str(WORKER),
        str(out),
        scenario,
    ]
    proc = subprocess.Popen(
        command,
        env=rank_environment(cuda=cuda),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_ranks([proc], TIMEOUT_S)


def load(out: Path, name: str) -> dict[str, Any]:
    return torch.load(out / name, weights_only=True)  # type: ignore[no-any-return]


def assert_same_across_ranks(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "DDP ranks hold different parameters"


def assert_close_to(params: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(params) == len(reference)
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0.0, atol=ATOL)


#: Scenarios that share one 2-rank launch (module fixture); each still has its own test below.
SUITE = ("accumulation", "sampler", "spike_skip", "checkpoint", "settings")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp-suite")
    launch(out, *SUITE)
    return out


def test_two_ranks_through_torchrun_match_one_process_on_the_global_batches(tmp_path: Path) -> None:
    launch_torchrun(tmp_path, "equivalence")
    out = tmp_path / "equivalence"
    ranks = [load(out, f"rank{r}.pt") for r in (0, 1)]
    reference = load(out, "reference.pt")["params"]
    assert_same_across_ranks(ranks[0]["params"], ranks[1]["params"])
    assert_close_to(ranks[0]["params"], reference)
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank and result["world_size"] == 2
        assert result["device"] == "cpu"
        assert result["wrapped"] and result["unwrapped_after_close"]
        assert result["optimizer_holds_model_params"]
        assert result["sampler"] == "DistributedSampler"
        assert result["step_count"] == 4 and result["global_step_count"] == 8
        # without accumulation every micro-batch ends a window: one all-reduce per step
        assert result["allreduce_calls"] == 4
        # the manager created the group, so closing the hook left it alone
        assert result["process_group_alive"]


def test_accumulation_all_reduces_once_per_optimizer_step(suite: Path) -> None:
    out = suite / "accumulation"
    ranks = [load(out, f"rank{r}.pt") for r in (0, 1)]
    reference = load(out, "reference.pt")["params"]
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank and result["world_size"] == 2
        assert result["batch_count"] == 8
        assert result["step_count"] == 2
        assert result["allreduce_calls"] == result["step_count"]
        # DDPHook initialised the group from the environment, and destroyed it on close
        assert result["initialised_during_run"]
        assert not result["process_group_alive"]
    assert_same_across_ranks(ranks[0]["params"], ranks[1]["params"])
    assert_close_to(ranks[0]["params"], reference)


def test_injected_sampler_gives_each_epoch_a_new_rank_disjoint_order(suite: Path) -> None:
    ranks = [load(suite / "sampler", f"rank{r}.pt") for r in (0, 1)]
    for rank, result in enumerate(ranks):
        assert result["replaced"] and result["sampler"] == "DistributedSampler"
        assert result["shuffle"] is True  # the original loader shuffled
        assert result["num_replicas"] == 2 and result["sampler_rank"] == rank
        assert result["sampler_drop_last"] is True  # from the loader
        assert result["batch_size"] == 2 and result["drop_last"] is True and result["collate_kept"]
        assert result["sampler_epoch"] == 2
    for epoch in range(3):
        first, second = ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]
        assert len(first) == len(second) == 10
        assert set(first).isdisjoint(second)
        assert set(first) | set(second) == set(range(20))
    for rank in (0, 1):
        orders = [ranks[rank]["seen"][epoch] for epoch in range(3)]
        assert orders[0] != orders[1] != orders[2] != orders[0], "set_epoch did not reshuffle"


def test_static_graph_with_accumulation_is_refused_on_every_rank_before_a_backward(suite: Path) -> None:
    for rank in (0, 1):
        by_hook, by_global_batch = load(suite / "settings", f"rank{rank}.pt")["refusals"]
        assert by_hook.startswith(
            "FieldValueError: DDPHook.static_graph=True does not combine with gradient accumulation"
        )
        assert by_global_batch.startswith("FieldValueError: DDPHook.static_graph=True"), by_global_batch


def test_the_injected_sampler_shuffles_with_the_loaders_seed(suite: Path) -> None:
    ranks = [load(suite / "settings", f"rank{r}.pt")["orders"] for r in (0, 1)]
    for orders in ranks:
        assert orders[5][1] == 5 and orders[7][1] == 7
        assert orders[5][0] != orders[7][0], "loaders seeded 5 and 7 read the same order"
    for seed in (5, 7, "per_rank"):
        first, second = ranks[0][seed][0], ranks[1][seed][0]
        assert set(first).isdisjoint(second) and set(first) | set(second) == set(range(16))
    # a generator seeded per process: every rank shuffles with rank 0's seed, or the shards overlap
    assert ranks[0]["per_rank"][1] == ranks[1]["per_rank"][1] == 100


def test_spike_skip_makes_every_rank_skip_the_same_step(suite: Path) -> None:
    out = suite / "spike_skip"
    ranks = [load(out, f"rank{r}.pt") for r in (0, 1)]
    for result in ranks:
        # the spike is in rank 1's shard only; rank 0 skips too
        assert result["skipped_steps"] == 1
        assert result["batch_count"] == 6 and result["step_count"] == 5
    assert_same_across_ranks(ranks[0]["params"], ranks[1]["params"])
    assert_close_to(ranks[0]["params"], load(out, "reference.pt")["params"])


def test_rank_zero_checkpoint_is_written_once_and_loads_on_every_rank(suite: Path) -> None:
    out = suite / "checkpoint"
    ranks = [load(out, f"rank{r}.pt") for r in (0, 1)]
    for result in ranks:
        assert result["steps"] == [2, 4] and result["latest"] == "step_4"
        # one tree, written by rank 0 only: no per-rank directories
        assert not any(name.startswith("rank_") for name in result["entries"])
        assert result["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert_same_across_ranks(result["loaded"], result["params"])
    assert_same_across_ranks(ranks[0]["params"], ranks[1]["params"])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for a 2-rank NCCL job")
def test_nccl_two_gpus_match_one_process(tmp_path: Path) -> None:
    launch_torchrun(tmp_path, "equivalence", cuda=True)
    out = tmp_path / "equivalence"
    ranks = [load(out, f"rank{r}.pt") for r in (0, 1)]
    for rank, result in enumerate(ranks):
        assert result["device"] == f"cuda:{rank}"
        assert result["wrapped"] and result["step_count"] == 4
    assert_same_across_ranks(ranks[0]["params"], ranks[1]["params"])
    # the reference ran on the CPU; fp32 GPU kernels sum in another order
    for got, want in zip(ranks[0]["params"], load(out, "reference.pt")["params"], strict=True):
        torch.testing.assert_close(got, want, rtol=0.0, atol=1e-5)
