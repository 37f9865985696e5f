"""A state the strategy refuses leaves it as it was: nothing is loaded before everything that can be refused is."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.errors import ResumeError


class TransposedHead(torch.nn.Module):
    """A head with the same parameter names as Linear(4, 2), its weight stored the other way round."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 2))
        self.bias = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def make_strategy(head: torch.nn.Module, head_optimizer: Any = None) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        return ctx.models["head"](ctx.models["enc"](ctx.batch[0]))

    return nvtrain.TrainingStrategy(
        models={"enc": torch.nn.Linear(3, 4), "head": head},
        optimizers={"enc": sgd, "head": head_optimizer or sgd},
        forward_fn=forward,
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
    )


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=generator), torch.randn(8, 2, generator=generator)


def snapshot(strategy: nvtrain.TrainingStrategy) -> dict[str, Any]:
    ctx = strategy.ctx
    return {
        "weights": {k: {n: t.clone() for n, t in m.state_dict().items()} for k, m in ctx.models.items()},
        "momentum": {
            k: [t.clone() for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            for k, o in ctx.optimizers.items()
        },
        "step_count": ctx.step_count,
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after["step_count"] == before["step_count"]
    for key, weights in before["weights"].items():
        for name, tensor in weights.items():
            assert torch.equal(after["weights"][key][name], tensor), (key, name)
    for key, buffers in before["momentum"].items():
        assert all(torch.equal(a, b) for a, b in zip(after["momentum"][key], buffers, strict=True)), key


def trained_state() -> dict[str, Any]:
    saving = make_strategy(torch.nn.Linear(4, 2))
    for _ in range(3):
        saving.train_batch(batch())
    return saving.state_dict()


@pytest.mark.parametrize(
    ("head", "head_optimizer", "message"),
    [
        (torch.nn.Linear(4, 2, bias=False), None, r"weights for model 'head' do not fit this model: unexpected bias"),
        (TransposedHead(), None, r"size mismatch for weight: saved \(2, 4\), model \(4, 2\)"),
        (
            torch.nn.Linear(4, 2),
            functools.partial(torch.optim.Adam, lr=0.1),
            r"optimizer 'head' is torch\.optim\.sgd\.SGD but this run builds torch\.optim\.adam\.Adam",
        ),
    ],
)
def test_a_refused_state_loads_nothing(head: torch.nn.Module, head_optimizer: Any, message: str) -> None:
    state = trained_state()
    strategy = make_strategy(head, head_optimizer)
    strategy.train_batch(batch())  # optimizer state of its own, to see that it stays
    before = snapshot(strategy)
    with pytest.raises(ResumeError, match=message):
        strategy.load_state_dict(state)
        strategy.setup()  # a state held before setup is applied here
    assert_unchanged(before, snapshot(strategy))


def test_an_optimizer_with_other_parameter_groups_is_refused_before_anything_loads() -> None:
    state = trained_state()
    state["optimizers"]["head"]["param_groups"][0]["params"] = [0]  # one parameter where the head has two
    strategy = make_strategy(torch.nn.Linear(4, 2))
    strategy.train_batch(batch())
    before = snapshot(strategy)
    with pytest.raises(ResumeError, match=r"optimizer 'head' does not fit it: its parameter groups hold \[1\] parameters in the checkpoint but \[2\]"):
        strategy.load_state_dict(state)
    assert_unchanged(before, snapshot(strategy))


class RenamedOnLoad(torch.nn.Module):
    """Loads states written when its layer was called ``lin`` (a load pre-hook renames the keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 2)

        def rename(state: dict[str, Any], prefix: str, *args: Any) -> None:
            for key in [k for k in state if k.startswith(prefix + "lin.")]:
                state[prefix + "proj." + key.removeprefix(prefix + "lin.")] = state.pop(key)

        self._register_load_state_dict_pre_hook(rename)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@pytest.mark.parametrize(
    ("live", "saved_state"),
    [
        (torch.nn.LazyLinear(2), lambda: torch.nn.Linear(3, 2).state_dict()),  # not materialised yet
        (RenamedOnLoad(), lambda: {f"lin.{k}": v for k, v in torch.nn.Linear(3, 2).state_dict().items()}),
        (  # an old state without num_batches_tracked, which BatchNorm's own loader accepts
            torch.nn.BatchNorm1d(3),
            lambda: {k: v for k, v in torch.nn.BatchNorm1d(3).state_dict().items() if k != "num_batches_tracked"},
        ),
    ],
)
def test_what_a_module_loads_its_own_way_is_left_to_it(live: torch.nn.Module, saved_state: Any) -> None:
    from nvtrain.state import check_model_fits

    saved = saved_state()
    check_model_fits("main", live, saved)
    live.load_state_dict(saved)  # and torch agrees


def _set(section: str, key: str, value: Any) -> Any:
    def craft(state: dict[str, Any]) -> None:
        state[section][key] = value

    return craft


@pytest.mark.parametrize(
    ("craft", "message"),
    [
        (_set("counters", "step_count", "x"), r"the state's counters\['step_count'\] must be an int >= 0; got 'x'"),
        (_set("counters", "epoch", -1), r"the state's counters\['epoch'\] must be an int >= 0; got -1 \(int\)"),
        (_set("models", "head", None), r"the state's models\['head'\] must be a dict of tensors .*; got None"),
        (
            _set("models", "head", {"weight": "x", "bias": torch.zeros(2)}),
            r"the state's models\['head'\]\['weight'\] must be a tensor; got 'x' \(str\)",
        ),
        (_set("optimizers", "head", None), r"the state's optimizers\['head'\] must be an optimizer state dict"),
        (_set("rng", "torch", torch.zeros(3, dtype=torch.uint8)), r"rng\['torch'\] cannot be restored: .*size to be 3"),
        (_set("rng", "python", (3, "x", None)), r"the state's rng\['python'\] / rng\['numpy'\] cannot be restored"),
    ],
    ids=[
        "counter-not-an-int",
        "negative-counter",
        "model-not-a-dict",
        "weight-not-a-tensor",
        "optimizer-not-a-dict",
        "torch-rng",
        "python-rng",
    ],
)
def test_a_crafted_state_is_refused_before_anything_loads(craft: Any, message: str) -> None:
    """Each of these was found only as it loaded (a raw ValueError, TypeError or RuntimeError), after the models."""
    state = trained_state()
    craft(state)
    strategy = make_strategy(torch.nn.Linear(4, 2))
    strategy.train_batch(batch())
    before, rng = snapshot(strategy), torch.get_rng_state()
    with pytest.raises(ResumeError, match=message):
        strategy.load_state_dict(state)
    assert_unchanged(before, snapshot(strategy))
    assert torch.equal(torch.get_rng_state(), rng)
