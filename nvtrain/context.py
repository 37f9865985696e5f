"""The state every hook sees: models, optimizers, the current batch, counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from nvtrain.batching import tensor_mapper
from nvtrain.stages import TrainingStage
from nvtrain.stash import Stash

#: A copy of a value with every tensor in it detached (see TrainingContext.release_step_graph).
_DETACH = tensor_mapper(torch.Tensor.detach)

if TYPE_CHECKING:
    from nvtrain.strategy import TrainingStrategy

__all__ = ["TrainingContext"]


@attrs.define(slots=True, eq=False, repr=False)
class TrainingContext:
    """Mutable state of one strategy, passed as ``ctx`` to every hook.

    Counters follow the reference semantics: ``batch_count`` and
    ``epoch_step_count`` advance on every micro-batch; ``step_count`` (this worker)
    and ``global_step_count`` (all data-parallel workers: ``world_size`` per step)
    advance only when an optimizer step really happened. ``metrics`` holds tensors:
    nothing on the per-batch path reads them to the host.
    """

    strategy: TrainingStrategy | None = None
    models: dict[str, torch.nn.Module] = attrs.field(factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = attrs.field(factory=dict)
    lr_schedulers: dict[str, Any] = attrs.field(factory=dict)
    train_loader: Any = None
    batch: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    #: The tensor that was back-propagated (``loss`` after the update hooks' transforms).
    backward_loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = attrs.field(factory=dict)
    stage: TrainingStage | None = None
    step_count: int = 0
    global_step_count: int = 0
    batch_count: int = 0
    epoch: int = 0
    epoch_step_count: int = 0
    #: Did this micro-batch's optimizer step not happen? Final from AFTER_OPTIMIZER_STEP on.
    step_skipped: bool = False
    #: Does this micro-batch end an accumulation window (gradients must be all-reduced)?
    sync_gradients: bool = True
    #: Number of micro-batches in the current window, and this one's 0-based position.
    window_size: int = 1
    window_position: int = 0
    #: True while a step scheduler drives micro-batches (window fields are set by the strategy);
    #: False for standalone ``train_batch()``, where an accumulation hook counts for itself.
    windowed: bool = False
    rank: int = 0
    world_size: int = 1
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    #: Summary of the latest validation pass (set before AFTER_VALIDATION).
    validation: dict[str, Any] | None = None
    #: ``step_count`` when that validation ran: whose weights it judged (a run's own, or earlier ones).
    validation_step: int | None = None
    #: True once a preemption signal ended the run.
    preempted: bool = False
    #: Why the run ended early (a stop request or preemption), set before AFTER_TRAINING; None otherwise.
    stop_reason: str | None = None
    #: The step scheduler driving the current run, if any.
    scheduler: Any = None
    #: True from the step boundary on when ``run()`` validates right after this step (a step
    #: cadence or the epoch's end): a checkpoint of the step then waits for AFTER_VALIDATION,
    #: so it holds what validation changed (early stopping, a ReduceLROnPlateau).
    validation_follows: bool = False
    #: Typed per-plugin storage: ``ctx.stash[KEY]`` with ``KEY = StashKey[T]()``.
    stash: Stash = attrs.field(factory=Stash)

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary, from any hook (observer or update hook) on any rank.

        The current step finishes (AFTER_OPTIMIZER_STEP, AFTER_BATCH, its checkpoint);
        it is the last step (``is_last_step``), then AFTER_EPOCH and AFTER_TRAINING fire
        and ``run()`` returns with ``stop_reason`` set. Asked during validation, the run
        ends right after it. Under torch.distributed every rank stops at the same step.
        """
        scheduler = self.scheduler
        stage = getattr(self.stage, "name", None)
        # after a run its scheduler stays, but nothing would stop; at AFTER_TRAINING the run has ended already
        if scheduler is None or not self.windowed or stage == "AFTER_TRAINING":
            at = f" (asked at {stage})" if stage is not None else ""
            raise RuntimeError(
                f"ctx.request_stop({reason!r}): no run is in progress to stop{at}; stop requests are taken from a "
                "hook during TrainingStrategy.run(), from BEFORE_TRAINING until its last step's AFTER_EPOCH"
            )
        scheduler.request_stop(reason)

    def release_step_graph(self) -> None:
        """Detach ``outputs``, ``loss`` and ``backward_loss`` from the last micro-batch's autograd graph.

        The values stay; the graph goes. Left attached, the context would keep the graph for
        as long as the strategy lives: with every saved activation when the step failed
        before its backward, and, under FSDP, with the model itself, since the graph's
        autograd functions refer back to it in a way the garbage collector cannot follow
        (the strategy, its models and their process group were then never freed). Tensors
        inside the containers a batch may use are detached too: mappings of any class (a dict
        subclass such as a model's output record), named tuples, lists, tuples, dataclass and
        attrs fields.
        """
        self.outputs = _DETACH(self.outputs)
        # whatever a loss_fn or a hook left there: a float or a tuple is what the failed step is reported for
        self.loss = _DETACH(self.loss)
        self.backward_loss = _DETACH(self.backward_loss)

    def __repr__(self) -> str:
        stage = self.stage.name if self.stage is not None else None
        return (
            f"TrainingContext(stage={stage}, epoch={self.epoch}, step_count={self.step_count}, "
            f"batch_count={self.batch_count}, models={sorted(self.models)})"
        )
