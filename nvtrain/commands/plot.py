"""Draw a run's curves again from its metrics file.

    nvtrain plot runs/digits                  # writes runs/digits/curves.png
    nvtrain plot runs/digits -o digits.png

RUN_DIR is a run directory (holding metrics.csv) or the path of a metrics CSV file.
Exit status: 0 written; 2 no metrics file, one that is not a metrics CSV, or nothing to plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["HELP", "add_arguments", "run"]

HELP = "draw curves.png again from a run's metrics.csv"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, or a metrics CSV file")
    parser.add_argument("-o", "--output", metavar="PNG", help="where to write (default: RUN_DIR/curves.png)")


def run(args: argparse.Namespace) -> int:
    from nvtrain.app import EXIT_OK, EXIT_USAGE
    from nvtrain.plotting import PLOT_NAME, plot_metrics

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
    except (OSError, ValueError, ImportError) as err:
        print(f"nvtrain plot: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(written)
    return EXIT_OK
