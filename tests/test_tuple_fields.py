"""Fields that take one item or several refuse a value that cannot be iterated (a 0-d tensor), naming the field;
and the shared path checks name the setting and what is in the way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from nvtrain_ddp import DDPHook
from nvtrain_fsdp import FSDPHook
from nvtrain_profiler import TorchProfilerHook
from torch.profiler import ProfilerActivity

from nvtrain.hooks import (
    GradientClippingHook,
    ModulePatchHook,
    SpikeSkipHook,
    StageTimingHook,
    TrainableParameterHook,
)
from nvtrain.stages import TrainingStage
from nvtrain.validators import FieldTypeError, FieldValueError, as_path, as_tuple, file_path, folder_path

#: (the hook's name, build it with the field set to a value, the field).
TUPLE_FIELDS: list[tuple[str, Callable[[Any], object], str]] = [
    ("GradientClippingHook", lambda v: GradientClippingHook(max_norm=1.0, model_keys=v), "model_keys"),
    ("SpikeSkipHook", lambda v: SpikeSkipHook(monitor=v), "monitor"),
    ("TrainableParameterHook", lambda v: TrainableParameterHook(trainable=v), "trainable"),
    ("TrainableParameterHook", lambda v: TrainableParameterHook(trainable="a", frozen=v), "frozen"),
    ("TrainableParameterHook", lambda v: TrainableParameterHook(trainable="a", model_keys=v), "model_keys"),
    ("ModulePatchHook", lambda v: ModulePatchHook(patches={"a": torch.nn.Identity}, model_keys=v), "model_keys"),
    ("StageTimingHook", lambda v: StageTimingHook(stages=v), "stages"),
    ("TorchProfilerHook", lambda v: TorchProfilerHook(activities=v), "activities"),
    ("FSDPHook", lambda v: FSDPHook(model_keys=v), "model_keys"),
    ("FSDPHook", lambda v: FSDPHook(shard_classes=v), "shard_classes"),
    ("DDPHook", lambda v: DDPHook(model_keys=v), "model_keys"),
]


@pytest.mark.parametrize(("owner", "build", "field"), TUPLE_FIELDS, ids=[f"{o}.{f}" for o, _, f in TUPLE_FIELDS])
def test_a_0d_tensor_is_refused_naming_the_field(owner: str, build: Callable[[Any], object], field: str) -> None:
    value = torch.tensor(3)
    with pytest.raises(FieldTypeError) as caught:
        build(value)
    assert (caught.value.owner, caught.value.field, caught.value.value) == (owner, field, value)
    message = str(caught.value)
    assert message == (
        f"{owner}.{field} must be {caught.value.expected} (got tensor(3), which cannot be iterated: "
        "iteration over a 0-d tensor)"
    )


@pytest.mark.parametrize(
    ("build", "field", "value", "expected"),
    [
        (lambda v: GradientClippingHook(max_norm=1.0, model_keys=v), "model_keys", ["a", "b"], ("a", "b")),
        (lambda v: GradientClippingHook(max_norm=1.0, model_keys=v), "model_keys", "a", ("a",)),
        (lambda v: SpikeSkipHook(monitor=v), "monitor", iter(["loss"]), ("loss",)),
        (lambda v: TrainableParameterHook(trainable="a", frozen=v), "frozen", None, ()),
        (lambda v: TrainableParameterHook(trainable=v), "trainable", ["x.*"], ("x.*",)),
        (lambda v: StageTimingHook(stages=v), "stages", "after_batch", (TrainingStage.AFTER_BATCH,)),
        (lambda v: TorchProfilerHook(activities=v), "activities", "cpu", (ProfilerActivity.CPU,)),
        (lambda v: FSDPHook(shard_classes=v), "shard_classes", ["Block", "Block"], ("Block",)),
        (lambda v: DDPHook(model_keys=v), "model_keys", "main", ("main",)),
    ],
)
def test_the_forms_taken_before_are_taken_alike(
    build: Callable[[Any], object], field: str, value: Any, expected: tuple[Any, ...]
) -> None:
    assert getattr(build(value), field) == expected


def test_as_tuple_keeps_an_iterables_items_and_chains_the_reason() -> None:
    assert as_tuple((x for x in "ab"), "H", "f", "names") == ("a", "b")
    with pytest.raises(FieldTypeError, match=r"^H\.f must be names \(got 5, which cannot be iterated: 'int'") as got:
        as_tuple(5, "H", "f", "names")
    assert isinstance(got.value.__cause__, TypeError)


@attrs.define
class _Paths:
    file: Path = attrs.field(converter=lambda v: as_path(v, "_Paths", "file"), validator=file_path())
    folder: Path = attrs.field(converter=lambda v: as_path(v, "_Paths", "folder"), validator=folder_path())


def test_file_path_refuses_a_directory_and_a_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    expected = "a file path, neither an existing directory nor under a file"
    with pytest.raises(FieldValueError) as caught:
        _Paths(tmp_path, tmp_path)
    assert str(caught.value) == f"_Paths.file must be {expected} (got '{tmp_path}', a directory)"
    with pytest.raises(FieldValueError) as caught:
        _Paths(tmp_path / "f" / "x.csv", tmp_path)
    assert str(caught.value) == f"_Paths.file must be {expected} (got '{tmp_path}/f/x.csv': '{tmp_path}/f' is a file)"
    assert _Paths(tmp_path / "new" / "x.csv", tmp_path / "new").file == tmp_path / "new" / "x.csv"


def test_folder_path_refuses_a_file_and_a_path_under_one(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    expected = "a folder path, neither an existing file nor under one"
    with pytest.raises(FieldValueError) as caught:
        _Paths(tmp_path / "x.csv", tmp_path / "f")
    assert str(caught.value) == f"_Paths.folder must be {expected} (got '{tmp_path}/f', a file)"
    with pytest.raises(FieldValueError) as caught:
        _Paths(tmp_path / "x.csv", tmp_path / "f" / "sub")
    assert str(caught.value) == f"_Paths.folder must be {expected} (got '{tmp_path}/f/sub': '{tmp_path}/f' is a file)"


def test_the_profilers_output_dir_names_the_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(FieldValueError) as caught:
        TorchProfilerHook(output_dir=tmp_path / "f" / "profiles")
    assert str(caught.value).endswith(f"(got '{tmp_path}/f/profiles': '{tmp_path}/f' is a file)")
