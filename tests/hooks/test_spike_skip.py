"""SpikeSkipHook: spikes and NaNs leave the model untouched, on every rank at once."""

from __future__ import annotations

import copy
import datetime
import functools
import math
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nvtrain
from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook, SpikeSkipHook
from nvtrain.hooks.spike_skip import RollingStats
from nvtrain.stages import TrainingStage

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_batches(count: int, seed: int = 1) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, generator=generator), torch.randn(8, 2, generator=generator)) for _ in range(count)]


class InjectingLoss:
    """MSE, multiplied by ``factors[i]`` on the i-th call (a spike, or NaN)."""

    def __init__(self, factors: dict[int, float] | None = None) -> None:
        self.factors = factors or {}
        self.calls = 0
        self.values: list[float] = []

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(outputs, targets)
        factor = self.factors.get(self.calls)
        self.calls += 1
        if factor is not None:
            loss = loss * factor
        self.values.append(loss.item())
        return loss


def make_strategy(hooks: Sequence[object], loss_fn: InjectingLoss, adamw: bool = True) -> nvtrain.TrainingStrategy:
    factory = functools.partial(torch.optim.AdamW, lr=0.01) if adamw else functools.partial(torch.optim.SGD, lr=0.05)
    return nvtrain.TrainingStrategy(
        models=make_model(), optimizers=factory, loss_fn=loss_fn, hooks=list(hooks), device="cpu"
    )


def snapshot(strategy: nvtrain.TrainingStrategy) -> tuple[list[torch.Tensor], dict[str, Any]]:
    params = [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]
    return params, copy.deepcopy(strategy.ctx.optimizers["main"].state_dict())


def assert_same_snapshot(
    a: tuple[list[torch.Tensor], dict[str, Any]], b: tuple[list[torch.Tensor], dict[str, Any]]
) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    state_a, state_b = a[1]["state"], b[1]["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name, value in state_a[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[key][name])), (key, name)


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold_sigmas": 0}, r"SpikeSkipHook\.threshold_sigmas must be a finite number > 0"),
        ({"threshold_sigmas": math.inf}, r"SpikeSkipHook\.threshold_sigmas must be a finite number > 0"),
        ({"window": 1}, r"SpikeSkipHook\.window must be an int >= 2"),
        ({"warmup_steps": 1}, r"SpikeSkipHook\.warmup_steps must be an int >= 2"),
        ({"monitor": ("loss", "loss")}, r"SpikeSkipHook\.monitor must name one or both"),
        ({"monitor": "weights"}, r"SpikeSkipHook\.monitor must name one or both"),
        ({"norm_type": -2}, r"SpikeSkipHook\.norm_type must be a number > 0"),
    ],
)
def test_bad_configuration_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpikeSkipHook(**kwargs)


def test_declares_only_the_step_stage() -> None:
    hook = SpikeSkipHook()
    assert (hook.priority, hook.plugin_name) == (40, "spike_skip")
    assert hook.stages == {TrainingStage.DO_OPTIMIZER_STEP}


# -- skipping --------------------------------------------------------------------------------------


def test_a_spike_leaves_parameters_optimizer_state_and_step_count_unchanged() -> None:
    hook = SpikeSkipHook(warmup_steps=4, threshold_sigmas=6.0)
    loss_fn = InjectingLoss({6: 1e3})
    strategy = make_strategy([hook], loss_fn)
    batches = make_batches(10)
    for batch in batches[:6]:
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 6 and hook.skipped_steps == 0
    before = snapshot(strategy)

    strategy.train_batch(batches[6])  # the spike
    assert strategy.ctx.step_skipped
    assert strategy.ctx.step_count == 6
    assert_same_snapshot(snapshot(strategy), before)
    assert torch.equal(strategy.ctx.metrics["skipped_steps"], torch.tensor(1))
    assert hook.last_skipped

    for batch in batches[7:]:  # training goes on normally
        strategy.train_batch(batch)
        assert not strategy.ctx.step_skipped
    assert strategy.ctx.step_count == 9
    assert not torch.equal(snapshot(strategy)[0][0], before[0][0])
    # the spike never entered the statistics
    state = hook.state_dict()
    assert state["accepted_steps"] == 9 and state["skipped_steps"] == 1
    assert len(state["loss_history"]) == 9
    assert max(state["loss_history"]) < loss_fn.values[6] / 100


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_is_skipped_even_during_warm_up(bad: float) -> None:
    hook = SpikeSkipHook(warmup_steps=50, monitor="loss")  # the loss alone must catch it
    strategy = make_strategy([hook], InjectingLoss({1: bad}))
    batches = make_batches(4)
    strategy.train_batch(batches[0])
    before = snapshot(strategy)
    strategy.train_batch(batches[1])
    assert strategy.ctx.step_skipped and strategy.ctx.step_count == 1
    assert_same_snapshot(snapshot(strategy), before)
    for batch in batches[2:]:
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 3
    assert all(math.isfinite(p.sum().item()) for p in strategy.ctx.models["main"].parameters())
    assert hook.skipped_steps == 1


def test_a_spike_below_warm_up_is_accepted() -> None:
    hook = SpikeSkipHook(warmup_steps=5)
    strategy = make_strategy([hook], InjectingLoss({2: 1e3}))
    for batch in make_batches(4):
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 4 and hook.skipped_steps == 0


def test_gradient_norm_alone_can_decide() -> None:
    hook = SpikeSkipHook(warmup_steps=4, monitor="grad_norm")
    strategy = make_strategy([hook], InjectingLoss({6: 1e3}))
    for batch in make_batches(8):
        strategy.train_batch(batch)
    state = hook.state_dict()
    assert state["skipped_steps"] == 1 and state["loss_history"] == []
    assert len(state["norm_history"]) == 7


class NormRecorder:
    priority = 90

    def __init__(self) -> None:
        self.norms: list[float] = []

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        self.norms.append(ctx.metrics["grad_norm"].item())


def test_reuses_the_pre_clip_norm_of_the_clipping_hook() -> None:
    hook = SpikeSkipHook(warmup_steps=50)  # no threshold yet: every step is accepted
    recorder = NormRecorder()
    strategy = make_strategy([hook, GradientClippingHook(max_norm=1e-3), recorder], InjectingLoss())
    for batch in make_batches(5):
        strategy.train_batch(batch)
    assert hook.state_dict()["norm_history"] == pytest.approx(recorder.norms, rel=1e-6)
    assert min(recorder.norms) > 1e-3  # pre-clip values, not the clipped norm


def test_computes_the_norm_itself_without_a_clipping_hook() -> None:
    hook = SpikeSkipHook(warmup_steps=3, norm_type=1.0)
    strategy = make_strategy([hook], InjectingLoss(), adamw=False)
    batch = make_batches(1)[0]
    strategy.train_batch(batch)
    model = make_model()
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    expected = sum(p.grad.abs().sum().item() for p in model.parameters())  # type: ignore[union-attr]
    assert hook.state_dict()["norm_history"] == pytest.approx([expected], rel=1e-5)


def test_with_accumulation_it_decides_once_per_window_on_the_window_mean_loss() -> None:
    hook = SpikeSkipHook(warmup_steps=3, threshold_sigmas=20.0)
    loss_fn = InjectingLoss({8: 1e3})  # first micro-batch of the fifth window
    strategy = make_strategy([GradientAccumulationHook(steps=2), hook], loss_fn)
    for batch in make_batches(12):
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 5
    state = hook.state_dict()
    assert (state["accepted_steps"], state["skipped_steps"]) == (5, 1)
    window_means = [(loss_fn.values[i] + loss_fn.values[i + 1]) / 2 for i in range(0, 12, 2)]
    assert state["loss_history"] == pytest.approx(window_means[:4] + window_means[5:], rel=1e-6)


def test_state_dict_round_trip_restores_the_thresholds() -> None:
    hook = SpikeSkipHook(warmup_steps=3, window=4, threshold_sigmas=20.0)
    strategy = make_strategy([hook], InjectingLoss({5: 1e3}))
    for batch in make_batches(7):
        strategy.train_batch(batch)
    restored = SpikeSkipHook(warmup_steps=3, window=4, threshold_sigmas=20.0)
    restored.load_state_dict(hook.state_dict())
    assert restored.thresholds() == hook.thresholds()
    assert all(math.isfinite(limit) for limit in restored.thresholds())
    assert (restored.accepted_steps, restored.skipped_steps) == (6, 1)
    assert len(restored.state_dict()["loss_history"]) == 4  # the window bounds the statistics


def test_a_window_left_open_is_abandoned_not_added_to_the_next_one() -> None:
    """A standalone window left open before run() takes over: run()'s first window is judged on its own losses."""
    hook = SpikeSkipHook(warmup_steps=10)
    loss_fn = InjectingLoss({0: 1e3})  # the abandoned micro-batch's loss is huge: it would dominate the mean
    strategy = make_strategy([GradientAccumulationHook(steps=2), hook], loss_fn)
    batches = make_batches(3)
    strategy.train_batch(batches[0])  # opens a window of 2 and leaves it open
    strategy.run(batches[1:])  # one window of 2 micro-batches
    assert hook.state_dict()["loss_history"] == pytest.approx([(loss_fn.values[1] + loss_fn.values[2]) / 2])


def test_a_state_captured_inside_a_window_keeps_its_losses_so_far() -> None:
    batches = make_batches(4)
    straight_hook = SpikeSkipHook(warmup_steps=10)
    straight = make_strategy([GradientAccumulationHook(steps=2), straight_hook], InjectingLoss())
    for batch in batches:
        straight.train_batch(batch)
    first = make_strategy([GradientAccumulationHook(steps=2), SpikeSkipHook(warmup_steps=10)], InjectingLoss())
    first.train_batch(batches[0])
    state = copy.deepcopy(first.state_dict())
    resumed_hook = SpikeSkipHook(warmup_steps=10)
    resumed = make_strategy([GradientAccumulationHook(steps=2), resumed_hook], InjectingLoss())
    resumed.load_state_dict(state)
    for batch in batches[1:]:
        resumed.train_batch(batch)
    assert resumed_hook.state_dict()["loss_history"] == straight_hook.state_dict()["loss_history"]
    assert len(straight_hook.state_dict()["loss_history"]) == 2


def test_a_restored_skip_count_replaces_the_published_metric() -> None:
    hook = SpikeSkipHook(warmup_steps=3, window=4, threshold_sigmas=20.0)
    strategy = make_strategy([hook], InjectingLoss({5: 1e3}))
    for batch in make_batches(7):
        strategy.train_batch(batch)
    assert int(strategy.ctx.metrics["skipped_steps"]) == 1
    hook.load_state_dict({**hook.state_dict(), "skipped_steps": 0})  # an earlier state, restored in place
    strategy.train_batch(make_batches(1, seed=9)[0])
    assert int(strategy.ctx.metrics["skipped_steps"]) == 0


# -- rank consistency ------------------------------------------------------------------------------

SPIKE_AT = 3


def run_rank(rank: int, port: int, out_dir: Path) -> None:
    """One rank: same data on both ranks, but only rank 1's loss spikes at micro-batch SPIKE_AT."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        hook = SpikeSkipHook(warmup_steps=2, threshold_sigmas=20.0)
        strategy = make_strategy([hook], InjectingLoss({SPIKE_AT: 1e4} if rank == 1 else {}), adamw=False)
        skipped = []
        for index, batch in enumerate(make_batches(7)):
            strategy.train_batch(batch)
            if strategy.ctx.step_skipped:
                skipped.append(index)
        torch.save(
            {
                "skipped": skipped,
                "world_size": strategy.ctx.world_size,
                "params": [p.detach() for p in strategy.ctx.models["main"].parameters()],
                "state": hook.state_dict(),
            },
            out_dir / f"rank{rank}.pt",
        )
        dist.barrier()  # no rank tears gloo down while the other still uses it (SIGABRT in gloo)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(out_dir: Path, timeout_s: float) -> None:
    """Two fresh ranks (spawn: a fork after autograd ran in this process is unsafe), joined within ``timeout_s``."""
    context = mp.spawn(run_rank, args=(free_port(), out_dir), nprocs=2, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the two ranks did not finish within {timeout_s:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.mark.slow
def test_ranks_skip_together_when_only_one_spikes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the spawned ranks import this module by name: make the repository root importable for them
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    for attempt in range(2):
        try:
            spawn_ranks(tmp_path, timeout_s=120)
            break
        except mp.ProcessRaisedException as err:
            transient = ("address already in use", "connection refused", "connection reset", "timed out")
            if attempt or not any(word in str(err).lower() for word in transient):
                raise  # only a rendezvous that lost a race for its port or socket is worth a second try
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    assert [r["world_size"] for r in results] == [2, 2]
    assert results[0]["skipped"] == results[1]["skipped"] == [SPIKE_AT]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert results[0]["state"] == results[1]["state"]  # identical statistics on both ranks


def test_rolling_statistics_match_an_exact_computation() -> None:
    generator = torch.Generator().manual_seed(3)
    values = (torch.randn(1000, generator=generator, dtype=torch.float64) * 0.01 + 1e3).tolist()
    stats = RollingStats(50)
    for count, value in enumerate(values, start=1):
        stats.append(value)
        recent = torch.tensor(values[max(0, count - 50) : count], dtype=torch.float64)
        expected = (recent.mean() + 3.0 * recent.std(unbiased=False)).item() if count > 1 else math.inf
        assert stats.limit(3.0) == pytest.approx(expected, rel=1e-12), count


class StepFailsWhen:
    """An SGD factory whose step raises while ``failing`` is set (a transient failure after the decision)."""

    def __init__(self) -> None:
        self.failing = False

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        owner = self

        class Flaky(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:
                if owner.failing:
                    raise RuntimeError("the optimizer step failed")
                return super().step(closure)

        return Flaky(params, lr=0.05)


def test_a_step_that_fails_after_the_decision_leaves_the_statistics_as_they_were() -> None:
    """Values of accepted steps only: a full window gets back the value the failed step's one evicted."""
    hook = SpikeSkipHook(window=3, warmup_steps=2, threshold_sigmas=1e9)  # every finite step accepted
    factory = StepFailsWhen()
    strategy = nvtrain.TrainingStrategy(
        models=make_model(), optimizers=factory, loss_fn=InjectingLoss(), hooks=[hook], device="cpu"
    )
    batches = make_batches(6)
    for batch in batches[:4]:
        strategy.train_batch(batch)
    before = hook.state_dict()
    assert len(before["loss_history"]) == 3 and before["accepted_steps"] == 4
    factory.failing = True
    with pytest.raises(RuntimeError, match="the optimizer step failed"):
        strategy.train_batch(batches[4])
    factory.failing = False
    after = hook.state_dict()
    assert after["loss_history"] == before["loss_history"] and after["norm_history"] == before["norm_history"]
    assert after["accepted_steps"] == 4
    strategy.train_batch(batches[5])  # and it goes on
    assert hook.state_dict()["accepted_steps"] == 5


def test_a_later_micro_batch_failing_before_the_decision_keeps_the_accepted_value() -> None:
    hook = SpikeSkipHook(window=5, warmup_steps=2)
    strategy = make_strategy([hook], InjectingLoss())
    batches = make_batches(2)
    strategy.train_batch(batches[0])
    accepted = hook.state_dict()["loss_history"]
    with pytest.raises(TypeError):
        strategy.train_batch("not a batch")  # fails in the forward, before any decision
    assert hook.state_dict()["loss_history"] == accepted and len(accepted) == 1
