"""MixedPrecisionHook: precision parsing, autocast scope, the fp16 GradScaler path, state, validation."""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from nvtrain_amp import MixedPrecisionHook

import nvtrain
from nvtrain import TrainingStage as S
from nvtrain.hooks import GradientAccumulationHook, SpikeSkipHook

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)
DEVICES = ["cpu", CUDA]

#: What torch warns at each synchronising CUDA call in sync debug mode "warn". The first
#: ``set_sync_debug_mode`` of a process also warns, once, that the mode is a prototype
#: ("Synchronization debug mode is a prototype feature ..."): that is no synchronisation.
SYNC_WARNING = "called a synchronizing CUDA operation"


# -- helpers ------------------------------------------------------------------------------------


def make_strategy(
    hooks: list[object], device: str = "cpu", *, scheduler: bool = False, **kwargs: Any
) -> nvtrain.TrainingStrategy:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    schedulers = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5) if scheduler else None
    return nvtrain.TrainingStrategy(
        models=model,
        optimizers=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        lr_schedulers=schedulers,
        hooks=hooks,
        device=device,
        **kwargs,
    )


def make_batches(n: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 4, generator=gen).to(device), torch.randn(8, 1, generator=gen).to(device)) for _ in range(n)
    ]


def params_of(strategy: nvtrain.TrainingStrategy) -> list[torch.Tensor]:
    """Host copies: the model moves to the strategy's device at SETUP, so snapshots compare on one device."""
    return [p.detach().to("cpu", copy=True) for p in strategy.ctx.models["main"].parameters()]


class RecordingScaler(torch.amp.GradScaler):
    """A real GradScaler that logs the calls the hook makes on it."""

    def __init__(self, log: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def scale(self, outputs: Any) -> Any:
        self.log.append("scale")
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append("unscale_")
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.log.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self.log.append("update")
        super().update(new_scale)


class RecordingAmp(MixedPrecisionHook):
    """The hook with a recording scaler; ``log`` also gets a '|' at the end of every batch."""

    def create_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return RecordingScaler(self.log, device_type, init_scale=self.init_scale, growth_interval=self.growth_interval)

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.log.append("|")


def recording_amp(**kwargs: Any) -> RecordingAmp:
    hook = RecordingAmp(**{"precision": "fp16", **kwargs})
    hook.log = []  # type: ignore[attr-defined]
    return hook


@attrs.define(eq=False)
class VetoOn(nvtrain.TrainingUpdateHook):
    """Veto the optimizer step on chosen micro-batches: a spike-skip veto under exact test control."""

    batches: frozenset[int]
    priority: int = 40
    stages = frozenset({S.DO_OPTIMIZER_STEP})
    veto_discards = True  # like a spike skip: the vetoed step's gradients are zeroed by the next micro-batch
    grads_seen: list[torch.Tensor] = attrs.field(factory=list)

    def __call__(self, ctx: Any, stage: S, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
        self.grads_seen.append(next(ctx.models["main"].parameters()).grad.detach().clone())
        return ctx.batch_count not in self.batches, None


@attrs.define(eq=False)
class InjectInf:
    """Puts an inf into one gradient after backward on the given micro-batches."""

    batches: frozenset[int]

    @nvtrain.hookimpl
    def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
        if ctx.batch_count in self.batches:
            with torch.no_grad():
                next(ctx.models["main"].parameters()).grad[0, 0] = float("inf")


@attrs.define(eq=False)
class AutocastProbe:
    """Records whether autocast is on (and its dtype) at each stage, and during backward."""

    device_type: str = "cpu"
    seen: dict[str, bool] = attrs.field(factory=dict)
    dtypes: dict[str, torch.dtype] = attrs.field(factory=dict)

    def _record(self, name: str) -> None:
        self.seen[name] = torch.is_autocast_enabled(self.device_type)
        self.dtypes[name] = torch.get_autocast_dtype(self.device_type)

    @nvtrain.hookimpl
    def before_forward(self, ctx: Any) -> None:
        self._record("before_forward")

    @nvtrain.hookimpl
    def after_forward(self, ctx: Any) -> None:
        self._record("after_forward")
        self.dtypes["outputs"] = ctx.outputs.dtype
        if ctx.outputs.requires_grad:
            ctx.outputs.register_hook(self._during_backward)

    def _during_backward(self, grad: torch.Tensor) -> None:
        self._record("backward")

    @nvtrain.hookimpl
    def before_backward(self, ctx: Any) -> None:
        self._record("before_backward")

    @nvtrain.hookimpl
    def after_backward(self, ctx: Any) -> None:
        self._record("after_backward")

    @nvtrain.hookimpl
    def after_batch(self, ctx: Any) -> None:
        self._record("after_batch")


@contextlib.contextmanager
def count_host_syncs(device: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Count host reads of tensors: CUDA's sync debug mode on a GPU, ``item``/``bool`` calls on CPU."""
    found: list[str] = []
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found.extend(str(w.message) for w in caught if SYNC_WARNING in str(w.message))
        return
    item, to_bool = torch.Tensor.item, torch.Tensor.__bool__

    def counting_item(self: torch.Tensor) -> Any:
        found.append("item")
        return item(self)

    def counting_bool(self: torch.Tensor) -> bool:
        found.append("bool")
        return to_bool(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
    try:
        yield found
    finally:
        monkeypatch.undo()


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("auto", "auto"),
    ],
)
def test_accepted_precisions(given: object, expected: object) -> None:
    assert MixedPrecisionHook(precision=given).precision == expected


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, "half", "FP16", "int8", 16, None])
def test_other_precisions_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"MixedPrecisionHook\.precision must be one of .*\(got "):
        MixedPrecisionHook(precision=bad)


def test_precision_defaults_to_auto() -> None:
    """``hooks: [amp]`` (docs/cli.md's example) needs no setting: bf16 on CUDA, fp32 on the CPU."""
    hook = MixedPrecisionHook()
    assert hook.precision == "auto" and hook.dtype is None
    assert nvtrain.plugins.load("amp").precision == "auto"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("init_scale", 0.0, "> 0"),
        ("init_scale", float("inf"), "finite number > 0"),
        ("growth_factor", 1.0, "> 1.0"),
        ("backoff_factor", 1.0, r"\(0.0, 1.0\)"),
        ("backoff_factor", 0.0, r"\(0.0, 1.0\)"),
        ("growth_interval", 0, ">= 1"),
        ("growth_interval", 2.5, ">= 1"),
    ],
)
def test_bad_scaler_settings_are_refused(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=rf"MixedPrecisionHook\.{field} must be .*{expected}.*\(got {value!r}\)"):
        MixedPrecisionHook(precision="fp16", **{field: value})


def test_scaler_settings_reach_the_grad_scaler() -> None:
    hook = MixedPrecisionHook(
        precision="fp16", init_scale=256.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
    )
    strategy = make_strategy([hook])
    strategy.train_batch(make_batches(1)[0])
    scaler = hook.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert (
        scaler.get_scale(),
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (256.0, 4.0, 0.25, 7)


def test_only_one_mixed_precision_hook_per_strategy() -> None:
    with pytest.raises(ValueError, match="exclusive key 'mixed_precision': at most one mixed-precision hook per"):
        make_strategy([MixedPrecisionHook(precision="bf16"), MixedPrecisionHook(precision="fp16")])


def test_plugin_metadata() -> None:
    import nvtrain_amp

    assert nvtrain_amp.__nvtrain_hooks__ == (MixedPrecisionHook,)
    assert MixedPrecisionHook.plugin_name == "amp"
    assert MixedPrecisionHook(precision="bf16").priority == 20


def test_discovered_through_its_entry_point() -> None:
    import nvtrain.plugins

    nvtrain.plugins.refresh()
    info = {plugin.name: plugin for plugin in nvtrain.plugins.available()}["amp"]
    assert info.status is nvtrain.plugins.PluginStatus.OK, info.error
    assert info.distribution == "nvtrain-amp"
    assert [hook.name for hook in info.hooks] == ["MixedPrecisionHook"]
    hook = nvtrain.plugins.load("amp", precision="bf16")
    assert isinstance(hook, MixedPrecisionHook)
    assert hook.precision == torch.bfloat16


# -- autocast -------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", [torch.bfloat16, torch.float16])
def test_autocast_spans_before_batch_to_do_backward(precision: torch.dtype) -> None:
    probe = AutocastProbe()
    strategy = make_strategy([MixedPrecisionHook(precision=precision), probe])
    strategy.train_batch(make_batches(1)[0])
    assert probe.seen == {
        "before_forward": True,
        "after_forward": True,
        "before_backward": True,
        "backward": False,
        "after_backward": False,
        "after_batch": False,
    }
    assert probe.dtypes["before_forward"] == precision
    assert probe.dtypes["outputs"] == precision


def test_the_autocast_region_is_reentered_every_batch_and_restores_what_it_found() -> None:
    """One autocast object serves every batch: each batch runs under it, and leaving it restores the
    autocast settings in force before (dtype, enabled, and the nesting depth)."""
    before_dtype = torch.get_autocast_dtype("cpu")
    probe = AutocastProbe()
    strategy = make_strategy([MixedPrecisionHook(precision="bf16"), probe])
    for batch in make_batches(3):
        probe.seen.clear()
        strategy.train_batch(batch)
        assert probe.seen["before_forward"] and not probe.seen["backward"]
        assert probe.dtypes["outputs"] == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == before_dtype
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    assert depth == 1  # every enter was matched by an exit
    assert strategy.ctx.step_count == 3


def test_fp32_uses_no_autocast_and_no_scaler() -> None:
    probe = AutocastProbe()
    hook = MixedPrecisionHook(precision="fp32")
    strategy = make_strategy([hook, probe])
    before = params_of(strategy)
    strategy.train_batch(make_batches(1)[0])
    assert not any(probe.seen.values())
    assert probe.dtypes["outputs"] == torch.float32
    assert hook.scaler is None
    assert strategy.ctx.step_count == 1
    assert not torch.equal(before[0], params_of(strategy)[0])


def test_auto_precision_resolves_to_fp32_on_cpu() -> None:
    probe = AutocastProbe()
    hook = MixedPrecisionHook(precision="auto")
    assert hook.dtype is None
    strategy = make_strategy([hook, probe])
    strategy.train_batch(make_batches(1)[0])
    assert hook.dtype == torch.float32
    assert hook.scaler is None
    assert probe.dtypes["outputs"] == torch.float32


def forward_failing_once() -> Callable[[nvtrain.TrainingContext], torch.Tensor]:
    """A forward_fn that raises on its first call, inside the autocast region, and works afterwards."""
    calls = {"n": 0}

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom in forward")
        return ctx.models["main"](ctx.batch[0])

    return forward


def test_autocast_is_closed_when_the_forward_raises() -> None:
    strategy = make_strategy([MixedPrecisionHook(precision="bf16")], forward_fn=forward_failing_once())
    with pytest.raises(RuntimeError, match="boom in forward"), strategy:
        strategy.train_batch(make_batches(1)[0])
    assert not torch.is_autocast_enabled("cpu")


def test_a_failed_train_batch_leaves_autocast_off_without_closing_the_strategy() -> None:
    strategy = make_strategy([MixedPrecisionHook(precision="bf16")], forward_fn=forward_failing_once())
    batch = make_batches(1)[0]
    with pytest.raises(RuntimeError, match="boom in forward"):
        strategy.train_batch(batch)
    assert not torch.is_autocast_enabled("cpu")  # nobody closed the strategy
    strategy.train_batch(batch)  # and it trains on
    assert not torch.is_autocast_enabled("cpu")
    assert strategy.ctx.step_count == 1


def test_next_batch_closes_an_autocast_left_open_outside_the_strategy() -> None:
    """A batch driven through the hook by hand and abandoned: the next batch still starts clean."""
    hook = MixedPrecisionHook(precision="bf16")
    strategy = make_strategy([hook])
    strategy.setup()
    hook(strategy.ctx, S.BEFORE_BATCH, False)
    assert torch.is_autocast_enabled("cpu")
    strategy.train_batch(make_batches(1)[0])
    assert not torch.is_autocast_enabled("cpu")


def test_a_failed_run_leaves_autocast_off_and_validation_in_full_precision() -> None:
    """Not used as a context manager, a strategy whose run() raised leaks no bf16 into the caller's code nor into
    a validate(use_mixed_precision=False)."""
    dtypes: list[torch.dtype] = []

    def record_dtype(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dtypes.append(outputs.dtype)
        return outputs.float().mean()

    config = nvtrain.ValidationConfig(data=make_batches(1), use_mixed_precision=False, metrics={"dtype": record_dtype})
    strategy = make_strategy(
        [MixedPrecisionHook(precision="bf16")], forward_fn=forward_failing_once(), validation=config, num_epochs=1
    )
    with pytest.raises(RuntimeError, match="boom in forward"):
        strategy.run(make_batches(3))
    assert not torch.is_autocast_enabled("cpu")
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    strategy.validate()
    assert dtypes == [torch.float32]


def test_validation_follows_use_mixed_precision() -> None:
    dtypes: list[torch.dtype] = []

    def record_dtype(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dtypes.append(outputs.dtype)
        return outputs.float().mean()

    data = make_batches(2)
    for use, expected in (("auto", torch.bfloat16), (True, torch.bfloat16), (False, torch.float32)):
        config = nvtrain.ValidationConfig(data=data, use_mixed_precision=use, metrics={"dtype": record_dtype})
        strategy = make_strategy([MixedPrecisionHook(precision="bf16")], validation=config)
        dtypes.clear()
        strategy.validate()
        assert dtypes == [expected, expected], use


def test_autocast_factory_before_any_training() -> None:
    hook = MixedPrecisionHook(precision="bf16")
    with hook.autocast():
        assert torch.is_autocast_enabled("cuda" if torch.cuda.is_available() else "cpu")
    assert isinstance(MixedPrecisionHook(precision="fp32").autocast(), contextlib.nullcontext)


# -- the fp16 update path -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_call_order_on_real_steps(device: str) -> None:
    hook = recording_amp()
    strategy = make_strategy([hook], device)
    for batch in make_batches(2, device):
        strategy.train_batch(batch)
    assert hook.log == ["scale", "unscale_", "step", "update", "|"] * 2
    assert strategy.ctx.step_count == 2


@pytest.mark.parametrize("device", DEVICES)
def test_accumulation_vetoes_suppress_unscale_step_and_update(device: str) -> None:
    hook = recording_amp()
    strategy = make_strategy([GradientAccumulationHook(steps=2), hook], device)
    for batch in make_batches(4, device):
        strategy.train_batch(batch)
    window = ["scale", "|", "scale", "unscale_", "step", "update", "|"]
    assert hook.log == window * 2
    assert strategy.ctx.step_count == 2


def test_fp16_scales_the_loss_and_unscales_before_later_hooks_read_gradients() -> None:
    hook = MixedPrecisionHook(precision="fp16", init_scale=1024.0)
    probe = VetoOn(batches=frozenset(), priority=30)
    scaled: list[torch.Tensor] = []

    class GradAfterBackward:
        @nvtrain.hookimpl
        def after_backward(self, ctx: nvtrain.TrainingContext) -> None:
            scaled.append(next(ctx.models["main"].parameters()).grad.detach().clone())

    strategy = make_strategy([hook, probe, GradAfterBackward()])
    strategy.train_batch(make_batches(1)[0])
    ctx = strategy.ctx
    assert torch.equal(ctx.backward_loss, ctx.loss * 1024.0)
    assert torch.equal(probe.grads_seen[0], scaled[0] / 1024.0)


@pytest.mark.parametrize("device", DEVICES)
def test_injected_inf_skips_the_step_and_lowers_the_scale(device: str) -> None:
    hook = recording_amp(init_scale=1024.0)
    strategy = make_strategy([hook, InjectInf(batches=frozenset({0}))], device, scheduler=True)
    ctx = strategy.ctx
    batches = make_batches(2, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.setup()
        before = params_of(strategy)
        strategy.train_batch(batches[0])
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert ctx.step_skipped is True
    assert (ctx.step_count, ctx.global_step_count, ctx.batch_count) == (0, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(strategy), strict=True))
    assert hook.scaler.get_scale() == 512.0
    assert ctx.lr_schedulers["main"].last_epoch == 0
    assert ctx.optimizers["main"].param_groups[0]["lr"] == 0.1
    assert hook.log == ["scale", "unscale_", "step", "update", "|"]

    strategy.train_batch(batches[1])
    assert ctx.step_skipped is False
    assert ctx.step_count == 1
    assert ctx.lr_schedulers["main"].last_epoch == 1
    assert not torch.equal(before[0], params_of(strategy)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_veto_after_unscale_keeps_the_scaler_consistent(device: str) -> None:
    hook = recording_amp(init_scale=1024.0)
    veto = VetoOn(batches=frozenset({1}))
    strategy = make_strategy([hook, veto], device)
    batches = make_batches(5, device)
    strategy.train_batch(batches[0])
    before = params_of(strategy)
    strategy.train_batch(batches[1])  # vetoed after unscale_
    assert strategy.ctx.step_skipped is True
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(strategy), strict=True))
    for batch in batches[2:]:
        strategy.train_batch(batch)
    assert strategy.ctx.step_count == 4
    real = ["scale", "unscale_", "step", "update", "|"]
    assert hook.log == real + ["scale", "unscale_", "update", "|"] + real * 3
    assert hook.scaler.get_scale() == 1024.0


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_with_spike_skipping_after_unscale_trains_on(device: str) -> None:
    """The real SpikeSkipHook (priority 40) vetoes a loss spike after the gradients were unscaled."""
    hook = recording_amp(init_scale=1024.0)
    spike = SpikeSkipHook(monitor="loss", warmup_steps=2, threshold_sigmas=3.0)
    strategy = make_strategy([hook, spike], device)
    batches = make_batches(7, device)
    inputs, targets = batches[3]
    batches[3] = (inputs, targets * 1000.0)
    steps = []
    for batch in batches:
        before = params_of(strategy)
        strategy.train_batch(batch)
        changed = not all(torch.equal(a, b) for a, b in zip(before, params_of(strategy), strict=True))
        steps.append((strategy.ctx.step_skipped, changed))
    assert spike.skipped_steps == 1
    assert steps == [(False, True)] * 3 + [(True, False)] + [(False, True)] * 3
    assert strategy.ctx.step_count == 6
    assert hook.log[15:19] == ["scale", "unscale_", "update", "|"]  # the vetoed batch: no scaler.step


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_host_syncs(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One host read per real step (GradScaler's own inf check), none on vetoed micro-batches."""
    hook = MixedPrecisionHook(precision="fp16")
    strategy = make_strategy([GradientAccumulationHook(steps=2), hook], device)
    batches = make_batches(4, device)
    strategy.train_batch(batches[0])
    strategy.train_batch(batches[1])  # warm-up: the scaler and optimizer state exist
    with count_host_syncs(device, monkeypatch) as vetoed:
        strategy.train_batch(batches[2])
    with count_host_syncs(device, monkeypatch) as stepped:
        strategy.train_batch(batches[3])
    assert strategy.ctx.step_count == 2
    assert vetoed == []
    assert len(stepped) == 1, stepped


def test_bf16_steps_without_a_scaler() -> None:
    hook = MixedPrecisionHook(precision="bf16")
    strategy = make_strategy([hook], scheduler=True)
    strategy.train_batch(make_batches(1)[0])
    assert hook.scaler is None
    assert strategy.ctx.step_count == 1
    assert strategy.ctx.lr_schedulers["main"].last_epoch == 1


def test_fused_optimizer_skip_is_reported() -> None:
    hook = MixedPrecisionHook(precision="fp16", init_scale=1024.0)
    torch.manual_seed(0)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(4, 1),
        optimizers=functools.partial(torch.optim.Adam, lr=0.1, fused=True),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[hook, InjectInf(batches=frozenset({0}))],
        device="cpu",
    )
    batches = make_batches(2)
    strategy.setup()
    assert getattr(strategy.ctx.optimizers["main"], "_step_supports_amp_scaling", False)
    before = params_of(strategy)
    strategy.train_batch(batches[0])
    assert strategy.ctx.step_skipped is True
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(strategy), strict=True))
    strategy.train_batch(batches[1])
    assert strategy.ctx.step_skipped is False
    assert strategy.ctx.step_count == 1


class NotAGradScaler:
    """GradScaler's public methods by delegation: the hook needs the inf checks a GradScaler keeps."""

    def __init__(self, device_type: str) -> None:
        self._inner = torch.amp.GradScaler(device_type)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_scaler_that_is_no_grad_scaler_is_refused_naming_create_scaler() -> None:
    class DelegatingAmp(MixedPrecisionHook):
        def create_scaler(self, device_type: str) -> Any:
            return NotAGradScaler(device_type)

    strategy = make_strategy([DelegatingAmp(precision="fp16")])
    with pytest.raises(
        TypeError,
        match=r"^DelegatingAmp\.create_scaler\(\) must return a torch\.amp\.GradScaler .*got NotAGradScaler$",
    ):
        strategy.train_batch(make_batches(1)[0])
    assert not torch.is_autocast_enabled("cpu")


def test_a_batch_that_raised_after_unscale_does_not_break_the_next() -> None:
    hook = MixedPrecisionHook(precision="fp16")

    @attrs.define(eq=False)
    class RaiseOnce(nvtrain.TrainingUpdateHook):
        priority: int = 40
        stages = frozenset({S.DO_OPTIMIZER_STEP})
        vetoes = frozenset()  # it raises, it never vetoes
        raised: bool = False

        def __call__(self, ctx: Any, stage: S, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
            if not self.raised:
                self.raised = True
                raise RuntimeError("boom after unscale")
            return True, None

    strategy = make_strategy([hook, RaiseOnce()])
    batches = make_batches(2)
    with pytest.raises(RuntimeError, match="boom after unscale"):
        strategy.train_batch(batches[0])
    strategy.train_batch(batches[1])
    assert strategy.ctx.step_count == 1


@pytest.mark.parametrize("growth_interval", [1, 2])
def test_a_run_retried_after_a_failure_between_unscale_and_step_scales_as_a_straight_run(growth_interval: int) -> None:
    """The failed attempt stepped nothing and runs again whole: it must not count as a clean step toward the
    scale's growth (the retried run grew the scale one step early, and could overflow a step sooner)."""

    @attrs.define(eq=False)
    class RaiseOnceAtBatch(nvtrain.TrainingUpdateHook):
        priority: int = 45  # after amp's unscale (40), before its step
        stages = frozenset({S.DO_OPTIMIZER_STEP})
        vetoes = frozenset()
        raised: bool = False

        def __call__(self, ctx: Any, stage: S, will_skip: bool) -> tuple[bool, torch.Tensor | None]:
            if ctx.batch_count == 2 and not self.raised:
                self.raised = True
                raise RuntimeError("transient")
            return True, None

    def run(extra: list[object]) -> tuple[MixedPrecisionHook, nvtrain.TrainingStrategy]:
        amp = MixedPrecisionHook(precision="fp16", init_scale=2.0**8, growth_interval=growth_interval)
        strategy = make_strategy([amp, *extra], num_epochs=1)
        batches = make_batches(6)
        if extra:
            with pytest.raises(RuntimeError, match="transient"):
                strategy.run(batches)
        strategy.run(batches)
        return amp, strategy

    straight, straight_run = run([])
    retried, retried_run = run([RaiseOnceAtBatch()])
    assert retried_run.ctx.step_count == straight_run.ctx.step_count == 6
    assert retried.state_dict()["scaler"] == straight.state_dict()["scaler"]
    for name, tensor in straight_run.ctx.models["main"].state_dict().items():
        assert torch.equal(retried_run.ctx.models["main"].state_dict()[name], tensor), name


# -- state ------------------------------------------------------------------------------------------


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_round_trip_keeps_the_loss_scale() -> None:
    hook = MixedPrecisionHook(precision="fp16", init_scale=1024.0)
    strategy = make_strategy([hook, InjectInf(batches=frozenset({0}))])
    strategy.train_batch(make_batches(1)[0])
    state = roundtrip(hook.state_dict())
    assert state["precision"] == "float16"
    assert state["scaler"]["scale"] == 512.0

    # loaded before the scaler exists: kept, and applied when it is created
    fresh = MixedPrecisionHook(precision=torch.float16, init_scale=1024.0)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["scaler"]["scale"] == 512.0
    resumed = make_strategy([fresh])
    resumed.train_batch(make_batches(1)[0])
    assert fresh.scaler.get_scale() == 512.0

    # loaded into an existing scaler
    hook.scaler.update(2048.0)
    hook.load_state_dict(state)
    assert hook.scaler.get_scale() == 512.0


@pytest.mark.parametrize("device", DEVICES)
def test_the_overflow_count_survives_a_checkpoint(device: str) -> None:
    """A resumed run's ``overflow_skips`` metric goes on from the saved count, as an uninterrupted run's does."""
    hook = MixedPrecisionHook(precision="fp16", init_scale=1024.0)
    strategy = make_strategy([hook, InjectInf(batches=frozenset({0, 1}))], device)
    for batch in make_batches(3, device):
        strategy.train_batch(batch)
    assert float(strategy.ctx.metrics["overflow_skips"]) == 2.0
    state = roundtrip(hook.state_dict())
    state["overflow_skips"] = state["overflow_skips"].cpu()  # as a checkpoint loads it (map_location="cpu")
    assert torch.equal(state["overflow_skips"], torch.tensor(2.0))
    hook.state_dict()["overflow_skips"].add_(5)  # a copy: saving never changes the live count
    assert float(strategy.ctx.metrics["overflow_skips"]) == 2.0

    fresh = MixedPrecisionHook(precision="fp16", init_scale=1024.0)
    fresh.load_state_dict(state)
    resumed = make_strategy([fresh, InjectInf(batches=frozenset({1}))], device)
    resumed.train_batch(make_batches(1, device)[0])  # a clean step: the count stays
    assert float(resumed.ctx.metrics["overflow_skips"]) == 2.0
    resumed.train_batch(make_batches(1, device)[0])  # an overflow: counted on top of the saved two
    assert float(resumed.ctx.metrics["overflow_skips"]) == 3.0
    # on the model's device: ctx.device is "cuda" as given, without the index every CUDA tensor carries
    assert resumed.ctx.metrics["overflow_skips"].device == next(resumed.ctx.models["main"].parameters()).device

    older = MixedPrecisionHook(precision="fp16")
    older.load_state_dict({k: v for k, v in state.items() if k != "overflow_skips"})  # saved before it was kept
    assert "overflow_skips" not in older.state_dict()


@pytest.mark.parametrize(
    ("value", "shown"), [([1], "got list"), (torch.zeros(2), r"got Tensor of shape \(2,\)"), (3, "got int")]
)
def test_a_bad_overflow_count_is_refused_before_anything_is_applied(value: Any, shown: str) -> None:
    hook = MixedPrecisionHook(precision="fp16")
    with pytest.raises(ValueError, match=rf"'overflow_skips' must be a one-element tensor .*{shown}"):
        hook.load_state_dict({"precision": "bfloat16", "scaler": {"scale": 8.0}, "overflow_skips": value})
    make_strategy([hook]).train_batch(make_batches(1)[0])  # the refused state left no trace: no mismatch raised
    assert hook.scaler.get_scale() == 65536.0


def test_state_from_another_precision_is_refused() -> None:
    fp16 = MixedPrecisionHook(precision="fp16")
    make_strategy([fp16]).train_batch(make_batches(1)[0])
    with pytest.raises(ValueError, match="saved with precision 'float16' but this hook uses 'bfloat16'"):
        MixedPrecisionHook(precision="bf16").load_state_dict(fp16.state_dict())

    auto = MixedPrecisionHook(precision="auto")
    auto.load_state_dict(fp16.state_dict())
    with pytest.raises(ValueError, match="saved with precision 'float16' but this hook uses 'float32'"):
        make_strategy([auto]).train_batch(make_batches(1)[0])


def test_bf16_state_round_trip() -> None:
    hook = MixedPrecisionHook(precision="bf16")
    state = roundtrip(hook.state_dict())
    assert state == {"precision": "bfloat16", "scaler": None}
    other = MixedPrecisionHook(precision="bfloat16")
    other.load_state_dict(state)
    assert isinstance(hook, nvtrain.CheckpointableHook)


def test_fp16_loss_scale_and_overflow_skips_reach_the_metrics_file(tmp_path: Any) -> None:
    """The CSV logger reads ``loss_scale`` and ``overflow_skips`` on logging steps (tensors until then)."""
    import csv

    from nvtrain.logging_hooks import CSVLoggerHook

    hook = MixedPrecisionHook(precision="fp16", init_scale=1024.0)
    logger = CSVLoggerHook(tmp_path / "metrics.csv", log_every_n_steps=2)
    strategy = make_strategy([hook, InjectInf(batches=frozenset({1})), logger], "cpu", scheduler=True)
    with strategy:
        strategy.run(make_batches(5, "cpu"))
    with (tmp_path / "metrics.csv").open(newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["train_loss"]]
    assert isinstance(strategy.ctx.metrics["loss_scale"], torch.Tensor)
    assert [(row["step"], row["overflow_skips"], row["loss_scale"]) for row in rows] == [
        ("2", "1", "512"),
        ("4", "1", "512"),
    ]


# -- "auto" and the composition checks ---------------------------------------------------------------


def test_auto_is_checked_as_fp16_before_the_device_is_known() -> None:
    """"auto" resolves to fp16 on a CUDA device without bf16: an order fp16 refuses is refused for it everywhere."""
    clip_first = nvtrain.hooks.GradientClippingHook(max_norm=1.0, priority=15)
    with pytest.raises(ValueError, match=r"GradientClippingHook .*priority 15.*MixedPrecisionHook"):
        make_strategy([clip_first, MixedPrecisionHook(precision="auto")])
    make_strategy([clip_first, MixedPrecisionHook(precision="bf16")])  # bf16 never rescales: the order is fine


@pytest.mark.parametrize(("resolved", "rescales"), [(torch.float32, False), (torch.float16, True)])
def test_once_resolved_the_flags_say_what_the_resolved_precision_does(
    resolved: torch.dtype, rescales: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nvtrain_amp.hook as amp_module

    monkeypatch.setattr(amp_module, "resolve_auto", lambda device: resolved)
    hook = MixedPrecisionHook(precision="auto")
    assert hook.uses_gradients and hook.rescales_gradients  # unresolved: checked as fp16
    strategy = make_strategy([hook])
    strategy.train_batch(make_batches(1)[0])
    assert hook.dtype == resolved
    assert (hook.uses_gradients, hook.rescales_gradients) == (rescales, rescales)
    plan = {h: uses for h, uses, _ in strategy.orchestrator._step_plan}
    assert plan[hook] is rescales  # the orchestrator read the flags again once the optimizers were bound


# -- several optimizers --------------------------------------------------------------------------------


def test_an_overflow_in_one_optimizers_gradients_skips_every_optimizer() -> None:
    """One decision per batch: GradScaler alone would step the clean optimizer and skip the other."""
    torch.manual_seed(0)
    models = {"a": torch.nn.Linear(4, 1), "b": torch.nn.Linear(4, 1)}
    poison = {"on": False}
    models["b"].weight.register_hook(lambda grad: grad * float("inf") if poison["on"] else grad)
    strategy = nvtrain.TrainingStrategy(
        models=models,
        optimizers={"a": functools.partial(torch.optim.SGD, lr=0.1), "b": functools.partial(torch.optim.SGD, lr=0.1)},
        loss_fn=torch.nn.functional.mse_loss,
        forward_fn=lambda ctx: ctx.models["a"](ctx.batch[0]) + ctx.models["b"](ctx.batch[0]),
        hooks=[MixedPrecisionHook(precision="fp16", init_scale=2.0**8)],  # no overflow on clean batches
        device="cpu",
    )
    first, second, third = make_batches(3)
    strategy.train_batch(first)
    assert strategy.ctx.step_count == 1
    before = {name: model.weight.detach().clone() for name, model in models.items()}
    poison["on"] = True
    strategy.train_batch(second)
    assert strategy.ctx.step_skipped is True
    assert strategy.ctx.step_count == 1  # unchanged
    for name, model in models.items():
        assert torch.equal(model.weight, before[name]), name
    poison["on"] = False
    strategy.train_batch(third)  # the scaler backed off and both step again
    assert strategy.ctx.step_skipped is False and strategy.ctx.step_count == 2
    assert all(not torch.equal(model.weight, before[name]) for name, model in models.items())


class CountSteps:
    """Counts ``optimizer.step()`` calls (an optimizer step post-hook)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls = 0
        optimizer.register_step_post_hook(self._mark)

    def _mark(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.calls += 1


def two_models_one_unused(precision: str, order: tuple[str, str], poison: dict[str, bool]) -> nvtrain.TrainingStrategy:
    """Optimizers in ``order``; model "aux" joins the forward on odd batches only, so on even ones its optimizer
    has no gradients. ``poison["on"]`` puts an inf into main's gradients."""
    torch.manual_seed(0)
    models = {"main": torch.nn.Linear(4, 1), "aux": torch.nn.Linear(4, 1)}
    models["main"].weight.register_hook(lambda grad: grad * float("inf") if poison["on"] else grad)

    def forward(ctx: nvtrain.TrainingContext) -> torch.Tensor:
        out = ctx.models["main"](ctx.batch[0])
        return out + ctx.models["aux"](ctx.batch[0]) if ctx.batch_count % 2 == 1 else out

    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1)  # would move grad-less weights
    step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    return nvtrain.TrainingStrategy(
        models={name: models[name] for name in order},
        optimizers={name: sgd for name in order},
        lr_schedulers={name: step_lr for name in order},
        loss_fn=torch.nn.functional.mse_loss,
        forward_fn=forward,
        hooks=[MixedPrecisionHook(precision=precision, init_scale=2.0**8)],
        device="cpu",
    )


def weights(strategy: nvtrain.TrainingStrategy) -> dict[str, list[torch.Tensor]]:
    return {name: [p.detach().clone() for p in m.parameters()] for name, m in strategy.ctx.models.items()}


@pytest.mark.parametrize("order", [("main", "aux"), ("aux", "main")])
def test_an_optimizer_without_gradients_steps_as_in_fp32(order: tuple[str, str]) -> None:
    """fp16 where one of two optimizers has no gradients on a batch: no GradScaler assertion, and that optimizer
    gets what fp32 gives it: ``optimizer.step()`` (a no-op for parameters without gradients, even with momentum and
    weight decay), its LR scheduler steps, and the batch counts as a step."""
    seen = {}
    for precision in ("fp32", "fp16"):
        strategy = two_models_one_unused(precision, order, {"on": False})
        strategy.setup()
        counters = {name: CountSteps(optimizer) for name, optimizer in strategy.ctx.optimizers.items()}
        before = weights(strategy)
        strategy.train_batch(make_batches(1)[0])  # batch 0: aux unused
        after = weights(strategy)
        seen[precision] = (
            strategy.ctx.step_skipped,
            strategy.ctx.step_count,
            {name: c.calls for name, c in counters.items()},
            {name: s.last_epoch for name, s in strategy.ctx.lr_schedulers.items()},
            all(torch.equal(a, b) for a, b in zip(before["aux"], after["aux"], strict=True)),
        )
        strategy.train_batch(make_batches(2)[1])  # batch 1: both have gradients
        assert strategy.ctx.step_count == 2, precision
    assert seen["fp16"] == seen["fp32"] == (False, 1, {"main": 1, "aux": 1}, {"main": 1, "aux": 1}, True)


@pytest.mark.parametrize("order", [("main", "aux"), ("aux", "main")])
def test_an_overflow_skips_the_optimizer_without_gradients_too(order: tuple[str, str]) -> None:
    """One decision per batch: an inf in main's gradients skips aux's step although aux had none to check."""
    poison = {"on": True}
    strategy = two_models_one_unused("fp16", order, poison)
    strategy.setup()
    counters = {name: CountSteps(optimizer) for name, optimizer in strategy.ctx.optimizers.items()}
    strategy.train_batch(make_batches(1)[0])  # batch 0: aux unused, main overflows
    assert strategy.ctx.step_skipped is True and strategy.ctx.step_count == 0
    assert {name: c.calls for name, c in counters.items()} == {"main": 0, "aux": 0}
    assert {name: s.last_epoch for name, s in strategy.ctx.lr_schedulers.items()} == {"main": 0, "aux": 0}
    assert float(strategy.ctx.metrics["overflow_skips"]) == 1.0
    poison["on"] = False
    strategy.train_batch(make_batches(2)[1])
    assert strategy.ctx.step_skipped is False and strategy.ctx.step_count == 1


@pytest.mark.parametrize(("order", "expected"), [(("main", "aux"), 1), (("aux", "main"), 2)])
def test_an_optimizer_without_gradients_costs_a_host_read_only_before_the_outcome_is_known(
    order: tuple[str, str], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepped after an optimizer with gradients, it reuses that step's outcome; before one, it reads the inf
    check once more (only on such batches)."""
    strategy = two_models_one_unused("fp16", order, {"on": False})
    batches = make_batches(3)
    strategy.train_batch(batches[1])
    strategy.train_batch(batches[1])  # warm-up on batches with gradients everywhere (odd batch counts)
    with count_host_syncs("cpu", monkeypatch) as found:
        strategy.train_batch(batches[2])  # batch 2: aux unused
    assert strategy.ctx.step_count == 3
    assert len(found) == expected, found
