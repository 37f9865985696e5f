"""Examples of the docs that a reader copies: each one runs, and does what its page says."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import stat
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.atomic_files import new_file_mode
from nvtrain.hooks import EarlyStoppingHook

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _python_block(page: str, containing: str) -> str:
    """The one ```python block of ``docs/<page>`` that holds ``containing``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if containing in b]
    assert len(blocks) == 1, f"docs/{page}: expected one python block with {containing!r}, found {len(blocks)}"
    return blocks[0]


def _run_block(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """Run a doc block in ``namespace`` (with torch and nvtrain imported); the names it binds land there."""
    namespace.setdefault("torch", torch)
    namespace.setdefault("nvtrain", nvtrain)
    exec(compile(code, "<doc block>", "exec"), namespace)
    return namespace


class _Losses:
    """Records every micro-batch's loss, as the example's hook sees it."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        assert ctx.loss is not None
        self.seen.append(ctx.loss.detach())


def test_the_checkpointable_hook_example_registers_and_is_saved_under_its_name(
    make_strategy: Callable[..., nvtrain.TrainingStrategy], batches: Callable[..., list[Any]], tmp_path: Path
) -> None:
    from nvtrain_checkpoint import CheckpointHook, read_checkpoint

    running_stats = _run_block(_python_block("checkpointing.md", "class RunningStats"), {})["RunningStats"]
    stats, losses = running_stats(), _Losses()
    strategy = make_strategy([stats, losses, CheckpointHook(tmp_path / "ck", step_interval=3)])
    with strategy:
        strategy.run(batches(3))
    assert torch.equal(stats.total, sum(losses.seen))  # the sum of the training losses seen
    saved = read_checkpoint(tmp_path / "ck")["hooks"]
    assert list(saved) == ["running_stats"]
    assert torch.equal(saved["running_stats"]["total"], stats.total)


@pytest.mark.parametrize("page", ["step-scheduler.md", "run-control.md"])
def test_the_loop_without_finish_step_saves_the_preemption_after_the_loop(
    page: str, fallback_handlers: list[int]
) -> None:
    code = _python_block(page, "for batches in scheduler:").replace(", ...}", "}")
    loader = list(range(80))
    saves: list[tuple[int, int]] = []
    namespace: dict[str, Any] = {
        "loader": loader,
        "scheduler": nvtrain.StepScheduler(global_batch_size=64, local_batch_size=8, dp_size=1, dataloader=loader),
        "export": lambda: None,
    }

    def train(window: list[Any]) -> None:
        if namespace["scheduler"].step == 3:  # the signal arrives while the third window trains
            os.kill(os.getpid(), signal.SIGTERM)

    def save(state: dict[str, Any]) -> None:
        saves.append((state["scheduler"]["step"], state["scheduler"]["position"]))

    namespace.update(train=train, save=save)
    scheduler = _run_block(code, namespace)["scheduler"]
    assert scheduler.sigterm_received and scheduler.is_ckpt_step
    assert saves == [(3, 3 * 8)]  # once, after the loop: the state resumes after the third window
    assert fallback_handlers == []  # the scheduler caught the signal


def test_the_update_hook_example_compares_by_identity_so_two_register(
    make_strategy: Callable[..., nvtrain.TrainingStrategy], batches: Callable[..., list[Any]]
) -> None:
    loss_scale_by = _run_block(_python_block("update-hooks.md", "class LossScaleBy"), {})["LossScaleBy"]
    first, second = loss_scale_by(), loss_scale_by()
    assert first != second  # pluggy tells plugins apart with ==
    strategy = make_strategy([first, second])
    assert strategy.registry.hooks() == [first, second]


def test_resetting_an_early_stopping_hook_as_run_control_says() -> None:
    text = (DOCS / "run-control.md").read_text(encoding="utf-8")
    reset = re.search(r"`(hook\.load_state_dict\(\{[^`]*\}\))`", text)
    assert reset is not None, "docs/run-control.md shows no early-stopping reset"
    hook = EarlyStoppingHook(monitor="accuracy", mode="max")
    hook.best, hook.wait = 0.9, 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eval(reset.group(1), {"hook": hook})
    assert (hook.best, hook.wait) == (None, 0)


def test_plot_overhead_writes_the_png_with_a_new_files_mode(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("docs_plot_overhead", REPO / "benchmarks" / "plot_overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    points = [
        {"extra_info": {"suite": "dispatch", "kind": kind, "observers": k}, "stats": {"median": 1e-5, "min": 1e-5}}
        for kind in ("nvtrain", "plain")
        for k in (1, 2)
    ]
    output = tmp_path / "overhead.png"
    module.plot(points, output, "test machine")
    assert stat.S_IMODE(output.stat().st_mode) == new_file_mode()  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["overhead.png"]
