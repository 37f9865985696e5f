"""What a resume refuses it leaves as it was: a checkpoint in a newer format stays on disk untouched (it is no
damage), and a refused state leaves the strategy unrestored, so a retried run() refuses it again."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest
import torch
from nvtrain_checkpoint import CheckpointError, CheckpointHook, storage

import nvtrain
from nvtrain.errors import ResumeError
from nvtrain.state import COUNTERS


def _train(driver: ModuleType, hooks: list[object], max_steps: int, **scheduler: Any) -> None:
    kwargs = driver.strategy_kwargs("plain", hooks)
    kwargs["step_scheduler"] = attrs.evolve(kwargs["step_scheduler"], max_steps=max_steps, **scheduler)
    with nvtrain.TrainingStrategy(**kwargs) as strategy:
        strategy.run(driver.make_loader("plain"))


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what a refused resume must leave exactly as it was."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def _edit_manifest(directory: Path, **fields: Any) -> None:
    manifest_file = directory / storage.MANIFEST_NAME
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    manifest.update(fields)
    manifest_file.write_text(json.dumps(manifest, indent=2), encoding="utf-8")


# -- a checkpoint in a newer format ------------------------------------------------------------------


@pytest.mark.parametrize("newer", ["step_6", "step_3"], ids=["the-newest", "an-older-one"])
def test_a_checkpoint_in_a_newer_format_stops_the_resume_and_stays_as_it_is(
    driver: ModuleType, tmp_path: Path, newer: str
) -> None:
    _train(driver, [CheckpointHook(tmp_path, step_interval=3)], max_steps=6)
    _edit_manifest(tmp_path / newer, format_version=storage.FORMAT_VERSION + 1)
    before = _files(tmp_path)
    # Passed over as damage, the newest would be set aside (or replaced by this run's save of step 6), and
    # keep_last_n=1 would rotate an older one out once the run saved step 9.
    resuming = CheckpointHook(tmp_path, step_interval=3, keep_last_n=1, resume="auto")
    with pytest.raises(CheckpointError) as refused:
        _train(driver, [resuming], max_steps=9)
    message = str(refused.value)
    assert f"{tmp_path / newer} is a checkpoint in format {storage.FORMAT_VERSION + 1}" in message
    assert f"it reads format {storage.FORMAT_VERSION}" in message
    assert "Install the nvtrain-checkpoint version that wrote it" in message and "checkpoint_dir" in message
    assert _files(tmp_path) == before  # nothing set aside, replaced, rotated out or written


def test_the_refusal_names_the_version_that_wrote_the_newer_checkpoint(driver: ModuleType, tmp_path: Path) -> None:
    _train(driver, [CheckpointHook(tmp_path, step_interval=3)], max_steps=3)
    plugins = {"checkpoint": {"distribution": "nvtrain-checkpoint", "version": "99.0"}}
    _edit_manifest(tmp_path / "step_3", format_version=storage.FORMAT_VERSION + 1, plugins=plugins)
    with pytest.raises(CheckpointError, match=r"Install nvtrain-checkpoint 99\.0 to resume from it"):
        CheckpointHook(tmp_path, resume="auto").resume_checkpoint()


@pytest.mark.parametrize("version", [0, "1", None], ids=["zero", "a-string", "null"])
def test_a_format_no_version_writes_is_damage_and_passed_over(driver: ModuleType, tmp_path: Path, version: Any) -> None:
    _train(driver, [CheckpointHook(tmp_path, step_interval=3)], max_steps=6)
    _edit_manifest(tmp_path / "step_6", format_version=version)
    assert CheckpointHook(tmp_path, resume="auto").resume_checkpoint() == tmp_path / "step_3"


# -- a refused state leaves the strategy unrestored --------------------------------------------------


class Tally:
    """A checkpointable hook whose state the saved run moved on (one per micro-batch)."""

    plugin_name = "tally"

    def __init__(self) -> None:
        self.seen = torch.zeros(())

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"].clone()


class RefusingTally(Tally):
    """Refuses its saved state: a failure only loading finds, after the counters were restored."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("this tally refuses its saved state")


def _snapshot(strategy: nvtrain.TrainingStrategy, tally: Tally) -> dict[str, Any]:
    ctx = strategy.ctx
    return {
        "weights": {name: copy.deepcopy(model.state_dict()) for name, model in ctx.models.items()},
        "optimizers": {name: copy.deepcopy(opt.state_dict()) for name, opt in ctx.optimizers.items()},
        "lr_schedulers": {name: copy.deepcopy(sched.state_dict()) for name, sched in ctx.lr_schedulers.items()},
        "counters": {name: getattr(ctx, name) for name in COUNTERS},
        "tally": tally.seen.clone(),
    }


def _refused_twice(
    driver: ModuleType, root: Path, tally: Tally, error: type[Exception], message: str, **scheduler: Any
) -> None:
    """Resume from ``root`` with ``tally``: run() is refused, the strategy stays as set up, and a second
    run() is refused the same way (never trains on from a half-restored state); nothing is written."""
    kwargs = driver.strategy_kwargs("plain", [CheckpointHook(root, step_interval=100, resume="auto"), tally])
    kwargs["step_scheduler"] = attrs.evolve(kwargs["step_scheduler"], **scheduler)
    files = _files(root)
    with nvtrain.TrainingStrategy(**kwargs) as strategy:
        strategy.setup(driver.make_loader("plain"))
        before = _snapshot(strategy, tally)
        for _ in range(2):
            with pytest.raises(error, match=message):
                strategy.run(driver.make_loader("plain"))
            if not isinstance(tally, RefusingTally):  # that one fails loading: the rest is loaded by then
                driver.assert_same(before, _snapshot(strategy, tally))
    assert _files(root) == files


def test_a_resume_refused_for_another_batch_size_restores_nothing_and_is_refused_again(
    driver: ModuleType, tmp_path: Path
) -> None:
    _train(driver, [CheckpointHook(tmp_path, step_interval=6), Tally()], max_steps=12)  # step 12: epoch 2, batch 3
    message = r"different configuration \(global_batch_size: saved 4, now 8"
    _refused_twice(driver, tmp_path, Tally(), ResumeError, message, global_batch_size=8)


def _crafted(
    mutate: Callable[[dict[str, Any]], None],
) -> Callable[[Path], None]:
    def craft(directory: Path) -> None:
        state_file = directory / storage.STATE_NAME
        state = torch.load(state_file, weights_only=True)
        mutate(state)
        torch.save(state, state_file)
        _edit_manifest(directory, files={storage.STATE_NAME: storage.file_digest(state_file)})  # hashes that agree

    return craft


@pytest.mark.parametrize(
    ("craft", "message"),
    [
        (
            _crafted(lambda state: state["counters"].update(step_count="x")),
            r"the state's counters\['step_count'\] must be an int >= 0; got 'x' \(str\)",
        ),
        (
            _crafted(lambda state: state["models"].update(main=None)),
            r"the state's models\['main'\] must be a dict of tensors by parameter name; got None \(NoneType\)",
        ),
        (
            _crafted(lambda state: state["rng"].update(torch=torch.zeros(3, dtype=torch.uint8))),
            r"the state's rng\['torch'\] cannot be restored: RuntimeError: .*size to be 3",
        ),
        (
            _crafted(lambda state: state.update(scheduler={"nonsense": 1})),
            r"StepScheduler.load_state_dict: the state lacks \['step', 'epoch', 'position', 'config'\]",
        ),
    ],
    ids=["counter-not-an-int", "model-not-a-dict", "rng-of-another-size", "scheduler-garbage"],
)
def test_a_crafted_state_is_refused_before_anything_loads(
    driver: ModuleType, tmp_path: Path, craft: Callable[[Path], None], message: str
) -> None:
    _train(driver, [CheckpointHook(tmp_path, step_interval=6), Tally()], max_steps=12)
    craft(tmp_path / "step_12")
    _refused_twice(driver, tmp_path, Tally(), ResumeError, message)


def test_a_resume_that_failed_while_loading_is_tried_again_not_taken_for_restored(
    driver: ModuleType, tmp_path: Path
) -> None:
    _train(driver, [CheckpointHook(tmp_path, step_interval=6), Tally()], max_steps=12)
    _refused_twice(driver, tmp_path, RefusingTally(), ValueError, "this tally refuses its saved state")
