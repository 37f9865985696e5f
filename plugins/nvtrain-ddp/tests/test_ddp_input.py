"""DDPHook refuses a model_keys or backend typo at SETUP in one process too: it returned before checking them
there, so the typo surfaced only under torchrun, on the cluster."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from nvtrain_ddp import DDPHook

import nvtrain
from nvtrain.validators import FieldValueError


def make_strategy(hook: DDPHook) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        torch.nn.Linear(4, 2),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        hooks=[hook],
        device="cpu",
    )


@pytest.mark.usefixtures("no_torchrun_env")
def test_a_model_key_naming_no_model_is_refused_in_one_process() -> None:
    with make_strategy(DDPHook(model_keys="mian")) as strategy, pytest.raises(FieldValueError) as caught:
        strategy.setup()
    assert str(caught.value) == "DDPHook.model_keys: no model named 'mian' (models: ['main'])"
    assert (caught.value.owner, caught.value.field) == ("DDPHook", "model_keys")


@pytest.mark.usefixtures("no_torchrun_env")
@pytest.mark.parametrize(
    ("backend", "unknown", "hint"),
    [
        ("glo", "glo", "; did you mean 'gloo'?"),
        ("cpu:gloo,cuda:ncl", "ncl", "; did you mean 'nccl'?"),
        ("zzz", "zzz", ""),
    ],
)
def test_a_backend_torch_does_not_know_is_refused_in_one_process(backend: str, unknown: str, hint: str) -> None:
    with make_strategy(DDPHook(backend=backend)) as strategy, pytest.raises(FieldValueError) as caught:
        strategy.setup()
    message = str(caught.value)
    assert message.startswith(f"DDPHook.backend={backend!r} names no torch.distributed backend {unknown!r}{hint} (")
    assert "'gloo'" in message and "'cpu:gloo,cuda:nccl'" in message
    assert caught.value.field == "backend"
    assert not dist.is_initialized()


@pytest.mark.usefixtures("no_torchrun_env")
@pytest.mark.parametrize(
    ("backend", "reason"),
    [
        ("gloo ", "it holds whitespace"),
        ("cpu:gloo, cuda:nccl", "it holds whitespace"),
        (":gloo", "':gloo' is not a device:backend pair"),
        ("cpu:gloo,cpu:mpi", "device 'cpu' is named twice"),
        ("nccl,gloo", "',' joins device:backend pairs, not backends"),
    ],
)
def test_a_spec_torch_would_refuse_as_written_is_refused_in_one_process(backend: str, reason: str) -> None:
    """Specs whose names torch knows but that init_process_group refuses as written ("Invalid device string:
    ' cuda'", "Duplicate device type cpu"): they used to pass SETUP in one process and fail on the cluster."""
    with make_strategy(DDPHook(backend=backend)) as strategy, pytest.raises(FieldValueError) as caught:
        strategy.setup()
    message = str(caught.value)
    assert message.startswith(f"DDPHook.backend={backend!r} is not a backend torch.distributed reads: {reason}")
    assert caught.value.field == "backend"
    assert not dist.is_initialized()


@pytest.mark.usefixtures("no_torchrun_env")
@pytest.mark.parametrize("backend", [None, "GLOO", "cpu:gloo,cuda:nccl", "CPU:GLOO,CUDA:NCCL"])
def test_known_backends_and_model_keys_set_up_in_one_process(backend: str | None) -> None:
    with make_strategy(DDPHook(model_keys="main", backend=backend)) as strategy:
        strategy.setup()
        assert isinstance(strategy.ctx.models["main"], torch.nn.Linear)  # one process: nothing wrapped
