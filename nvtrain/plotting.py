"""Draw a run's curves (losses, validation metrics, learning rate) from its ``metrics.csv``.

The figure is rendered by matplotlib's Agg canvas directly (no pyplot, no global
backend switch), so plotting works on a headless node, never opens a window and
leaves an interactive session's backend alone. The image is written to a temporary
name and renamed, so a reader never sees half an image.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from nvtrain.atomic_files import replaced_atomically
from nvtrain.errors import naming_file

__all__ = ["PLOT_NAME", "nonfinite_counts", "omitted_note", "plot_metrics", "read_metrics"]

#: File name of the figure in a run directory.
PLOT_NAME = "curves.png"

#: Formats matplotlib writes that are no image file to write a plot to: LaTeX code (needs LaTeX), raw pixels.
_NOT_IMAGE_FORMATS = frozenset({"pgf", "raw", "rgba"})

Series = dict[str, tuple[list[float], list[float]]]


def read_metrics(path: str | Path) -> Series:
    """``metrics.csv`` as ``{column: (steps, values)}``, skipping empty cells and values that are not finite (a
    diverged run's NaN or inf: :func:`nonfinite_counts` counts them); a column whose every value is not finite
    is there with no points. A last row with no line end, cut short as the run stopped, is left out."""
    return _read(Path(path))[0]


def nonfinite_counts(path: str | Path) -> dict[str, int]:
    """How many values of each column are NaN or infinite: left out of the curves, the plot says how many."""
    return _read(Path(path))[1]


def _read(path: Path) -> tuple[Series, dict[str, int]]:
    return _series(_read_rows(path))


def _read_rows(path: Path) -> list[dict[str, str]]:
    """The file's rows; a file that is no metrics CSV is a ValueError naming it (``nvtrain plot`` prints it
    as one error line, as it does a missing file)."""
    try:
        with path.open(newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            if not reader.fieldnames or "step" not in reader.fieldnames:
                raise ValueError(f"{path}: not a metrics file (no 'step' column; columns: {reader.fieldnames})")
            rows = list(reader)
        if rows and not _ends_a_line(path):
            rows.pop()  # written in part when the run stopped: its cells may be cut short (1.25 read as 1.2)
        return rows
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no metrics file (was the run started with logging.csv: true?)") from None
    except csv.Error as err:  # e.g. a field over csv's size limit
        raise ValueError(f"{path}: not a readable CSV file, expected a metrics.csv ({err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text, expected a metrics.csv (byte {err.start}: {err.reason})") from None


def _ends_a_line(path: Path) -> bool:
    """Whether the file's last byte ends a line: every row the CSV logger writes does."""
    with path.open("rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return True
        file.seek(-1, os.SEEK_END)
        return file.read(1) in (b"\n", b"\r")


def _series(rows: list[dict[str, str]]) -> tuple[Series, dict[str, int]]:
    """The finite values of each column by step, and how many were NaN or infinite."""
    series: Series = {}
    nonfinite: dict[str, int] = {}
    for row in rows:
        step = _number(row.get("step"))
        if step is None or not math.isfinite(step):
            continue
        for key, text in row.items():
            if key in ("step", "epoch") or key is None:
                continue
            value = _number(text)
            if value is None:
                continue
            steps, values = series.setdefault(key, ([], []))
            if math.isfinite(value):
                steps.append(step)
                values.append(value)
            else:
                nonfinite[key] = nonfinite.get(key, 0) + 1
    return series, nonfinite


def _number(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _panels(series: Mapping[str, object]) -> list[tuple[str, list[str]]]:
    """Which columns share an axis: losses, validation metrics, learning rates, other metrics."""
    losses = [k for k in ("train_loss", "train_loss_avg", "val_loss", "val_ema_loss") if k in series]
    val_metrics = sorted(k for k in series if k.startswith("val_") and k not in losses)
    rates = sorted(k for k in series if k == "lr" or k.startswith("lr/"))
    skip = {*losses, *val_metrics, *rates, "step_time", "samples_per_s"}
    others = sorted(k for k in series if k not in skip)
    panels = [("loss", losses), ("validation metrics", val_metrics), ("learning rate", rates)]
    panels += [(name, [name]) for name in others]
    return [(title, keys) for title, keys in panels if keys]


def plot_metrics(csv_path: str | Path, output: str | Path | None = None, title: str | None = None) -> Path:
    """Draw the curves of ``csv_path`` into ``output`` (default: ``curves.png`` beside it); return its path.

    The image is in the format ``output``'s suffix names (``.png``, ``.svg``, ``.pdf``, ``.jpg``, ...; PNG
    without one). Values that are not finite are left out of the lines, and each curve missing some says how
    many in its legend.
    """
    csv_path = Path(csv_path)
    output = Path(output) if output is not None else csv_path.with_name(PLOT_NAME)
    _check_output(output, csv_path)
    rows = _read_rows(csv_path)
    series, nonfinite = _series(rows)
    panels = _panels(series)
    if not panels and rows:  # rows, but no number in them: not what the CSV logger writes
        columns = [key for key in rows[0] if key not in ("step", "epoch") and key is not None]
        raise ValueError(
            f"{csv_path}: no numeric values in its {len(rows)} row{'' if len(rows) == 1 else 's'} (columns: "
            f"{', '.join(columns) or 'none besides step'}); expected numbers, as the CSV logger writes them"
        )
    if not panels:
        raise ValueError(f"{csv_path}: no values to plot yet")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'nvtrain[cli]'") from err

    image_format = _image_format(output, FigureCanvasAgg.get_supported_filetypes())
    figure = Figure(figsize=(7, 2.6 * len(panels)))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)
    for axis, (name, keys) in zip(axes[:, 0], panels, strict=True):
        _draw(axis, name, keys, series, nonfinite)
    axes[-1, 0].set_xlabel("optimizer step")
    figure.suptitle(title or csv_path.parent.name)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    with naming_file(output), replaced_atomically(output, suffix=f".{image_format}") as tmp:
        figure.savefig(tmp, format=image_format, dpi=100)
    return output


def _check_output(output: Path, csv_path: Path) -> None:
    """Refuse to write the plot over a directory or over the metrics it is drawn from."""
    if output.is_dir():
        raise ValueError(f"{output} is a directory: name the image file to write (e.g. {output / PLOT_NAME})")
    if output.resolve() == csv_path.resolve():
        raise ValueError(
            f"the plot's output {output} is its input {csv_path}: it would replace the metrics with an image; "
            f"name another file (e.g. {csv_path.with_name(PLOT_NAME)})"
        )


def _image_format(output: Path, supported: Mapping[str, str]) -> str:
    """The format ``output``'s suffix names (``png`` when it has none); one matplotlib cannot write is refused."""
    suffix = output.suffix.lower().removeprefix(".")
    if not suffix:
        return "png"
    formats = sorted(name for name in supported if name not in _NOT_IMAGE_FORMATS)
    if suffix not in formats:
        raise ValueError(
            f"{output}: no image format is named .{suffix}; name the file with one of "
            f"{', '.join('.' + name for name in formats)} (e.g. {output.with_suffix('.png')})"
        )
    return suffix


def _draw(axis: object, name: str, keys: Sequence[str], series: Series, nonfinite: Mapping[str, int]) -> None:
    for key in keys:
        steps, values = series[key]
        marker = "o" if key.startswith("val_") or len(steps) < 30 else None
        label = f"{key} (EMA weights)" if key.startswith("val_ema_") else key  # validation of the averaged model
        if nonfinite.get(key):  # a diverged run's NaN or inf: the line cannot show them, so the legend says so
            label += f" ({omitted_note(nonfinite[key])})"
        axis.plot(steps, values, label=label, marker=marker, markersize=3)  # type: ignore[attr-defined]
    drawn = [v for key in keys for v in series[key][1]]
    if name == "loss" and drawn and all(v > 0 for v in drawn):
        axis.set_yscale("log")  # type: ignore[attr-defined]
    if name == "learning rate":
        axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))  # type: ignore[attr-defined]
    axis.set_ylabel(name)  # type: ignore[attr-defined]
    axis.grid(True, alpha=0.3)  # type: ignore[attr-defined]
    axis.legend(loc="best", fontsize="small")  # type: ignore[attr-defined]


def omitted_note(count: int) -> str:
    """``3 non-finite values omitted``: what a curve missing ``count`` values says of them."""
    return f"{count} non-finite value{'' if count == 1 else 's'} omitted"
