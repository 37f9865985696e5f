"""TorchProfilerHook's recording settings reach torch.profiler: each test fails if the hook ignored its setting.

``record_shapes`` and ``profile_memory`` show in the Chrome trace; ``with_flops`` in the profiler's
``key_averages()``; ``activities`` in what torch.profiler is built with (on the CPU it equals torch's
default, so the arguments are checked) and, on a CUDA device, in the trace.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from nvtrain_profiler import TorchProfilerHook
from torch.profiler import ProfilerActivity

import nvtrain

#: The model's layers: Linear(4, 8), ReLU, Linear(8, 1), on batches of 8 rows.
BATCH, WIDTH, HIDDEN = 8, 4, 8


class RecordingProfile(torch.profiler.profile):
    """The real torch.profiler.profile, remembering each instance and the arguments it was built with."""

    created: ClassVar[list[RecordingProfile]] = []

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kwargs = kwargs
        RecordingProfile.created.append(self)


@pytest.fixture
def profiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RecordingProfile]]:
    """Every profiler the hook builds (it looks up ``torch.profiler.profile`` when it starts)."""
    created: list[RecordingProfile] = []
    monkeypatch.setattr(RecordingProfile, "created", created)
    monkeypatch.setattr(torch.profiler, "profile", RecordingProfile)
    yield created


def run_one_batch(hook: TorchProfilerHook, device: str = "cpu") -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 1, generator=generator))
    with nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook],
        device=device,
    ) as strategy:
        strategy.run([batch])


def trace_events(hook: TorchProfilerHook) -> list[dict[str, Any]]:
    (trace,) = hook.traces
    events: list[dict[str, Any]] = json.loads(trace.read_text())["traceEvents"]
    return events


@pytest.mark.parametrize("record_shapes", [True, False])
def test_record_shapes_puts_the_operators_input_shapes_in_the_trace(tmp_path: Path, record_shapes: bool) -> None:
    hook = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"], record_shapes=record_shapes)
    run_one_batch(hook)
    addmms = [event for event in trace_events(hook) if event.get("name") == "aten::addmm"]
    assert len(addmms) == 2  # one per Linear's forward
    dims = [event["args"].get("Input Dims") for event in addmms]
    if record_shapes:  # addmm(bias, input, weight.T, beta, alpha)
        assert dims == [
            [[HIDDEN], [BATCH, WIDTH], [WIDTH, HIDDEN], [], []],
            [[1], [BATCH, HIDDEN], [HIDDEN, 1], [], []],
        ]
    else:
        assert dims == [None, None]


@pytest.mark.parametrize("profile_memory", [True, False])
def test_profile_memory_puts_allocations_in_the_trace(tmp_path: Path, profile_memory: bool) -> None:
    hook = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"], profile_memory=profile_memory)
    run_one_batch(hook)
    memory = [event for event in trace_events(hook) if event.get("name") == "[memory]"]
    if profile_memory:
        allocated = {event["args"]["Bytes"] for event in memory if event["args"]["Bytes"] > 0}
        assert BATCH * HIDDEN * 4 in allocated  # the first Linear's float32 output
        assert {event["args"]["Device Type"] for event in memory} == {0}  # all on the CPU
    else:
        assert memory == []


@pytest.mark.parametrize("with_flops", [True, False])
def test_with_flops_estimates_the_matrix_multiplications(
    tmp_path: Path, profiles: list[RecordingProfile], with_flops: bool
) -> None:
    hook = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"], with_flops=with_flops)
    run_one_batch(hook)
    (profiler,) = profiles
    (addmm,) = [event for event in profiler.key_averages() if event.key == "aten::addmm"]
    # 2 * rows * inputs * outputs for each Linear's forward, or nothing without the estimate
    expected = 2 * BATCH * WIDTH * HIDDEN + 2 * BATCH * HIDDEN * 1 if with_flops else 0
    assert addmm.count == 2 and addmm.flops == expected


def test_activities_are_what_the_profiler_is_built_with(tmp_path: Path, profiles: list[RecordingProfile]) -> None:
    run_one_batch(TorchProfilerHook(output_dir=tmp_path / "cpu", activities=["cpu"]))
    run_one_batch(TorchProfilerHook(output_dir=tmp_path / "default"))  # None: the run's device decides
    cpu = (ProfilerActivity.CPU,)
    assert [profiler.kwargs.get("activities") for profiler in profiles] == [cpu, cpu]
    assert profiles[0].activities == {ProfilerActivity.CPU}


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cpu", (ProfilerActivity.CPU,)),
        ("cuda", (ProfilerActivity.CPU, ProfilerActivity.CUDA)),
        ("cuda:1", (ProfilerActivity.CPU, ProfilerActivity.CUDA)),
        ("meta", (ProfilerActivity.CPU,)),  # no activity of its own
    ],
)
def test_the_default_activities_follow_the_runs_device_not_what_the_machine_has(
    monkeypatch: pytest.MonkeyPatch, device: str, expected: tuple[ProfilerActivity, ...]
) -> None:
    """torch's default adds CUDA wherever it is available: a run on the CPU of a machine with GPUs would
    initialise CUDA (a context on a GPU it never uses) to profile nothing there."""
    from nvtrain_profiler.hook import run_activities

    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU, ProfilerActivity.CUDA})
    assert run_activities(torch.device(device)) == expected


def test_the_default_leaves_out_an_accelerator_this_build_cannot_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from nvtrain_profiler.hook import run_activities

    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU})
    assert run_activities(torch.device("cuda")) == (ProfilerActivity.CPU,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("activities", "has_cpu_ops", "has_kernels"),
    [(["cpu"], True, False), (["cuda"], False, True), (None, True, True)],
)
def test_activities_choose_what_a_cuda_run_traces(
    tmp_path: Path, activities: list[str] | None, has_cpu_ops: bool, has_kernels: bool
) -> None:
    hook = TorchProfilerHook(output_dir=tmp_path, activities=activities)
    run_one_batch(hook, device="cuda")
    categories = {event.get("cat") for event in trace_events(hook)}
    assert ("cpu_op" in categories) is has_cpu_ops
    assert ("kernel" in categories) is has_kernels


def test_an_output_dir_that_is_no_path_is_refused_naming_the_setting() -> None:
    from nvtrain.validators import FieldTypeError

    with pytest.raises(FieldTypeError) as caught:
        TorchProfilerHook(output_dir=None)  # type: ignore[arg-type]
    assert (caught.value.owner, caught.value.field) == ("TorchProfilerHook", "output_dir")
    assert str(caught.value) == "TorchProfilerHook.output_dir must be a path (a str or os.PathLike) (got None)"
