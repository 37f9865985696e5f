"""Settings of built-in hooks that change behaviour: each test fails when the code ignores its setting.

SpikeSkipHook.process_group, StageTimingHook.nvtx, ProgressBarHook.refresh_interval and .ncols,
ModulePatchHook.model_keys.
"""

from __future__ import annotations

import functools
import io
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import nvtrain
from nvtrain.hooks import ModulePatchHook, SpikeSkipHook, StageTimingHook
from nvtrain.logging_hooks import ProgressBarHook

MakeStrategy = Callable[..., nvtrain.TrainingStrategy]
Batches = Callable[..., list[tuple[torch.Tensor, torch.Tensor]]]


# -- SpikeSkipHook.process_group ------------------------------------------------------------------


def pretend_group_of_two(monkeypatch: pytest.MonkeyPatch, group: Any, peer_rows: list[float | None]) -> list[Any]:
    """Make the real one-process ``group`` look like a group of two; returns the groups all_reduce ran on.

    ``get_world_size`` reports 2 for ``group`` alone (the default group keeps its real size 1, so a hook
    deciding over it runs no collective). After each real all_reduce of a two-row table, the peer's row
    is filled from ``peer_rows``: None copies this rank's values, a number stands for every value.
    """
    real_world_size, real_all_reduce = dist.get_world_size, dist.all_reduce
    reduced_on: list[Any] = []

    def world_size(group_: Any = None) -> int:
        return 2 if group_ is group else real_world_size(group_)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced_on.append(kwargs.get("group"))
        work = real_all_reduce(tensor, *args, **kwargs)
        if tensor.dim() == 2 and tensor.shape[0] == 2:
            peer = peer_rows.pop(0)
            tensor[1] = tensor[0] if peer is None else peer
        return work

    monkeypatch.setattr(dist, "get_world_size", world_size)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return reduced_on


def test_spike_skip_agrees_over_the_given_process_group(
    world_of_one: None, make_strategy: MakeStrategy, batches: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = dist.new_group([0])
    reduced_on = pretend_group_of_two(monkeypatch, group, peer_rows=[None, math.nan])
    hook = SpikeSkipHook(warmup_steps=50, process_group=group)
    strategy = make_strategy([hook], device="cpu")
    first, second = batches(2)

    strategy.train_batch(first)  # the peer saw the same values: accepted
    assert reduced_on == [group]
    assert not strategy.ctx.step_skipped and hook.accepted_steps == 1

    strategy.train_batch(second)  # only the peer's values are NaN: this rank skips as well
    assert reduced_on == [group, group]
    assert strategy.ctx.step_skipped and hook.skipped_steps == 1
    assert strategy.ctx.step_count == 1


def test_spike_skip_without_a_group_decides_over_the_default_one(
    world_of_one: None, make_strategy: MakeStrategy, batches: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the contrast: with process_group None the default group (one process) decides, with no collective
    reduced_on = pretend_group_of_two(monkeypatch, dist.new_group([0]), peer_rows=[math.nan, math.nan])
    hook = SpikeSkipHook(warmup_steps=50)
    strategy = make_strategy([hook], device="cpu")
    for batch in batches(2):
        strategy.train_batch(batch)
    assert reduced_on == []
    assert hook.accepted_steps == 2 and strategy.ctx.step_count == 2


# -- StageTimingHook.nvtx -------------------------------------------------------------------------


class FakeEvent:
    """Stands in for torch.cuda.Event on CPU, so the CUDA timing path runs on any machine."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.time = 0.0

    def record(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1000.0


def nvtx_calls(monkeypatch: pytest.MonkeyPatch, fake_cuda: bool) -> list[str]:
    """Record NVTX pushes (the range name) and pops ("pop") in order; optionally fake a CUDA device."""
    calls: list[str] = []
    if fake_cuda:
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", calls.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    return calls


def timed_run(make_strategy: MakeStrategy, batches: Batches, hook: StageTimingHook, cuda: bool) -> None:
    """Two micro-batches, then close(); with ``cuda`` the hook takes its CUDA path (the model stays on CPU)."""
    strategy = make_strategy([hook], device="cpu")
    if cuda:
        strategy.ctx.device = torch.device("cuda")  # only the timing hook reads it
    for batch in batches(2):
        strategy.train_batch(batch)
    strategy.close()


def test_nvtx_on_pushes_one_range_per_timed_interval(
    make_strategy: MakeStrategy,
    batches: Batches,
    batch_sequence: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    calls = nvtx_calls(monkeypatch, fake_cuda=True)
    hook = StageTimingHook(output=tmp_path / "t.csv", nvtx=True)
    timed_run(make_strategy, batches, hook, cuda=True)
    # each stage closes the previous stage's range and opens its own; close() pops the last one
    stage_names = [name.upper() for name in batch_sequence] * 2
    expected = [stage_names[0]] + [call for name in stage_names[1:] for call in ("pop", name)] + ["pop"]
    assert calls == expected
    assert hook.report()["BEFORE_FORWARD"]["count"] == 2


def test_nvtx_off_pushes_no_range_but_still_times(
    make_strategy: MakeStrategy, batches: Batches, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    calls = nvtx_calls(monkeypatch, fake_cuda=True)
    hook = StageTimingHook(output=tmp_path / "t.csv", nvtx=False)
    timed_run(make_strategy, batches, hook, cuda=True)
    assert calls == []
    assert hook.report()["BEFORE_FORWARD"]["count"] == 2  # the CUDA path ran: events timed the stages


def test_nvtx_is_only_emitted_on_cuda(
    make_strategy: MakeStrategy, batches: Batches, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # nvtx=True (the default) is accepted without CUDA: on a CPU device it simply emits nothing
    calls = nvtx_calls(monkeypatch, fake_cuda=False)
    hook = StageTimingHook(output=tmp_path / "t.csv")
    assert hook.nvtx is True
    timed_run(make_strategy, batches, hook, cuda=False)
    assert calls == []
    assert hook.report()["BEFORE_FORWARD"]["count"] == 2


# -- ProgressBarHook.ncols and refresh_interval -----------------------------------------------------


def bar_frames(make_strategy: MakeStrategy, batches: Batches, steps: int, **settings: Any) -> list[str]:
    """Every frame a tqdm bar drew on a StringIO over a run of ``steps`` steps."""
    stream = io.StringIO()
    hook = ProgressBarHook(log_every_n_steps=1, stream=stream, use_bar=True, **settings)
    with make_strategy([hook], device="cpu", max_steps=steps) as strategy:
        strategy.run(batches(steps))
    return [frame for frame in stream.getvalue().replace("\n", "\r").split("\r") if frame.strip()]


@pytest.mark.parametrize("ncols", [72, 110])
def test_ncols_sets_the_width_of_every_frame(
    ncols: int, make_strategy: MakeStrategy, batches: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "90")  # what a bar following the terminal would take instead
    frames = bar_frames(make_strategy, batches, steps=3, ncols=ncols, refresh_interval=1e-9)
    assert len(frames) >= 4  # the first frame and one per step
    assert {len(frame) for frame in frames} == {ncols}, frames
    assert "loss " in frames[-1]  # the postfix fits into that width


@pytest.mark.parametrize(("refresh_interval", "shown"), [(1e-9, list(range(7))), (3600.0, [0, 6])])
def test_refresh_interval_sets_how_often_the_bar_redraws(
    refresh_interval: float, shown: list[int], make_strategy: MakeStrategy, batches: Batches
) -> None:
    # a tiny interval redraws at every step; an hour draws only the first and the closing frame
    frames = bar_frames(make_strategy, batches, steps=6, refresh_interval=refresh_interval, ncols=100)
    counts = [int(match.group(1)) for frame in frames if (match := re.search(r"\| (\d+)/6 ", frame))]
    assert sorted(set(counts)) == shown, frames


# -- ModulePatchHook.model_keys ---------------------------------------------------------------------


def headed_model() -> torch.nn.Module:
    return torch.nn.Sequential(OrderedDict(body=torch.nn.Linear(3, 4), head=torch.nn.Linear(4, 2)))


def head(strategy: nvtrain.TrainingStrategy, key: str) -> torch.nn.Linear:
    module = strategy.ctx.models[key].get_submodule("head")
    assert isinstance(module, torch.nn.Linear)
    return module


def patched(model_keys: Any, make_strategy: MakeStrategy) -> tuple[nvtrain.TrainingStrategy, ModulePatchHook]:
    """A strategy over models "a" and "b" (one optimizer each) whose SETUP ran a head patch."""
    hook = ModulePatchHook(patches={"head": lambda old: torch.nn.Linear(old.in_features, 5)}, model_keys=model_keys)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    strategy = make_strategy(
        [hook],
        models={"a": headed_model(), "b": headed_model()},
        optimizers={"a": sgd, "b": sgd},
        forward_fn=lambda ctx: ctx.models["a"](ctx.batch[0]),  # no "main" model for the default forward
        device="cpu",
    )
    return strategy, hook


def optimizer_holds(strategy: nvtrain.TrainingStrategy, name: str, module: torch.nn.Module) -> bool:
    held = {id(p) for group in strategy.ctx.optimizers[name].param_groups for p in group["params"]}
    return {id(p) for p in module.parameters()} <= held


def test_model_keys_patch_only_the_named_model(make_strategy: MakeStrategy) -> None:
    strategy, hook = patched(("a",), make_strategy)
    old_b_head = head(strategy, "b")
    strategy.setup()
    assert hook.replaced == [("a", "head")]
    assert head(strategy, "a").out_features == 5
    assert head(strategy, "b") is old_b_head and old_b_head.out_features == 2
    assert optimizer_holds(strategy, "a", head(strategy, "a")) and optimizer_holds(strategy, "b", old_b_head)


def test_without_model_keys_every_model_is_patched(make_strategy: MakeStrategy) -> None:
    strategy, hook = patched(None, make_strategy)
    strategy.setup()
    assert hook.replaced == [("a", "head"), ("b", "head")]
    assert [head(strategy, key).out_features for key in ("a", "b")] == [5, 5]


def test_model_keys_naming_an_unknown_model_is_an_error(make_strategy: MakeStrategy) -> None:
    strategy, _ = patched(("a", "c"), make_strategy)
    with pytest.raises(ValueError, match=r"ModulePatchHook\.model_keys names \['c'\], but the models are \['a', 'b'\]"):
        strategy.setup()
