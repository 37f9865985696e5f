"""Where a config's hooks write: every output setting a hook takes or declares defaults into the run directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest

from nvtrain.app import prepare
from nvtrain.app.hook_stack import output_parameters
from nvtrain.cli import main
from nvtrain.config import load_config
from nvtrain.hooks import StageTimingHook, TorchProfilerHook


class Declares:
    """A hook of someone else's: one output it declares, one it declares but does not take."""

    output_settings: ClassVar[Mapping[str, str]] = {"report": "report.json", "absent": "x"}

    def __init__(self, report: str = "report.json", log_dir: str = "logs") -> None:
        self.report, self.log_dir = report, log_dir


def test_output_parameters_are_the_shared_folder_names_and_what_the_class_declares() -> None:
    assert output_parameters(StageTimingHook) == {"output": "stage_timing.csv"}
    assert output_parameters(TorchProfilerHook) == {"output_dir": None}
    # a declared name the constructor does not take would be an unknown setting: left out
    assert output_parameters(Declares) == {"log_dir": None, "report": "report.json"}
    assert output_parameters(None) == {}


def built_stage_timing(tmp_path: Path, entry: str) -> tuple[StageTimingHook, Path]:
    loaded = load_config(None, [f"hooks=[{entry}]", f"output_dir={json.dumps(str(tmp_path))}", "device=cpu"])
    (hook,) = [h for h in prepare(loaded, world_size=1).hooks if isinstance(h, StageTimingHook)]
    return hook, loaded.config.run_dir


def test_stage_timing_in_a_config_writes_into_the_run_directory(tmp_path: Path) -> None:
    # it used to write stage_timing.csv into the working directory, apart from the run's metrics.csv
    hook, run_dir = built_stage_timing(tmp_path, "{name: stage_timing}")
    assert hook.output == run_dir / "stage_timing.csv"
    hook, _ = built_stage_timing(tmp_path, "{name: stage_timing, output: mine.csv}")
    assert hook.output == Path("mine.csv")  # one the config gives is kept


def test_train_leaves_the_working_directory_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = [
        "hooks=[{name: stage_timing}]",
        "trainer.max_steps=2",
        "device=cpu",
        "logging.progress_bar=false",
        "logging.plot=false",
        "logging.tensorboard=false",
    ]
    code = main(["train", *(arg for setting in settings for arg in ("--set", setting))])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert (tmp_path / "runs" / "digits" / "stage_timing.csv").is_file()
