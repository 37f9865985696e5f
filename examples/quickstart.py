"""The README's Python quickstart, runnable as written: the digits classifier with accumulation,
bf16 autocast, clipping and EMA (needs the nvtrain-amp and nvtrain-ema plugins).

    python examples/quickstart.py

The first lines build the ``model`` and ``train_loader`` the README leaves to you; the
rest, between the markers, is the README's code block unchanged (a test keeps them equal).
"""

from nvtrain.builtin.digits import make_classifier, make_loaders

model = make_classifier()
train_loader, _ = make_loaders(batch_size=64)

# --- README quickstart begins ---
import functools, torch, nvtrain
from nvtrain.hooks import GradientAccumulationHook, GradientClippingHook, MixedPrecisionHook, EMAHook

class PrintLoss:
    @nvtrain.hookimpl
    def after_optimizer_step(self, ctx):
        if not ctx.step_skipped and ctx.step_count % 5 == 0:   # every 5th optimizer step
            print(ctx.step_count, ctx.loss.item())      # a logging step: the only host read

strategy = nvtrain.TrainingStrategy(
    models=model,                                             # or {"main": model, ...}
    optimizers=functools.partial(torch.optim.AdamW, lr=1e-3),  # built after SETUP
    loss_fn=torch.nn.functional.cross_entropy,
    hooks=[
        GradientAccumulationHook(steps=4),                    # priority 10
        MixedPrecisionHook(precision="bf16"),                 # 20 (nvtrain-amp)
        GradientClippingHook(max_norm=1.0),                   # 30
        EMAHook(model_key="main", decay=0.999),               # 50 (nvtrain-ema)
        PrintLoss(),
    ],
    num_epochs=3,
)
with strategy:
    result = strategy.run(train_loader)
# --- README quickstart ends ---

print(f"done: {result.step_count} optimizer steps over {result.epoch} epochs")
