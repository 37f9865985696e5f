"""Resume without replay: a resumed epoch reads only the samples it has not consumed, bit for bit as before."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from nvtrain.data_cursor import DataCursor
from tests.resume_helpers import CountingDataset, GrabState, train


def _loader(samples: int, generator: bool, workers: int) -> DataLoader[Any]:
    return DataLoader(
        CountingDataset(samples),
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(7) if generator else None,
    )


@pytest.mark.parametrize(
    ("samples", "generator", "workers"),
    [(100, False, 0), (98, True, 0), (98, True, 2)],
    ids=["global-rng", "own-generator-partial-batch", "own-generator-2-workers"],
)
def test_resume_at_step_20_of_25_reads_only_what_it_trains(samples: int, generator: bool, workers: int) -> None:
    grab = GrabState(20)
    reference = train(_loader(samples, generator, 0), [grab], 30)  # uninterrupted, one process: the read order
    straight = reference if workers == 0 else train(_loader(samples, generator, workers), [], 30)
    assert grab.state is not None and grab.state["scheduler"]["position"] == 20

    resumed = train(_loader(samples, generator, workers), [], 30, state=grab.state)

    for name, tensor in straight["params"].items():
        assert torch.equal(tensor, resumed["params"][name]), name
    assert torch.equal(straight["rng"], resumed["rng"])
    if generator:  # the sampler's generator advanced as in the uninterrupted run (trailing draws included)
        assert torch.equal(straight["generator"], resumed["generator"])
    reads = resumed["reads"]
    lookahead = 2 * 4 if workers == 0 else 2 * workers * 4  # two batches; with workers, their prefetch
    assert len(reads) <= 40 + lookahead
    rest_of_epoch = samples - 80
    consumed = set(reference["reads"][:80])  # the samples of the 20 steps before the save
    assert not consumed & set(reads[:rest_of_epoch])  # never a sample before the saved position
    assert sorted(reads[:rest_of_epoch]) == sorted(reference["reads"][80:samples])
    if workers == 0:
        assert reads == reference["reads"][80 : samples + 20]  # the rest of epoch 1, then 5 steps of epoch 2


def _replayed(loader: DataLoader[Any], position: int) -> list[Any]:
    iterator = iter(loader)
    for _ in range(position):
        next(iterator)
    return list(iterator)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _variants() -> dict[str, Any]:
    def dataset() -> CountingDataset:
        return CountingDataset(22)

    return {
        "sequential": lambda: DataLoader(dataset(), batch_size=4),
        "no-auto-collation": lambda: DataLoader(dataset(), batch_size=None, shuffle=True),
        "drop-last": lambda: DataLoader(
            dataset(), batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(5)
        ),
        "replacement": lambda: DataLoader(
            (d := dataset()),
            batch_size=3,
            sampler=RandomSampler(d, replacement=True, num_samples=40, generator=torch.Generator().manual_seed(2)),
        ),
        "more-samples-than-data": lambda: DataLoader(
            (d := dataset()), batch_size=5, sampler=RandomSampler(d, num_samples=50, generator=torch.Generator().manual_seed(4))
        ),
        "distributed-rank-1": lambda: DataLoader(
            (d := dataset()), batch_size=2, sampler=DistributedSampler(d, num_replicas=2, rank=1, seed=9)
        ),
        "batch-sampler": lambda: DataLoader(
            (d := dataset()), batch_sampler=BatchSampler(SequentialSampler(d), batch_size=3, drop_last=False)
        ),
    }


@pytest.mark.parametrize("variant", list(_variants()))
def test_the_cursor_gives_the_replayed_batches_without_reading_the_skipped_ones(variant: str) -> None:
    make = _variants()[variant]
    position = 3
    torch.manual_seed(21)
    replay_loader = make()
    expected = _replayed(replay_loader, position)
    expected_rng = torch.get_rng_state()

    torch.manual_seed(21)
    loader = make()
    cursor = DataCursor(loader)
    assert cursor.skips_without_reading
    got = list(cursor.open(position))
    reads, replay_reads = loader.dataset.read(), replay_loader.dataset.read()  # type: ignore[attr-defined]
    unread = sum(1 if x.dim() == 1 else len(x) for x, _ in expected)  # samples in the batches after the position
    assert len(reads) == unread < len(replay_reads)
    assert reads == replay_reads[-unread:]  # exactly the samples after the position, in the same order
    assert _same(expected, got)
    assert torch.equal(expected_rng, torch.get_rng_state())
    for gen_a, gen_b in zip(_generators(replay_loader), _generators(loader), strict=True):
        assert torch.equal(gen_a.get_state(), gen_b.get_state())


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    found = [loader.generator, getattr(loader.sampler, "generator", None)]
    return [g for g in found if isinstance(g, torch.Generator)]


class _NotALoader:
    def __init__(self, batches: list[int]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def test_any_other_iterable_is_fast_forwarded_with_one_line_saying_so(caplog: pytest.LogCaptureFixture) -> None:
    cursor = DataCursor(_NotALoader(list(range(10))))
    assert not cursor.skips_without_reading
    with caplog.at_level(logging.WARNING, logger="nvtrain.data_cursor"):
        assert list(cursor.open(4, epoch=2)) == [4, 5, 6, 7, 8, 9]
    (record,) = caplog.records
    message = record.getMessage()
    assert "resuming epoch 3: replaying 4 micro-batch(es)" in message
    assert "the loader is a _NotALoader, not a torch.utils.data.DataLoader" in message
    assert "use a torch DataLoader over a map-style dataset" in message


def test_a_position_past_the_epoch_is_refused() -> None:
    loader = DataLoader(CountingDataset(8), batch_size=4)
    with pytest.raises(ValueError, match="cannot resume epoch 1 at micro-batch 3: the dataloader yields only 2"):
        DataCursor(loader).open(3)
    assert loader.dataset.read() == []  # type: ignore[attr-defined]
