"""Property: resuming from any checkpoint of a run finishes it bit for bit as the run itself did.

Over random epoch lengths, accumulation windows, checkpoint cadences, validations and LR
schedules stepped per step or per epoch (so checkpoints fall mid-epoch, on an epoch's last
step, after a validation and on a trailing partial window), every checkpoint the straight run
wrote is loaded into a fresh strategy, which then finishes the run: its parameters,
optimizer state, LR and counters must equal the straight run's exactly (``torch.equal``).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nvtrain_checkpoint import CheckpointHook, list_checkpoints
from torch.utils.data import DataLoader, TensorDataset

import nvtrain
from nvtrain.hooks import GradientAccumulationHook

FEATURES = 3


def _loader(samples: int, batch_size: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(5)
    data = TensorDataset(
        torch.randn(samples, FEATURES, generator=generator), torch.randn(samples, 1, generator=generator)
    )
    return DataLoader(data, batch_size=batch_size, shuffle=True)  # shuffled by the global RNG


def _strategy(case: dict[str, Any], hooks: list[object]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    validation = None
    if case["validate_every"] is not None:
        validation = nvtrain.ValidationConfig(
            data=_loader(4, 2), every_n_steps=case["validate_every"], every_n_epochs=None
        )
    return {
        "models": model,
        "optimizers": functools.partial(torch.optim.AdamW, lr=0.01),
        "loss_fn": torch.nn.functional.mse_loss,
        "lr_schedulers": nvtrain.LRSchedule(
            functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.8), interval=case["interval"]
        ),
        "hooks": [GradientAccumulationHook(steps=case["accumulate"]), *hooks],
        "validation": validation,
        "num_epochs": case["epochs"],
        "device": "cpu",
    }


def _final(strategy: nvtrain.TrainingStrategy) -> dict[str, Any]:
    ctx = strategy.ctx
    return {
        "params": [p.detach().clone() for p in ctx.models["main"].parameters()],
        "optimizer": ctx.optimizers["main"].state_dict(),
        "lr": ctx.optimizers["main"].param_groups[0]["lr"],
        "counters": (ctx.step_count, ctx.batch_count, ctx.epoch),
    }


def _assert_equal(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            _assert_equal(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (one, other) in enumerate(zip(expected, actual, strict=True)):
            _assert_equal(one, other, f"{where}[{index}]")
    else:
        assert expected == actual, where


CASES = st.fixed_dictionaries(
    {
        "samples": st.integers(3, 9),
        "batch_size": st.sampled_from([1, 2]),
        "accumulate": st.integers(1, 3),
        "every": st.integers(1, 3),
        "epochs": st.integers(1, 3),
        "interval": st.sampled_from(["step", "epoch"]),
        "validate_every": st.sampled_from([None, 2]),
    }
)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_every_checkpoint_of_a_run_resumes_to_the_same_end(case: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        with nvtrain.TrainingStrategy(**_strategy(case, [CheckpointHook(root, step_interval=case["every"])])) as run:
            run.run(_loader(case["samples"], case["batch_size"]))
            straight = _final(run)
        saved = [info.step for info in list_checkpoints(root)]
        assert saved and saved[-1] == straight["counters"][0]  # the run's end is always saved
        for step in saved[:-1]:
            torch.manual_seed(1234)  # a fresh process: the checkpoint sets every generator
            resumed = nvtrain.TrainingStrategy.load_checkpoint(root / f"step_{step}", **_strategy(case, []))
            with resumed:
                resumed.run(_loader(case["samples"], case["batch_size"]))
                _assert_equal(straight, _final(resumed), f"{case}, resumed from step {step}")
