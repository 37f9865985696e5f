"""Check a config and the hooks it names without training: the YAML structure, every
import path, keyword arguments against the factories' signatures, hook names and
settings (each hook is built, which runs its validators). Nothing is written.

    nvtrain validate my.yaml --set trainer.max_steps=200

Exit status: 0 valid; 2 invalid (one line on stderr naming the field and its line).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["HELP", "add_arguments", "run"]

HELP = "check a config and its plugins without training"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from nvtrain.commands.train import add_config_arguments

    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from nvtrain.app import EXIT_OK, EXIT_USAGE, prepare
    from nvtrain.config import ConfigError, load_config

    try:
        plan = prepare(load_config(args.config, args.overrides))
    except (ConfigError, ImportError) as err:
        print(f"nvtrain validate: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    names = ", ".join(type(hook).__name__ for hook in plan.hooks) or "none"
    print(f"{plan.loaded.source}: valid (run directory {plan.run_dir}; hooks: {names})")
    return EXIT_OK
