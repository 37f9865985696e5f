"""HookRegistry: one owner of who is registered, in what order, and what to close."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

import nvtrain
from nvtrain import TrainingStage, TrainingStrategy
from nvtrain.hooks import GradientClippingHook
from nvtrain.hooks.accumulation import GradientAccumulationHook
from nvtrain.registry import HookRegistry

ROOT = Path(__file__).resolve().parents[1]


class Observer:
    plugin_name = "observer"

    def __init__(self, log: list[str], name: str = "observer") -> None:
        self.log, self.plugin_name = log, name

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.log.append(self.plugin_name)

    def close(self) -> None:
        self.log.append(f"close {self.plugin_name}")


class ClassicHook(nvtrain.Hook):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __call__(self, ctx: nvtrain.TrainingContext, stage: TrainingStage) -> None:
        self.log.append(f"classic {stage.name}")


def _strategy(hooks: list[object]) -> TrainingStrategy:
    model = torch.nn.Linear(2, 1)
    return TrainingStrategy(
        models=model,
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=hooks,
        device="cpu",
    )


def test_hooks_lists_update_hooks_then_the_others_each_in_registration_order() -> None:
    log: list[str] = []
    first, second = Observer(log, "first"), Observer(log, "second")
    clip = GradientClippingHook(max_norm=1.0, priority=30)
    accumulate = GradientAccumulationHook(steps=2)  # priority 10: the orchestrator calls it before clipping
    registry = HookRegistry([first, clip, second])
    registry.register(accumulate)
    assert registry.hooks() == [clip, accumulate, first, second]
    assert registry.update_hooks() == (clip, accumulate)
    assert registry.orchestrator.hooks_for(TrainingStage.DO_OPTIMIZER_STEP) == (accumulate, clip)


class _Scale(nvtrain.TrainingUpdateHook):
    """A DO_BACKWARD transform; the three used below do not commute, so their order shows in the loss."""

    stages = frozenset({TrainingStage.DO_BACKWARD})

    def __init__(self, name: str, transform: Any, order: list[str]) -> None:
        self.name, self.transform, self.order = name, transform, order

    def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
        self.order.append(self.name)
        return True, self.transform(ctx.loss)


@pytest.mark.parametrize("composed_first", [False, True])
def test_priority_ties_follow_the_list_order_also_around_a_composed_orchestrator(composed_first: bool) -> None:
    order: list[str] = []
    a = _Scale("a", lambda loss: loss * 2, order)
    b = _Scale("b", lambda loss: loss + 1, order)
    c = _Scale("c", lambda loss: loss * 3, order)
    hooks: list[object] = [b + c, a] if composed_first else [a, b + c]
    strategy = _strategy(hooks)
    strategy.train_batch((torch.ones(4, 2), torch.zeros(4, 1)))
    expected = ["b", "c", "a"] if composed_first else ["a", "b", "c"]
    assert order == expected
    assert [hook.name for hook in strategy.orchestrator.hooks_for(TrainingStage.DO_BACKWARD)] == expected
    loss = strategy.ctx.loss
    want = {"a": lambda x: x * 2, "b": lambda x: x + 1, "c": lambda x: x * 3}
    for name in expected:
        loss = want[name](loss)
    assert torch.equal(strategy.ctx.backward_loss, loss)


def test_an_update_hook_registered_after_bind_is_bound_to_the_optimizers() -> None:
    strategy = _strategy([])
    strategy.setup()
    assert strategy.is_set_up
    clip = GradientClippingHook(max_norm=1.0)
    strategy.register_hook(clip)
    assert strategy.orchestrator.hooks == (clip,)
    # a bound orchestrator steps the strategy's optimizer: one batch changes the weights
    before = [p.detach().clone() for p in strategy.ctx.models["main"].parameters()]
    strategy.train_batch((torch.ones(4, 2), torch.zeros(4, 1)))
    after = list(strategy.ctx.models["main"].parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert "grad_norm" in strategy.ctx.metrics


def test_registering_the_same_update_hook_twice_is_refused_and_changes_nothing() -> None:
    clip = GradientClippingHook(max_norm=1.0)
    registry = HookRegistry([clip])
    orchestrator = registry.orchestrator
    with pytest.raises(ValueError, match=r"update hook .* is already registered"):
        registry.register(clip)
    assert registry.orchestrator is orchestrator


def test_stage_selection_is_refused_for_update_hooks_and_pluggy_plugins() -> None:
    registry = HookRegistry()
    with pytest.raises(ValueError, match=r"stage=\.\.\. is not supported for update hooks"):
        registry.register(GradientClippingHook(max_norm=1.0), TrainingStage.AFTER_BATCH)
    with pytest.raises(ValueError, match=r"stage=\.\.\. applies to nvtrain\.Hook instances"):
        registry.register(Observer([]), TrainingStage.AFTER_BATCH)


def test_a_classic_hook_limited_to_one_stage_sees_only_that_stage() -> None:
    log: list[str] = []
    strategy = _strategy([])
    strategy.register_hook(ClassicHook(log), TrainingStage.AFTER_LOSS)
    strategy.train_batch((torch.ones(4, 2), torch.zeros(4, 1)))
    assert log == ["classic AFTER_LOSS"]


def test_close_runs_in_reverse_registration_order_and_keeps_every_failure() -> None:
    log: list[str] = []

    class Failing(Observer):
        def close(self) -> None:
            log.append(f"close {self.plugin_name}")
            raise RuntimeError(f"{self.plugin_name} failed")

    registry = HookRegistry([Failing(log, "a"), Observer(log, "b"), Failing(log, "c")])
    with pytest.raises(RuntimeError, match="c failed") as caught:
        registry.close()
    assert log == ["close c", "close b", "close a"]
    assert any("a failed" in note for note in caught.value.__notes__)


def test_close_with_a_pending_error_adds_notes_instead_of_raising() -> None:
    class Failing(Observer):
        def close(self) -> None:
            raise RuntimeError("close failed")

    pending = ValueError("the run failed")
    HookRegistry([Failing([])]).close(pending)
    assert pending.__notes__ == ["while closing hooks, RuntimeError: close failed"]


@pytest.mark.parametrize("pending", [None, ValueError("the run failed")], ids=["no-pending", "pending"])
@pytest.mark.parametrize("interruption", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_while_closing_one_hook_still_closes_the_others(
    interruption: type[BaseException], pending: BaseException | None
) -> None:
    """Ctrl-C while one hook's close() waits (a checkpoint write): the hooks after it in closing order still
    close, then the interrupt goes on, with the other failures as notes."""
    log: list[str] = []

    class Interrupted(Observer):
        def close(self) -> None:
            log.append(f"close {self.plugin_name}")
            raise interruption()

    class Failing(Observer):
        def close(self) -> None:
            log.append(f"close {self.plugin_name}")
            raise RuntimeError(f"{self.plugin_name} failed")

    class Closes(Observer):
        def close(self) -> None:
            log.append(f"close {self.plugin_name}")

    registry = HookRegistry([Closes(log, "a"), Failing(log, "b"), Interrupted(log, "c")])
    with pytest.raises(interruption) as caught:
        registry.close(pending)
    assert log == ["close c", "close b", "close a"]
    assert caught.value.__notes__ == ["while closing hooks, RuntimeError: b failed"]


# -- no module reaches into another module's private names ---------------------------------------------


def _package_files() -> list[Path]:
    files = sorted((ROOT / "nvtrain").rglob("*.py"))
    files += sorted(path for path in ROOT.glob("plugins/*/nvtrain_*/**/*.py"))
    return files


def _module_name(path: Path) -> str:
    """``nvtrain.bus`` for nvtrain/bus.py, ``nvtrain_ema.hook`` for plugins/nvtrain-ema/nvtrain_ema/hook.py."""
    relative = path.relative_to(ROOT)
    if relative.parts[0] == "plugins":
        relative = Path(*relative.parts[2:])
    return ".".join(relative.with_suffix("").parts).removesuffix(".__init__")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_private_uses(path: Path) -> list[str]:
    """``from nvtrain.x import _name`` and ``module._name`` for imported nvtrain modules, other than its own."""
    own = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[str] = []
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0].startswith("nvtrain"):
            for alias in node.names:
                if _private(alias.name) and node.module != own:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}")
                elif not _private(alias.name):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0].startswith("nvtrain"):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
            target = modules.get(node.value.id)
            if target is not None and target != own:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    uses = [use for path in _package_files() for use in _foreign_private_uses(path)]
    assert uses == []


def test_the_private_name_check_finds_a_foreign_private_import(tmp_path: Path) -> None:
    assert _private("_scheduler") and not _private("__init__") and not _private("create")
    sample = ROOT / "nvtrain" / "_sample_for_the_check.py"
    sample.write_text("from nvtrain.step_scheduler import _check_int\nimport nvtrain.bus as bus\nbus._no_results\n")
    try:
        uses = _foreign_private_uses(sample)
    finally:
        sample.unlink()
    assert [use.split(" ", 1)[1] for use in uses] == [
        "imports nvtrain.step_scheduler._check_int",
        "uses nvtrain.bus._no_results",
    ]


@pytest.mark.parametrize("name", ["_ensure_set_up", "_all_hooks", "_scheduler"])
def test_no_code_outside_tests_calls_the_strategys_old_private_entry_points(name: str) -> None:
    pattern = f".{name}("
    offenders = [
        str(path.relative_to(ROOT))
        for path in [*_package_files(), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").rglob("*.py")]
        if pattern in path.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_an_update_hook_with_an_unmarked_stage_method_is_refused() -> None:
    class ForgotTheMark(nvtrain.TrainingUpdateHook):
        stages = frozenset({TrainingStage.AFTER_OPTIMIZER_STEP})

        def __call__(self, ctx: Any, stage: TrainingStage, will_skip: bool) -> tuple[bool, Any]:
            return True, None

        def before_training(self, ctx: Any) -> None:  # meant as an observer: without the mark, never called
            raise AssertionError("unreachable")

    with pytest.raises(ValueError, match=r"ForgotTheMark: method 'before_training' is named after a stage but is not"):
        _strategy([ForgotTheMark()])
    with pytest.raises(ValueError, match=r"method 'before_training' is named after a stage"):
        _strategy([]).register_hook(ForgotTheMark())
