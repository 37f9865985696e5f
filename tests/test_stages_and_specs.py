"""The stage enum and the hookspec module: the contract between the loop and its plugins."""

from __future__ import annotations

import inspect
import re

import pluggy
import pytest

import nvtrain
from nvtrain import hookspecs
from nvtrain.stages import BATCH_STAGES, REPLACEMENT_STAGES, UPDATE_STAGES, TrainingStage

EXPECTED_STAGES = (
    "SETUP",
    "BEFORE_TRAINING",
    "BEFORE_EPOCH",
    "BEFORE_BATCH",
    "BEFORE_FORWARD",
    "AFTER_FORWARD",
    "BEFORE_LOSS",
    "AFTER_LOSS",
    "BEFORE_BACKWARD",
    "DO_BACKWARD",
    "AFTER_BACKWARD",
    "BEFORE_OPTIMIZER_STEP",
    "DO_OPTIMIZER_STEP",
    "AFTER_OPTIMIZER_STEP",
    "AFTER_BATCH",
    "AFTER_EPOCH",
    "AFTER_TRAINING",
    "AFTER_VALIDATION",
)


def _spec_functions() -> dict[str, object]:
    marker = hookspecs.PROJECT_NAME + "_spec"
    return {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, marker)}


def _spec_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def test_training_stage_has_the_eighteen_members_with_reference_values() -> None:
    assert [stage.name for stage in TrainingStage] == list(EXPECTED_STAGES)
    assert [stage.value for stage in TrainingStage] == list(range(1, 19))
    assert TrainingStage.SETUP == 1 and TrainingStage.AFTER_VALIDATION == 18
    assert nvtrain.TrainingStage is TrainingStage


def test_stage_groups() -> None:
    assert {TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP} == REPLACEMENT_STAGES
    assert {
        TrainingStage.BEFORE_BATCH,
        TrainingStage.DO_BACKWARD,
        TrainingStage.DO_OPTIMIZER_STEP,
        TrainingStage.AFTER_OPTIMIZER_STEP,
    } == UPDATE_STAGES
    assert {TrainingStage(v) for v in range(4, 16)} == BATCH_STAGES


def test_one_hookspec_per_stage_named_after_it_taking_ctx() -> None:
    specs = _spec_functions()
    assert sorted(specs) == sorted(stage.name.lower() for stage in TrainingStage)
    assert hookspecs.spec_names() == tuple(stage.name.lower() for stage in TrainingStage)
    pm = _spec_manager()
    for stage in TrainingStage:
        assert stage.hook_name == stage.name.lower()
        caller = getattr(pm.hook, stage.hook_name)
        assert caller.spec is not None, stage
        assert tuple(caller.spec.argnames) == ("ctx",), stage


def test_only_the_two_do_slots_are_firstresult() -> None:
    pm = _spec_manager()
    firstresult = {
        stage for stage in TrainingStage if getattr(pm.hook, stage.hook_name).spec.opts.get("firstresult")
    }
    assert firstresult == {TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP}


def test_every_hookspec_has_a_docstring() -> None:
    for name, fn in _spec_functions().items():
        doc = inspect.getdoc(fn)
        assert doc and len(doc.split()) >= 5, f"hookspec {name} has no real docstring"


def test_hookspecs_module_docstring_draws_the_loop_in_stage_order() -> None:
    doc = hookspecs.__doc__
    assert doc is not None and "::" in doc
    picture = doc[doc.index("::") :]
    for line in ("for epoch:", "for micro-batch in window:"):
        assert line in picture
    # Every stage appears, the training stages in firing order.
    positions = [re.search(rf"\b{stage.name}\b", picture) for stage in TrainingStage]
    assert all(p is not None for p in positions)
    starts = [p.start() for p in positions if p is not None]
    assert starts == sorted(starts)
    # The per-batch stages sit inside the micro-batch loop, the epoch stages around it.
    loop = picture.index("for micro-batch in window:")
    assert starts[TrainingStage.BEFORE_EPOCH - 1] < loop < starts[TrainingStage.BEFORE_BATCH - 1]
    assert starts[TrainingStage.AFTER_BATCH - 1] < starts[TrainingStage.AFTER_EPOCH - 1]


def test_the_stage_enum_points_at_the_one_drawing_of_the_loop() -> None:
    assert TrainingStage.__doc__ is not None and "nvtrain.hookspecs" in TrainingStage.__doc__


@pytest.mark.parametrize("stage", list(TrainingStage))
def test_a_plugin_implementing_a_stage_is_called_with_ctx_keyword(stage: TrainingStage) -> None:
    pm = _spec_manager()
    seen = []

    class Plugin:
        pass

    def impl(self: object, ctx: object) -> object:
        seen.append(ctx)
        return "result"

    setattr(Plugin, stage.hook_name, nvtrain.hookimpl(impl))
    pm.register(Plugin())
    pm.check_pending()
    result = getattr(pm.hook, stage.hook_name)(ctx="the-ctx")
    assert seen == ["the-ctx"]
    assert result == ("result" if stage in REPLACEMENT_STAGES else ["result"])
