"""Bad input to the public API is refused when it is given, in one line naming the setting, what it takes and what
came, instead of being run as something else (``foreach="no"`` as True), failing later with a message naming
nothing (``'float' object is not iterable`` after an epoch), or passing a test that never ran (``nprocs=0``)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch

import nvtrain
import nvtrain.plugins
import nvtrain.testing
from nvtrain.hooks import GradientClippingHook, SpikeSkipHook
from nvtrain.plugins import PluginNotFoundError
from nvtrain.validation import ValidationConfig, ValidationLoop, check_batches
from nvtrain.validators import FieldProblem


def _forward(models: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    inputs, targets = batch
    return models["main"](inputs), targets, len(inputs)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))]


# -- GradientClippingHook.foreach ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["no", 1, object()])
def test_clipping_foreach_takes_only_a_bool_or_none(value: Any) -> None:
    with pytest.raises(TypeError, match=r"^GradientClippingHook\.foreach must be a bool or None \(got ") as caught:
        GradientClippingHook(max_norm=1.0, foreach=value)
    assert isinstance(caught.value, FieldProblem) and caught.value.field == "foreach"


@pytest.mark.parametrize("value", [None, True, False])
def test_clipping_foreach_keeps_its_accepted_values(value: bool | None) -> None:
    assert GradientClippingHook(max_norm=1.0, foreach=value).foreach is value


# -- ValidationConfig.data, ValidationLoop --------------------------------------------------------


@pytest.mark.parametrize("value", [3.0, 7, "val.csv", b"batches"])
def test_validation_data_that_yields_no_batches_is_refused_when_built(value: Any) -> None:
    expected = (
        r"^ValidationConfig\.data must be an iterable of batches \(a DataLoader, a list of batches\) that can be "
        r"read again at every validation \(a generator or iterator is used up by the first\) or None"
    )
    with pytest.raises(TypeError, match=expected + rf" \(got {value!r}\)$".replace(".", r"\.")):
        ValidationConfig(data=value)


def test_validation_data_takes_loaders_lists_sequences_and_none() -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 3)), batch_size=2)
    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 3))  # a sequence: iter() takes its __getitem__
    candidates: tuple[Any, ...] = (None, loader, _batches(), dataset)
    for data in candidates:
        assert ValidationConfig(data=data).data is data


def test_check_batches_names_the_call_and_its_argument() -> None:
    check_batches(_batches(), "TrainingStrategy.validate", "loader")
    with pytest.raises(
        TypeError, match=r"^TrainingStrategy\.validate\(loader\) must be an iterable of batches .*\(got 3\)$"
    ):
        check_batches(3, "TrainingStrategy.validate", "loader")


def test_the_validation_loop_refuses_a_loader_that_yields_no_batches() -> None:
    loop = ValidationLoop(forward=_forward, loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(
        TypeError, match=r"^ValidationLoop\.run\(loader\) must be an iterable of batches .*\(got 3\.0\)$"
    ):
        loop.run({"main": torch.nn.Linear(3, 1)}, 3.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("forward", 3, r"ValidationLoop\.forward must be callable as forward\(models, batch\)"),
        ("loss_fn", None, r"ValidationLoop\.loss_fn must be callable as loss_fn\(outputs, targets\)"),
        ("autocast", "bf16", r"ValidationLoop\.autocast must be callable as autocast\(\) -> context manager"),
        ("metrics", ["accuracy"], r"ValidationLoop\.metrics must be a dict of name -> callable"),
        ("metrics", {"accuracy": "accuracy"}, r"ValidationLoop\.metrics\['accuracy'\] must be callable"),
        ("metrics", {"loss": torch.nn.functional.l1_loss}, r"ValidationLoop\.metrics\['loss'\]: 'loss' is the"),
    ],
)
def test_validation_loop_fields_are_checked_when_it_is_built(field: str, value: Any, expected: str) -> None:
    settings: dict[str, Any] = {"forward": _forward, "loss_fn": torch.nn.functional.mse_loss, field: value}
    with pytest.raises(FieldProblem, match="^" + expected) as caught:
        ValidationLoop(**settings)
    assert caught.value.field == field


def test_a_valid_validation_loop_still_runs() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    loop = ValidationLoop(
        forward=_forward,
        loss_fn=torch.nn.functional.mse_loss,
        autocast=contextlib.nullcontext,
        metrics={"mae": torch.nn.functional.l1_loss},
    )
    summary = loop.run({"main": model}, _batches())
    inputs, targets = _batches()[0]
    with torch.no_grad():
        assert torch.equal(summary["mae"], torch.nn.functional.l1_loss(model(inputs), targets))
    assert summary["num_samples"] == 4


# -- HookBus.trace, StashKey ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", "no", 1, 0])
def test_hook_bus_trace_takes_only_a_bool_or_none(value: Any) -> None:
    with pytest.raises(TypeError, match=r"^HookBus\.trace must be True, False or None \(NVTRAIN_TRACE decides\) "):
        nvtrain.HookBus(trace=value)


def test_stash_key_names_must_be_non_empty_str() -> None:
    with pytest.raises(TypeError, match=r"^StashKey\.name must be a non-empty str .* \(got 3\)$"):
        nvtrain.StashKey(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^StashKey\.name must be a non-empty str .* \(got ''\)$"):
        nvtrain.StashKey("")
    assert (nvtrain.StashKey("grad_norm").name, nvtrain.StashKey().name, nvtrain.StashKey(None).name) == (
        "grad_norm",
        "",
        "",
    )


# -- nvtrain.testing: nprocs ----------------------------------------------------------------------


@pytest.mark.parametrize("nprocs", [0, -1, True, 2.0])
def test_rank_launchers_refuse_a_rank_count_below_one(nprocs: Any) -> None:
    """Without the check ``nprocs=0`` started no rank and returned at once: the test built on it passed."""
    shown = repr(nprocs).replace(".", r"\.")
    with pytest.raises(ValueError, match=rf"^run_ranks\(nprocs=\.\.\.\) must be an int >= 1 \(got {shown}\)$"):
        nvtrain.testing.run_ranks("worker.py", nprocs=nprocs)
    with pytest.raises(ValueError, match=rf"^start_ranks\(nprocs=\.\.\.\) must be an int >= 1 \(got {shown}\)$"):
        nvtrain.testing.start_ranks("worker.py", nprocs=nprocs)
    with pytest.raises(ValueError, match=rf"^spawn_ranks\(nprocs=\.\.\.\) must be an int >= 1 \(got {shown}\)$"):
        nvtrain.testing.spawn_ranks(print, nprocs=nprocs)


# -- nvtrain.plugins.load -------------------------------------------------------------------------

_CASE_SOURCE = """
    import nvtrain
    from nvtrain import TrainingStage


    class CaseObserver(nvtrain.Hook):
        plugin_name = "casey"
        stages = (TrainingStage.AFTER_BATCH,)

        def __call__(self, ctx, stage):
            return None


    __nvtrain_hooks__ = (CaseObserver,)
"""


@pytest.mark.parametrize("spec", [None, 3, ("ema",)])
def test_plugin_specs_that_are_no_str_are_refused(spec: Any) -> None:
    with pytest.raises(TypeError, match=r"^nvtrain\.plugins\.load\(spec\) must be a str naming a plugin"):
        nvtrain.plugins.load(spec)
    with pytest.raises(TypeError, match=r"^nvtrain\.plugins\.hook_class\(spec\) must be a str naming a plugin"):
        nvtrain.plugins.hook_class(spec)


def test_a_plugin_name_in_another_case_gets_a_suggestion(site: Any) -> None:
    site.install("nvtrain-casey", {"casey": site.module("case", _CASE_SOURCE)})
    with pytest.raises(PluginNotFoundError, match=r"no plugin named 'CASEY'.*; did you mean 'casey'\?"):
        nvtrain.plugins.load("CASEY")
    with pytest.raises(PluginNotFoundError, match=r"no hook class 'caseobserver'; did you mean 'CaseObserver'\?"):
        nvtrain.plugins.load("casey:caseobserver")
    assert type(nvtrain.plugins.load("casey")).__name__ == "CaseObserver"


# -- SpikeSkipHook.window -------------------------------------------------------------------------


@pytest.mark.parametrize("window", [10**30, 1_000_001, 1])
def test_spike_skip_window_is_bounded(window: int) -> None:
    """10**30 reached the deque of recent values and failed as a bare OverflowError naming no field."""
    expected = rf"^SpikeSkipHook\.window must be an int >= 2 and <= 1000000 .* \(got {window}\)$"
    with pytest.raises(ValueError, match=expected):
        SpikeSkipHook(window=window)


def test_spike_skip_window_at_its_bound_is_taken() -> None:
    assert SpikeSkipHook(window=1_000_000).window == 1_000_000


# -- TrainingStrategy.load_state_dict ---------------------------------------------------------------


@pytest.mark.parametrize(("state", "got"), [({}, "an empty dict"), ({"weights": 1}, "the keys ['weights']")])
def test_a_state_without_its_format_key_says_so(state: dict[str, Any], got: str) -> None:
    strategy = nvtrain.TrainingStrategy(
        torch.nn.Linear(3, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        torch.nn.functional.mse_loss,
        device="cpu",
    )
    with pytest.raises(ValueError) as caught:
        strategy.load_state_dict(state)
    message = str(caught.value)
    assert "not a training state: it has no 'format' key" in message
    assert "expected the keys of strategy.state_dict(): ['counters', 'format', 'hooks'," in message
    assert message.endswith(f"got {got})")
    assert "format None" not in message


def test_validate_given_what_is_not_batches_names_its_loader_argument() -> None:
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
    )
    with strategy, pytest.raises(TypeError, match=r"^TrainingStrategy\.validate\(loader\) must be an iterable"):
        strategy.validate(3)  # type: ignore[arg-type]


def test_a_generator_as_validation_data_is_refused_when_built() -> None:
    """The first validation reads it up; every later one found it empty, mid-run."""
    with pytest.raises(TypeError, match=r"ValidationConfig\.data must be .*a generator or iterator is used up"):
        ValidationConfig(data=(batch for batch in [(torch.ones(2, 3), torch.ones(2, 2))]))


@pytest.mark.parametrize("call", ["run", "setup"])
@pytest.mark.parametrize("loader", [5, "abc"], ids=["int", "str"])
def test_run_and_setup_name_a_loader_that_is_not_batches(call: str, loader: Any) -> None:
    """A str was iterated character by character and the forward was blamed."""
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
    )
    with strategy, pytest.raises(TypeError, match=rf"^TrainingStrategy\.{call}\(train_loader\) must be an iterable"):
        getattr(strategy, call)(loader)


def test_the_default_forward_says_how_many_items_a_batch_had() -> None:
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
    )
    batch = (torch.ones(2, 3), torch.ones(2, 2), torch.ones(2))
    with strategy, pytest.raises(TypeError, match=r"expects batches of \(inputs, targets\), got a tuple of 3 items"):
        strategy.run([batch])


def test_loading_a_built_in_hooks_name_as_a_plugin_says_it_is_built_in() -> None:
    with pytest.raises(PluginNotFoundError, match=r"'clip' is nvtrain's built-in GradientClippingHook: build it as "):
        nvtrain.plugins.load("clip")


def test_a_state_that_is_no_mapping_names_the_call() -> None:
    strategy = nvtrain.TrainingStrategy(
        torch.nn.Linear(3, 1), functools.partial(torch.optim.SGD, lr=0.1), torch.nn.functional.mse_loss, device="cpu"
    )
    with pytest.raises(TypeError, match=r"^TrainingStrategy\.load_state_dict\(state\) must be a training state dict"):
        strategy.load_state_dict([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^TrainingStrategy\.load_state_dict\(state\): not a training state"):
        strategy.load_state_dict({})


def test_the_mixed_precision_state_that_is_no_mapping_says_so() -> None:
    amp = pytest.importorskip("nvtrain_amp")
    with pytest.raises(TypeError, match=r"MixedPrecisionHook\.load_state_dict\(state\) must be a mapping \(got list\)"):
        amp.MixedPrecisionHook(precision="bf16").load_state_dict([])  # type: ignore[arg-type]


def test_an_iterator_class_that_restarts_after_its_end_is_taken_as_validation_data() -> None:
    """Some data pipelines' iterators are their own iter() and start again after StopIteration."""

    class Restarts:
        def __init__(self) -> None:
            self.position = 0

        def __iter__(self) -> Restarts:
            return self

        def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
            if self.position == 2:
                self.position = 0
                raise StopIteration
            self.position += 1
            return torch.ones(2, 3), torch.ones(2, 2)

    data = Restarts()
    assert ValidationConfig(data=data).data is data
    with pytest.raises(TypeError, match=r"a generator or iterator is used up by the first"):
        ValidationConfig(data=iter([(torch.ones(2, 3), torch.ones(2, 2))]))
