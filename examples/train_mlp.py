"""Train a small MLP on a synthetic regression task and print its loss falling.

    python examples/train_mlp.py
"""

from __future__ import annotations

import functools

import torch

import nvtrain


class PrintLoss:
    """An observer: every 20 optimizer steps, read the loss to the host and print it."""

    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx: nvtrain.TrainingContext) -> None:
        if not ctx.step_skipped and ctx.step_count % 20 == 0:
            print(f"epoch {ctx.epoch}  step {ctx.step_count:4d}  loss {ctx.loss.item():.4f}")


def main() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(1024, 32)
    targets = torch.sin(inputs[:, :4].sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=32, shuffle=True
    )
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    strategy = nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.AdamW, lr=3e-3),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[PrintLoss()],
        num_epochs=5,
        device="cpu",
    )
    with strategy:
        result = strategy.run(loader)
    print(f"done: {result.step_count} steps over {result.epoch} epochs")


if __name__ == "__main__":
    main()
