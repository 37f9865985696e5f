"""``TrainingStrategy.load_checkpoint``: an immediate restore, a checkpoint of ``nvtrain train`` that
loads on its own, and a saved run config that can only name trusted code."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
import nvtrain.app
import nvtrain.app.checking
import nvtrain.app.hook_stack
from nvtrain.cli import main
from nvtrain.errors import ResumeError

pytest.importorskip("nvtrain_checkpoint")
pytest.importorskip("nvtrain_ema")

from nvtrain_checkpoint import CheckpointHook, read_checkpoint


def _sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small digits job (EMA and checkpoint hooks on) in ``tmp_path``; returns the config path."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            output_dir: {tmp_path / 'out'}
            device: cpu
            model: {{factory: nvtrain.builtin.digits:make_classifier, kwargs: {{hidden: 16, depth: 1}}}}
            data: {{factory: nvtrain.builtin.digits:make_loaders, kwargs: {{batch_size: 64}}}}
            trainer: {{max_steps: 8}}
            validation: {{every_n_epochs: null}}
            logging: {{log_every_n_steps: 2, tensorboard: false, plot: false, progress_bar: false}}
            hooks:
              - {{name: ema, decay: 0.9}}
              - {{name: checkpoint, resume: auto}}
            """
        ),
        encoding="utf-8",
    )
    return config


@pytest.fixture
def trained(job: Path) -> Path:
    """``nvtrain train --set trainer.max_steps=20``; returns its checkpoint of step 20."""
    assert main(["train", str(job), *_sets("trainer.max_steps=20")]) == 0
    checkpoint = job.parent / "out" / "job" / "checkpoints" / "step_20"
    assert (checkpoint / "manifest.json").is_file()
    return checkpoint


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key], f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def _assert_same(live: Any, saved: Any) -> None:
    live_items, saved_items = dict(_tensors(live)), dict(_tensors(saved))
    assert live_items.keys() == saved_items.keys()
    for key, value in live_items.items():
        other = saved_items[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), key
        else:
            assert value == other, key


def _hook(strategy: nvtrain.TrainingStrategy, name: str) -> Any:
    from nvtrain.state import strategy_hooks

    found = [h for h in strategy_hooks(strategy) if getattr(h, "plugin_name", None) == name]
    assert len(found) == 1
    return found[0]


# -- a checkpoint of `nvtrain train` loads on its own -------------------------------------------


def test_checkpoint_of_nvtrain_train_loads_with_no_other_argument(trained: Path) -> None:
    saved = read_checkpoint(trained)
    with nvtrain.TrainingStrategy.load_checkpoint(trained) as strategy:
        ctx = strategy.ctx
        assert ctx.step_count == 20  # restored on return, not at the next run
        assert ctx.batch_count == saved["counters"]["batch_count"]
        _assert_same(ctx.models["main"].state_dict(), saved["models"]["main"])
        _assert_same(ctx.optimizers["main"].state_dict(), saved["optimizers"]["main"])
        assert isinstance(ctx.optimizers["main"], torch.optim.AdamW)
        ema = _hook(strategy, "ema")
        _assert_same(ema.state_dict(), saved["hooks"]["ema:main"])
        assert ema.state_dict()["num_updates"] == 20
        checkpoint = _hook(strategy, "checkpoint")  # the config's checkpoint hook, rebuilt
        assert isinstance(checkpoint, CheckpointHook)
        assert checkpoint.checkpoint_dir == trained.parent


def test_hooks_given_to_load_checkpoint_take_part_in_setup(trained: Path) -> None:
    seen: list[str] = []

    class SetupProbe:
        @nvtrain.hookimpl
        def setup(self, ctx: nvtrain.TrainingContext) -> None:
            seen.append(ctx.stage.name if ctx.stage is not None else "")

    with nvtrain.TrainingStrategy.load_checkpoint(trained, hooks=[SetupProbe()]) as strategy:
        assert seen == ["SETUP"]  # registered before the strategy was set up, as the config's hooks are
        assert any(isinstance(hook, SetupProbe) for hook in strategy.registry.hooks())


def test_the_loaded_run_continues_like_an_uninterrupted_one(trained: Path, job: Path) -> None:
    from nvtrain.builtin.digits import make_loaders

    loader, _ = make_loaders(batch_size=64)
    with nvtrain.TrainingStrategy.load_checkpoint(trained, max_steps=24) as strategy:
        before = {k: v.clone() for k, v in strategy.ctx.models["main"].state_dict().items()}
        result = strategy.run(loader)
        assert result.step_count == 24
        after = {k: v.clone() for k, v in strategy.ctx.models["main"].state_dict().items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)
    continued = trained.parent / "step_24"
    assert json.loads((continued / "manifest.json").read_text())["run_config"]["trainer"]["max_steps"] == 24
    # The same job trained to step 24 in one go ends with the same weights, bit for bit.
    assert main(["train", str(job), *_sets("trainer.max_steps=24", f"output_dir={job.parent / 'straight'}")]) == 0
    straight = read_checkpoint(job.parent / "straight" / "job" / "checkpoints" / "step_24")
    _assert_same(after, straight["models"]["main"])


# -- a checkpoint written from Python ------------------------------------------------------------


def test_checkpoint_written_from_python_names_the_missing_arguments(tmp_path: Path) -> None:
    def make() -> dict[str, Any]:
        torch.manual_seed(0)
        return {
            "models": torch.nn.Linear(3, 2),
            "optimizers": lambda params: torch.optim.SGD(params, lr=0.1),
            "loss_fn": torch.nn.functional.cross_entropy,
            "device": "cpu",
        }

    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    with nvtrain.TrainingStrategy(**make(), max_steps=3, hooks=[CheckpointHook(tmp_path)]) as strategy:
        strategy.run(batches)
    with pytest.raises(ResumeError, match=r"missing the arguments models, optimizers and loss_fn") as info:
        nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_3")
    assert "run_config" in str(info.value) and "written from Python" in str(info.value)
    with pytest.raises(TypeError, match=r"not \['optimizers', 'loss_fn'\]"):
        nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_3", models=torch.nn.Linear(3, 2))
    # With the arguments it loads as before, and now at once.
    with nvtrain.TrainingStrategy.load_checkpoint(tmp_path / "step_3", **make()) as strategy:
        assert strategy.ctx.step_count == 3
        assert int(strategy.ctx.optimizers["main"].state_dict()["param_groups"][0]["lr"] * 10) == 1


# -- a checkpoint stays data ----------------------------------------------------------------------


def _doctored(checkpoint: Path, where: Path, **changes: str) -> Path:
    """A copy of ``checkpoint`` whose manifest's run config names other import paths.

    The manifest records the size and sha256 of ``state.pt`` only, so the state still
    verifies: the refusal below is about the config, not a corrupt checkpoint.
    """
    copy = where / checkpoint.name
    shutil.copytree(checkpoint, copy)
    manifest_file = copy / "manifest.json"
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    for key, value in changes.items():
        section, field = key.split("__")
        manifest["run_config"][section][field] = value
    manifest_file.write_text(json.dumps(manifest), encoding="utf-8")
    assert read_checkpoint(copy)["counters"]["step_count"] == 20
    return copy


@pytest.fixture
def resolved(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every import path the app resolves, recorded (the real resolver still runs)."""
    calls: list[str] = []
    real = nvtrain.app.checking.resolve_import_path

    def recording(spec: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(spec)
        return real(spec, *args, **kwargs)

    for module in (nvtrain.app.checking, nvtrain.app.hook_stack):  # the config's factories, and hooks by path
        monkeypatch.setattr(module, "resolve_import_path", recording)
    return calls


def test_config_naming_os_system_is_refused_before_any_import(
    trained: Path, tmp_path: Path, resolved: list[str]
) -> None:
    doctored = _doctored(trained, tmp_path / "doctored", model__factory="os:system")
    with pytest.raises(ResumeError) as info:
        nvtrain.TrainingStrategy.load_checkpoint(doctored)
    message = str(info.value)
    assert "model.factory = 'os:system'" in message
    assert "trust=['os']" in message and "Nothing was imported" in message
    assert resolved == []  # not even the trusted paths were resolved: the check comes first


def test_a_package_named_in_trust_may_be_imported(trained: Path, tmp_path: Path, resolved: list[str]) -> None:
    (tmp_path / "mypkg_models.py").write_text(
        "from nvtrain.builtin.digits import make_classifier as make\n", encoding="utf-8"
    )
    doctored = _doctored(trained, tmp_path / "doctored", model__factory="mypkg_models:make")
    try:
        with pytest.raises(ResumeError, match=r"trust=\['mypkg_models'\]"):
            nvtrain.TrainingStrategy.load_checkpoint(doctored)
        assert resolved == [] and "mypkg_models" not in sys.modules
        with nvtrain.TrainingStrategy.load_checkpoint(doctored, trust=["mypkg_models"]) as strategy:
            assert strategy.ctx.step_count == 20
        assert "mypkg_models:make" in resolved
    finally:
        sys.modules.pop("mypkg_models", None)


def test_import_paths_of_a_run_config() -> None:
    config = {
        "model": {"factory": "a.b:make", "forward_fn": None},
        "data": {"factory": "c:loaders"},
        "loss": {"function": "torch.nn.functional:cross_entropy"},
        "optimizer": {"factory": "torch.optim:AdamW"},
        "lr_scheduler": {"factory": "cosine"},
        "validation": {"metrics": ["accuracy", "d:f1"]},
        "hooks": [{"name": "ema"}, "clip", {"name": "e.hooks:Mine"}],
    }
    paths = dict(nvtrain.app.config_import_paths(config))
    assert paths["model.factory"] == "a.b:make" and "model.forward_fn" not in paths
    assert paths["validation.metrics[0]"] == "nvtrain.builtin.metrics:accuracy"
    assert paths["validation.metrics[1]"] == "d:f1"
    assert paths["lr_scheduler.factory"].startswith(("torch.", "nvtrain."))
    assert paths["hooks[2].name"] == "e.hooks:Mine" and "hooks[0].name" not in paths
    trusted = nvtrain.app.trusted_packages(["a"])
    assert {"torch", "nvtrain", "nvtrain_ema", "nvtrain_checkpoint", "a"} <= set(trusted)
