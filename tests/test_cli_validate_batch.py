"""`nvtrain validate` runs one training and one validation batch through the forward, the loss and the metrics.

A loss that cannot take the model's outputs, a loss or metric that returns something the run
cannot use, or a forward_fn that fails on the batch passed ``validate`` and failed at the
run's first step or first validation; now each is one located line with exit status 2.
"""

from __future__ import annotations

import multiprocessing
import re
import textwrap
from pathlib import Path

import pytest
import torch

from nvtrain.app import EXIT_OK, EXIT_USAGE, build, check_one_batch, prepare
from nvtrain.cli import main
from nvtrain.config import load_config

MODULE = "validate_batch_helpers"

HELPERS = """\
import torch
from torch.utils.data import DataLoader, TensorDataset


def build(norm=False):
    linear = torch.nn.Linear(4, 3)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)  # all outputs 0: the loss is log(3), every prediction class 0
    return torch.nn.Sequential(torch.nn.BatchNorm1d(4), linear) if norm else linear


def samples():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=generator) + 5.0, torch.randint(0, 3, (8,), generator=generator)


class Corrupt(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        raise ValueError(f"sample {index} is corrupt")


def loaders(targets="index", workers=0, validation="loader", corrupt=False):
    inputs, labels = samples()
    if targets == "column":  # class indices as a [B, 1] float column: not what cross_entropy takes
        labels = labels.float().unsqueeze(1)
    data = Corrupt() if corrupt else TensorDataset(inputs, labels)
    settings = {"batch_size": 4, "num_workers": workers, "persistent_workers": workers > 0}
    val = {"loader": DataLoader(data, **settings), "empty": [], "absent": None}[validation]
    return DataLoader(data, **settings), val


def per_sample_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")


def number_loss(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs, targets).item()


def fp32_buffer_loss(outputs, targets):
    total = torch.zeros(outputs.shape)  # float32: index_add_ refuses the bf16 outputs autocast gives
    total.index_add_(0, torch.arange(len(outputs)), outputs)
    return torch.nn.functional.cross_entropy(total, targets)


def label(outputs, targets):
    return "fine"


def truncated_forward(ctx):
    inputs, _ = ctx.batch
    return ctx.models["main"](inputs[:, :2])
"""


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny job in ``tmp_path`` (the working directory) whose model and data come from ``MODULE`` beside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.dont_write_bytecode", True)  # the folder must stay as it was
    (tmp_path / f"{MODULE}.py").write_text(HELPERS, encoding="utf-8")
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / "out"}
            device: cpu
            model: {{factory: "{MODULE}:build"}}
            data: {{factory: "{MODULE}:loaders"}}
            loss: {{function: "torch.nn.functional:cross_entropy"}}
            trainer: {{max_steps: 2}}
            validation: {{metrics: [accuracy]}}
            logging: {{tensorboard: false, plot: false, progress_bar: false}}
            """
        ),
        encoding="utf-8",
    )
    return config


def sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def listing(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``nvtrain validate argv``: exit 2, one line on stderr without a traceback; that line."""
    assert main(["validate", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("nvtrain validate: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def first_batch_accuracy() -> float:
    """The accuracy of all-zero outputs (class 0 everywhere) on the first validation batch of ``loaders``."""
    generator = torch.Generator().manual_seed(0)
    torch.randn(8, 4, generator=generator)
    labels = torch.randint(0, 3, (8,), generator=generator)
    return float((labels[:4] == 0).float().mean())


def test_a_good_config_reports_one_batch_and_writes_nothing(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("nvtrain_checkpoint")
    before = listing(job.parent)
    assert main(["validate", str(job), *sets("hooks=[checkpoint]")]) == EXIT_OK, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{job}: valid (run directory {job.parent / 'out' / 'job'}; hooks: CheckpointHook")
    loss = f"{torch.log(torch.tensor(3.0)).item():.5g}"  # all-zero outputs over three classes
    accuracy = f"{first_batch_accuracy():.5g}"
    assert re.fullmatch(
        rf"one batch: loss {loss}, validation loss {loss}, accuracy {accuracy} \(forward \d+ ms\)", lines[1]
    ), lines
    assert listing(job.parent) == before  # no run directory, no checkpoint, no log


def test_a_config_that_resumes_says_the_batch_ran_on_the_weights_as_built(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check runs before the resume loads anything: its loss is not the checkpoint's, and says so."""
    pytest.importorskip("nvtrain_checkpoint")
    hooks = "hooks=[{name: checkpoint, resume: auto}]"
    assert main(["train", str(job), *sets(hooks)]) == EXIT_OK, capsys.readouterr().err
    capsys.readouterr()
    assert main(["validate", str(job), *sets(hooks, "trainer.max_steps=4")]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith(" ms, on the weights as built, not the checkpoint's)"), lines
    assert lines[2].startswith("resumes from "), lines


def test_without_validation_data_only_the_training_batch_is_reported(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", str(job), *sets("data.kwargs.validation=absent")]) == EXIT_OK, capsys.readouterr().err
    assert re.fullmatch(r"one batch: loss 1\.0986 \(forward \d+ ms\)", capsys.readouterr().out.splitlines()[1])


def test_a_loss_that_cannot_take_the_outputs_is_refused_at_loss(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([str(job), *sets("data.kwargs.targets=column")], capsys)
    assert err == (
        f"nvtrain validate: error: {job}:5:1: loss: loss torch.nn.functional:cross_entropy failed on one training "
        "batch (outputs tensor [4, 3] float32, targets tensor [4, 1] float32): RuntimeError: 0D or 1D target "
        "tensor expected, multi-target not supported\n"
    )
    assert not (job.parent / "out").exists()


@pytest.mark.parametrize(
    ("function", "returned"),
    [
        ("per_sample_loss", "tensor [4] float32, expected a scalar: backward() needs one number"),
        ("number_loss", "float 1.09861"),
    ],
)
def test_a_loss_returning_what_backward_cannot_take_is_refused(
    job: Path, capsys: pytest.CaptureFixture[str], function: str, returned: str
) -> None:
    err = refused([str(job), *sets(f"loss.function={MODULE}:{function}")], capsys)
    assert f"--set loss.function={MODULE}:{function}: loss: loss {MODULE}:{function} returned {returned}" in err


def test_a_metric_returning_a_string_is_refused_at_its_entry(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([str(job), *sets(f"validation.metrics=[accuracy, '{MODULE}:label']")], capsys)
    assert f"validation.metrics[1]: metric 'label' ({MODULE}:label) returned str 'fine', expected a one-element" in err


def test_a_forward_fn_failing_on_the_batch_is_refused_at_forward_fn(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([str(job), *sets(f"model.forward_fn={MODULE}:truncated_forward")], capsys)
    assert (
        f"model.forward_fn: forward_fn {MODULE}:truncated_forward failed on one training batch "
        "(list (tensor [4, 4] float32, tensor [4] int64)): RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    ) in err


def test_an_empty_validation_loader_is_refused_at_data(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([str(job), *sets("data.kwargs.validation=empty")], capsys)
    assert f"data: {MODULE}:loaders returned a validation loader that yields no batch" in err


def test_a_loss_failing_only_under_autocast_is_refused(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The training batch runs under the amp hook's autocast, as the run's steps do: bf16 outputs here."""
    pytest.importorskip("nvtrain_amp")
    overrides = sets(f"loss.function={MODULE}:fp32_buffer_loss", "hooks=[{name: amp, precision: bf16}]")
    err = refused([str(job), *overrides], capsys)
    assert f"loss: loss {MODULE}:fp32_buffer_loss failed on one training batch (outputs tensor [4, 3] bfloat16" in err
    assert "self (Float) and source (BFloat16) must have the same scalar type" in err
    assert main(["validate", str(job), *sets(f"loss.function={MODULE}:fp32_buffer_loss")]) == EXIT_OK  # fp32


def test_no_batch_check_skips_it(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(job), "--no-batch-check", *sets("data.kwargs.targets=column")]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(f"{job}: valid") and "one batch" not in out


def test_loader_workers_end_with_the_check(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Persistent workers are kept by their loader; the check lets them go, not the garbage collector later."""
    assert main(["validate", str(job), *sets("data.kwargs.workers=1")]) == EXIT_OK, capsys.readouterr().err
    assert "one batch: loss 1.0986" in capsys.readouterr().out
    assert multiprocessing.active_children() == []


def test_a_dataset_failing_in_a_worker_is_refused_at_data_with_its_own_error(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([str(job), *sets("data.kwargs={workers: 1, corrupt: true}")], capsys)
    assert err.endswith(
        f"data: the training loader of {MODULE}:loaders failed on its first batch: ValueError: sample 0 is corrupt "
        "(in a DataLoader worker)\n"
    )
    assert multiprocessing.active_children() == []


def test_the_check_leaves_the_models_buffers_as_they_were(job: Path) -> None:
    """The training-mode forward updates BatchNorm's running statistics; they are put back."""
    plan = prepare(load_config(job, ["model.kwargs={norm: true}"]), world_size=1)
    built = build(plan)
    try:
        check_one_batch(plan, built)
        norm = built.strategy.ctx.models["main"][0]
        assert norm.training
        assert torch.equal(norm.running_mean, torch.zeros(4)) and torch.equal(norm.running_var, torch.ones(4))
        assert int(norm.num_batches_tracked) == 0
    finally:
        built.strategy.close()
