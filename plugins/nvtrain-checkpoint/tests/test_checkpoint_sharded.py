"""Sharded (DCP) checkpoints of FSDP models, with real two-rank gloo jobs on the CPU.

``sharded_worker.py`` runs the ranks (started as subprocesses with torchrun's variables,
never forked); the assertions run here. What is checked: the layout and manifest, the
async path, keep_last_n, bitwise resume on 2 ranks (the loaded state and the finished
run) and on 1 rank (resharded), refusing rank_zero_only=False, and that a SIGKILL at any
point of a sharded save leaves ``latest`` naming a complete checkpoint, from which
resume="auto" finishes the run as if nothing had happened.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from nvtrain_checkpoint import CheckpointHook, latest_checkpoint, list_checkpoints
from nvtrain_checkpoint.storage import LATEST_NAME, TMP_PREFIX

from nvtrain.errors import ResumeError
from nvtrain.testing import kill_ranks, load_script, start_ranks, wait_ranks

pytest.importorskip("nvtrain_fsdp")  # the ranks shard their model with the FSDP plugin

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sharded_worker.py")
TIMEOUT_S = 180


def _start(out: Path, *scenarios: str) -> list[subprocess.Popen[str]]:
    return start_ranks(WORKER, [str(out), *scenarios], scenarios=len(scenarios))


def launch(out: Path, *scenarios: str) -> None:
    wait_ranks(_start(out, *scenarios), TIMEOUT_S)


def results(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def _worker() -> ModuleType:
    return load_script(WORKER, "sharded_worker")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (checkpoints at 4 and 8), the async run, and the rank_zero_only=False refusal."""
    out = tmp_path_factory.mktemp("sharded")
    launch(out, "save", "async", "per_rank")
    return out


# -- writing ---------------------------------------------------------------------------------------------


def test_every_rank_writes_its_shards_and_the_manifest_lists_them(saved: Path) -> None:
    root = saved / "save" / "checkpoints"
    assert [info.step for info in list_checkpoints(root)] == [4, 8]
    assert (root / LATEST_NAME).read_text().strip() == "step_8"
    manifest = json.loads((root / "step_4" / "manifest.json").read_text())
    assert manifest["sharded"] == {"format": "torch.distributed.checkpoint", "directory": "sharded", "world_size": 2}
    assert sorted(manifest["files"]) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "state.pt"]
    for name, entry in manifest["files"].items():
        assert (root / "step_4" / name).stat().st_size == entry["size"]
    # the rest of the state is a weights-only file (no model or optimizer tensors in it)
    rest = torch.load(root / "step_4" / "state.pt", weights_only=True)
    assert rest["models"] == {"main": {}} and rest["optimizers"] == {"main": {}}
    assert len(rest["rng_by_rank"]) == 2 and rest["counters"]["step_count"] == 4
    assert not [entry for entry in root.iterdir() if entry.name.startswith(TMP_PREFIX)]


def test_async_save_publishes_the_same_checkpoints_and_keeps_the_last_two(driver: ModuleType, saved: Path) -> None:
    root = saved / "async" / "checkpoints"
    assert [info.step for info in list_checkpoints(root)] == [6, 8]
    assert (root / LATEST_NAME).read_text().strip() == "step_8"
    run, sync = results(saved / "async"), results(saved / "save")
    for rank in (0, 1):
        assert run[rank]["last_checkpoint_index"] == 8
        driver.assert_same(sync[rank]["snapshots"], run[rank]["snapshots"])  # saving in the background changes nothing
    exported = CheckpointHook(root).export(saved / "async-final.pt")
    driver.assert_same(sync[0]["snapshots"][8]["weights"], torch.load(exported, weights_only=True))


def test_rank_zero_only_false_is_refused_for_sharded_models(saved: Path) -> None:
    for result in results(saved / "per_rank"):
        assert result["field"] == "rank_zero_only"
        assert "CheckpointHook.rank_zero_only=False writes one checkpoint tree per rank" in result["error"]
        assert "set rank_zero_only=True" in result["error"]


def test_export_consolidates_the_shards_into_one_plain_state_dict(
    driver: ModuleType, saved: Path, tmp_path: Path
) -> None:
    make_model = _worker().make_model
    path = CheckpointHook(saved / "save" / "checkpoints").export(tmp_path / "model.pt", saved / "save" / "checkpoints" / "step_4")
    weights = torch.load(path, weights_only=True)
    assert all(type(t) is torch.Tensor for t in weights.values())
    driver.assert_same(results(saved / "save")[0]["snapshots"][4]["weights"], weights)
    make_model().load_state_dict(weights)  # strict: the plain model's keys
    # the EMA average, written in shards by two ranks, consolidated in this process
    averaged = torch.load(CheckpointHook(saved / "save" / "checkpoints").export(tmp_path / "ema.pt", ema=True))
    driver.assert_same(results(saved / "save")[0]["snapshots"][8]["ema"], averaged)
    make_model().load_state_dict(averaged)


# -- resuming ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resumed(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resumed")
    step_4 = saved / "save" / "checkpoints" / "step_4"
    launch(out, f"resume={step_4}", f"load_checkpoint={step_4}")
    return out


def test_load_checkpoint_restores_a_sharded_checkpoint_before_any_run(
    driver: ModuleType, saved: Path, resumed: Path
) -> None:
    uninterrupted = results(saved / "save")
    for rank, result in enumerate(results(resumed / "load_checkpoint")):
        # weights, optimizer state, LR, EMA and counters of step 4, readable as load_checkpoint returns
        driver.assert_same(uninterrupted[rank]["snapshots"][4], result["loaded"])


def test_two_ranks_resume_bitwise_and_finish_like_the_uninterrupted_run(
    driver: ModuleType, saved: Path, resumed: Path
) -> None:
    uninterrupted = results(saved / "save")
    for rank, result in enumerate(results(resumed / "resume-0")):
        # weights, optimizer state (gathered, by parameter name), LR, EMA and counters as saved at step 4
        driver.assert_same(uninterrupted[rank]["snapshots"][4], result["first"])
        # and training goes on to the very same step 8
        driver.assert_same(uninterrupted[rank]["snapshots"][8], result["snapshots"][8])
        assert result["step_count"] == 8


def test_one_process_loads_the_two_rank_checkpoint_resharded(
    driver: ModuleType, saved: Path, tmp_path: Path
) -> None:
    worker = _worker()
    step_4 = saved / "save" / "checkpoints" / "step_4"
    ema = worker.EMAHook(decay=0.5)
    record = worker.Record(ema, ())
    # resume= keeps the data position, which one process with half the global batch cannot continue:
    # refused, saying what to do
    hook = CheckpointHook(tmp_path, resume=step_4)
    with worker.make_strategy(hook, ema, record) as strategy, pytest.raises(
        ResumeError, match=r"dp_size: saved 2, now 1.*cannot be carried over: the global batch size differs "
        r"\(saved 8, now 4\).*restore without the data position"
    ):
        strategy.run(worker.make_loader(1))
    hook = CheckpointHook(tmp_path)
    ema = worker.EMAHook(decay=0.5)
    with worker.make_strategy(hook, ema, worker.Record(ema, ())) as strategy:
        strategy.setup(worker.make_loader(1))
        assert hook.load_into(strategy, step_4, data_position=False) == step_4
        loaded = worker.snapshot_of(strategy, ema)
        assert all(type(p) is torch.nn.Parameter for p in strategy.ctx.models["main"].parameters())  # plain
    driver.assert_same(results(saved / "save")[0]["snapshots"][4], loaded)


def test_without_the_data_position_a_sharded_epoch_end_goes_on_with_the_next_epoch(
    saved: Path, tmp_path: Path
) -> None:
    """step_8 ends the two-rank job's only epoch: loaded without its data position in one process, the run
    continues after that epoch (here: nothing is left to train) instead of training it again."""
    worker = _worker()
    step_8 = saved / "save" / "checkpoints" / "step_8"
    hook, ema = CheckpointHook(tmp_path), worker.EMAHook(decay=0.5)
    with worker.make_strategy(hook, ema, worker.Record(ema, ())) as strategy:
        loader = worker.make_loader(1)
        strategy.setup(loader)
        assert hook.load_into(strategy, step_8, data_position=False) == step_8
        ctx = strategy.ctx
        assert (ctx.step_count, ctx.epoch, ctx.epoch_step_count) == (8, 1, 0)
        result = strategy.run(loader)
    assert (result.step_count, result.batch_count, result.epoch) == (8, 8, 1)


# -- SIGKILL during a sharded save ---------------------------------------------------------------------------

#: fault point -> complete checkpoints the killed job leaves, and whether a temporary directory remains
FAULTS = {
    "during_shards": ([2], True),  # rank 1 stopped half-way through writing its shards of step 4
    "before_rename": ([2], True),  # step 4 fully written under .tmp-..., never renamed
    "before_latest": ([2, 4], False),  # step 4 published, but latest still names step 2
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per fault point a two-rank job saving every 2 steps, SIGKILLed (both ranks) at that point of its second save."""
    base = tmp_path_factory.mktemp("killed")
    for point in FAULTS:
        procs = _start(base, f"fault={point}")
        marker = base / f"fault-{point}" / "marker"
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not (marker.exists() and marker.read_text()):
                exited = [proc for proc in procs if proc.poll() is not None]
                if exited:
                    pytest.fail(f"{point}: a rank exited early:\n{exited[0].communicate()[0][-4000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"{point}: the job did not reach the fault point in time")
                time.sleep(0.05)
        finally:
            kill_ranks(procs)
    return base


@pytest.mark.parametrize("point", sorted(FAULTS))
def test_a_kill_during_a_sharded_save_leaves_latest_on_a_complete_checkpoint(point: str, killed: Path) -> None:
    root = killed / f"fault-{point}" / "checkpoints"
    steps, leftover = FAULTS[point]
    assert [info.step for info in list_checkpoints(root)] == steps
    assert (root / LATEST_NAME).read_text().strip() == "step_2"
    assert latest_checkpoint(root) == root / "step_2"
    assert any(entry.name.startswith(TMP_PREFIX) for entry in root.iterdir()) is leftover
    assert CheckpointHook(root, resume="auto").resume_checkpoint() == root / "step_2"  # verified, every shard


@pytest.fixture(scope="module")
def continued(killed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("continued")
    launch(out, *(f"resume_auto={killed / f'fault-{point}' / 'checkpoints'}" for point in sorted(FAULTS)))
    return out


@pytest.mark.parametrize("index", range(len(FAULTS)))
def test_auto_resume_after_a_kill_finishes_like_the_uninterrupted_run(
    driver: ModuleType, index: int, killed: Path, continued: Path, saved: Path
) -> None:
    point = sorted(FAULTS)[index]
    root = killed / f"fault-{point}" / "checkpoints"
    uninterrupted = results(saved / "save")
    for rank, result in enumerate(results(continued / f"resume-{index}")):
        assert result["first"]["step_count"] == 2  # the newest checkpoint latest names
        driver.assert_same(uninterrupted[rank]["snapshots"][8], result["snapshots"][8])
    # step_2 (resumed from) was dropped by keep_last_n=3 and deleted before the run ended
    assert not [entry.name for entry in root.iterdir() if entry.name.startswith((TMP_PREFIX, ".trash-"))]
    assert [info.step for info in list_checkpoints(root)] == [4, 6, 8]
    assert (root / LATEST_NAME).read_text().strip() == "step_8"

