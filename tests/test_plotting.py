"""curves.png from metrics.csv: valid PNG, the right panels, errors that name the file, `nvtrain plot`."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvtrain.cli import main
from nvtrain.plotting import PLOT_NAME, plot_metrics, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

METRICS = """\
step,epoch,train_loss,lr,val_loss,val_accuracy,step_time,samples_per_s,grad_norm
10,0,2.0,0.003,,,0.01,6400,1.5
20,0,1.0,0.002,,,0.01,6400,
23,0,,,0.9,0.7,,,
30,1,0.5,0.001,,,0.01,6400,0.5
46,1,,,0.4,0.9,,,
"""


def write_metrics(folder: Path, text: str = METRICS) -> Path:
    path = folder / "metrics.csv"
    path.write_text(text, encoding="utf-8")
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_read_metrics_skips_empty_cells(tmp_path: Path) -> None:
    series = read_metrics(write_metrics(tmp_path))
    assert series["train_loss"] == ([10.0, 20.0, 30.0], [2.0, 1.0, 0.5])
    assert series["val_accuracy"] == ([23.0, 46.0], [0.7, 0.9])
    assert series["grad_norm"] == ([10.0, 30.0], [1.5, 0.5])
    assert "epoch" not in series


def test_plot_writes_a_png_with_one_panel_per_group(tmp_path: Path) -> None:
    written = plot_metrics(write_metrics(tmp_path))
    assert written == tmp_path / PLOT_NAME
    width, height = png_size(written)
    # loss, validation metrics, learning rate, grad_norm: four panels of 2.6 inches at 100 dpi.
    assert (width, height) == (700, 1040)
    assert not list(tmp_path.glob(".curves.png*"))  # no temporary left behind


def test_plot_leaves_the_pyplot_backend_alone(tmp_path: Path) -> None:
    import matplotlib

    before = matplotlib.get_backend()
    plot_metrics(write_metrics(tmp_path), tmp_path / "elsewhere.png")
    assert matplotlib.get_backend() == before
    assert png_size(tmp_path / "elsewhere.png")[0] == 700


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        (None, FileNotFoundError, "no metrics file"),
        ("epoch,train_loss\n0,1.0\n", ValueError, "no 'step' column"),
        ("step,epoch,train_loss\n", ValueError, "no values to plot yet"),
    ],
)
def test_plot_errors_name_the_file(tmp_path: Path, text: str | None, error: type, message: str) -> None:
    path = tmp_path / "metrics.csv"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(error, match=message) as info:
        plot_metrics(path)
    assert str(path) in str(info.value)


def test_plot_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_metrics(tmp_path)
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / PLOT_NAME)
    assert png_size(tmp_path / PLOT_NAME)[0] == 700
    assert main(["plot", str(tmp_path / "metrics.csv"), "-o", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_command_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "missing-run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nvtrain plot: error: ") and err.count("\n") == 1 and "no metrics file" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'step,epoch,train_loss\n1,1,"' + b"x" * 200_000 + b'"\n', "not a readable CSV file"),
        (b"\xff\xfe\x00s", "not UTF-8 text"),
    ],
    ids=["field-over-the-csv-limit", "not-utf8"],
)
def test_a_malformed_file_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "metrics.csv"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        read_metrics(path)
    assert str(path) in str(info.value)
    assert main(["plot", str(tmp_path)]) == 2  # an error line, no traceback
    err = capsys.readouterr().err
    assert err.startswith(f"nvtrain plot: error: {path}: ") and err.count("\n") == 1


def test_rows_without_a_number_are_not_called_too_early_to_plot(tmp_path: Path) -> None:
    """A file with rows of text said "no values to plot yet", as if the run had not logged."""
    path = tmp_path / "bad.csv"
    path.write_text("step,train_loss\n1,abc\n2,def\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.csv: no numeric values in its 2 rows \(columns: train_loss\)"):
        plot_metrics(path)
