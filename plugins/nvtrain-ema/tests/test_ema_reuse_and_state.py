"""EMAHook reused with another model, states that reset or refuse, and the half-precision warning."""

from __future__ import annotations

import copy
import functools
import io
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from nvtrain_ema import EMAHook

import nvtrain


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def make_strategy(hooks: list[object], model: torch.nn.Module | None = None, **kwargs: Any) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=model if model is not None else make_model(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
        **kwargs,
    )


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# -- one hook, another strategy ---------------------------------------------------------------------------


def test_a_hook_reused_with_another_model_averages_that_model() -> None:
    """The average (and count) carries over, as a checkpoint's would, and the new model's weights enter it."""
    ema = EMAHook(decay=0.5)
    make_strategy([ema], model=make_model(0)).run(make_batches(2))
    carried = roundtrip(ema.state_dict())

    second = make_model(1)
    strategy = make_strategy([ema], model=second)
    strategy.run(make_batches(3, seed=3))

    reference = EMAHook(decay=0.5)  # a new hook given the first average, on an identical second model
    reference.load_state_dict(carried)
    make_strategy([reference], model=make_model(1)).run(make_batches(3, seed=3))
    assert ema.num_updates == reference.num_updates == 5
    assert int(ema.get_averaged_model().n_averaged) == 5
    assert_same(ema.averaged_weights(), reference.averaged_weights())
    sources = {id(p) for p in second.parameters()}
    assert ema._plan is not None and all(id(t) in sources for t in ema._plan.lerp_src)


def test_load_checkpoint_with_the_same_hook_objects_continues_the_run(tmp_path: Path) -> None:
    """Train, then TrainingStrategy.load_checkpoint(..., hooks=[ema, ck]) with the same objects: bitwise the
    uninterrupted run."""
    checkpoint = pytest.importorskip("nvtrain_checkpoint")
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))

    def loader() -> Any:
        return torch.utils.data.DataLoader(data, batch_size=4)

    straight = EMAHook(decay=0.5)
    make_strategy([straight], num_epochs=1).run(loader())

    ema = EMAHook(decay=0.5)
    hook = checkpoint.CheckpointHook(tmp_path, step_interval=4)
    first = make_strategy([ema, hook], max_steps=4)
    with first:
        first.run(loader())
    resumed = nvtrain.TrainingStrategy.load_checkpoint(
        tmp_path / "step_4",
        models=make_model(),
        hooks=[ema, hook],
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        num_epochs=1,
    )
    with resumed:
        resumed.run(loader())
    assert ema.num_updates == straight.num_updates == 8
    assert_same(ema.averaged_weights(), straight.averaged_weights())


def test_a_hook_reused_with_a_model_its_average_does_not_fit_is_refused() -> None:
    ema = EMAHook(decay=0.5)
    make_strategy([ema]).run(make_batches(1))
    with pytest.raises(ValueError, match=r"EMAHook: reused with another model 'main' than the one it averaged"):
        make_strategy([ema], model=torch.nn.Linear(4, 1)).run(make_batches(1))
    ema.load_state_dict({"num_updates": 0, "averaged": None})  # the reset the message names
    make_strategy([ema], model=torch.nn.Linear(4, 1)).run(make_batches(1))
    assert ema.num_updates == 1


# -- states with no average, and malformed ones ----------------------------------------------------------


def test_a_state_without_an_average_resets_the_average() -> None:
    """Restore a snapshot taken before the copy existed: the run goes on as a fresh one would."""
    ema = EMAHook(decay=0.5)
    strategy = make_strategy([ema])
    strategy.setup()
    snapshot = copy.deepcopy(strategy.state_dict())
    strategy.run(make_batches(4))
    strategy.load_state_dict(snapshot)
    assert ema.num_updates == 0
    assert int(ema.get_averaged_model().n_averaged) == 0
    strategy.run(make_batches(3, seed=9))

    fresh = EMAHook(decay=0.5)
    make_strategy([fresh]).run(make_batches(3, seed=9))
    assert ema.num_updates == fresh.num_updates == 3
    assert_same(ema.averaged_weights(), fresh.averaged_weights())


def test_loading_a_fresh_state_makes_the_next_update_copy_the_weights() -> None:
    ema = EMAHook(decay=0.5)
    strategy = make_strategy([ema])
    strategy.run(make_batches(4))
    ema.load_state_dict(EMAHook().state_dict())
    strategy.train_batch(make_batches(1, seed=5)[0])
    assert ema.num_updates == 1
    assert_same(ema.averaged_weights(), {k: v.detach() for k, v in strategy.ctx.models["main"].state_dict().items()})


@pytest.mark.parametrize("averaged", ["oops", [1, 2], 3])
@pytest.mark.parametrize("copy_made", [True, False])
def test_an_average_that_is_no_mapping_is_refused(averaged: Any, copy_made: bool) -> None:
    ema = EMAHook(model_key="main")
    if copy_made:
        make_strategy([ema]).setup()
        ema.get_averaged_model()
    with pytest.raises(
        ValueError,
        match=rf"EMAHook\.load_state_dict: 'averaged' \(model 'main'\) must be None or a mapping .*, "
        rf"got {type(averaged).__name__}$",
    ):
        ema.load_state_dict({"num_updates": 1, "averaged": averaged})


def test_a_state_that_is_no_mapping_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"EMAHook\.load_state_dict: the state must be a mapping with 'num_updates' and 'averaged' "
        r"\(got list\)",
    ):
        EMAHook().load_state_dict(["x"])  # type: ignore[arg-type]


def test_get_averaged_model_before_setup_says_setup_has_not_run() -> None:
    ema = EMAHook()
    make_strategy([ema])  # registered, not set up
    with pytest.raises(RuntimeError, match=r"there is no averaged model yet: the hook has not been set up"):
        ema.get_averaged_model()


# -- the average's dtype -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "decay", "warns"),
    [
        (torch.bfloat16, 0.999, True),
        (torch.float16, 0.999, True),
        (torch.bfloat16, 0.5, False),
        (torch.float32, 0.9999, False),
    ],
)
def test_a_half_precision_average_that_would_stall_warns_once(dtype: torch.dtype, decay: float, warns: bool) -> None:
    ema = EMAHook(decay=decay)
    strategy = nvtrain.TrainingStrategy(
        models=make_model().to(dtype),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=lambda o, t: torch.nn.functional.mse_loss(o.float(), t.float()),
        hooks=[ema],
        device="cpu",
    )
    batches = [(x.to(dtype), y.to(dtype)) for x, y in make_batches(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(batches)
        strategy.run(batches)
    stalls = [w for w in caught if "round away" in str(w.message)]
    assert len(stalls) == (1 if warns else 0)
    if warns:
        assert f"EMAHook (model 'main'): the average is kept in {dtype}" in str(stalls[0].message)
    assert all(p.dtype == dtype for p in ema.get_averaged_model().module.parameters())  # the model's dtype


def test_two_averages_of_one_model_save_and_resume_under_their_state_keys() -> None:
    """A fast and a slow average of the same model: refused without state keys, each restored to its own with."""
    with pytest.raises(ValueError, match=r"both save their checkpoint state under the key 'ema:main'"):
        make_strategy([EMAHook(decay=0.5), EMAHook(decay=0.9)]).state_dict()

    def hooks() -> list[EMAHook]:
        return [EMAHook(decay=0.5, state_key="fast"), EMAHook(decay=0.9, state_key="slow")]

    straight_hooks = hooks()
    straight = make_strategy(straight_hooks)
    batches = make_batches(6)
    for batch in batches[:3]:
        straight.train_batch(batch)
    state = roundtrip(straight.state_dict())
    assert {"ema:fast", "ema:slow"} <= set(state["hooks"])
    for batch in batches[3:]:
        straight.train_batch(batch)

    resumed_hooks = hooks()[::-1]  # registered in the other order: the keys, not the order, match them up
    resumed = make_strategy(resumed_hooks)
    resumed.load_state_dict(state)
    for batch in batches[3:]:
        resumed.train_batch(batch)
    for straight_hook, resumed_hook in zip(straight_hooks, resumed_hooks[::-1], strict=True):
        assert_same(resumed_hook.averaged_weights(), straight_hook.averaged_weights())
    assert not all(
        torch.equal(a, b)
        for a, b in zip(
            straight_hooks[0].averaged_weights().values(), straight_hooks[1].averaged_weights().values(), strict=True
        )
    )


def test_a_state_key_must_be_a_non_empty_string() -> None:
    with pytest.raises(ValueError, match=r"EMAHook\.state_key"):
        EMAHook(state_key="")
