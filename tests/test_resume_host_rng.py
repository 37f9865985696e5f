"""A resume that replays the epoch's first micro-batches keeps Python's and NumPy's random streams exact.

A sampler that shuffles with ``numpy.random`` or ``random``, or a data set that
augments with them, is replayed from the epoch's start: the replay must see the
streams as the epoch's start had them (the same order), and leave them as the
checkpoint had them (the same augmentations afterwards).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import nvtrain
from tests.resume_helpers import GrabState, make_strategy

SAMPLES, BATCH, STEPS, SAVE_AT = 24, 4, 9, 4  # 6 micro-batches per epoch: the save falls inside epoch 1


class HostShuffled(Sampler[int]):
    """A custom sampler (the cursor cannot seek it: it is replayed) that shuffles with a host RNG."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self) -> Iterator[int]:
        if self.source == "numpy":
            return iter(np.random.permutation(SAMPLES).tolist())
        order = list(range(SAMPLES))
        random.shuffle(order)
        return iter(order)


class HostAugmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Adds noise drawn from a host RNG to every sample it reads."""

    def __init__(self, source: str) -> None:
        data = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 3, generator=data)
        self.y = torch.randn(SAMPLES, 2, generator=data)
        self.source = source

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = np.random.standard_normal(3) if self.source == "numpy" else [random.gauss(0, 1) for _ in range(3)]
        return self.x[index] + 0.1 * torch.as_tensor(noise, dtype=torch.float32), self.y[index]


class RecordLosses:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    @nvtrain.hookimpl
    def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
        self.losses.append(ctx.loss.detach().clone())  # type: ignore[union-attr]


def train(source: str, state: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[torch.Tensor], Any]:
    loader = DataLoader(HostAugmented(source), batch_size=BATCH, sampler=HostShuffled(source))
    grab, losses = GrabState(SAVE_AT), RecordLosses()
    strategy = make_strategy([grab, losses], STEPS)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # what the process drew before must not matter
    if state is not None:
        strategy.load_state_dict(state)
    else:
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with strategy:
        strategy.run(loader)
    params = {k: v.clone() for k, v in strategy.ctx.models["main"].state_dict().items()}
    streams = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())
    return {"params": params, "state": grab.state, "streams": streams}, losses.losses, grab


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_a_replayed_resume_is_bitwise_with_host_rng_shuffling_and_augmentation(
    source: str, caplog: pytest.LogCaptureFixture
) -> None:
    straight, straight_losses, _ = train(source)
    assert straight["state"] is not None
    resumed, resumed_losses, _ = train(source, straight["state"])  # the custom sampler is replayed
    assert "replaying 4 micro-batch(es)" in caplog.text
    assert len(resumed_losses) == STEPS - SAVE_AT
    for got, expected in zip(resumed_losses, straight_losses[SAVE_AT:], strict=True):
        assert torch.equal(got, expected)
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["streams"][0] == straight["streams"][0]
    assert resumed["streams"][1] == straight["streams"][1]
    assert torch.equal(resumed["streams"][2], straight["streams"][2])


def test_validating_with_host_rng_augmentation_leaves_training_unchanged() -> None:
    """A validation set that augments with numpy and random: training with or without validation is the same."""
    def trained(validate: bool) -> dict[str, torch.Tensor]:
        val = DataLoader(HostAugmented("numpy"), batch_size=BATCH)
        validation = nvtrain.ValidationConfig(data=val, every_n_steps=1) if validate else None
        strategy = make_strategy([], STEPS, validation=validation)
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        train_loader = DataLoader(HostAugmented("python"), batch_size=BATCH, sampler=HostShuffled("numpy"))
        with strategy:
            strategy.run(train_loader)
        return {k: v.clone() for k, v in strategy.ctx.models["main"].state_dict().items()}

    plain, validated = trained(False), trained(True)
    for name, value in plain.items():
        assert torch.equal(validated[name], value), name


class FailsAfterDrawing:
    """Validation data that draws from both host streams, then raises on its second batch."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        random.random(), np.random.rand()
        yield torch.zeros(BATCH, 3), torch.zeros(BATCH, 2)
        random.random(), np.random.rand()
        raise RuntimeError("validation data failed")


class RecordsHostStreams:
    """The host streams at each AFTER_BATCH: what a validation right after must leave as it found."""

    def __init__(self) -> None:
        self.streams: tuple[Any, Any] | None = None

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.streams = random.getstate(), np.random.get_state()


def test_a_validation_that_raises_leaves_the_host_streams_as_training_had_them() -> None:
    recorder = RecordsHostStreams()
    validation = nvtrain.ValidationConfig(data=FailsAfterDrawing(), every_n_steps=1)
    strategy = make_strategy([recorder], STEPS, validation=validation)
    random.seed(1), np.random.seed(1)
    with strategy, pytest.raises(RuntimeError, match="validation data failed"):
        strategy.run(DataLoader(HostAugmented("python"), batch_size=BATCH))
    assert recorder.streams is not None
    assert random.getstate() == recorder.streams[0]
    expected = recorder.streams[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), expected, strict=True))


@pytest.mark.parametrize("initialized", [False, True])
def test_cuda_generators_are_read_only_once_cuda_is_initialised(
    monkeypatch: pytest.MonkeyPatch, initialized: bool
) -> None:
    """Reading them would initialise CUDA: a context on the GPU, in every rank, for a run on the CPU of a machine
    with GPUs. Before it is initialised no CUDA draw has happened, and there is nothing to keep."""
    from nvtrain.state import capture_rng_state

    saved = [torch.zeros(16, dtype=torch.uint8)]

    def read_all() -> list[torch.Tensor]:
        assert initialized, "get_rng_state_all() initialises CUDA"
        return saved

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", read_all)
    state = capture_rng_state()
    assert ("cuda" in state) is initialized
    if initialized:
        assert state["cuda"] == saved
