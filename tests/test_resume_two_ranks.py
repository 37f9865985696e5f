"""Resume without replay on two ranks (gloo, CPU, DDP through the nvtrain-ddp plugin).

One spawn of two ranks trains 30 steps and checkpoints at step 20 of a 25-step epoch
(``CheckpointHook``, rank 0 writing for both); a second spawn resumes from that checkpoint
and trains the remaining 10. Three loaders, each in turn in the same processes (starting
them is the slow part): a torch DataLoader (the built-in cursor), shuffled and given a
DistributedSampler by the DDP plugin; a torchdata StatefulDataLoader (its own state) built
with a shuffling DistributedSampler; and a StatefulDataLoader over a stream sharded by
rank, whose saved states differ between the ranks, so each rank must get its own back.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from nvtrain.testing import gloo_group, spawn_ranks
from tests.resume_helpers import CountingDataset, CountingStream, RecordSamples, make_strategy

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
BATCH = 4
SAMPLES = 200  # 100 a rank: 25 steps an epoch
SAVE_AT = 20


def _variants() -> list[str]:
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        return ["dataloader"]
    return ["dataloader", "stateful", "stateful-stream"]


def _loader(variant: str, rank: int) -> Any:
    if variant == "dataloader":
        return DataLoader(CountingDataset(SAMPLES), batch_size=BATCH, shuffle=True)
    from torchdata.stateful_dataloader import StatefulDataLoader

    if variant == "stateful":
        dataset = CountingDataset(SAMPLES)
        sampler: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=0
        )
        return StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler)
    return StatefulDataLoader(CountingStream(SAMPLES, rank, WORLD_SIZE), batch_size=BATCH)


def _train(variant: str, rank: int, root: Path, resume: bool) -> dict[str, Any]:
    from nvtrain_checkpoint import CheckpointHook
    from nvtrain_ddp import DDPHook

    loader = _loader(variant, rank)
    if resume:
        checkpoint = CheckpointHook(root / "resumed", resume=root / "straight" / f"step_{SAVE_AT}")
    else:
        checkpoint = CheckpointHook(root / "straight", step_interval=SAVE_AT)
    recorder = RecordSamples(loader.dataset)
    strategy = make_strategy([DDPHook(), checkpoint, recorder], 30)
    torch.manual_seed(12345 if resume else 1)  # a resumed run takes every random stream from the checkpoint
    with strategy:
        strategy.run(loader)
        sampler = type(strategy.ctx.train_loader.sampler).__name__
    return {
        "params": {k: v.clone() for k, v in strategy.ctx.models["main"].state_dict().items()},
        "reads": loader.dataset.read(),
        "trained": recorder.samples,
        "sampler": sampler,
    }


def _rank(rank: int, port: int, out_dir: str, resume: bool) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
    warnings.filterwarnings("ignore", message="DDPHook: no distributed sampler")  # the stream shards itself
    with gloo_group(rank, WORLD_SIZE, port):
        for variant in _variants():
            root = Path(out_dir, variant)
            result = _train(variant, rank, root, resume)
            torch.save(result, root / f"{'resumed' if resume else 'straight'}-rank{rank}.pt")
            dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the spawned ranks import this module by name: make the repository root importable for them
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        out = tmp_path_factory.mktemp("resume-two-ranks")
        for variant in _variants():
            (out / variant).mkdir()
        spawn_ranks(_rank, str(out), False, nprocs=WORLD_SIZE)
        spawn_ranks(_rank, str(out), True, nprocs=WORLD_SIZE)
    return out


@pytest.mark.parametrize("variant", ["dataloader", "stateful", "stateful-stream"])
def test_two_ranks_resume_bitwise_and_each_reads_only_its_unconsumed_samples(runs: Path, variant: str) -> None:
    if variant not in _variants():
        pytest.skip("torchdata is not installed")
    load = lambda name: torch.load(runs / variant / name, weights_only=True)  # noqa: E731
    straight = [load(f"straight-rank{rank}.pt") for rank in range(WORLD_SIZE)]
    resumed = [load(f"resumed-rank{rank}.pt") for rank in range(WORLD_SIZE)]
    epoch_1 = [set(run["trained"][: SAMPLES // WORLD_SIZE]) for run in straight]
    assert not epoch_1[0] & epoch_1[1]  # each rank trains its own half
    for rank in range(WORLD_SIZE):
        if variant != "stateful-stream":
            assert straight[rank]["sampler"] == "DistributedSampler"
        for name, tensor in straight[rank]["params"].items():
            assert torch.equal(tensor, resumed[rank]["params"][name]), (rank, name)
            assert torch.equal(tensor, straight[0]["params"][name])  # DDP kept the ranks equal
        order = straight[rank]["trained"]  # this rank's 30 steps of the uninterrupted run
        position = SAVE_AT * BATCH
        assert resumed[rank]["trained"] == order[position:]
        reads = resumed[rank]["reads"]
        # never a sample before the saved position, never another rank's: the rest of the epoch, then epoch 2
        assert reads[: 30 * BATCH - position] == order[position:]
        look_ahead = BATCH if variant == "stateful-stream" else 0  # a stream without len() is read one ahead
        assert len(reads) <= 30 * BATCH - position + look_ahead

    if variant == "stateful-stream":  # rank 0 wrote both ranks' loader states, and they differ
        from nvtrain_checkpoint import read_checkpoint

        state = read_checkpoint(runs / variant / "straight" / f"step_{SAVE_AT}")
        by_rank = [entry["loader"]["state"] for entry in state["rng_by_rank"]]
        assert state["scheduler"]["loader"]["state"] == by_rank[0] != by_rank[1]


def test_one_process_continues_the_two_ranks_epoch_on_the_same_samples(runs: Path, tmp_path: Path) -> None:
    """An elastic resume: the 2-rank checkpoint (4 samples a rank) continued by one process reading 8 a step
    through a DistributedSampler of one replica. Every step trains on the samples the two ranks' step did,
    and only the unconsumed ones are read."""
    from nvtrain_checkpoint import CheckpointHook

    dataset = CountingDataset(SAMPLES)
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=WORLD_SIZE * BATCH, sampler=sampler)
    recorder = RecordSamples(dataset)
    hook = CheckpointHook(tmp_path, resume=runs / "dataloader" / "straight" / f"step_{SAVE_AT}")
    epoch_end = SAMPLES // (WORLD_SIZE * BATCH)
    with make_strategy([hook, recorder], epoch_end) as strategy:
        strategy.run(loader)
    assert strategy.ctx.step_count == epoch_end
    straight = [torch.load(runs / "dataloader" / f"straight-rank{r}.pt", weights_only=True) for r in range(2)]
    expected = [
        set().union(*(run["trained"][step * BATCH : (step + 1) * BATCH] for run in straight))
        for step in range(SAVE_AT, epoch_end)
    ]
    size = WORLD_SIZE * BATCH
    trained = recorder.samples
    assert [set(trained[i * size : (i + 1) * size]) for i in range(epoch_end - SAVE_AT)] == expected
    assert dataset.read() == trained
