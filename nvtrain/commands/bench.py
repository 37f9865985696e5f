"""Measure what a hook stack costs: per stage, and per training step against a bare loop.

    nvtrain bench dispatch --hooks amp,ema,clip
    nvtrain bench dispatch --hooks ema --set hooks.ema.decay=0.99 --json
    nvtrain bench dispatch --config train.yaml            # the hooks a run config builds

`dispatch` builds the stack (plugins and built-in hooks by name, or the hooks of a
run config, built as `nvtrain train` builds them), trains a small MLP with it and
prints, per stage, how many implementations run and what one call costs, then the
per-step time of a bare hand-written loop, of nvtrain with no hooks and of nvtrain
with the stack. Nothing is written outside a temporary directory: every output
folder or file of the stack (a hook's checkpoint_dir, output_dir or log_dir, a
CSV logger's path, what a hook class declares in output_settings such as
stage_timing's output, even one the config sets, and the logging hooks' run
directory) goes there, a hook's resume is set to never (a bench run never loads
a checkpoint), and the progress bar is off. Before measuring, the stack runs
SETUP and one step on the bench model, so a hook that refuses it (raising what
`nvtrain train` takes for a refusal: ValueError, TypeError, KeyError, IndexError,
AssertionError, ImportError, a RuntimeError but out-of-memory or accelerator
errors) is one line.

Settings a hook requires get bench defaults with --hooks (amp: precision auto;
clip: max_norm 1.0; checkpoint: step_interval 100); --set KEY=VALUE changes any
setting the way `nvtrain train --set` does (hooks are addressed by name). Without
--config the built-in job does not check the hooks against its validation section
(validation.use_ema with two EMA hooks, early stopping's monitor): the bench never
validates. A --config's checks apply, located in that file.

With --json, stdout holds the JSON document alone: what Python code prints while
the stack is imported, built and measured goes to stderr (output of C code or of
a subprocess is not redirected). Runs cycle through 64 distinct seeded batches,
so memory does not grow with --steps; --threads is at most 4 per CPU.

Exit status: 0 measured; 2 bad arguments (an unknown or unavailable --device
or --threads past 4 per CPU too), config or hook settings, or a hook refusing
the bench model at SETUP or its first step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from nvtrain.config import LoadedConfig

__all__ = ["BENCH_SETTINGS", "HELP", "add_arguments", "contained", "device_problem", "max_threads", "run"]

HELP = "measure hook dispatch and per-step overhead of a hook stack (--hooks or --config)"

#: Settings given to hooks named with --hooks that need one to be built at all.
BENCH_SETTINGS: dict[str, dict[str, Any]] = {
    "amp": {"precision": "auto"},
    "clip": {"max_norm": 1.0},
    "checkpoint": {"step_interval": 100},
}

#: (steps per run, runs) of the normal and the --quick measurement.
FULL = (200, 5)
QUICK = (30, 2)


class _OneLineErrors(argparse.ArgumentParser):
    """A parser whose usage errors are the one line the other bench errors are, not usage plus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"nvtrain bench: error: {message} (see {self.prog} --help)\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT", required=True, parser_class=_OneLineErrors)
    dispatch = sub.add_parser(
        "dispatch",
        help="per-stage dispatch and per-step overhead of a hook stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dispatch.add_argument(
        "--hooks",
        metavar="NAMES",
        default="",
        help="comma-separated plugin or built-in hook names, e.g. amp,ema,clip (added to --config's hooks)",
    )
    dispatch.add_argument("--config", metavar="CONFIG.yaml", help="measure the hooks this run config builds")
    dispatch.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="change a setting, e.g. --set hooks.ema.decay=0.99 (a YAML value; repeatable)",
    )
    dispatch.add_argument("--model", choices=("tiny", "larger"), default="tiny", help="MLP to train (default tiny)")
    dispatch.add_argument("--steps", type=int, help=f"steps per timed run (default {FULL[0]}; --quick {QUICK[0]})")
    dispatch.add_argument(
        "--rounds", type=int, help=f"timed runs per candidate (default {FULL[1]}; --quick {QUICK[1]})"
    )
    dispatch.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads while measuring (default 1; at most 4 per CPU)"
    )
    dispatch.add_argument("--device", default="cpu", help="torch device (default cpu)")
    dispatch.add_argument("--quick", action="store_true", help="fewer, shorter runs: a rough figure in seconds")
    dispatch.add_argument(
        "--json",
        action="store_true",
        help="print JSON (for CI) instead of tables; what Python code prints meanwhile goes to stderr",
    )


def run(args: argparse.Namespace) -> int:
    document = sys.stdout
    with _prints_to_stderr() if args.json else contextlib.nullcontext():
        report = _report(args)
    if report is None:
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report), file=document)
    return 0


def _prints_to_stderr() -> contextlib.AbstractContextManager[object]:
    """What Python code prints goes to stderr while it is active: a hook printing progress must not
    break the JSON document on stdout (C code and subprocesses write to the file descriptor directly)."""
    return contextlib.redirect_stdout(sys.stderr)


def max_threads() -> int:
    """The most ``--threads`` a measurement takes: 4 per CPU. More only measures contention, and
    thousands make the OpenMP runtime fail to start them, or crash."""
    return 4 * (os.cpu_count() or 1)


def _report(args: argparse.Namespace) -> dict[str, Any] | None:
    """Build, try and measure the stack; None (the reason printed on stderr) when the arguments are refused."""
    from nvtrain.commands.bench_stack import StackRefused
    from nvtrain.config import ConfigError

    steps, rounds = QUICK if args.quick else FULL
    steps = args.steps if args.steps is not None else steps
    rounds = args.rounds if args.rounds is not None else rounds
    problem = _count_problem(steps, rounds, args.threads) or device_problem(args.device)
    if problem is not None:
        print(f"nvtrain bench: error: {problem}", file=sys.stderr)
        return None
    names = [name.strip() for name in args.hooks.split(",") if name.strip()]
    with _scratch() as scratch:
        try:
            build = stack_builder(args.config, names, args.overrides, scratch)
            _try_stack(build(), args)  # every error in the config, the settings or at SETUP surfaces here
        except (ConfigError, ImportError) as err:
            print(f"nvtrain bench: error: {_located(err, names)}", file=sys.stderr)
            return None
        except StackRefused as err:
            print(f"nvtrain bench: error: {_source(args.config, names)}: {err}", file=sys.stderr)
            return None
        report = _measure(build, args, steps, rounds)
    report["source"] = _source(args.config, names)
    return report


def _count_problem(steps: int, rounds: int, threads: int) -> str | None:
    if steps < 3 or rounds < 1 or threads < 1:
        return "--steps must be >= 3, --rounds >= 1 and --threads >= 1"
    if threads > max_threads():
        return f"--threads {threads} is more than {max_threads()} (4 per CPU; this machine has {os.cpu_count() or 1})"
    return None


def _try_stack(stack: Sequence[object], args: argparse.Namespace) -> None:
    """SETUP and one step with ``stack`` on the bench model, so a hook's refusal is one line, not a traceback."""
    from nvtrain.commands.bench_stack import MODELS, trial_step

    trial_step(stack, model=MODELS[args.model], device=args.device)


def device_problem(spec: str) -> str | None:
    """Why ``--device spec`` cannot be measured on (not a torch device, or not on this machine), or None.

    Checked before building anything, so a typo is one line and exit 2, not a traceback mid-measurement.
    """
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        return f"--device {spec!r} is not a torch device (expected e.g. cpu, cuda or cuda:1)"
    if device.type == "meta":
        return f"--device {spec!r} holds no data to train on (expected e.g. cpu, cuda or cuda:1)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {spec!r} asked for CUDA, which this machine does not have (use --device cpu)"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return (
                f"--device {spec!r} names CUDA device {device.index}, "
                f"but this machine has {count} (cuda:0 to cuda:{count - 1})"
            )
        return None
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        return f"--device {spec!r} is not available on this machine ({' '.join(str(err).split())})"
    return None


def stack_builder(
    config: str | None, names: Sequence[str], overrides: Sequence[str], scratch: Path
) -> Callable[[], list[object]]:
    """A function building the stack afresh, each time into a new folder under ``scratch``.

    The hooks come from ``config`` (as ``nvtrain train`` builds them, logging hooks
    included but the progress bar off) plus ``names``; without a config only ``names``,
    which the built-in job's validation section does not check (:func:`_hooks_alone`).
    Every output location lands in that folder and no hook resumes (:func:`contained`),
    so a bench leaves nothing behind and never measures a run resumed from elsewhere.
    """
    from nvtrain.app import prepare
    from nvtrain.config import load_config

    base: list[str] = []
    if names or config is None:
        hooks = [] if config is None else _config_hooks(config)
        hooks += [{"name": name, **BENCH_SETTINGS.get(name.partition(":")[0], {})} for name in names]
        base.append("hooks=" + json.dumps(hooks))
    if config is None:  # only the named hooks: no logging hooks either
        base += ["logging.csv=false", "logging.plot=false", "logging.tensorboard=false"]
    counter = iter(range(1_000_000))

    def build() -> list[object]:
        folder = scratch / f"run{next(counter)}"
        fixed = [f"output_dir={json.dumps(str(folder))}", "logging.progress_bar=false"]
        loaded = contained(load_config(config, [*base, *overrides, *fixed]))
        if config is None:
            return _hooks_alone(loaded)
        return list(prepare(loaded, world_size=1).hooks)

    return build


def _hooks_alone(loaded: LoadedConfig) -> list[object]:
    """The hooks and logging hooks of ``loaded``, each built and checked as ``nvtrain train`` does.

    Without ``--config`` the job around them is the built-in one, not the user's, and the
    bench never validates: its cross-checks of the hooks against its validation section
    (``use_ema`` with two EMA hooks, early stopping's ``monitor`` against its metrics)
    would refuse the stack for a job nobody runs.
    """
    from nvtrain.app.hook_stack import build_hooks, run_logging_hooks

    return [*build_hooks(loaded, [Path.cwd()]), *run_logging_hooks(loaded)]


def contained(loaded: LoadedConfig) -> LoadedConfig:
    """``loaded`` with each hook's output files and folders left to the run directory and its resume off.

    Every output setting of a hook (``checkpoint_dir``, ``output_dir``, ``log_dir``
    and what the class declares in ``output_settings``, such as StageTimingHook's
    ``output``: the ones ``nvtrain train`` fills in) is dropped, so it defaults into
    the run directory as it does for a run that does not set it; a CSV logger's file
    ``path`` moves into the run directory under its own name; a hook that takes
    ``resume`` gets ``resume: never``. A hook whose class cannot be found is left as
    it is: :func:`~nvtrain.app.prepare` reports it.
    """
    import attrs

    from nvtrain.app.hook_stack import output_parameters, signature_parameters
    from nvtrain.logging_hooks import CSVLoggerHook

    search = [loaded.directory] if loaded.directory is not None else []
    search.append(Path.cwd())
    hooks = []
    for index, hook in enumerate(loaded.config.hooks):
        cls = _hook_class(hook.name, search)
        parameters = signature_parameters(cls)
        outputs = output_parameters(cls)
        settings = {key: value for key, value in hook.settings.items() if key not in outputs}
        if isinstance(cls, type) and issubclass(cls, CSVLoggerHook) and "path" in settings:
            settings["path"] = str(loaded.config.run_dir / f"hook{index}" / Path(str(settings["path"])).name)
        if "resume" in parameters:
            settings["resume"] = "never"
        hooks.append(attrs.evolve(hook, settings=settings))
    return attrs.evolve(loaded, config=attrs.evolve(loaded.config, hooks=tuple(hooks)))


def _hook_class(name: str, search: Sequence[Path]) -> object:
    """The class ``nvtrain train`` builds for hook ``name`` (built-in, plugin or import path), or None."""
    from nvtrain import plugins
    from nvtrain.app.hook_stack import builtin_hook_classes
    from nvtrain.config import resolve_import_path

    builtin = builtin_hook_classes()
    installed = {record.name for record in plugins.visible_records()}  # metadata: nothing is imported yet
    if name in builtin and name not in installed:  # both: ambiguous, which prepare() reports
        return builtin[name]
    try:
        if name.partition(":")[0] in installed:
            return plugins.hook_class(name)  # imports this plugin alone
        return resolve_import_path(name, search) if ":" in name else None
    except Exception:  # any failure is reported, located, when prepare() builds the stack
        return None


def _located(err: Exception, names: Sequence[str]) -> str:
    """Name --hooks, not the override it became, as the place of an error in a named hook."""
    from nvtrain.config import ConfigError, format_path

    if isinstance(err, ConfigError) and (err.location or "").startswith("--set hooks="):
        return ": ".join(p for p in ("--hooks " + ",".join(names), format_path(err.path), err.problem) if p)
    return str(err)


def _config_hooks(config: str) -> list[dict[str, Any]]:
    from nvtrain.config import load_config

    return [{"name": hook.name, **hook.settings} for hook in load_config(config).config.hooks]


def _measure(build: Callable[[], list[object]], args: argparse.Namespace, steps: int, rounds: int) -> dict[str, Any]:
    import torch

    from nvtrain.commands.bench_stack import MODELS, stack_report

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return stack_report(build, model=MODELS[args.model], steps=steps, rounds=rounds, device=args.device)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="nvtrain-bench-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _source(config: str | None, names: Sequence[str]) -> str:
    parts = []
    if config is not None:
        parts.append(f"config {config}")
    if names:
        parts.append("--hooks " + ",".join(names))
    return " + ".join(parts) or "no hooks"


# -- text output ------------------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    """The report as tables: stages, the per-micro-batch sweep, and per-step times."""
    from nvtrain.commands.plugins import format_table

    hooks = ", ".join(f"{h['name']} ({h['kind']})" for h in report["hooks"]) or "none"
    lines = [
        f"nvtrain bench dispatch: {report['source']}",
        f"hooks: {hooks}",
        f"model {report['model']}; {report['device']}, {report['threads']} thread(s); "
        f"{report['steps']} steps per run, {report['rounds']} runs per candidate",
        "",
    ]
    rows = []
    for stage in report["stages"]:
        median = stage["median_ns"]
        rows.append(
            [
                stage["stage"],
                str(len(stage["implementations"])),
                str(len(stage["update_hooks"])) if stage["update_hooks"] else "-",
                str(stage["calls"]),
                "-" if median is None else f"{median:,.0f}",
                "-" if median is None else f"{stage['min_ns']:,.0f}",
                f"includes {stage['includes']}" if stage["includes"] else "",
            ]
        )
    headers = ("stage", "impls", "update hooks", "calls", "ns/call (median)", "(min)", "")
    lines += [format_table(headers, rows), ""]
    sweep = report["sweep_ns"]
    lines.append(
        "per micro-batch: observer stages {:,.0f} ns, update stages {:,.0f} ns, "
        "DO slots {:,.0f} ns (with backward() and the optimizer step); once per run: {:,.0f} ns".format(
            sweep["observer_stages"], sweep["update_stages"], sweep["do_slots"], sweep["once_per_run"]
        )
    )
    lines += [
        "",
        "per step, us        run: median      min   single steps: p10   ratio to the bare loop: "
        "run median, run min, step p10",
    ]
    for name, figures in report["per_step_us"].items():
        ratio = report["ratios"].get(name)
        ratio_text = (
            "1.000x (baseline)"
            if ratio is None
            else f"{ratio['run_median']:.3f}x  {ratio['run_min']:.3f}x  {ratio['step_p10']:.3f}x"
        )
        run, step = figures["run_us"], figures["step_us"]
        lines.append(f"  {name:22s} {run['median']:10.1f} {run['min']:8.1f} {step['p10']:19.1f}   {ratio_text}")
    extra = report.get("hooks_overhead_us")
    if extra is not None:
        lines.append(
            f"your hooks add {extra['run_median']:.1f} us per step (run median; {extra['step_p10']:.1f} us on "
            "single-step p10) over nvtrain with no hooks"
        )
    return "\n".join(lines)
