"""FSDPHook refuses a backend typo at SETUP in one process too, as DDPHook does: it passed there, and
surfaced only under torchrun, on the cluster."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from nvtrain_fsdp import FSDPHook

import nvtrain
from nvtrain.validators import FieldValueError

#: A single process, whatever torchrun variables the shell has (the root conftest's fixture clears them).
pytestmark = pytest.mark.usefixtures("no_torchrun_env")


def make_strategy(hook: FSDPHook) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        torch.nn.Linear(4, 2),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )


@pytest.mark.parametrize(
    ("backend", "unknown", "hint"),
    [("glo", "glo", "; did you mean 'gloo'?"), ("cpu:gloo,cuda:ncl", "ncl", "; did you mean 'nccl'?")],
)
def test_a_backend_torch_does_not_know_is_refused_in_one_process(backend: str, unknown: str, hint: str) -> None:
    with make_strategy(FSDPHook(backend=backend)) as strategy, pytest.raises(FieldValueError) as caught:
        strategy.setup()
    message = str(caught.value)
    assert message.startswith(f"FSDPHook.backend={backend!r} names no torch.distributed backend {unknown!r}{hint} (")
    assert "'cpu:gloo,cuda:nccl'" in message
    assert (caught.value.owner, caught.value.field, caught.value.value) == ("FSDPHook", "backend", backend)
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", [None, "GLOO", "cpu:gloo,cuda:nccl"])
def test_known_backends_set_up_in_one_process(backend: str | None) -> None:
    with make_strategy(FSDPHook(backend=backend)) as strategy:
        strategy.setup()
        assert isinstance(strategy.ctx.models["main"], torch.nn.Linear)  # one process: nothing sharded
