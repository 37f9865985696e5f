"""FSDPHook's process_group and sampler_kwargs go through the checks it shares with DDPHook."""

from __future__ import annotations

from typing import Any

import pytest
from nvtrain_fsdp import FSDPHook

from nvtrain.validators import FieldTypeError, FieldValueError


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        (
            {"process_group": "world"},
            FieldTypeError,
            r"^FSDPHook\.process_group must be a torch\.distributed\.ProcessGroup",
        ),
        (
            {"sampler_kwargs": {"shufle": True}},
            FieldValueError,
            r"^FSDPHook\.sampler_kwargs: DistributedSampler takes no keyword 'shufle'",
        ),
    ],
)
def test_bad_process_group_and_sampler_kwargs_fail_at_construction(
    settings: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        FSDPHook(**settings)
