"""Draw a run's curves (losses, validation metrics, learning rate) from its ``metrics.csv``.

The figure is rendered by matplotlib's Agg canvas directly (no pyplot, no global
backend switch), so plotting works on a headless node, never opens a window and
leaves an interactive session's backend alone. The PNG is written to a temporary
name and renamed, so a reader never sees half an image.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from nvtrain.atomic_files import replaced_atomically
from nvtrain.errors import naming_file

__all__ = ["PLOT_NAME", "plot_metrics", "read_metrics"]

#: File name of the figure in a run directory.
PLOT_NAME = "curves.png"

Series = dict[str, tuple[list[float], list[float]]]


def read_metrics(path: str | Path) -> Series:
    """``metrics.csv`` as ``{column: (steps, values)}``, skipping empty cells."""
    path = Path(path)
    return _series(_read_rows(path))


def _read_rows(path: Path) -> list[dict[str, str]]:
    """The file's rows; a file that is no metrics CSV is a ValueError naming it (``nvtrain plot`` prints it
    as one error line, as it does a missing file)."""
    try:
        with path.open(newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            if not reader.fieldnames or "step" not in reader.fieldnames:
                raise ValueError(f"{path}: not a metrics file (no 'step' column; columns: {reader.fieldnames})")
            return list(reader)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no metrics file (was the run started with logging.csv: true?)") from None
    except csv.Error as err:  # e.g. a field over csv's size limit
        raise ValueError(f"{path}: not a readable CSV file, expected a metrics.csv ({err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text, expected a metrics.csv (byte {err.start}: {err.reason})") from None


def _series(rows: list[dict[str, str]]) -> Series:
    series: Series = {}
    for row in rows:
        step = _number(row.get("step"))
        if step is None:
            continue
        for key, text in row.items():
            if key in ("step", "epoch") or key is None:
                continue
            value = _number(text)
            if value is None:
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
    return series


def _number(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


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
    """Draw the curves of ``csv_path`` into ``output`` (default: ``curves.png`` beside it); return its path."""
    csv_path = Path(csv_path)
    output = Path(output) if output is not None else csv_path.with_name(PLOT_NAME)
    series = read_metrics(csv_path)
    panels = _panels(series)
    if not panels:
        raise ValueError(f"{csv_path}: no values to plot yet")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'nvtrain[cli]'") from err

    figure = Figure(figsize=(7, 2.6 * len(panels)))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)
    for axis, (name, keys) in zip(axes[:, 0], panels, strict=True):
        _draw(axis, name, keys, series)
    axes[-1, 0].set_xlabel("optimizer step")
    figure.suptitle(title or csv_path.parent.name)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    with naming_file(output), replaced_atomically(output, suffix=".png") as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    return output


def _draw(axis: object, name: str, keys: Sequence[str], series: Series) -> None:
    for key in keys:
        steps, values = series[key]
        marker = "o" if key.startswith("val_") or len(steps) < 30 else None
        label = f"{key} (EMA weights)" if key.startswith("val_ema_") else key  # validation of the averaged model
        axis.plot(steps, values, label=label, marker=marker, markersize=3)  # type: ignore[attr-defined]
    if name == "loss" and all(v > 0 for key in keys for v in series[key][1]):
        axis.set_yscale("log")  # type: ignore[attr-defined]
    if name == "learning rate":
        axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))  # type: ignore[attr-defined]
    axis.set_ylabel(name)  # type: ignore[attr-defined]
    axis.grid(True, alpha=0.3)  # type: ignore[attr-defined]
    axis.legend(loc="best", fontsize="small")  # type: ignore[attr-defined]
