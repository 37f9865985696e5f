"""The app's own observer of a run: where it starts, its last step, ``config.yaml``, a diverging loss."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nvtrain.atomic_files import replaced_atomically
from nvtrain.errors import naming_file
from nvtrain.hookspecs import hookimpl

if TYPE_CHECKING:
    from nvtrain.app.checking import Plan

logger = logging.getLogger("nvtrain.app")


class RunWatch:
    """The app's own observer: notes where the run starts and where its last step was, writes
    ``config.yaml`` once a resume has been applied, and reports a non-finite loss at once."""

    plugin_name = "nvtrain.app.watch"

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        self.every = plan.config.logging.log_every_n_steps
        self.start_step: int | None = None
        #: The step of the latest validation (the summary's values; None: none this run), and its 0-based epoch.
        self.validated_at: int | None = None
        self.validated_epoch: int | None = None
        #: 0-based epoch of the latest optimizer step (the summary shows it 1-based).
        self.last_step_epoch: int | None = None
        self.effective_config: dict[str, Any] = {}
        self._reported_train = False

    @hookimpl
    def before_epoch(self, ctx: Any) -> None:
        self._begin(ctx)

    def _begin(self, ctx: Any) -> None:
        """At the run's first epoch, or a validation before it (one a preemption left owed): a resume has
        been applied by then."""
        if self.start_step is None:
            self.start_step = ctx.step_count
            if self.rank == 0:
                self.plan.run_dir.mkdir(parents=True, exist_ok=True)
                _write_atomically(self.plan.run_dir / "config.yaml", _dump(self.effective_config))

    @hookimpl
    def after_batch(self, ctx: Any) -> None:
        if not ctx.sync_gradients or ctx.step_skipped:
            return
        self.last_step_epoch = ctx.epoch
        if self.rank != 0 or ctx.step_count % self.every or self._reported_train:
            return
        loss = ctx.loss
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):  # a logging step
            self._reported_train = True  # once: the divergence check or the user takes it from here
            logger.warning(
                "training loss is %s at step %d (epoch %d): the run is diverging (lower the learning rate or "
                "check the data); checkpoints from now on are marked unhealthy",
                float(loss.detach().float().mean()),
                ctx.step_count,
                ctx.epoch + 1,
            )

    @hookimpl
    def after_validation(self, ctx: Any) -> None:
        self._begin(ctx)
        self.validated_at, self.validated_epoch = ctx.step_count, ctx.epoch
        if self.rank != 0:
            return
        loss = (ctx.validation or {}).get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not math.isfinite(float(loss)):
            logger.warning(
                "validation loss is %s at step %d: the weights are no longer finite", float(loss), ctx.step_count
            )


def _dump(data: Mapping[str, Any]) -> str:
    """YAML that ``nvtrain train --config`` reads back as it was (a saved run's config can be run again)."""
    from nvtrain.config.source import dump_yaml

    return dump_yaml(dict(data))


def _write_atomically(path: Path, text: str) -> None:
    with naming_file(path), replaced_atomically(path) as tmp, tmp.open("w", encoding="utf-8") as file:
        file.write(text)
