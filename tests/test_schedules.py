"""nvtrain.schedules: linear warmup in front of a scheduler, and the aliases a config may name."""

from __future__ import annotations

import functools
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, ReduceLROnPlateau, StepLR

import nvtrain
from nvtrain import schedules
from nvtrain.app import build, prepare
from nvtrain.config import ConfigError, load_config


def optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def rates(factory: Any, count: int, lr: float = 1.0) -> list[float]:
    """The learning rate after 0, 1, ..., count - 1 scheduler steps."""
    opt = optimizer(lr)
    scheduler = factory(opt)
    seen = []
    for _ in range(count):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return seen


def test_warmup_then_cosine_matches_a_hand_computation() -> None:
    steps, t_max, start, lr = 10, 20, 1e-3, 0.5
    factory = schedules.warmup(functools.partial(CosineAnnealingLR, T_max=t_max), steps=steps, start_factor=start)
    got = rates(factory, steps + t_max + 1, lr=lr)
    assert got[0] == pytest.approx(lr * start)
    assert got[steps // 2] == pytest.approx(lr * (start + (1 - start) * 0.5))  # halfway up the ramp
    for k in range(steps):
        assert got[k] == pytest.approx(lr * (start + (1 - start) * k / steps)), k
    assert got[steps] == pytest.approx(lr)  # the cosine starts at its peak
    for k in range(t_max + 1):
        assert got[steps + k] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * k / t_max)), abs=1e-12), k
    assert got[steps + t_max] == pytest.approx(0.0, abs=1e-12)


def test_warmup_then_step_decay() -> None:
    factory = schedules.warmup(functools.partial(StepLR, step_size=3, gamma=0.1), steps=4, start_factor=0.25)
    assert rates(factory, 11) == pytest.approx([0.25, 0.4375, 0.625, 0.8125, 1, 1, 1, 0.1, 0.1, 0.1, 0.01])


def test_warmup_state_round_trips() -> None:
    factory = schedules.warmup(functools.partial(CosineAnnealingLR, T_max=10), steps=5)
    first_opt = optimizer()
    first = factory(first_opt)
    for _ in range(7):
        first_opt.step()
        first.step()
    second_opt = optimizer()
    second = factory(second_opt)
    second.load_state_dict(first.state_dict())
    second_opt.load_state_dict(first_opt.state_dict())
    for _ in range(3):
        for opt, scheduler in ((first_opt, first), (second_opt, second)):
            opt.step()
            scheduler.step()
        assert second_opt.param_groups[0]["lr"] == first_opt.param_groups[0]["lr"]


def test_warmup_works_as_a_strategy_scheduler() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 1),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        lr_schedulers=schedules.warmup(schedules.constant, steps=4, start_factor=0.5),
        num_epochs=1,
        device="cpu",
    )
    with strategy:
        strategy.run(batches)
        assert strategy.ctx.optimizers["main"].param_groups[0]["lr"] == pytest.approx(0.1)
        assert strategy.ctx.lr_schedulers["main"].last_epoch == 6


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"steps": 0}, ValueError, r"warmup: steps must be an int >= 1 \(got 0\)"),
        ({"steps": 2.5}, ValueError, r"warmup: steps must be an int >= 1 \(got 2.5\)"),
        ({"steps": 3, "start_factor": 0.0}, ValueError, r"warmup: start_factor must be in \(0.0, 1.0\] \(got 0.0\)"),
        ({"steps": 3, "start_factor": 1.5}, ValueError, r"start_factor must be in \(0.0, 1.0\] \(got 1.5\)"),
    ],
)
def test_bad_warmup_settings_fail_when_the_factory_is_made(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        schedules.warmup(schedules.constant, **kwargs)


def test_warmup_refuses_what_it_cannot_follow() -> None:
    with pytest.raises(TypeError, match=r"warmup: factory must be callable"):
        schedules.warmup("cosine", steps=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a ReduceLROnPlateau cannot follow a warmup"):
        schedules.warmup(ReduceLROnPlateau, steps=3)(optimizer())
    one_cycle = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=1.0, total_steps=10)
    with pytest.raises(TypeError, match=r"a OneCycleLR cannot follow a warmup: it ramps the LR up itself"):
        schedules.warmup(one_cycle, steps=3)(optimizer())


def test_warmup_refuses_an_lr_schedule_whose_interval_it_would_drop() -> None:
    schedule = nvtrain.LRSchedule(schedules.constant, interval="epoch")
    with pytest.raises(TypeError, match=r"wrap the warmup in it instead"):
        schedules.warmup(schedule, steps=3)


def test_aliases_resolve_to_their_schedulers() -> None:
    assert schedules.resolve("cosine") is CosineAnnealingLR
    assert schedules.resolve("plateau") is ReduceLROnPlateau
    assert set(schedules.ALIASES) == {"constant", "cosine", "linear", "step", "exponential", "onecycle", "plateau"}
    for name in schedules.ALIASES:
        assert callable(schedules.resolve(name))
    with pytest.raises(KeyError, match=r"no LR schedule alias 'cosin' \(aliases: constant, cosine"):
        schedules.resolve("cosin")


def test_linear_decays_to_end_factor_and_constant_holds() -> None:
    assert rates(functools.partial(schedules.linear, total_steps=4), 6) == pytest.approx([1, 0.75, 0.5, 0.25, 0, 0])
    half = functools.partial(schedules.linear, total_steps=2, end_factor=0.5)
    assert rates(half, 4) == pytest.approx([1, 0.75, 0.5, 0.5])
    assert rates(schedules.constant, 3, lr=0.3) == pytest.approx([0.3, 0.3, 0.3])


def test_the_package_exports_schedules() -> None:
    assert nvtrain.schedules is schedules


# -- from a config: lr_scheduler {factory, warmup_steps, interval, monitor, kwargs} ------------

JOB_MODULE = """\
import torch

def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)

def data(batches=5):
    generator = torch.Generator().manual_seed(0)
    def batch():
        return torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator)
    return [batch() for _ in range(batches)], [batch()]
"""


def job(tmp_path: Path, lr_scheduler: str, *, lr: float = 1.0, num_epochs: int = 2) -> Path:
    (tmp_path / "schedule_job.py").write_text(JOB_MODULE, encoding="utf-8")
    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / 'runs'}
            device: cpu
            model: {{factory: 'schedule_job:model'}}
            data: {{factory: 'schedule_job:data'}}
            optimizer: {{factory: 'torch.optim:SGD', kwargs: {{lr: {lr}}}}}
            lr_scheduler: {lr_scheduler}
            trainer: {{num_epochs: {num_epochs}}}
            validation: {{every_n_epochs: 1}}
            logging: {{progress_bar: false, csv: false, tensorboard: false, plot: false}}
            """
        ),
        encoding="utf-8",
    )
    return path


class RecordLR:
    """The learning rate each optimizer step uses (read before the step)."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    @nvtrain.hookimpl
    def before_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        self.rates.append(ctx.optimizers["main"].param_groups[0]["lr"])


def train_job(path: Path, *overrides: str) -> tuple[nvtrain.TrainingStrategy, list[float]]:
    plan = prepare(load_config(path, overrides), world_size=1)
    built = build(plan)
    recorder = RecordLR()
    built.strategy.register_hook(recorder)
    with built.strategy as strategy:
        strategy.run(built.train_loader)
    return strategy, recorder.rates


def test_config_warmup_then_cosine_follows_the_hand_computed_curve(tmp_path: Path) -> None:
    strategy, got = train_job(job(tmp_path, "{factory: cosine, warmup_steps: 4}"))  # 2 epochs x 5 = 10 steps
    scheduler = strategy.ctx.lr_schedulers["main"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR)
    assert scheduler._schedulers[1].T_max == 6  # the run's 10 steps less the 4 of the warmup
    want = [1e-3 + (1 - 1e-3) * k / 4 for k in range(4)] + [0.5 * (1 + math.cos(math.pi * j / 6)) for j in range(6)]
    assert got == pytest.approx(want, abs=1e-12)


def test_config_t_max_given_is_kept(tmp_path: Path) -> None:
    strategy, _ = train_job(job(tmp_path, "{factory: cosine, warmup_steps: 2, kwargs: {T_max: 50}}"))
    assert strategy.ctx.lr_schedulers["main"]._schedulers[1].T_max == 50


def test_config_linear_alias_decays_to_zero_over_the_run(tmp_path: Path) -> None:
    _, got = train_job(job(tmp_path, "{factory: linear}"))
    assert got == pytest.approx([1 - k / 10 for k in range(10)])


def test_config_epoch_interval_step_lr(tmp_path: Path) -> None:
    path = job(tmp_path, "{factory: step, interval: epoch, kwargs: {step_size: 1, gamma: 0.5}}", num_epochs=3)
    strategy, got = train_job(path)
    assert got == [1.0] * 5 + [0.5] * 5 + [0.25] * 5
    assert strategy.ctx.optimizers["main"].param_groups[0]["lr"] == 0.125  # lr0 / 8 after 3 epochs


def test_config_epoch_interval_fills_t_max_in_epochs(tmp_path: Path) -> None:
    path = job(tmp_path, "{factory: cosine, interval: epoch, warmup_steps: 1}", num_epochs=4)
    strategy, got = train_job(path)
    assert strategy.ctx.lr_schedulers["main"]._schedulers[1].T_max == 3  # 4 epochs less 1 of warmup
    per_epoch = [got[5 * e] for e in range(4)]
    assert got == pytest.approx([rate for rate in per_epoch for _ in range(5)])  # constant within an epoch
    want = [1e-3] + [0.5 * (1 + math.cos(math.pi * j / 3)) for j in range(3)]
    assert per_epoch == pytest.approx(want)


def test_config_plateau_steps_after_each_validation_only(tmp_path: Path) -> None:
    # A learning rate too small to move the validation loss: every validation after the first stalls.
    path = job(tmp_path, "{factory: plateau, kwargs: {patience: 0, factor: 0.5}}", lr=1e-12, num_epochs=3)
    strategy, got = train_job(path)
    assert got == pytest.approx([1e-12] * 10 + [0.5e-12] * 5, rel=1e-9)  # halved after validation 2, not per step
    assert strategy.ctx.optimizers["main"].param_groups[0]["lr"] == pytest.approx(0.25e-12)


@pytest.mark.parametrize(
    ("section", "key", "message"),
    [
        ("{factory: cosin}", "factory", "must be a schedule name (constant, cosine, linear, step, exponential, "
         "onecycle, plateau) or an import path 'package.module:name' (got 'cosin'); did you mean 'cosine'?"),
        ("{factory: plateau, warmup_steps: 2}", "warmup_steps", "plateau is stepped after each validation with "
         "validation value 'loss': it cannot follow a warmup"),
        ("{factory: plateau, interval: epoch}", "interval", "interval 'epoch' does not apply"),
        ("{factory: cosine, monitor: loss, warmup_steps: 2}", "warmup_steps", "cannot follow a warmup"),
        ("{factory: exponential, monitor: loss, kwargs: {gamma: 0.5}}", "monitor",
         "monitor 'loss' makes exponential step after each validation with that value, but its step() takes no"),
        ("{factory: onecycle, warmup_steps: 3, kwargs: {max_lr: 1.0}}", "warmup_steps",
         "onecycle ramps the LR up itself (from max_lr / div_factor over pct_start of its steps)"),
        ("{factory: cosine, interval: month}", "interval", "expected one of 'step', 'epoch', got str 'month'"),
        ("{factory: cosine, warmup_steps: -1}", "warmup_steps", "must be >= 0 (got -1)"),
        ("{factory: step}", "kwargs", "step cannot be called with these kwargs: missing a required argument"),
    ],
)
def test_config_schedule_errors_point_at_the_key(tmp_path: Path, section: str, key: str, message: str) -> None:
    path = job(tmp_path, section)
    with pytest.raises(ConfigError) as info:
        prepare(load_config(path), world_size=1)
    assert message in str(info.value)
    assert info.value.path == ("lr_scheduler", key)


def test_config_warmup_longer_than_the_run_is_refused(tmp_path: Path) -> None:
    plan = prepare(load_config(job(tmp_path, "{factory: cosine, warmup_steps: 10}")), world_size=1)
    with pytest.raises(ConfigError, match=r"warmup_steps=10 leaves no optimizer steps for cosine: the run has 10"):
        build(plan)


@pytest.mark.parametrize(
    "section", ["{factory: constant, warmup_steps: 10}", "{factory: cosine, warmup_steps: 12, kwargs: {T_max: 50}}"]
)
def test_config_warmup_longer_than_the_run_is_refused_with_no_horizon_to_fill(tmp_path: Path, section: str) -> None:
    """Not only where T_max is filled in: a warmup the run never finishes never reaches the base rate."""
    plan = prepare(load_config(job(tmp_path, section)), world_size=1)
    with pytest.raises(ConfigError, match=r"warmup_steps=1\d leaves no optimizer steps for .*: the run has 10 ") as info:
        build(plan)
    assert info.value.path == ("lr_scheduler", "warmup_steps")


def test_config_horizon_counts_from_the_start_step(tmp_path: Path) -> None:
    """A run that starts counting at step 4 of max_steps 10 steps its fresh scheduler 6 times: T_max is 6 less
    the warmup, so the cosine ends at 0 on the run's last step."""
    path = job(tmp_path, "{factory: cosine, warmup_steps: 2}", num_epochs=4)
    strategy, got = train_job(path, "trainer.num_epochs=null", "trainer.max_steps=10", "trainer.start_step=4")
    assert strategy.ctx.lr_schedulers["main"]._schedulers[1].T_max == 4
    want = [1e-3 + (1 - 1e-3) * k / 2 for k in range(2)] + [0.5 * (1 + math.cos(math.pi * j / 4)) for j in range(4)]
    assert got == pytest.approx(want, abs=1e-12)
