"""Moving a batch to the device keeps its structure, and counting its samples reads its first tensor.

The ``meta`` device stands in for an accelerator: a CPU machine can move tensors there,
and a tensor that stayed behind is visibly still on ``cpu``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import attrs
import pytest
import torch

import nvtrain
from nvtrain.batching import batch_size, device_mover

META = torch.device("meta")
move = device_mover(META)


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    label: str
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FrozenRecord:
    x: torch.Tensor


@dataclasses.dataclass
class TextRecord:
    text: list[str]
    y: torch.Tensor


@attrs.define
class AttrsRecord:
    x: torch.Tensor
    mask: torch.Tensor


class GraphBatch:
    """A batch type with its own ``to()`` (as graph libraries have)."""

    def __init__(self, nodes: torch.Tensor) -> None:
        self.nodes = nodes

    def to(self, device: torch.device) -> GraphBatch:
        return GraphBatch(self.nodes.to(device))


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict | collections.UserDict):
        return [t for item in value.values() for t in tensors(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in tensors(item)]
    if dataclasses.is_dataclass(value):
        return [t for item in vars(value).values() for t in tensors(item)]
    if attrs.has(type(value)):
        return [t for item in attrs.asdict(value, recurse=False).values() for t in tensors(item)]
    if isinstance(value, GraphBatch):
        return [value.nodes]
    return []


def x() -> torch.Tensor:
    return torch.ones(4, 3)


@pytest.mark.parametrize(
    "batch",
    [
        x(),
        (x(), x()),
        [x(), (x(), {"m": x()})],
        {"a": x(), "b": [x()]},
        collections.OrderedDict(b=x(), a=x()),
        collections.defaultdict(list, {"a": x()}),
        collections.UserDict({"a": x()}),
        Pair(x(), x()),
        Record(x(), "cat", {"m": x()}),
        FrozenRecord(x()),
        AttrsRecord(x(), x()),
        GraphBatch(x()),
    ],
    ids=lambda b: type(b).__name__,
)
def test_every_tensor_of_a_batch_reaches_the_device_and_its_types_stay(batch: Any) -> None:
    moved = move(batch)
    assert type(moved) is type(batch)
    found = tensors(moved)
    assert found and all(t.device == META for t in found)
    assert all(t.device.type == "cpu" for t in tensors(batch))  # the loader's batch is left as it was


def test_structure_and_non_tensor_values_are_kept() -> None:
    assert list(move(collections.OrderedDict(b=x(), a=x()))) == ["b", "a"]
    moved = move(collections.defaultdict(list, {"a": x()}))
    assert moved.default_factory is list
    record = move(Record(x(), "cat"))
    assert record.label == "cat" and record.extra == {}
    pair = move(Pair(x(), x()))
    assert pair._fields == ("x", "y") and pair.x.device == META
    assert move("text") == "text" and move(3) == 3 and move(None) is None


def test_a_read_only_mapping_becomes_a_dict() -> None:
    moved = move(types.MappingProxyType({"a": x()}))
    assert isinstance(moved, dict) and moved["a"].device == META


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (torch.ones(5, 2), 5),
        (torch.tensor(1.0), 1),
        ({}, 0),
        (Pair(torch.ones(6), torch.ones(6)), 6),
        (Record(torch.ones(7, 2), "cat"), 7),
        (AttrsRecord(torch.ones(3), torch.ones(3)), 3),
        ("text", 1),
        ((["a", "b", "c"], torch.ones(3, 1)), 3),  # default collate of (str, tensor) items: the strings come first
        ({"text": ["a", "b"], "ids": {"input": torch.ones(2, 5)}}, 2),
        ([("a", None), torch.ones(4)], 4),
        (TextRecord(["a", "b"], torch.ones(2)), 2),
    ],
    ids=repr,
)
def test_the_batch_size_is_the_first_tensors_first_dimension(batch: Any, expected: int) -> None:
    assert batch_size(batch) == expected


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (["a", "b", "c"], 3),
        ((["a", "b"], ["c", "d"]), 2),  # a tuple groups fields: its first list counts the samples
        ([("a", 1), ("b", 2), ("c", 3)], 3),  # an identity collate's list of samples
        ({"text": ["a", "b", "c", "d"]}, 4),
        ([], 0),
        ((), 0),
        ({}, 0),
        (GraphBatch(x()), 1),
    ],
    ids=repr,
)
def test_a_batch_without_a_tensor_counts_its_first_list(batch: Any, expected: int) -> None:
    assert batch_size(batch) == expected


class Texts(torch.utils.data.Dataset[tuple[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]:
        return f"sample {index}", torch.tensor([float(index)])


class Constant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, texts: list[str]) -> torch.Tensor:
        return self.w.expand(len(texts), 1)


def test_validation_weights_text_batches_by_their_samples() -> None:
    loader = torch.utils.data.DataLoader(Texts(), batch_size=4)  # batches of 4, 4 and 2 samples
    strategy = nvtrain.TrainingStrategy(
        models=Constant(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
    )
    summary = strategy.validate(loader)
    assert summary["num_samples"] == 10
    assert summary["loss"].item() == pytest.approx(sum(i * i for i in range(10)) / 10)  # 28.5


class BatchDevices:
    """Records the device of ``ctx.batch``'s first tensor and the batch's type at BEFORE_FORWARD."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device]] = []

    @nvtrain.hookimpl
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen.append((type(ctx.batch).__name__, tensors(ctx.batch)[0].device))


@pytest.mark.parametrize("batch", [Pair(x(), torch.ones(4, 2)), Record(x(), "cat", {"y": torch.ones(4, 2)})], ids=repr)
def test_the_strategy_hands_hooks_the_batch_on_its_device(batch: Any) -> None:
    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        return ctx.models["main"](ctx.batch.x)

    seen = BatchDevices()
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=lambda outputs, batch: outputs.sum(),
        forward_fn=forward,
        hooks=[seen],
        device="meta",
    )
    strategy.train_batch(batch)
    assert seen.seen == [(type(batch).__name__, META)]


class Store(MutableMapping[str, Any]):
    """A mapping class of its own, its items in a dict it keeps (a shallow copy would share it)."""

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_moving_a_mapping_of_its_own_class_leaves_the_callers_batch_on_the_cpu() -> None:
    batch = Store(x=x())
    moved = move(batch)
    assert batch["x"].device.type == "cpu"  # the loader's batch (maybe a cached one) is not changed
    assert moved["x"].device == META and isinstance(moved, dict)  # Store(**items) only: a dict


class _NotIterated(list):  # type: ignore[type-arg]
    """A list that fails when iterated: the batch-size search must not walk a collated list item by item."""

    def __iter__(self) -> Any:
        raise AssertionError("batch_size walked a list of one kind of item, one call per item")


def test_the_batch_size_search_passes_over_lists_of_one_kind_of_item_whole() -> None:
    token_ids = _NotIterated([_NotIterated([1] * 2048) for _ in range(4)])
    assert batch_size({"input_ids": token_ids, "labels": _NotIterated([0] * 4)}) == 4
    arrays = _NotIterated([types.SimpleNamespace(values=[0.0] * 8) for _ in range(4)])  # e.g. numpy arrays
    assert batch_size((arrays, torch.ones(4))) == 4
