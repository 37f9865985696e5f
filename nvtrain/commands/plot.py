"""Draw a run's curves again from its metrics file.

    nvtrain plot runs/digits                  # writes runs/digits/curves.png
    nvtrain plot runs/digits -o digits.png

RUN_DIR is a run directory (holding metrics.csv) or the path of a metrics CSV file.
The image is in the format the output's suffix names (.png, .svg, .pdf, .jpg, ...; PNG without one).
NaN or infinite values are left out of the curves; the legend and a line on stderr say how many.
Exit status: 0 written; 2 no metrics file, one that is not a metrics CSV, nothing to plot, or an
output that is a directory, the metrics file itself, or of a format matplotlib does not write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["HELP", "add_arguments", "run"]

HELP = "draw curves.png again from a run's metrics.csv"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or a metrics CSV file")
    parser.add_argument(
        "-o",
        "--output",
        metavar="IMAGE",
        help="where to write, in the format its suffix names (default: RUN_DIR/curves.png)",
    )


def run(args: argparse.Namespace) -> int:
    from nvtrain.app import EXIT_OK, EXIT_USAGE
    from nvtrain.plotting import PLOT_NAME, nonfinite_counts, omitted_note, plot_metrics

    target = Path(args.run_dir)
    if target.is_file() and target.suffix != ".csv":
        print(
            f"nvtrain plot: error: {target} is a file, not a run directory or a metrics CSV "
            "(e.g. nvtrain plot runs/digits)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not target.exists():
        print(f"nvtrain plot: error: {target}: no metrics file (no such run directory; e.g. runs/digits)", file=sys.stderr)
        return EXIT_USAGE
    csv_path = target if target.suffix == ".csv" else target / "metrics.csv"
    output = Path(args.output) if args.output else csv_path.with_name(PLOT_NAME)
    try:
        written = plot_metrics(csv_path, output)
        nonfinite = nonfinite_counts(csv_path)
    except (OSError, ValueError, ImportError) as err:
        print(f"nvtrain plot: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if nonfinite:
        columns = ", ".join(f"{key} {count}" for key, count in nonfinite.items())
        print(
            f"nvtrain plot: {csv_path}: {omitted_note(sum(nonfinite.values()))} from the curves ({columns})",
            file=sys.stderr,
        )
    print(written)
    return EXIT_OK
