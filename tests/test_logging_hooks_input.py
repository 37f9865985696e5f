"""The loggers refuse bad settings when built, and an output folder that cannot be made before the first step."""

from __future__ import annotations

import functools
import io
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.logging_hooks import CSVLoggerHook, LogFolderError, ProgressBarHook, TensorBoardHook
from nvtrain.validators import FieldTypeError, FieldValueError

# A folder no process can create, whoever it runs as (root included): /proc holds no new folders.
UNCREATABLE = Path("/proc/nvtrain-no-such-folder")
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


class StepCounter:
    """Counts the micro-batches that trained."""

    def __init__(self) -> None:
        self.batches = 0

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.batches += 1


def run(hooks: list[object], steps: int = 6) -> None:
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.cross_entropy,
        hooks=hooks,
        device="cpu",
        max_steps=steps,
    )
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(steps)]
    with strategy:
        strategy.run(data)


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "afile"
    path.write_text("not a folder")
    return path


# -- CSVLoggerHook.path -----------------------------------------------------------------------------


def test_csv_path_that_is_a_directory_is_refused_when_built(tmp_path: Path) -> None:
    with pytest.raises(FieldValueError, match=r"CSVLoggerHook.path must be a CSV file path, .* a directory\)"):
        CSVLoggerHook(tmp_path, log_every_n_steps=3)


def test_csv_path_under_a_file_is_refused_when_built(a_file: Path) -> None:
    with pytest.raises(FieldValueError, match=rf"CSVLoggerHook.path must be .*: '{a_file}' is a file\)"):
        CSVLoggerHook(a_file / "metrics.csv", log_every_n_steps=3)


@pytest.mark.parametrize("cls, field", [(CSVLoggerHook, "path"), (TensorBoardHook, "log_dir")])
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(cls: type, field: str) -> None:
    with pytest.raises(FieldValueError, match=rf"^{cls.__name__}.{field} must be a non-empty path \(got ''\)$"):
        cls("")


@pytest.mark.parametrize("value", [None, 3, ["metrics.csv"]])
@pytest.mark.parametrize("cls, field", [(CSVLoggerHook, "path"), (TensorBoardHook, "log_dir")])
def test_what_is_no_path_is_refused_naming_the_field(cls: type, field: str, value: Any) -> None:
    with pytest.raises(FieldTypeError, match=rf"^{cls.__name__}.{field} must be a path \(a str or os.PathLike\)"):
        cls(value)


# -- TensorBoardHook.log_dir ------------------------------------------------------------------------


def test_tensorboard_log_dir_that_is_a_file_is_refused_when_built(a_file: Path) -> None:
    with pytest.raises(FieldValueError, match=r"TensorBoardHook.log_dir must be a folder path, .* a file\)"):
        TensorBoardHook(a_file, log_every_n_steps=3)


def test_tensorboard_log_dir_under_a_file_is_refused_when_built(a_file: Path) -> None:
    with pytest.raises(FieldValueError, match=rf"TensorBoardHook.log_dir must be .*: '{a_file}' is a file\)"):
        TensorBoardHook(a_file / "tb", log_every_n_steps=3)


# -- folders made at the run's start -----------------------------------------------------------------


@needs_proc
@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: CSVLoggerHook(UNCREATABLE / "metrics.csv", log_every_n_steps=3), "CSVLoggerHook.path"),
        (lambda: TensorBoardHook(UNCREATABLE / "tb", log_every_n_steps=3), "TensorBoardHook.log_dir"),
    ],
)
def test_an_output_folder_that_cannot_be_made_fails_before_the_first_step(make: Any, setting: str) -> None:
    counter = StepCounter()
    with pytest.raises(LogFolderError, match=rf"^{setting}: the folder '{UNCREATABLE}.*' cannot be created") as err:
        run([make(), counter])
    assert counter.batches == 0
    assert isinstance(err.value, OSError) and err.value.filename == str(UNCREATABLE)  # the OS error's parts


def test_the_output_folders_exist_once_the_run_started(tmp_path: Path) -> None:
    csv_hook = CSVLoggerHook(tmp_path / "csv" / "metrics.csv", log_every_n_steps=100)
    tb_hook = TensorBoardHook(tmp_path / "tb", log_every_n_steps=100)
    seen: list[bool] = []

    class Probe:
        priority = 95  # after the loggers at the first epoch's start, before any step

        @nvtrain.hookimpl
        def before_epoch(self, ctx: nvtrain.TrainingContext) -> None:
            seen.append((tmp_path / "csv").is_dir() and (tmp_path / "tb").is_dir())

    run([csv_hook, tb_hook, Probe()], steps=1)
    assert seen == [True]


# -- ProgressBarHook ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", ["progress.log", 3, Path("progress.log")])
def test_a_progress_stream_without_write_is_refused_when_built(stream: Any) -> None:
    with pytest.raises(FieldTypeError, match=r"^ProgressBarHook.stream must be a text stream with write\(\) and flush"):
        ProgressBarHook(stream=stream)


def test_a_progress_stream_with_write_and_flush_is_taken() -> None:
    stream = io.StringIO()
    assert ProgressBarHook(stream=stream).stream is stream


@pytest.mark.parametrize("use_bar", ["false", 0, 1])
def test_use_bar_takes_a_bool_or_none_only(use_bar: Any) -> None:
    with pytest.raises(FieldTypeError, match=rf"^ProgressBarHook.use_bar must be a bool or None \(got {use_bar!r}\)$"):
        ProgressBarHook(use_bar=use_bar)


@pytest.mark.parametrize("interval", [math.nan, math.inf, -math.inf])
def test_refresh_interval_refuses_nan_and_infinity(interval: float) -> None:
    with pytest.raises(FieldValueError, match=r"^ProgressBarHook.refresh_interval must be a finite number of seconds"):
        ProgressBarHook(refresh_interval=interval)


@pytest.mark.parametrize("ncols", [0, "80", 80.0, True])
def test_ncols_takes_a_positive_int_or_none(ncols: Any) -> None:
    with pytest.raises(FieldValueError, match=r"^ProgressBarHook.ncols must be an int >= 1 or None"):
        ProgressBarHook(ncols=ncols)


@pytest.mark.parametrize("cls", [ProgressBarHook, CSVLoggerHook])
def test_priority_takes_an_int_only(cls: type, tmp_path: Path) -> None:
    args = (tmp_path / "m.csv",) if cls is CSVLoggerHook else ()
    with pytest.raises(FieldTypeError, match=rf"^{cls.__name__}.priority must be an int \(got '90'\)$"):
        cls(*args, priority="90")
