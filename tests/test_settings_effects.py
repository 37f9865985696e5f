"""Each public setting below changes what a run does: a test per setting that fails if the code ignored it.

The run-config settings go through ``nvtrain train`` (``nvtrain.cli.main``) or through what it
does (``prepare`` then ``build``) with a tiny job module written beside the config: a
``Linear(4, 3)`` classifier on a few fixed batches, always on an explicit device.
"""

from __future__ import annotations

import math
import random
import re
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.app import Built, Plan, build, prepare
from nvtrain.cli import main
from nvtrain.config import ConfigError, load_config

#: The job a config names by import path (as ``<module>:<name>``); written once per test under a fresh name.
JOB_MODULE = '''\
from pathlib import Path

import torch

import nvtrain

CLASSES = 3


def model():
    """Initialised from torch's global generator: the run's ``seed`` decides the weights."""
    return torch.nn.Linear(4, CLASSES)


def data(batches=4, val_batches=2):
    """Fixed batches of 8 samples (their own generator): train and validation loaders."""
    generator = torch.Generator().manual_seed(0)

    def batch():
        return torch.randn(8, 4, generator=generator), torch.randint(0, CLASSES, (8,), generator=generator)

    return [batch() for _ in range(batches)], [batch() for _ in range(val_batches)]


def zero_logits(ctx):
    """A forward whose logits are all zero: cross-entropy is then exactly log(CLASSES), and no gradient flows."""
    inputs, _ = ctx.batch
    return ctx.models["main"](inputs) * 0.0


CALLS = [0]


def progress(outputs, targets):
    """A metric that improves (falls) at every call, so a plateau schedule monitoring it never stalls."""
    CALLS[0] += 1
    return torch.tensor(-float(CALLS[0]))


def autocast_on(outputs, targets):
    return torch.tensor(float(torch.is_autocast_enabled("cpu")))


def bf16_outputs(outputs, targets):
    return torch.tensor(float(outputs.dtype == torch.bfloat16))


class SaveWeights:
    """Saves the trained model's weights when the run ends (``output_dir`` defaults into the run directory)."""

    def __init__(self, output_dir):
        self.output_dir = Path(output_dir)

    @nvtrain.hookimpl
    def after_training(self, ctx):
        self.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(ctx.models["main"].state_dict(), self.output_dir / "weights.pt")
'''

CONFIG = """\
output_dir: {runs}
name: effects
seed: 0
device: cpu
model: {{factory: '{module}:model'}}
data: {{factory: '{module}:data'}}
loss: {{function: 'torch.nn.functional:cross_entropy'}}
optimizer: {{factory: 'torch.optim:SGD', kwargs: {{lr: 0.5}}}}
trainer: {{num_epochs: 1}}
validation: {{every_n_epochs: 1}}
logging: {{log_every_n_steps: 1, progress_bar: false, csv: false, tensorboard: false, plot: false}}
"""


class Job:
    """A config file and the job module it names; overrides are ``--set`` strings (``{job}`` is the module)."""

    def __init__(self, directory: Path) -> None:
        self.module = f"settings_effects_job_{uuid.uuid4().hex[:12]}"
        (directory / f"{self.module}.py").write_text(JOB_MODULE, encoding="utf-8")
        self.runs = directory / "runs"
        self.path = directory / "job.yaml"
        self.path.write_text(CONFIG.format(runs=self.runs, module=self.module), encoding="utf-8")

    def overrides(self, overrides: Iterable[str]) -> list[str]:
        return [override.replace("{job}", self.module) for override in overrides]

    def plan(self, *overrides: str) -> Plan:
        return prepare(load_config(self.path, self.overrides(overrides)), world_size=1)

    def build(self, *overrides: str) -> Built:
        return build(self.plan(*overrides))

    def train(self, *overrides: str) -> int:
        """``nvtrain train job.yaml --set ...`` in this process; the exit status."""
        args = ["train", str(self.path)]
        for override in self.overrides(overrides):
            args += ["--set", override]
        return main(args)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: no DDP plugin added
    made = Job(tmp_path)
    numpy = sys.modules.get("numpy")
    # `nvtrain train` seeds torch, random and numpy: leave the other tests' streams as they were.
    with torch.random.fork_rng(devices=[]):
        states = random.getstate(), numpy.random.get_state() if numpy is not None else None
        torch.manual_seed(0)  # the model factory draws from it where no `nvtrain train` seeds it
        try:
            yield made
        finally:
            random.setstate(states[0])
            if numpy is not None:
                numpy.random.set_state(states[1])
            sys.modules.pop(made.module, None)


class Seen:
    """Records ``(epoch, step_count)`` at BEFORE_BATCH / AFTER_BATCH, each training loss, each validation."""

    def __init__(self) -> None:
        self.batch_starts: list[tuple[int, int]] = []
        self.batch_ends: list[tuple[int, int]] = []
        self.losses: list[torch.Tensor] = []
        self.lrs: list[float] = []
        self.validations: list[tuple[int, int]] = []

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.batch_starts.append((ctx.epoch, ctx.step_count))

    @nvtrain.hookimpl
    def after_loss(self, ctx: nvtrain.TrainingContext) -> None:
        assert isinstance(ctx.loss, torch.Tensor)
        self.losses.append(ctx.loss.detach().clone())

    @nvtrain.hookimpl
    def before_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        self.lrs.append(ctx.optimizers["main"].param_groups[0]["lr"])

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.batch_ends.append((ctx.epoch, ctx.step_count))

    @nvtrain.hookimpl
    def after_validation(self, ctx: nvtrain.TrainingContext) -> None:
        self.validations.append((ctx.epoch, ctx.step_count))


def run(built: Built) -> tuple[nvtrain.RunResult, Seen]:
    seen = Seen()
    built.strategy.register_hook(seen)
    with built.strategy as strategy:
        result = strategy.run(built.train_loader)
    return result, seen


def loss_by_hand(
    model: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[Any], **loss_kwargs: Any
) -> torch.Tensor:
    """Sample-weighted mean cross-entropy over ``batches``, as the validation loop weights it."""
    total, count = torch.zeros(()), 0
    with torch.no_grad():
        for inputs, targets in batches:
            loss = torch.nn.functional.cross_entropy(model(inputs), targets, **loss_kwargs)
            total = total + loss.float() * len(targets)
            count += len(targets)
    return total / count


def validation_batches(built: Built) -> list[Any]:
    config = built.strategy.validation
    assert config is not None and config.data is not None
    return list(config.data)


# -- seed -------------------------------------------------------------------------------------------


def test_seed_makes_nvtrain_train_repeatable_and_another_seed_changes_the_weights(
    job: Job, capsys: pytest.CaptureFixture[str]
) -> None:
    hook = "hooks=[{name: '{job}:SaveWeights'}]"
    runs = {
        name: (seed, job.runs / name / "SaveWeights" / "weights.pt") for name, seed in [("a", 1), ("b", 1), ("c", 2)]
    }
    for name, (seed, _) in runs.items():
        assert job.train(f"seed={seed}", f"name={name}", hook) == 0
    capsys.readouterr()
    a, b, c = (torch.load(path, weights_only=True) for _, path in runs.values())
    assert list(a) == list(b) == list(c) == ["weight", "bias"]
    assert all(torch.equal(a[key], b[key]) for key in a)  # the same seed: bitwise the same run
    assert not any(torch.equal(a[key], c[key]) for key in a)  # another seed: another initialisation


# -- device -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu"])
def test_device_is_where_the_strategy_puts_the_model(job: Job, device: str) -> None:
    # On a CUDA machine `auto` picks cuda: `cpu` then shows the setting is read; on a CPU one the refusal of
    # a device this machine lacks (below) and of `meta` (tests/test_cli_failures.py) show it.
    strategy = job.build(f"device={device}").strategy
    strategy.setup()
    assert strategy.device == torch.device(device)
    assert {p.device for p in strategy.ctx.models["main"].parameters()} == {torch.device(device)}


def test_a_cuda_device_without_cuda_is_refused_at_the_device_key(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        job.plan("device=cuda:0")
    assert info.value.path == ("device",)
    assert "device 'cuda:0' asked for CUDA, which this machine does not have" in str(info.value)


# -- model.forward_fn -------------------------------------------------------------------------------


def test_forward_fn_computes_the_outputs_of_training_and_validation(job: Job) -> None:
    built = job.build("model.forward_fn='{job}:zero_logits'")
    model = built.strategy.models["main"]
    before = {key: value.clone() for key, value in model.state_dict().items()}
    result, seen = run(built)
    uniform = torch.tensor(math.log(3))  # cross-entropy of all-zero logits over 3 classes
    assert len(seen.losses) == 4
    assert all(torch.allclose(loss, uniform, rtol=0, atol=1e-6) for loss in seen.losses)
    assert result.validation is not None
    assert torch.allclose(result.validation["loss"], uniform, rtol=0, atol=1e-6)
    after = built.strategy.ctx.models["main"].state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)  # zero logits: zero gradients


# -- loss.kwargs ------------------------------------------------------------------------------------


def test_loss_kwargs_are_bound_to_the_loss_function(job: Job) -> None:
    built = job.build("loss.kwargs={label_smoothing: 0.5}")
    summary = built.strategy.validate()
    model = built.strategy.ctx.models["main"]
    batches = validation_batches(built)
    smoothed = loss_by_hand(model, batches, label_smoothing=0.5)
    plain = loss_by_hand(model, batches)
    assert torch.allclose(summary["loss"], smoothed, rtol=1e-6, atol=0)
    assert not torch.allclose(smoothed, plain, rtol=1e-3, atol=0)  # the two losses are told apart


# -- optimizer.factory ------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [torch.optim.SGD, torch.optim.Adagrad])
def test_optimizer_factory_is_the_optimizer_the_strategy_builds(job: Job, factory: type[torch.optim.Optimizer]) -> None:
    # Neither is the default (AdamW).
    strategy = job.build(f"optimizer.factory='torch.optim:{factory.__name__}'", "optimizer.kwargs={lr: 0.25}").strategy
    strategy.setup()
    optimizer = strategy.ctx.optimizers["main"]
    assert type(optimizer) is factory
    assert optimizer.param_groups[0]["lr"] == 0.25


# -- lr_scheduler.monitor ---------------------------------------------------------------------------

PLATEAU = "lr_scheduler={factory: plateau, kwargs: {patience: 0, factor: 0.5}, monitor: %s}"


def test_lr_scheduler_monitor_is_the_validation_value_a_plateau_schedule_steps_with(job: Job) -> None:
    # A learning rate too small to move the weights: the validation loss stalls, the monitored metric falls.
    settings = ("optimizer.kwargs={lr: 1.0e-12}", "trainer.num_epochs=3", "validation.metrics=['{job}:progress']")
    built = job.build(*settings, PLATEAU % "progress")
    result, seen = run(built)
    assert seen.lrs == [1e-12] * 12  # the metric improved at every validation: never reduced
    scheduler = built.strategy.ctx.lr_schedulers["main"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert result.validation is not None
    assert scheduler.best == float(result.validation["progress"])  # the last (best) value it was stepped with

    # The same run monitoring the loss (the default) halves the rate after the second validation.
    _, by_loss = run(job.build(*settings, PLATEAU % "null"))
    assert by_loss.lrs == pytest.approx([1e-12] * 8 + [0.5e-12] * 4, rel=1e-9)


def test_an_accumulate_hook_alone_sets_the_steps_the_cosine_horizon_counts(job: Job) -> None:
    """8 micro-batches an epoch, 4 a step, 2 epochs: 4 optimizer steps, and T_max is 4, not 16."""
    built = job.build(
        "data.kwargs={batches: 8}", "trainer.num_epochs=2", "hooks=[{name: accumulate, steps: 4}]",
        "lr_scheduler={factory: cosine}",
    )
    assert built.run_length == 4
    result, _ = run(built)
    assert result.step_count == 4
    assert built.strategy.ctx.lr_schedulers["main"].T_max == 4


def test_an_unknown_lr_scheduler_monitor_is_refused_before_the_run(job: Job) -> None:
    """Not at the first validation, after files were written: when the config is checked."""
    with pytest.raises(ConfigError, match=r"monitor 'f1' is not a key of the validation summary") as caught:
        job.plan(PLATEAU % "f1")
    assert caught.value.path == ("lr_scheduler", "monitor")


# -- validation.every_n_epochs, use_ema, use_mixed_precision ----------------------------------------


def test_validation_every_n_epochs_validates_on_that_epoch_cadence(job: Job) -> None:
    _, seen = run(job.build("trainer.num_epochs=4", "validation.every_n_epochs=2", "data.kwargs={batches: 2}"))
    assert seen.validations == [(1, 4), (3, 8)]  # (0-based epoch, step): after epochs 2 and 4 only


@pytest.mark.parametrize("use_ema", [True, False])
def test_validation_use_ema_chooses_the_weights_validated(job: Job, use_ema: bool) -> None:
    ema_module = pytest.importorskip("nvtrain_ema")
    built = job.build(
        "hooks=[{name: ema, decay: 0.5}]", "trainer.num_epochs=2", f"validation.use_ema={str(use_ema).lower()}"
    )
    result, _ = run(built)
    (ema,) = [hook for hook in built.strategy.hooks if isinstance(hook, ema_module.EMAHook)]
    batches = validation_batches(built)
    averaged = loss_by_hand(ema.get_averaged_model(), batches)
    live = loss_by_hand(built.strategy.ctx.models["main"], batches)
    assert not torch.allclose(averaged, live, rtol=1e-3, atol=0)  # the two sets of weights are told apart
    assert result.validation is not None
    assert torch.allclose(result.validation["loss"], averaged if use_ema else live, rtol=1e-6, atol=0)


@pytest.mark.parametrize("use_mixed_precision", [True, False])
def test_validation_use_mixed_precision_decides_whether_validation_autocasts(
    job: Job, use_mixed_precision: bool
) -> None:
    pytest.importorskip("nvtrain_amp")
    built = job.build(
        "hooks=[{name: amp, precision: bf16}]",
        "validation.metrics=['{job}:autocast_on', '{job}:bf16_outputs']",
        f"validation.use_mixed_precision={str(use_mixed_precision).lower()}",
    )
    summary = built.strategy.validate()
    expected = torch.tensor(float(use_mixed_precision))
    assert torch.equal(summary["autocast_on"], expected)
    assert torch.equal(summary["bf16_outputs"], expected)


# -- logging.progress_bar ---------------------------------------------------------------------------

#: A progress line as ProgressBarHook writes it where stderr is not a terminal (as under pytest).
PROGRESS_LINE = re.compile(r"^epoch 1/1 +step [1-4]/4 +loss ", re.MULTILINE)


@pytest.mark.parametrize("progress_bar", [True, False])
def test_logging_progress_bar_decides_whether_progress_is_shown(
    job: Job, capsys: pytest.CaptureFixture[str], progress_bar: bool
) -> None:
    assert job.train(f"logging.progress_bar={str(progress_bar).lower()}") == 0
    shown = PROGRESS_LINE.findall(capsys.readouterr().err)
    assert len(shown) == (4 if progress_bar else 0)  # one line per logging step (log_every_n_steps: 1)


# -- logging.csv, tensorboard, plot -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("csv", "tensorboard", "plot", "files"),
    [
        (False, False, False, set()),
        (True, False, False, {"metrics.csv"}),
        (True, True, True, {"metrics.csv", "tensorboard", "curves.png"}),
    ],
)
def test_logging_csv_tensorboard_and_plot_decide_the_run_directorys_files(
    job: Job, capsys: pytest.CaptureFixture[str], csv: bool, tensorboard: bool, plot: bool, files: set[str]
) -> None:
    for needed, module in ((tensorboard, "tensorboard"), (plot, "matplotlib")):
        if needed:
            pytest.importorskip(module)
    settings = {"csv": csv, "tensorboard": tensorboard, "plot": plot}
    assert job.train(*(f"logging.{key}={str(value).lower()}" for key, value in settings.items())) == 0
    capsys.readouterr()
    run_dir = job.plan().run_dir
    logged = {"metrics.csv", "tensorboard", "curves.png"}
    assert {path.name for path in run_dir.iterdir()} & logged == files


def test_logging_plot_without_the_csv_file_is_refused_at_logging_plot(job: Job) -> None:
    message = r"plot needs the metrics file: set logging\.csv to true or plot to false"
    with pytest.raises(ConfigError, match=message) as info:
        job.plan("logging.csv=false", "logging.plot=true")
    assert info.value.path == ("logging", "plot")


# -- trainer.start_step / start_epoch through TrainingStrategy --------------------------------------


def test_start_step_is_where_the_strategy_counts_steps_from(make_strategy: Any, batches: Any) -> None:
    seen = Seen()
    strategy = make_strategy([seen], step_scheduler=nvtrain.StepSchedulerConfig(start_step=5), num_epochs=1)
    result = strategy.run(batches(3))
    assert [step for _, step in seen.batch_starts] == [5, 6, 7]
    assert [step for _, step in seen.batch_ends] == [6, 7, 8]
    assert result.step_count == 8


def test_start_epoch_is_the_epoch_the_strategy_starts_in(make_strategy: Any, batches: Any) -> None:
    seen = Seen()
    config = nvtrain.StepSchedulerConfig(start_epoch=2, num_epochs=4)  # num_epochs is absolute: epochs 2 and 3
    result = make_strategy([seen], step_scheduler=config).run(batches(2))
    assert seen.batch_ends == [(2, 1), (2, 2), (3, 3), (3, 4)]
    assert result.epoch == 4
