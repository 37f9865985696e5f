"""A checkpoint written by one process (FSDPHook inactive: plain, full tensors) resumed by two FSDP ranks.

The one-process runs happen here; ``plain_resume_worker.py`` runs the ranks (gloo on the
CPU, started with torchrun's variables, never forked). Checked: each rank's shards of the
weights and of the AdamW state are cut bitwise from the saved full tensors (by
``load_into`` and by ``resume="auto"``), the resumed job ends where the one-process run
ends, and a model or an optimizer that does not fit is refused naming what differs.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from nvtrain.testing import load_script, run_ranks

pytest.importorskip("nvtrain_checkpoint")  # writes the plain checkpoint and loads it on the ranks
from nvtrain_checkpoint import read_checkpoint

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("plain_resume_worker.py")
TIMEOUT_S = 180
#: The same global batches after the resume, summed in another order (one process accumulates two
#: micro-batches, two ranks reduce-scatter theirs): close, not bitwise.
RTOL, ATOL = 1e-5, 1e-6


def _worker() -> ModuleType:
    return load_script(WORKER, "plain_resume_worker")


@pytest.fixture(scope="module")
def worker() -> ModuleType:
    return _worker()


@pytest.fixture(scope="module")
def runs(worker: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process: stopped after SAVED_AT steps (its checkpoint) and uninterrupted; then the two-rank jobs."""
    out = tmp_path_factory.mktemp("plain-resume")
    root = out / "checkpoints"
    worker.one_process_run(root, worker.SAVED_AT)
    reference = worker.one_process_run(None, worker.STEPS)
    checkpoint = root / f"step_{worker.SAVED_AT}"
    saved = read_checkpoint(checkpoint)
    scenarios = [f"load_into={checkpoint}", f"too_wide={checkpoint}", f"two_groups={checkpoint}", f"resume_auto={root}"]
    run_ranks(WORKER, [str(out), *scenarios], nprocs=2, scenarios=len(scenarios), timeout_s=TIMEOUT_S)
    ranks = {
        name: [torch.load(out / name / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
        for name in ("load_into", "too_wide", "two_groups", "resume_auto")
    }
    return {"saved": saved, "reference": reference, "ranks": ranks}


def assert_loaded_bitwise(loaded: dict[str, Any], saved: dict[str, Any], worker: ModuleType) -> None:
    """The gathered shards are the saved full tensors, weights and optimizer state, bit for bit."""
    assert loaded["sharded"], "the ranks' parameters are not DTensors: FSDPHook did not shard"
    weights = saved["models"]["main"]
    assert sorted(loaded["weights"]) == sorted(weights)
    for key, tensor in weights.items():
        assert type(tensor) is torch.Tensor  # the checkpoint holds full, plain tensors
        assert torch.equal(loaded["weights"][key], tensor), f"weight {key!r} differs from the checkpoint"
    optimizer = saved["optimizers"]["main"]
    names = [name for name, _ in worker.make_model().named_parameters()]  # the saved state's ids, in order
    by_name = {names[index]: state for index, state in optimizer["state"].items()}
    assert sorted(loaded["optimizer"]) == sorted(by_name) == sorted(names)
    for name, state in by_name.items():
        assert sorted(loaded["optimizer"][name]) == sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        for key, tensor in state.items():
            assert torch.equal(loaded["optimizer"][name][key], tensor), f"AdamW {key!r} of {name!r} differs"
    assert loaded["param_groups"] == [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer["param_groups"]
    ]


def test_load_into_shards_the_one_process_checkpoint_bitwise(runs: dict[str, Any], worker: ModuleType) -> None:
    for loaded in runs["ranks"]["load_into"]:
        assert_loaded_bitwise(loaded, runs["saved"], worker)
        assert loaded["step_count"] == worker.SAVED_AT


def test_resume_auto_shards_it_and_continues_like_the_one_process_run(runs: dict[str, Any], worker: ModuleType) -> None:
    results = runs["ranks"]["resume_auto"]
    for result in results:
        first = result["first"]
        assert_loaded_bitwise(first, runs["saved"], worker)
        # the data position carried over: the epoch goes on after the saved step's micro-batches
        assert (first["step_count"], first["epoch_step_count"]) == (worker.SAVED_AT, worker.SAVED_AT)
        assert result["step_count"] == worker.STEPS
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        assert torch.equal(a, b), "the ranks gathered different weights"
    for got, want in zip(results[0]["final"], runs["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_a_model_that_does_not_fit_is_refused_naming_the_shapes(runs: dict[str, Any]) -> None:
    for result in runs["ranks"]["too_wide"]:
        assert "the checkpoint's weights for model 'main' do not fit this model" in result["error"]
        assert "'0.weight' is [16, 4] in the checkpoint but [32, 4] in this model" in result["error"]


def test_an_optimizer_grouped_otherwise_is_refused_naming_the_groups(runs: dict[str, Any]) -> None:
    for result in runs["ranks"]["two_groups"]:
        assert "the checkpoint's state for optimizer 'main' does not fit it" in result["error"]
        assert (
            "its parameter groups hold [4] parameters in the checkpoint but [2, 2] in this optimizer" in result["error"]
        )
