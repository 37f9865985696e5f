"""The ``nvtrain`` command: one argparse parser, one module per subcommand.

Subcommands live in their own modules, listed in :data:`COMMANDS`. A subcommand
module defines::

    HELP = "one line for `nvtrain --help`"
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...      # the exit code

and keeps heavy imports inside ``run`` so ``nvtrain --help`` stays quick. Adding
a subcommand is adding a module and one line here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand name -> module implementing it.
COMMANDS: dict[str, str] = {
    "train": "nvtrain.commands.train",
    "validate": "nvtrain.commands.validate",
    "plot": "nvtrain.commands.plot",
    "plugins": "nvtrain.commands.plugins",
    "bench": "nvtrain.commands.bench",
    "export": "nvtrain.commands.export",
}


def build_parser() -> argparse.ArgumentParser:
    from nvtrain import __version__

    parser = argparse.ArgumentParser(
        prog="nvtrain",
        description="nvtrain: a PyTorch training loop whose stages are pluggy hooks.",
    )
    parser.add_argument("--version", action="version", version=f"nvtrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = _command_module(name, module_name)
        sub = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvtrain`` console script and of ``python -m nvtrain``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._run(args))
    except KeyboardInterrupt:  # a second Ctrl-C during training, or one outside a run
        print(f"\nnvtrain {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (``nvtrain plugins --json | head``): stop quietly
        _silence_stdout()
        return EXIT_BROKEN_PIPE


#: The status of a command whose stdout was closed under it, as a shell reports a process SIGPIPE ended.
EXIT_BROKEN_PIPE = 128 + 13


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind stdout (replaced in-process): nothing to flush
        pass


def _command_module(name: str, module_name: str) -> ModuleType:
    module = importlib.import_module(module_name)
    for attribute in ("HELP", "add_arguments", "run"):
        if not hasattr(module, attribute):
            raise TypeError(f"nvtrain subcommand {name!r}: module {module_name} does not define {attribute}")
    return module


if __name__ == "__main__":
    sys.exit(main())
