"""Check a config by building everything ``nvtrain train`` builds, without training a step:
the YAML structure, every import path, the model, the data loaders, the optimizer
and LR scheduler (their own argument checks run), every hook and their composition
into the training strategy, and the checkpoint a resume would start from (with the
config changes since it). Then one training batch goes through the forward and the
loss, and one validation batch through the forward, the loss and every metric
(``--no-batch-check`` skips that), so a loss or metric that fails on the model's
outputs is reported now, not at the first step or validation. Nothing is trained or
written: when ``validate`` says valid, ``train`` starts.

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
    parser.add_argument(
        "--no-batch-check",
        dest="batch_check",
        action="store_false",
        help="do not run one training and one validation batch through the forward, the loss and the metrics "
        "(for a model too large or slow to run here)",
    )


def run(args: argparse.Namespace) -> int:
    from nvtrain.commands.train import logs_shown

    with logs_shown():  # a resume's warnings (a corrupt checkpoint passed over) are part of the answer
        return _validate(args)


def _validate(args: argparse.Namespace) -> int:
    from nvtrain.app import EXIT_OK, EXIT_USAGE, build, check_one_batch, prepare
    from nvtrain.config import ConfigError, load_config

    try:
        plan = prepare(load_config(args.config, args.overrides), world_size=1)
        built = build(plan)
    except (ConfigError, ImportError) as err:
        return _refused(err, EXIT_USAGE)
    try:
        checked = check_one_batch(plan, built) if args.batch_check else None
    except ConfigError as err:
        return _refused(err, EXIT_USAGE)
    finally:
        built.strategy.close()
    names = ", ".join(type(hook).__name__ for hook in plan.hooks) or "none"
    print(f"{plan.loaded.source}: valid (run directory {plan.run_dir}; hooks: {names})")
    if checked is not None:
        print(checked.describe(resumes=built.resume_from is not None))
    if built.resume_from is not None:
        print(f"resumes from {built.resume_from} (step {built.resume_step})")
        for change in built.changes:
            print(f"  {change.describe()}")
    return EXIT_OK


def _refused(err: Exception, status: int) -> int:
    """One line on stderr (a message's inner line breaks folded), the exit status of a bad config."""
    from nvtrain.commands.train import with_notes

    print(f"nvtrain validate: error: {' '.join(with_notes(err).split())}", file=sys.stderr)
    return status
