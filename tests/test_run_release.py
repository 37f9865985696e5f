"""A strategy dropped without ``close()`` ends the worker processes of the loaders it read from as it is
collected, while their queues still work (torch's shutdown of an iterator collected in one cycle with its
queues waits 5 s per worker instead)."""

from __future__ import annotations

import functools
import gc
import weakref

import torch

import nvtrain


def _loader() -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(8, 3, generator=generator), torch.randn(8, 2, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)


def _strategy(validation: torch.utils.data.DataLoader) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        num_epochs=1,
        validation=nvtrain.ValidationConfig(data=validation),
    )


def _train_and_drop(train: torch.utils.data.DataLoader, validation: torch.utils.data.DataLoader) -> None:
    _strategy(validation).run(train)  # no close(): the strategy is left to the garbage collector


def test_an_unclosed_strategy_ends_its_loaders_persistent_workers_when_collected() -> None:
    train, validation = _loader(), _loader()
    _train_and_drop(train, validation)
    workers = [worker for loader in (train, validation) for worker in loader._iterator._workers]
    assert workers and all(worker.is_alive() for worker in workers)
    gc.collect()
    assert train._iterator is None and validation._iterator is None
    for worker in workers:
        worker.join(timeout=30)
        assert not worker.is_alive()
    assert [len(batch[0]) for batch in train] == [4, 4]  # the loader still works: new workers start


class _HoldsContext(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Reads the run's context (a curriculum picking its difficulty by step): refers back to the strategy."""

    def __init__(self) -> None:
        self.ctx: object = None
        self.inputs, self.targets = torch.zeros(8, 3), torch.zeros(8, 2)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


def test_a_closed_strategy_whose_data_refers_back_to_it_is_collected() -> None:
    data = _HoldsContext()
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    strategy = _strategy(loader)
    data.ctx = strategy.ctx
    with strategy:
        strategy.run(loader)
    collected = weakref.ref(strategy)
    del strategy, data, loader
    gc.collect()
    assert collected() is None
