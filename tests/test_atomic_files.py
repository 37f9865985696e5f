"""Files nvtrain publishes by renaming a temporary file get the mode a new file gets under the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvtrain.atomic_files import new_file_mode, replaced_atomically


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    new_file_mode.cache_clear()
    try:
        yield
    finally:
        os.umask(old)
        new_file_mode.cache_clear()


@pytest.mark.usefixtures("umask_022")
def test_a_replaced_file_has_the_mode_open_would_give_it(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    target = tmp_path / "metrics.csv"
    with replaced_atomically(target) as tmp, tmp.open("w") as file:
        file.write("step\n1\n")
    assert target.read_text() == "step\n1\n"
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk"), replaced_atomically(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("length", [12, 250])  # 250: the temporary name is cut short to fit NAME_MAX
def test_an_os_error_naming_the_temporary_file_names_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """A full disk at the rename says which file could not be written, not a hidden name nobody asked for."""
    target = tmp_path / ("m" * (length - 4) + ".png")

    def no_room(source: str, destination: object) -> None:
        raise OSError(28, "No space left on device", source)

    monkeypatch.setattr(os, "replace", no_room)
    with pytest.raises(OSError) as caught, replaced_atomically(target, suffix=".png") as tmp:
        tmp.write_bytes(b"image")
    assert caught.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("umask_022")
def test_a_runs_metrics_config_and_plot_are_readable_by_others(tmp_path: Path) -> None:
    from nvtrain.cli import main

    overrides = ["--set", f"output_dir={tmp_path}", "--set", "trainer.max_steps=2", "--set", "hooks=[]"]
    overrides += ["--set", "device=cpu"]
    assert main(["train", *overrides, "--set", "logging.progress_bar=false"]) == 0
    run_dir = tmp_path / "digits"
    for name in ("config.yaml", "metrics.csv", "curves.png"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o644, name
