"""What a hook sees and may do at a stage, kept on every device and for every container: a hook's own
validate() leaves the stage it runs in current; the batch a hook edits is never the loader's; the graph
goes with the step whatever container the outputs come in."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

import nvtrain


def data(count: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [[torch.randn(2, 3, generator=generator), torch.randn(2, 2, generator=generator)] for _ in range(count)]


def make(hooks: list[object], **fields: Any) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    fields.setdefault("num_epochs", 2)
    return nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        **fields,
    )


class StopAt:
    def __init__(self, step: int) -> None:
        self.step = step

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.step_count == self.step:
            ctx.request_stop("paused")


class FirstBatch:
    """Where the run's first micro-batch stands: (step_count, epoch_step_count)."""

    seen: tuple[int, int] | None = None

    @nvtrain.hookimpl
    def before_batch(self, ctx: nvtrain.TrainingContext) -> None:
        if self.seen is None:
            self.seen = (ctx.step_count, ctx.epoch_step_count)


def test_a_validation_a_hook_runs_at_before_training_leaves_a_later_resume_its_position() -> None:
    """A baseline validate() at BEFORE_TRAINING left ctx.stage at AFTER_VALIDATION: a restore later in the same
    stage took itself for one outside a run, loaded the weights and held the position for the next run, so the
    run trained the restored weights from the data's start."""
    batches = data(6)
    paused = make([StopAt(3)])
    paused.run(batches)
    state = copy.deepcopy(paused.state_dict())
    stages: list[nvtrain.TrainingStage | None] = []

    class Baseline:
        @nvtrain.hookimpl(tryfirst=True)
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            ctx.strategy.validate(batches[:1])
            stages.append(ctx.stage)

    class Resume:
        @nvtrain.hookimpl(trylast=True)
        def before_training(self, ctx: nvtrain.TrainingContext) -> None:
            ctx.strategy.load_state_dict(state)

    first = FirstBatch()
    result = make([Baseline(), Resume(), first]).run(batches)
    assert stages == [nvtrain.TrainingStage.BEFORE_TRAINING]
    assert first.seen == (3, 3)
    assert (result.step_count, result.batch_count) == (12, 12)


def test_a_hook_editing_the_batch_in_place_leaves_the_loaders_batches_as_they_were() -> None:
    """On the CPU the batch was the loader's own object: an augmentation written in place piled up epoch after
    epoch in a list of batches (on CUDA the move to the device copied it)."""
    batches = data(2)
    original = copy.deepcopy(batches)
    seen: list[torch.Tensor] = []

    class AddOne:
        @nvtrain.hookimpl
        def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
            ctx.batch[0] = ctx.batch[0] + 1.0
            seen.append(ctx.batch[0])

    make([AddOne()], num_epochs=3).run(batches)
    assert all(
        torch.equal(a, b) for pair, twin in zip(batches, original, strict=True) for a, b in zip(pair, twin, strict=True)
    )
    assert all(torch.equal(seen[i], original[i % 2][0] + 1.0) for i in range(6))  # once per batch, every epoch


class Output(dict):  # type: ignore[type-arg]
    """A model output record of the dict-subclass kind."""


@dataclasses.dataclass
class Record:
    logits: torch.Tensor
    extra: list[torch.Tensor]


def test_the_graph_goes_with_the_step_whatever_container_holds_the_outputs() -> None:
    for wrap in (lambda t: Output(logits=t), lambda t: Record(logits=t, extra=[t * 2])):
        strategy = make([], forward_fn=lambda ctx, wrap=wrap: wrap(ctx.models["main"](ctx.batch[0])), num_epochs=1)
        strategy.loss_fn = lambda outputs, targets: torch.nn.functional.mse_loss(_logits(outputs), targets)
        strategy.run(data(2))
        outputs = strategy.ctx.outputs
        assert _logits(outputs).grad_fn is None and type(outputs) in (Output, Record)
        if isinstance(outputs, Record):
            assert outputs.extra[0].grad_fn is None


def _logits(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) else outputs.logits
