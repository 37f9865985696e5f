"""What `nvtrain plot` refuses (its own metrics file or a directory as output, a format nobody writes), what it
says of values it cannot draw (NaN, inf), a row cut short, the image format the suffix names, long names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvtrain.atomic_files import replaced_atomically
from nvtrain.cli import main
from nvtrain.plotting import nonfinite_counts, plot_metrics, read_metrics

METRICS = "step,epoch,train_loss,lr\n10,0,2.0,0.003\n20,0,1.0,0.002\n30,1,0.5,0.001\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text(METRICS, encoding="utf-8")
    return tmp_path / "run"


# -- outputs refused --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["{run}", "{run}/metrics.csv", "{run}/../run/metrics.csv"])
def test_the_metrics_file_is_never_written_over(run_dir: Path, capsys: pytest.CaptureFixture[str], source: str) -> None:
    csv_path = run_dir / "metrics.csv"
    assert main(["plot", source.format(run=run_dir), "-o", str(csv_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain plot: error: the plot's output {csv_path} is its input ") and err.count("\n") == 1
    assert "name another file (e.g. " in err
    assert csv_path.read_text(encoding="utf-8") == METRICS


def test_a_directory_as_output_is_refused_in_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(run_dir), "-o", str(run_dir)]) == 2
    assert capsys.readouterr().err == (
        f"nvtrain plot: error: {run_dir} is a directory: name the image file to write (e.g. {run_dir}/curves.png)\n"
    )


def test_an_image_format_matplotlib_does_not_write_is_refused(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(run_dir), "-o", str(run_dir / "out.xyz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain plot: error: {run_dir / 'out.xyz'}: no image format is named .xyz; name the ")
    assert ".png, " in err and ".pgf" not in err and not (run_dir / "out.xyz").exists()


# -- the format the suffix names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "magic"),
    [("out.jpg", b"\xff\xd8\xff"), ("out.SVG", b"<?xml"), ("out.pdf", b"%PDF"), ("out", b"\x89PNG\r\n\x1a\n")],
)
def test_the_image_is_in_the_format_its_suffix_names(run_dir: Path, name: str, magic: bytes) -> None:
    assert main(["plot", str(run_dir), "-o", str(run_dir / name)]) == 0
    assert (run_dir / name).read_bytes().startswith(magic)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(["metrics.csv", name])  # no temporary left


# -- values it cannot draw, a row cut short ---------------------------------------------------------------------


def test_non_finite_values_are_left_out_and_said(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_dir / "metrics.csv").write_text(
        "step,train_loss,val_loss,lr\n1,nan,,0.1\n2,inf,,0.1\n3,-inf,nan,0.1\n4,1.5,,0.1\n", encoding="utf-8"
    )
    assert read_metrics(run_dir / "metrics.csv")["train_loss"] == ([4.0], [1.5])
    assert read_metrics(run_dir / "metrics.csv")["val_loss"] == ([], [])  # every value NaN: there, with no point
    assert nonfinite_counts(run_dir / "metrics.csv") == {"train_loss": 3, "val_loss": 1}
    assert main(["plot", str(run_dir), "-o", str(run_dir / "curves.svg")]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"nvtrain plot: {run_dir / 'metrics.csv'}: 4 non-finite values omitted from the curves "
        "(train_loss 3, val_loss 1)\n"
    )
    svg = (run_dir / "curves.svg").read_text(encoding="utf-8")  # matplotlib keeps each text as a comment
    assert "<!-- train_loss (3 non-finite values omitted) -->" in svg
    assert "<!-- val_loss (1 non-finite value omitted) -->" in svg


def test_a_column_of_nan_alone_still_gets_its_panel(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("step,train_loss\n1,nan\n2,inf\n", encoding="utf-8")
    plot_metrics(tmp_path / "metrics.csv", tmp_path / "curves.svg")
    svg = (tmp_path / "curves.svg").read_text(encoding="utf-8")
    assert "<!-- loss -->" in svg and "<!-- train_loss (2 non-finite values omitted) -->" in svg


def test_a_last_row_cut_short_is_left_out(tmp_path: Path) -> None:
    """A run stopped while writing its last row: that row (``3,1.2`` of ``3,1.25``) is not drawn as written."""
    path = tmp_path / "metrics.csv"
    path.write_text("step,train_loss\n1,2.0\n2,1.5\n3,1.2", encoding="utf-8")
    assert read_metrics(path)["train_loss"] == ([1.0, 2.0], [2.0, 1.5])
    path.write_text("step,train_loss\r\n1,2.0\r\n2,1.5\r\n3,1.25\r\n", encoding="utf-8")
    assert read_metrics(path)["train_loss"] == ([1.0, 2.0, 3.0], [2.0, 1.5, 1.25])


# -- long names ---------------------------------------------------------------------------------------------------


def _longest_name(folder: Path) -> int:
    return int(os.pathconf(folder, "PC_NAME_MAX"))


def test_an_output_name_near_the_limit_is_written(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The temporary name (``.<name>.<8 random>.png``) is cut short to fit where the output's own name fits."""
    output = run_dir / ("b" * (_longest_name(run_dir) - 4) + ".png")
    assert main(["plot", str(run_dir), "-o", str(output)]) == 0
    assert capsys.readouterr().out == f"{output}\n"
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(["metrics.csv", output.name])


def test_a_replaced_file_with_a_long_name_gets_a_hidden_temporary(tmp_path: Path) -> None:
    target = tmp_path / ("é" * ((_longest_name(tmp_path) - 4) // 2) + ".txt")  # two bytes a character
    with replaced_atomically(target, suffix=".tmp") as tmp, tmp.open("w", encoding="utf-8") as file:
        assert tmp.name.startswith(".é") and tmp.name.endswith(".tmp")
        assert len(os.fsencode(tmp.name)) <= _longest_name(tmp_path)
        file.write("whole")
    assert target.read_text(encoding="utf-8") == "whole" and os.listdir(tmp_path) == [target.name]
