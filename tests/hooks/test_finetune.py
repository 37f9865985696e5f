"""Fine-tuning helpers: the optimizer receives exactly the trainable parameters of the patched model."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain.cli import main
from nvtrain.hooks import ModulePatchHook, TrainableParameterHook
from nvtrain.validators import FieldProblem, FieldTypeError, FieldValueError


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def make_strategy(hooks: Sequence[object], model: torch.nn.Module | None = None) -> nvtrain.TrainingStrategy:
    return nvtrain.TrainingStrategy(
        models=model if model is not None else make_net(),
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=list(hooks),
        device="cpu",
    )


def make_batch(outputs: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, generator=generator), torch.randn(4, outputs, generator=generator)


def optimizer_param_ids(strategy: nvtrain.TrainingStrategy) -> set[int]:
    return {id(p) for group in strategy.ctx.optimizers["main"].param_groups for p in group["params"]}


def param_ids(module: torch.nn.Module, *names: str) -> set[int]:
    return {id(module.get_parameter(name)) for name in names}


# -- TrainableParameterHook ------------------------------------------------------------------------


def test_trainable_is_an_allow_list_and_the_optimizer_gets_only_those() -> None:
    hook = TrainableParameterHook(trainable=["head.*"])
    strategy = make_strategy([hook])
    strategy.train_batch(make_batch())
    model = strategy.ctx.models["main"]
    assert optimizer_param_ids(strategy) == param_ids(model, "head.weight", "head.bias")
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]
    assert hook.trainable_names == {"main": ["head.weight", "head.bias"]}
    assert all(p.grad is None for p in model.backbone.parameters())


def test_frozen_alone_keeps_the_other_flags() -> None:
    model = make_net()
    model.head.bias.requires_grad_(False)
    strategy = make_strategy([TrainableParameterHook(frozen="backbone.0.*")], model)
    strategy.train_batch(make_batch())
    expected = param_ids(model, "backbone.2.weight", "backbone.2.bias", "head.weight")
    assert optimizer_param_ids(strategy) == expected


def test_frozen_wins_over_trainable() -> None:
    strategy = make_strategy([TrainableParameterHook(trainable=["backbone.*", "head.*"], frozen=["*.bias"])])
    strategy.train_batch(make_batch())
    model = strategy.ctx.models["main"]
    assert optimizer_param_ids(strategy) == param_ids(model, "backbone.0.weight", "backbone.2.weight", "head.weight")


def test_a_pattern_that_matches_nothing_is_an_error_naming_it() -> None:
    strategy = make_strategy([TrainableParameterHook(trainable=["head.*"], frozen=["heads.*"])])
    with pytest.raises(ValueError, match=r"TrainableParameterHook\.frozen pattern 'heads\.\*' matches no parameter"):
        strategy.train_batch(make_batch())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs at least one pattern"),
        ({"trainable": [""]}, r"TrainableParameterHook\.trainable must hold non-empty glob strings"),
        ({"frozen": ["a", 3]}, r"TrainableParameterHook\.frozen must hold non-empty glob strings"),
        ({"frozen": "a", "model_keys": ()}, r"TrainableParameterHook\.model_keys must be None or a non-empty"),
    ],
)
def test_trainable_bad_configuration(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainableParameterHook(**kwargs)


def test_trainable_refuses_built_optimizers() -> None:
    model = make_net()
    optimizers = {"main": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(RuntimeError, match="TrainableParameterHook must run before the optimizers are built"):
        TrainableParameterHook(trainable="head.*").apply({"main": model}, optimizers)


def test_trainable_registered_after_setup_fails_the_run() -> None:
    strategy = make_strategy([])
    strategy.train_batch(make_batch())  # SETUP has run, optimizers exist
    strategy.register_hook(TrainableParameterHook(trainable="head.*"))
    with pytest.raises(RuntimeError, match="TrainableParameterHook was registered after SETUP"):
        strategy.run([make_batch()])


def test_model_keys_limit_which_models_are_touched() -> None:
    models = {"student": make_net(), "teacher": make_net()}
    hook = TrainableParameterHook(trainable="head.*", model_keys="student")
    hook.apply(models)
    assert all(p.requires_grad for p in models["teacher"].parameters())
    assert [n for n, p in models["student"].named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]
    with pytest.raises(ValueError, match=r"TrainableParameterHook\.model_keys names \['pupil'\]"):
        TrainableParameterHook(trainable="head.*", model_keys="pupil").apply(models)


# -- ModulePatchHook -------------------------------------------------------------------------------


def test_patch_swaps_the_head_and_the_optimizer_gets_the_new_parameters() -> None:
    hook = ModulePatchHook(patches={"head": lambda old: torch.nn.Linear(old.in_features, 5)})
    strategy = make_strategy([hook])
    old_head = strategy.ctx.models["main"].head
    strategy.train_batch(make_batch(outputs=5))
    model = strategy.ctx.models["main"]
    assert model.head is not old_head and model.head.out_features == 5
    assert hook.replaced == [("main", "head")]
    ids = optimizer_param_ids(strategy)
    assert param_ids(model, "head.weight", "head.bias") <= ids
    assert not {id(p) for p in old_head.parameters()} & ids


def test_freeze_backbone_and_swap_head_together() -> None:
    # the example of docs/update-hooks.md: new 5-way head, frozen backbone
    hooks = [
        ModulePatchHook(patches={"head": lambda old: torch.nn.Linear(old.in_features, 5)}),
        TrainableParameterHook(frozen="backbone.*"),
    ]
    strategy = make_strategy(hooks)
    backbone_before = [p.detach().clone() for p in strategy.ctx.models["main"].backbone.parameters()]
    strategy.run([make_batch(outputs=5)] * 3)
    model = strategy.ctx.models["main"]
    assert optimizer_param_ids(strategy) == param_ids(model, "head.weight", "head.bias")
    for before, after in zip(backbone_before, model.backbone.parameters(), strict=True):
        assert torch.equal(before, after)
    assert strategy.ctx.step_count == 3


def test_glob_patches_replace_every_match_outermost_first() -> None:
    hook = ModulePatchHook(patches={"backbone.[02]": lambda old: torch.nn.Linear(old.in_features, old.out_features)})
    model = make_net()
    old = [model.backbone[0], model.backbone[2]]
    hook.apply({"main": model})
    assert hook.replaced == [("main", "backbone.0"), ("main", "backbone.2")]
    assert model.backbone[0] is not old[0] and model.backbone[2] is not old[1]

    nested = ModulePatchHook(patches={"backbone*": lambda old: torch.nn.Identity()})
    nested.apply({"main": model})
    assert nested.replaced == [("main", "backbone")]  # its children were not visited separately


@pytest.mark.parametrize(
    ("patches", "error", "message"),
    [
        ({"neck": torch.nn.Identity}, ValueError, r"pattern\(s\) \['neck'\] match no submodule"),
        ({"head": lambda old: "not a module"}, TypeError, r"patches\['head'\] returned str for module 'head'"),
        ({"head*": torch.nn.Identity, "h*": torch.nn.Identity}, ValueError, "matches several patterns"),
        (
            {"backbone": lambda old: torch.nn.Identity(), "backbone.0": torch.nn.Identity},
            ValueError,
            r"\['backbone\.0'\] match only modules inside modules that are replaced whole",
        ),
    ],
)
def test_patch_errors_name_the_pattern(patches: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ModulePatchHook(patches=patches).apply({"main": make_net()})


def test_patch_refuses_built_optimizers_clearly() -> None:
    model = make_net()
    optimizers = {"main": torch.optim.SGD(model.parameters(), lr=0.1)}
    hook = ModulePatchHook(patches={"head": torch.nn.Identity})
    with pytest.raises(RuntimeError, match=r"ModulePatchHook must run before the optimizers are built.*\['main'\]"):
        hook.apply({"main": model}, optimizers)
    strategy = make_strategy([])
    strategy.train_batch(make_batch())
    strategy.register_hook(ModulePatchHook(patches={"head": torch.nn.Identity}))
    with pytest.raises(RuntimeError, match="ModulePatchHook was registered after SETUP"):
        strategy.run([make_batch()])


@pytest.mark.parametrize(
    ("patches", "error", "message"),
    [
        ({}, ValueError, "must map at least one glob"),
        ({"": torch.nn.Identity}, ValueError, "keys must be non-empty glob strings"),
        ({"head": "Identity"}, TypeError, r"patches\['head'\] must be callable"),
    ],
)
def test_patch_bad_configuration(patches: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ModulePatchHook(patches=patches)


# -- import-path factories (what a YAML config can give) -------------------------------------------


HEAD_MODULE = """\
import pathlib

import torch


def make_head(old):
    pathlib.Path("patched.txt").write_text(f"{type(old).__name__} {old.in_features} {old.out_features}")
    return torch.nn.Linear(old.in_features, old.out_features)
"""


def head_module(folder: Path, name: str) -> str:
    """Write module ``name`` with ``make_head`` into ``folder``; its import path."""
    (folder / f"{name}.py").write_text(HEAD_MODULE, encoding="utf-8")
    return f"{name}:make_head"


def test_patch_factory_given_as_an_import_path_is_found_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = head_module(tmp_path, "finetune_head_api")
    hook = ModulePatchHook(patches={"head": path})
    assert hook.patches["head"] is sys.modules["finetune_head_api"].make_head
    strategy = make_strategy([hook])
    old_head = strategy.ctx.models["main"].head
    strategy.train_batch(make_batch())
    assert strategy.ctx.models["main"].head is not old_head and hook.replaced == [("main", "head")]
    assert (tmp_path / "patched.txt").read_text() == "Linear 8 2"
    # an installed module needs no folder; callables and import paths mix
    mixed = ModulePatchHook(patches={"head": "torch.nn:Identity", "backbone.0": torch.nn.Identity})
    assert mixed.patches == {"head": torch.nn.Identity, "backbone.0": torch.nn.Identity}


@pytest.mark.parametrize(
    ("factory", "error", "message"),
    [
        (
            "no_such_finetune_module:make_head",
            FieldValueError,
            "ModulePatchHook.patches['head']: cannot import the module factory 'no_such_finetune_module:make_head': "
            "cannot import module 'no_such_finetune_module' for 'no_such_finetune_module:make_head' (also looked in ",
        ),
        (
            "torch.nn:NoSuchLayer",
            FieldValueError,
            "ModulePatchHook.patches['head']: cannot import the module factory 'torch.nn:NoSuchLayer': "
            "'torch.nn' has no attribute 'NoSuchLayer'",
        ),
        ("math:pi", FieldTypeError, "ModulePatchHook.patches['head']: 'math:pi' names 3.14"),
        (
            "torch.nn.Identity",
            FieldTypeError,
            "ModulePatchHook.patches['head'] must be callable as factory(old_module) -> new module, or an import "
            "path 'package.module:attr' to one (got 'torch.nn.Identity')",
        ),
    ],
)
def test_a_bad_import_path_factory_is_a_field_error_naming_the_pattern_and_the_path(
    factory: str, error: type[FieldProblem], message: str
) -> None:
    with pytest.raises(error) as caught:
        ModulePatchHook(patches={"head": factory})
    assert str(caught.value).startswith(message)
    assert (caught.value.owner, caught.value.field, caught.value.value) == ("ModulePatchHook", "patches", factory)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``nvtrain ARGS`` in this process (as the console script: the working directory not on sys.path)
    with the built-in config on the CPU, two steps."""
    small = ["--set", "device=cpu", "--set", "trainer.max_steps=2", "--set", "logging.tensorboard=false"]
    code = main([*args, *small])
    out, err = capsys.readouterr()
    return code, out, err


def test_module_patch_from_the_command_line_with_an_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the built-in digits MLP's last layer (index 6: Linear 128 -> 10) replaced through a module in the working dir
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path) not in sys.path
    path = head_module(tmp_path, "finetune_head_cli")
    hooks = "hooks=[{name: module_patch, patches: {'6': '%s'}}]"
    code, out, err = cli(capsys, "validate", "--set", hooks % path)
    assert code == 0, err
    assert "hooks: ModulePatchHook," in out
    (tmp_path / "patched.txt").unlink(missing_ok=True)
    code, out, err = cli(capsys, "train", "--set", hooks % path, "--set", "logging.progress_bar=false")
    assert code == 0, err
    assert (tmp_path / "patched.txt").read_text() == "Linear 128 10"  # the run's model was patched at SETUP
    assert f"run {Path('runs', 'digits')} | step 2 | " in out
    code, out, err = cli(capsys, "validate", "--set", hooks % "finetune_head_cli:make_hed")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        "hooks[0].patches: hook 'module_patch': ModulePatchHook.patches['6']: cannot import the module factory "
        "'finetune_head_cli:make_hed': 'finetune_head_cli' has no attribute 'make_hed'"
    ) in err


# -- a module or parameter that goes by two names ------------------------------------------------


class TiedTwice(torch.nn.Module):
    """One linear layer registered as ``a`` and ``b``, and an untied ``c``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(3, 3)
        self.b = self.a
        self.c = torch.nn.Linear(3, 3)


@pytest.mark.parametrize("pattern", ["a", "b"])
def test_patching_a_module_registered_twice_replaces_it_under_both_names(pattern: str) -> None:
    model = TiedTwice()
    calls: list[torch.nn.Module] = []

    def factory(old: torch.nn.Module) -> torch.nn.Module:
        calls.append(old)
        return torch.nn.Linear(3, 3)

    hook = ModulePatchHook({pattern: factory})
    replaced = hook.apply({"main": model})
    assert len(calls) == 1  # one new module, shared as the old one was
    assert model.a is model.b and model.a is not calls[0]
    assert sorted(name for _, name in replaced) == ["a", "b"]
    assert len(list(model.parameters())) == 4  # the new shared layer and c: no stale copy left training


def test_patterns_giving_one_module_two_replacements_are_refused() -> None:
    hook = ModulePatchHook({"a": lambda old: torch.nn.Linear(3, 3), "b": lambda old: torch.nn.Identity()})
    with pytest.raises(ValueError, match=r"module 'a' of model 'main' is also registered as 'b'.*different factories"):
        hook.apply({"main": TiedTwice()})
    def one_factory(old: torch.nn.Module) -> torch.nn.Module:
        return torch.nn.Linear(3, 3)

    same = ModulePatchHook({"a": one_factory, "b": one_factory})  # both names, one factory: one replacement
    model = TiedTwice()
    same.apply({"main": model})
    assert model.a is model.b


@pytest.mark.parametrize(
    ("hook", "trainable"),
    [
        (TrainableParameterHook(frozen=("b.weight",)), {"a.bias", "c.weight", "c.bias"}),
        (TrainableParameterHook(trainable=("b.*",)), {"a.weight", "a.bias"}),
        (TrainableParameterHook(trainable=("a.*", "c.*"), frozen=("b.bias",)), {"a.weight", "c.weight", "c.bias"}),
    ],
)
def test_a_tied_parameter_is_named_by_either_of_its_names(hook: TrainableParameterHook, trainable: set[str]) -> None:
    model = TiedTwice()
    names = hook.apply({"main": model})
    assert set(names["main"]) == trainable
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable
