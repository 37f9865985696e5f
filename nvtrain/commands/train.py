"""Train a model from a YAML config; with no config, the built-in example (an MLP on
scikit-learn's handwritten digits: no download).

    nvtrain train                                  # the built-in job, into runs/digits/
    nvtrain train my.yaml --set trainer.max_steps=200
    nvtrain train --print-config > my.yaml         # start your own from the built-in one (runs/my/)

Exit status: 0 done (also: already at the requested step, nothing to train);
1 training failed (traceback; one line for a full disk); 2 bad config, arguments
or checkpoint to resume from (one line on stderr, nothing written); 3 diverged
(trainer.max_consecutive_skipped_steps skipped steps in a row); 75 stopped by a
preemption signal after a checkpoint (run the same command again to resume);
76 stopped by a preemption signal with nothing saved (no checkpoint hook);
130 aborted by a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nvtrain.errors import disk_full

if TYPE_CHECKING:
    from nvtrain.config import LoadedConfig, RunConfig

__all__ = ["HELP", "add_arguments", "add_config_arguments", "printable", "run"]

HELP = "train from a YAML config (default: the built-in digits example)"


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """CONFIG and --set, shared by ``train`` and ``validate``."""
    parser.add_argument(
        "config",
        metavar="CONFIG",
        nargs=None if required else "?",
        help="a YAML config file" + ("" if required else " (default: the built-in digits example)"),
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a field, e.g. --set trainer.max_steps=200 (a YAML value; repeatable)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the fully resolved config as YAML and exit without training "
        "(name: null unless the config or --set names the run, so a saved copy runs under its file's stem)",
    )


class _StderrHandler:
    """Marker base: the handler ``logs_shown`` installs (so it is installed once)."""


@contextlib.contextmanager
def logs_shown() -> Iterator[None]:
    """Print nvtrain's INFO messages (a resume, a preemption) and everyone's warnings on stderr while the command
    runs; the root logger is left as it was afterwards (``main()`` may be called in-process: tests, notebooks)."""

    class StderrHandler(logging.StreamHandler, _StderrHandler):  # type: ignore[type-arg]
        def emit(self, record: logging.LogRecord) -> None:
            self.stream = sys.stderr  # whatever stderr is now (tests and notebooks replace it)
            super().emit(record)

    root = logging.getLogger()
    if any(isinstance(h, _StderrHandler) for h in root.handlers):  # a command inside a command: shown already
        yield
        return
    handler = StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("nvtrain"))
    level = root.level
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def run(args: argparse.Namespace) -> int:
    from nvtrain.app import EXIT_USAGE, prepare
    from nvtrain.config import ConfigError, dump_config, load_config

    try:
        loaded = load_config(args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(dump_config(printable(loaded)))
            return 0
        plan = prepare(loaded)
    except (ConfigError, ImportError) as err:
        return error(with_notes(err), EXIT_USAGE)
    with logs_shown():
        return _train(plan)


def _train(plan: Any) -> int:
    from nvtrain.app import EXIT_DIVERGED, EXIT_FAILURE, EXIT_USAGE, train
    from nvtrain.config import ConfigError
    from nvtrain.errors import TrainingDivergedError

    try:
        return train(plan).exit_code
    except ConfigError as err:  # found while building: nothing was trained or written
        return error(with_notes(err), EXIT_USAGE)
    except TrainingDivergedError as err:
        return error(with_notes(err), EXIT_DIVERGED)
    except OSError as err:
        full = disk_full(err)
        if full is None:
            raise
        # a write that names no file is still one in the run directory (metrics, plot, checkpoints)
        where = f"writing {full.filename}" if full.filename else f"writing into {plan.run_dir}"
        return error(f"no space left on device {where}", EXIT_FAILURE)


def printable(loaded: LoadedConfig) -> RunConfig:
    """The config ``--print-config`` shows: ``name: null`` unless the config or a ``--set`` named the run.

    A default name (the built-in ``digits``, a file's stem) would pin a saved copy to
    that run directory, and so to that run's checkpoints; null lets it default to the
    saved file's stem.
    """
    import attrs

    return loaded.config if loaded.name_given else attrs.evolve(loaded.config, name=None)


def error(message: str, code: int) -> int:
    """Print ``nvtrain train: error: <message>`` (one line) on stderr and return ``code``."""
    print(f"nvtrain train: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


def with_notes(err: BaseException) -> str:
    """``str(err)`` and the notes added to it on its way out (a hook that failed to close, a plot not drawn):
    they are failures of their own, never dropped from the one line a command prints."""
    notes = [str(note) for note in getattr(err, "__notes__", ())]
    return str(err) + (f" (also: {'; '.join(notes)})" if notes else "")
