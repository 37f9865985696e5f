"""Write a model's weights from a checkpoint as one plain file, for inference.

    nvtrain export runs/digits/checkpoints model.pt            # the latest checkpoint's weights
    nvtrain export runs/digits/checkpoints/step_500 model.pt   # one checkpoint
    nvtrain export runs/digits/checkpoints ema.pt --ema        # the EMA average instead
    nvtrain export CKPT teacher.pt --model teacher             # one model of several

CHECKPOINT is a checkpoint directory (step_<N>) or a checkpoint root (its latest
complete checkpoint); sharded (FSDP) checkpoints are consolidated in this process.
OUTPUT receives what model.state_dict() of the plain model holds, written atomically;
it loads with torch.load(OUTPUT, weights_only=True) and load_state_dict, without nvtrain.
--ema takes the average of the EMA hook that served the model (its state "ema:<model>");
--ema-key KEY names another hook state (with --model, one that averages that model).
OUTPUT may not lie inside the checkpoint or its root. Needs the nvtrain-checkpoint plugin.

Exit status: 0 written (the line names the step read); 1 OUTPUT could not be written (left as it was);
2 no such checkpoint, a damaged one, no such model or average, or an OUTPUT that is empty, a directory
or inside the checkpoint root.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["HELP", "add_arguments", "run"]

HELP = "write a model's weights (or their EMA average) from a checkpoint as one plain file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory, or a checkpoint root")
    parser.add_argument("output", metavar="OUTPUT", help="the weights file to write (e.g. model.pt)")
    parser.add_argument("--model", metavar="NAME", help="which model, when the checkpoint holds several")
    parser.add_argument("--ema", action="store_true", help="export the model's EMA average instead of its weights")
    parser.add_argument(
        "--ema-key", metavar="KEY", help="the hook state holding the average (implies --ema; default ema:<model>)"
    )


def run(args: argparse.Namespace) -> int:
    from nvtrain.app import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
    from nvtrain.errors import ResumeError
    from nvtrain.state import checkpoint_plugin_function

    try:
        export_weights = checkpoint_plugin_function("export_weights", "nvtrain export")
        ema = args.ema_key if args.ema_key is not None else args.ema  # an empty key is refused, not taken for none
        read: list[Path] = []
        written = export_weights(args.checkpoint, args.output, args.model, ema=ema, on_checkpoint=read.append)
    except (ImportError, ResumeError, ValueError) as err:  # a CheckpointError is a ResumeError
        print(f"nvtrain export: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:
        if _about_the_output(err, args.output):  # a full disk, no permission: nothing was replaced
            print(f"nvtrain export: error: cannot write {args.output}: {err}", file=sys.stderr)
        else:  # reading the checkpoint failed below what its checks name
            print(f"nvtrain export: error: cannot read {args.checkpoint}: {err}", file=sys.stderr)
        return EXIT_FAILURE
    what = "the EMA average" if ema is not False else "the weights"
    print(f"wrote {written} ({what} of {read[-1].name}, {written.stat().st_size / 1e6:.1f} MB)")
    return EXIT_OK


def _about_the_output(err: OSError, output: str) -> bool:
    """Whether ``err`` is about writing ``output``: the file, the temporary file beside it, or a folder on its way."""
    if err.filename is None:
        return True
    target = Path(output).absolute()
    failed = Path(os.fsdecode(err.filename)).absolute()
    return target.is_relative_to(failed) or failed.parent == target.parent
