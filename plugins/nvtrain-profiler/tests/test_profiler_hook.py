"""TorchProfilerHook: Chrome traces of a CPU run, per-rank folders, finalised on every exit path."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_profiler import TorchProfilerHook
from torch.profiler import ProfilerActivity

import nvtrain
from nvtrain.validators import FieldValueError


def make_strategy(hooks: list[object], **kwargs: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        **kwargs,
    )


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def event_names(trace: Path) -> set[str]:
    data = json.loads(trace.read_text())
    return {event.get("name", "") for event in data["traceEvents"]}


def trace_files(root: Path, rank: int = 0) -> list[Path]:
    return sorted((root / f"rank_{rank}" / "torch").iterdir())


def test_cpu_run_writes_a_chrome_trace_naming_the_models_ops(tmp_path: Path) -> None:
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=(ProfilerActivity.CPU,))
    with make_strategy([profiler]) as strategy:
        strategy.run(make_batches(3))
        assert not profiler.running  # finalised at AFTER_TRAINING
    files = trace_files(tmp_path)
    assert files == profiler.traces
    assert len(files) == 1 and files[0].name.endswith(".pt.trace.json")
    names = event_names(files[0])
    assert "aten::addmm" in names  # the Linear layers' forward
    assert "aten::relu" in names
    assert any(name.startswith("Optimizer.step#SGD") for name in names)


@pytest.mark.filterwarnings("ignore:.*Profiler clears events at the end of each cycle")
def test_schedule_writes_one_trace_per_active_cycle(tmp_path: Path) -> None:
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=2)
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"], schedule=schedule)
    with make_strategy([profiler]) as strategy:
        strategy.run(make_batches(9))
    files = trace_files(tmp_path)
    assert len(files) == 2
    for trace in files:
        steps = {name for name in event_names(trace) if name.startswith("ProfilerStep#")}
        assert len(steps) == 2


@pytest.mark.filterwarnings("ignore:.*Profiler clears events at the end of each cycle")
def test_a_schedule_given_as_its_arguments_is_built_from_them(tmp_path: Path) -> None:
    """What a config can say: ``schedule: {wait: 1, warmup: 1, active: 2, repeat: 2}``."""
    arguments = {"wait": 1, "warmup": 1, "active": 2, "repeat": 2}
    profiler = nvtrain.plugins.load("profiler", output_dir=tmp_path, activities=["cpu"], schedule=arguments)
    expected = torch.profiler.schedule(**arguments)
    assert [profiler.schedule(step) for step in range(10)] == [expected(step) for step in range(10)]  # type: ignore[misc]
    with make_strategy([profiler]) as strategy:
        strategy.run(make_batches(9))
    assert len(trace_files(tmp_path)) == 2
    only_active = TorchProfilerHook(schedule={"active": 3})  # the others default to 0, as in torch
    assert [only_active.schedule(step) for step in range(4)] == [  # type: ignore[misc]
        torch.profiler.schedule(wait=0, warmup=0, active=3)(step) for step in range(4)
    ]


@pytest.mark.parametrize(("skip_first", "profiled"), [(0, {"ProfilerStep#1"}), (4, {"ProfilerStep#5"})])
def test_a_schedules_skip_first_skips_that_many_steps_before_its_cycle(
    tmp_path: Path, skip_first: int, profiled: set[str]
) -> None:
    """``schedule: {warmup: 1, active: 1, repeat: 1, skip_first: 4}``: steps 0-3 skipped, 4 warms up, 5 recorded."""
    arguments = {"warmup": 1, "active": 1, "repeat": 1} | ({"skip_first": skip_first} if skip_first else {})
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"], schedule=arguments)
    with make_strategy([profiler]) as strategy:
        strategy.run(make_batches(8))
    (trace,) = trace_files(tmp_path)
    assert {name for name in event_names(trace) if name.startswith("ProfilerStep#")} == profiled


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({"wait": 1, "warmup": 1}, r"TorchProfilerHook\.schedule: no 'active' in"),
        ({"active": 2, "wiat": 1}, r"TorchProfilerHook\.schedule: unknown key\(s\) \['wiat'\]"),
        ({"active": 0}, r"TorchProfilerHook\.schedule\.active must be an int >= 1 \(got 0\)"),
        ({"active": 2, "repeat": 1.5}, r"TorchProfilerHook\.schedule\.repeat must be an int >= 0 \(got 1\.5\)"),
        ({"active": 2, "wait": True}, r"TorchProfilerHook\.schedule\.wait must be an int >= 0 \(got True\)"),
    ],
)
def test_bad_schedule_arguments_are_named(schedule: dict[str, Any], message: str) -> None:
    with pytest.raises(FieldValueError, match=message):
        TorchProfilerHook(schedule=schedule)


@pytest.mark.filterwarnings("ignore:.*Profiler clears events at the end of each cycle")
@pytest.mark.filterwarnings("ignore:.*Profiler won't be using warmup")
def test_no_trace_is_written_for_a_cycle_no_micro_batch_reached(tmp_path: Path) -> None:
    """repeat=0 opens a new cycle after the last micro-batch; a second run() has nothing left to train."""
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=["cpu"], schedule={"active": 2})
    with make_strategy([profiler]) as strategy:
        strategy.run(make_batches(8))
        assert len(trace_files(tmp_path)) == 4  # 8 micro-batches, cycles of 2: four traces, no fifth
        strategy.run(make_batches(8))  # the epoch is done: nothing to train, no trace
    files = trace_files(tmp_path)
    assert len(files) == 4
    for trace in files:
        assert len({name for name in event_names(trace) if name.startswith("ProfilerStep#")}) == 2


def test_profiler_is_finalised_after_an_exception(tmp_path: Path) -> None:
    calls = {"n": 0}

    def failing_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in loss")
        return torch.nn.functional.mse_loss(outputs, targets)

    profiler = TorchProfilerHook(output_dir=tmp_path, activities=(ProfilerActivity.CPU,))
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=failing_loss,
        hooks=[profiler],
        device="cpu",
    )
    with pytest.raises(RuntimeError, match="boom in loss"), strategy:
        strategy.run(make_batches(5))
    assert not profiler.running
    assert not torch.autograd._profiler_enabled()
    files = trace_files(tmp_path)
    assert len(files) == 1
    assert "aten::addmm" in event_names(files[0])


def test_standalone_train_batch_starts_lazily_and_closes_with_the_strategy(tmp_path: Path) -> None:
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=(ProfilerActivity.CPU,))
    with make_strategy([profiler]) as strategy:
        assert not profiler.running
        for batch in make_batches(2):
            strategy.train_batch(batch)
        assert profiler.running
        assert trace_files(tmp_path) == []
    assert not profiler.running
    assert len(trace_files(tmp_path)) == 1


def test_traces_go_to_the_global_rank_folder(tmp_path: Path) -> None:
    profiler = TorchProfilerHook(output_dir=tmp_path, activities=(ProfilerActivity.CPU,))
    strategy = make_strategy([profiler])
    strategy.ctx.rank = 3
    with strategy:
        strategy.run(make_batches(1))
    assert len(trace_files(tmp_path, rank=3)) == 1
    assert not (tmp_path / "rank_0").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"activities": ["gpu"]}, ValueError, r"TorchProfilerHook\.activities: unknown activity name 'gpu' \(known: "),
        ({"activities": [3]}, TypeError, r"TorchProfilerHook\.activities must hold .* \(got 3\)"),
        ({"activities": ()}, ValueError, r"TorchProfilerHook\.activities is empty"),
        ({"schedule": 3}, TypeError, r"TorchProfilerHook\.schedule must be a callable .* \(got 3\)"),
        ({"record_shapes": "yes"}, TypeError, r"TorchProfilerHook\.record_shapes must be True or False"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        TorchProfilerHook(**kwargs)


@pytest.mark.parametrize("activities", [["cuda"], [ProfilerActivity.CPU, ProfilerActivity.CUDA], "CUDA"])
def test_an_activity_this_machine_cannot_profile_is_refused_when_built(
    activities: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without CUDA it was accepted (and passed `nvtrain validate`), then torch.profiler dropped it and raised
    # "AssertionError: No activities specified for the profiler" at the first batch
    monkeypatch.setattr(torch.profiler, "supported_activities", lambda: {ProfilerActivity.CPU})
    with pytest.raises(FieldValueError) as caught:
        TorchProfilerHook(activities=activities)
    assert (caught.value.owner, caught.value.field) == ("TorchProfilerHook", "activities")
    assert str(caught.value) == (
        "TorchProfilerHook.activities: cuda cannot be profiled on this machine "
        "(torch.profiler supports: cpu; or None for what is available)"
    )
    assert TorchProfilerHook(activities=["cpu"]).activities == (ProfilerActivity.CPU,)


def test_an_existing_file_as_output_dir_is_refused_when_built(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for below in ("", "sub/dir"):  # the file itself, or a folder that would have to be made inside it
        with pytest.raises(FieldValueError, match=r"^TorchProfilerHook\.output_dir must be a folder path, neither"):
            TorchProfilerHook(output_dir=tmp_path / "afile" / below, activities=["cpu"])
    assert TorchProfilerHook(output_dir=tmp_path, activities=["cpu"]).output_dir == tmp_path


def test_settings_and_metadata() -> None:
    import nvtrain_profiler

    hook = TorchProfilerHook(output_dir="runs/p", activities=("CPU", ProfilerActivity.CPU))
    assert hook.output_dir == Path("runs/p")
    assert hook.activities == (ProfilerActivity.CPU,)
    assert hook.trace_dir(2) == Path("runs/p/rank_2/torch")
    assert nvtrain_profiler.__nvtrain_hooks__ == (TorchProfilerHook,)
    assert TorchProfilerHook.plugin_name == "profiler"


def test_discovered_through_its_entry_point() -> None:
    import nvtrain.plugins

    nvtrain.plugins.refresh()
    info = {plugin.name: plugin for plugin in nvtrain.plugins.available()}["profiler"]
    assert info.status is nvtrain.plugins.PluginStatus.OK, info.error
    assert info.distribution == "nvtrain-profiler"
    assert [hook.name for hook in info.hooks] == ["TorchProfilerHook"]
    hook = nvtrain.plugins.load("profiler", output_dir="runs/p")
    assert isinstance(hook, TorchProfilerHook)
    assert hook.output_dir == Path("runs/p")
