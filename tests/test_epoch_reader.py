"""EpochReader and the loader helpers: one owner of where a loader keeps its generators and its position."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from nvtrain.epoch_reader import NO_ITEM, EpochReader, loader_generators, loader_len, loader_parts


class Counting(torch.utils.data.Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size, self.read = size, []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        self.read.append(index)
        return index


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(5))


def test_loader_generators_finds_each_generator_once_by_path() -> None:
    shared = torch.Generator().manual_seed(1)
    own = torch.Generator().manual_seed(2)
    loader = DataLoader(Counting(8), sampler=RandomSampler(Counting(8), generator=own), generator=shared)
    assert loader_generators(loader) == {"loader.generator": shared, "loader.sampler.generator": own}
    same = DataLoader(Counting(8), sampler=RandomSampler(Counting(8), generator=shared), generator=shared)
    assert loader_generators(same) == {"loader.generator": shared}
    assert loader_generators(None) == {}


def test_loader_generators_sees_a_batch_samplers_own_generator() -> None:
    class Shuffled(BatchSampler):
        def __init__(self) -> None:
            super().__init__(SequentialSampler(range(8)), batch_size=2, drop_last=False)
            self.generator = torch.Generator().manual_seed(3)

    batch_sampler = Shuffled()
    loader = DataLoader(Counting(8), batch_sampler=batch_sampler)
    assert loader_generators(loader) == {"loader.batch_sampler.generator": batch_sampler.generator}


def test_loader_len_and_parts() -> None:
    loader = DataLoader(Counting(6), batch_size=4)
    assert loader_len(loader) == 2
    assert loader_len(DataLoader(Stream())) is None
    parts = loader_parts(loader)
    assert parts[0] is loader and loader.dataset in parts and loader.batch_sampler in parts
    assert len({id(p) for p in parts}) == len(parts)


def test_opening_at_a_position_reads_nothing_before_it() -> None:
    data = Counting(10)
    reader = EpochReader(DataLoader(data, batch_size=2))
    with pytest.warns(RuntimeWarning, match="resuming epoch 1 at micro-batch 3 without the epoch's RNG state"):
        reader.open(3, epoch=0)
    assert (reader.pulled, reader.items) == (3, 5)
    assert reader.take().tolist() == [6, 7]
    assert data.read == [6, 7]
    assert reader.take().tolist() == [8, 9]
    assert reader.take() is NO_ITEM and reader.pulled == 5


def test_a_resume_with_the_epochs_rng_state_replays_the_same_permutation() -> None:
    def loader() -> DataLoader[int]:
        return DataLoader(Counting(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))

    first = EpochReader(loader())
    first.open(0, epoch=0)
    order = [first.take().tolist() for _ in range(4)]
    resumed = EpochReader(loader())
    resumed.load(first.epoch_rng, None, position=2)
    resumed.open(2, epoch=0)
    assert [resumed.take().tolist() for _ in range(2)] == order[2:]


def test_peeking_keeps_the_item_for_the_next_take() -> None:
    reader = EpochReader(DataLoader(Stream(), batch_size=2), sized=False)
    reader.open(0, epoch=0)
    assert reader.items is None
    assert reader.take().tolist() == [0, 1]
    assert reader.peek_exhausted() is False and reader.pending is not NO_ITEM and reader.pulled == 1
    assert reader.take().tolist() == [2, 3] and reader.pulled == 2
    assert reader.take().tolist() == [4]
    assert reader.peek_exhausted() is True


def test_a_loader_entry_is_refused_with_the_field_named() -> None:
    reader = EpochReader(DataLoader(Counting(4)))
    with pytest.raises(ValueError, match=r"owner: state\['loader'\] must be None or a dict .* \(got a list\)"):
        reader.check_loader_entry([1], "owner")
    with pytest.raises(ValueError, match=r"state\['loader'\]\['num_workers'\] must be an int >= 0 \(got -1\)"):
        reader.check_loader_entry({"state": {}, "num_workers": -1}, "owner")
    assert reader.check_loader_entry({"state": {}, "num_workers": 0}, "owner") is None  # not a stateful loader now
