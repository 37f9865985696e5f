"""`nvtrain validate` / `train` on hostile input: one located line, exit status 2, nothing written.

Each case was a raw traceback before (a fuzz audit of the config reader and the
builders): recursive YAML aliases, nesting deeper than the stack, control
characters, config paths the OS refuses, NUL characters in names, factory
arguments torch refuses, a data factory returning None, and run directories or hook
outputs that cannot be created.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

import nvtrain.app.building
from nvtrain.app import EXIT_USAGE
from nvtrain.cli import main

COMMANDS = ["validate", "train"]
LONG = "n" * 300


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small digits job in ``tmp_path`` (the working directory), writing into ``tmp_path/out``."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / "out"}
            device: cpu
            model: {{factory: nvtrain.builtin.digits:make_classifier, kwargs: {{hidden: 16, depth: 1}}}}
            data: {{factory: nvtrain.builtin.digits:make_loaders, kwargs: {{batch_size: 64}}}}
            trainer: {{max_steps: 2}}
            validation: {{every_n_epochs: null}}
            logging: {{tensorboard: false, plot: false, progress_bar: false}}
            """
        ),
        encoding="utf-8",
    )
    return config


def sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def listing(folder: Path) -> set[str]:
    """Every path under ``folder``, to compare before and after a refused command."""
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], folder: Path) -> str:
    """Run ``nvtrain argv``; assert exit 2, one line on stderr, no traceback, nothing new in ``folder``."""
    before = listing(folder)
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain {argv[0]}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert listing(folder) == before
    return err


def append(config: Path, text: str) -> Path:
    config.write_text(config.read_text(encoding="utf-8") + text, encoding="utf-8")
    return config


# -- the YAML reader --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("hooks: &h\n  - *h\n", "job.yaml:8:8: hooks[0]: "),
        ("optimizer: {kwargs: &k {self: *k}}\n", "job.yaml:8:21: optimizer.kwargs.self: "),
    ],
)
def test_a_recursive_alias_is_refused_at_its_node(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, text: str, where: str
) -> None:
    err = refused([command, str(append(job, text))], capsys, job.parent)
    assert f"{job.parent}/{where}recursive alias: expected a value" in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("depth", "got"), [(3000, "more levels than the parser can follow"), (150, "more than 100")])
def test_nesting_too_deep_is_refused(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, depth: int, got: str
) -> None:
    append(job, "optimizer: {kwargs: {deep: " + "[" * depth + "]" * depth + "}}\n")
    err = refused([command, str(job)], capsys, job.parent)
    assert f"{job}:8:" in err
    assert f"nested too deeply: expected at most 100 levels of mappings and lists, got {got}" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_control_character_in_the_file_is_located(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    err = refused([command, str(append(job, "# a stray \x01 here\n"))], capsys, job.parent)
    assert f"error: {job}:8:11: invalid YAML: expected printable text, got the control character #x0001" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_control_character_in_a_set_value_is_located(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    err = refused([command, str(job), *sets("name=a\x01b")], capsys, job.parent)
    assert (
        "error: --set name=a\\x01b:1:2: invalid YAML: expected printable text, got the control character #x0001" in err
    )
    assert "\x01" not in err


# -- the config file --------------------------------------------------------------------------------


def _symlink_loop(folder: Path) -> Path:
    loop = folder / "loop.yaml"
    loop.symlink_to(loop)
    return loop


def _under_a_file(folder: Path) -> Path:
    (folder / "afile").write_text("", encoding="utf-8")
    return folder / "afile" / "job.yaml"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_symlink_loop, "Too many levels of symbolic links"),
        (_under_a_file, "Not a directory"),
        (lambda folder: folder / f"{LONG}.yaml", "File name too long"),
    ],
)
def test_a_config_path_the_os_refuses_is_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, make: object, reason: str
) -> None:
    assert callable(make)
    path = make(job.parent)
    err = refused([command, str(path)], capsys, job.parent)
    assert f"error: {path}: cannot read the config file: expected a readable file, got {reason}" in err


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc")
def test_an_unreadable_special_file_is_one_line(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["validate", "/proc/self/mem"], capsys, job.parent)
    assert "error: /proc/self/mem: cannot read the config file: expected a readable file, got " in err


# -- names and folders ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ('name="a\\0b"', "name", "a plain directory name without slashes or NUL characters (got 'a\\x00b')"),
        ('output_dir="ru\\0ns"', "output_dir", "a folder path without NUL characters (got 'ru\\x00ns')"),
    ],
)
def test_a_nul_character_in_a_name_or_folder_is_refused(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, override: str, field: str, expected: str
) -> None:
    err = refused([command, str(job), *sets(override)], capsys, job.parent)
    assert f"--set {override}: {field}: must be {expected}" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_name_too_long_for_the_file_system_is_refused(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    err = refused([command, str(job), *sets(f"name={LONG}")], capsys, job.parent)
    assert f"--set name={LONG}: name: the run directory " in err
    assert "cannot be created: expected names of at most 255 bytes, got one of 300 bytes" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_directory_that_cannot_be_created_is_refused(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    override = "output_dir=/proc/nvtrain-runs"
    err = refused([command, str(job), *sets(override)], capsys, job.parent)
    assert f"--set {override}: output_dir: the run directory '/proc/nvtrain-runs/job' cannot be created: " in err
    assert "expected a writable folder at '/proc', got No such file or directory" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("command", COMMANDS)
def test_a_hook_output_that_cannot_be_created_is_refused_before_training(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    override = "hooks=[{name: stage_timing, output: /proc/nvtrain-x/st.csv}]"
    err = refused([command, str(job), *sets(override)], capsys, job.parent)
    assert f"--set {override}: hooks[0].output: hook 'stage_timing': output '/proc/nvtrain-x/st.csv' " in err
    assert "cannot be created: expected a writable folder at '/proc'" in err


def test_a_run_directory_that_fails_at_the_start_is_one_line_and_leaves_nothing(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build's check passed (the disk changed since, say): train's own mkdir failing is still exit 2."""
    monkeypatch.setattr(nvtrain.app.building, "check_outputs", lambda plan: None)
    override = f"output_dir={job.parent / 'out' / 'deeper'}"
    err = refused(
        ["train", str(job), *sets(override, f"name={LONG}", "trainer.preemption_signal=null")], capsys, job.parent
    )
    assert f"--set name={LONG}: name: the run directory " in err
    assert "cannot be created: expected a writable folder, got File name too long" in err


# -- what the factories refuse ----------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("override", "where", "message"),
    [
        ("data.kwargs.seed=abc", "data.kwargs.seed", "seed must be an int from -2**63 to 2**64 - 1 (got str 'abc')"),
        (
            "data.kwargs.batch_size=1180591620717411303424",
            "data.kwargs.batch_size",
            "batch_size must be an int from 1 to the data set's 1797 samples",
        ),
        (
            "data.kwargs.val_fraction=0.9999",
            "data.kwargs.val_fraction",
            "val_fraction must be in (0, 1) and leave at least one training and one validation sample",
        ),
        (
            "model.kwargs.depth=1180591620717411303424",
            "model.kwargs.depth",
            "depth must be an int from 1 to 1024",
        ),
        ("model.kwargs.dropout=x", "model.kwargs.dropout", "dropout must be a number in [0, 1) (got str 'x')"),
    ],
)
def test_the_digits_factories_name_the_argument_they_refuse(
    job: Path, capsys: pytest.CaptureFixture[str], command: str, override: str, where: str, message: str
) -> None:
    err = refused([command, str(job), *sets(override)], capsys, job.parent)
    assert f"--set {override}: {where}: " in err and message in err


FACTORIES = """\
import torch


def runtime_error(**kwargs):
    raise RuntimeError("the model cannot be built from these settings")


def out_of_memory(**kwargs):
    raise torch.OutOfMemoryError("simulated: out of memory")


def no_loader(**kwargs):
    return None
"""


@pytest.mark.parametrize("command", COMMANDS)
def test_a_model_factory_raising_runtime_error_is_one_line(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (job.parent / "bad_factories.py").write_text(FACTORIES, encoding="utf-8")
    override = "model.factory=bad_factories:runtime_error"
    err = refused([command, str(job), *sets(override)], capsys, job.parent)
    # the --set that named the factory is where the refusal comes from, not the model section's line
    assert f"error: --set {override}: model: bad_factories:runtime_error: the model cannot be built" in err


def test_out_of_memory_while_building_is_not_a_config_error(job: Path) -> None:
    (job.parent / "bad_factories.py").write_text(FACTORIES, encoding="utf-8")
    with pytest.raises(torch.OutOfMemoryError):
        main(["validate", str(job), *sets("model.factory=bad_factories:out_of_memory")])


@pytest.mark.parametrize("command", COMMANDS)
def test_a_data_factory_returning_none_is_refused_at_build(
    job: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (job.parent / "bad_factories.py").write_text(FACTORIES, encoding="utf-8")
    override = "data.factory=bad_factories:no_loader"
    err = refused([command, str(job), *sets(override)], capsys, job.parent)
    assert f"--set {override}: data.factory: bad_factories:no_loader returned None as the training loader; " in err
