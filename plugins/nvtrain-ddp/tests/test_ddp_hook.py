"""DDPHook in one process: configuration, discovery, the single-process no-op, and (in a
gloo world of one) wrapping, unwrapping, sampler injection, set_epoch and no_sync."""

from __future__ import annotations

import datetime
import functools
import gc
import importlib.metadata
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from nvtrain_ddp import DDPHook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import nvtrain
from nvtrain.distributed import unwrap_model

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def make_loader(**kwargs: Any) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator))
    return DataLoader(data, **({"batch_size": 4} | kwargs))


def make_strategy(hook: DDPHook, models: Any = None, **kwargs: Any) -> nvtrain.TrainingStrategy:
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    return nvtrain.TrainingStrategy(
        models if models is not None else make_model(),
        kwargs.pop("optimizers", sgd),
        torch.nn.functional.mse_loss,
        hooks=[hook, *kwargs.pop("hooks", ())],
        device="cpu",
        **kwargs,
    )


# -- configuration ---------------------------------------------------------------------------


def test_defaults_follow_the_reference_table() -> None:
    hook = DDPHook()
    assert hook.model_keys is None
    assert hook.find_unused_parameters is None and hook.broadcast_buffers is None
    assert hook.static_graph is False
    assert hook.process_group is None and hook.backend is None
    assert hook.auto_init is True
    assert hook.sampler_cls is DistributedSampler and hook.sampler_kwargs == {}
    assert DDPHook.plugin_name == "ddp"


def test_settings_are_normalised() -> None:
    hook = DDPHook(model_keys="main", sampler_cls="torch.utils.data:DistributedSampler", sampler_kwargs={"seed": 3})
    assert hook.model_keys == ("main",)
    assert hook.sampler_cls is DistributedSampler
    assert DDPHook(model_keys=["a", "b"]).model_keys == ("a", "b")
    assert DDPHook(sampler_cls="torch.utils.data.DistributedSampler").sampler_cls is DistributedSampler


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"model_keys": ()}, ValueError, "DDPHook.model_keys"),
        ({"model_keys": ("a", "")}, ValueError, "DDPHook.model_keys"),
        ({"model_keys": ("a", "a")}, ValueError, "names a model twice"),
        ({"model_keys": 3}, TypeError, "DDPHook.model_keys"),
        ({"find_unused_parameters": "yes"}, TypeError, "DDPHook.find_unused_parameters must be a bool or None"),
        ({"broadcast_buffers": 1}, TypeError, "DDPHook.broadcast_buffers must be a bool or None"),
        ({"static_graph": None}, TypeError, "DDPHook.static_graph must be a bool"),
        ({"auto_init": 1}, TypeError, "DDPHook.auto_init must be a bool"),
        ({"backend": ""}, ValueError, "DDPHook.backend"),
        ({"sampler_cls": 5}, TypeError, "DDPHook.sampler_cls"),
        ({"sampler_cls": "no.such.module.Sampler"}, ValueError, "cannot import"),
        ({"sampler_cls": "Sampler"}, ValueError, "dotted path"),
        ({"sampler_kwargs": [1]}, TypeError, "DDPHook.sampler_kwargs"),
        ({"sampler_kwargs": {"dataset": None}}, ValueError, "'dataset'"),
        (
            {"sampler_kwargs": {"shufle": True}},
            ValueError,
            "DDPHook.sampler_kwargs: DistributedSampler takes no keyword 'shufle'",
        ),
        ({"process_group": "world"}, TypeError, "DDPHook.process_group must be a torch.distributed.ProcessGroup"),
        ({"process_group": 3}, TypeError, "DDPHook.process_group must be a torch.distributed.ProcessGroup"),
    ],
)
def test_bad_settings_fail_at_construction(settings: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DDPHook(**settings)


def test_bad_process_group_and_sampler_kwargs_are_refused_by_name_when_loaded_from_a_config() -> None:
    with pytest.raises(nvtrain.validators.FieldTypeError, match=r"DDPHook\.process_group") as err:
        nvtrain.plugins.load("ddp", process_group="world")
    assert err.value.field == "process_group"
    with pytest.raises(nvtrain.validators.FieldValueError, match=r"DDPHook\.sampler_kwargs") as err2:
        nvtrain.plugins.load("ddp", sampler_kwargs={"shufle": True})
    assert err2.value.field == "sampler_kwargs"


def test_sampler_kwargs_of_a_factory_taking_any_keyword_are_not_checked() -> None:
    def factory(dataset: Any, **kwargs: Any) -> list[int]:
        return list(range(len(dataset)))

    assert DDPHook(sampler_cls=factory, sampler_kwargs={"anything": 1}).sampler_kwargs == {"anything": 1}
    with pytest.raises(ValueError, match="takes no keyword 'stride'"):
        DDPHook(sampler_cls=lambda dataset, *, rank, num_replicas: [], sampler_kwargs={"stride": 2})


def test_static_graph_with_an_accumulation_hook_is_refused_at_setup() -> None:
    from nvtrain.hooks import GradientAccumulationHook

    strategy = make_strategy(DDPHook(static_graph=True), hooks=[GradientAccumulationHook(steps=2)], num_epochs=1)
    with strategy, pytest.raises(nvtrain.validators.FieldValueError, match=r"DDPHook.static_graph=True .*accumulation"):
        strategy.run(make_loader())
    assert strategy.ctx.step_count == 0


def test_static_graph_with_a_global_batch_implying_accumulation_is_refused_before_training() -> None:
    strategy = make_strategy(DDPHook(static_graph=True), num_epochs=1, step_scheduler=_global_batch(8))
    with strategy, pytest.raises(nvtrain.validators.FieldValueError, match=r"windows of 2 micro-batches"):
        strategy.run(make_loader())
    assert strategy.ctx.step_count == 0
    # without accumulation static_graph stays allowed
    with make_strategy(DDPHook(static_graph=True), num_epochs=1, step_scheduler=_global_batch(4)) as strategy:
        assert strategy.run(make_loader()).step_count == 4


def _global_batch(size: int) -> Any:
    return nvtrain.StepSchedulerConfig(global_batch_size=size)


def test_plugin_is_discovered_through_its_entry_point() -> None:
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="nvtrain") if ep.name == "ddp"]
    module = entry.load()
    assert module.__nvtrain_hooks__[0] is DDPHook


# -- one process, no process group ------------------------------------------------------------


def test_single_process_without_environment_trains_unwrapped() -> None:
    model = make_model()
    loader = make_loader()
    with make_strategy(DDPHook(), model, num_epochs=1) as strategy:
        result = strategy.run(loader)
        assert strategy.ctx.models["main"] is model
        assert strategy.ctx.train_loader is loader
    assert result.step_count == 4 and not dist.is_initialized()


def test_world_size_above_one_without_a_group_and_auto_init_off_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    # A hook that initialised a group anyway would wait for a rank 1 that never comes (torch's default: 30
    # minutes): a short rendezvous timeout makes that a failure in seconds, and the calls show there was none.
    init, calls = dist.init_process_group, list[dict[str, Any]]()

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        init(*args, **(kwargs | {"timeout": datetime.timedelta(seconds=5)}))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with make_strategy(DDPHook(auto_init=False)) as strategy, pytest.raises(RuntimeError, match="auto_init=False"):
        strategy.run(make_loader())
    assert calls == []


# -- a gloo world of one: the hook is active ------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_wraps_before_optimizers_and_unwraps_on_close() -> None:
    model = make_model()
    strategy = make_strategy(DDPHook(), model, num_epochs=1)
    with strategy:
        strategy.run(make_loader())
        wrapped = strategy.ctx.models["main"]
        assert isinstance(wrapped, DistributedDataParallel) and wrapped.module is model
        assert unwrap_model(wrapped) is model
        optimizer_params = strategy.ctx.optimizers["main"].param_groups[0]["params"]
        assert [id(p) for p in optimizer_params] == [id(p) for p in model.parameters()]
    assert strategy.ctx.models["main"] is model
    assert dist.is_initialized(), "the hook must not destroy a process group it did not create"


@pytest.mark.usefixtures("world_of_one")
def test_close_frees_the_wrapper_while_the_callers_group_is_alive() -> None:
    # The wrapper sits in reference cycles; left to a later collection, its Reducer would outlive a group the
    # caller destroys after the run (a hang in the group's destructor, or an abort at interpreter exit)
    strategy = make_strategy(DDPHook(), num_epochs=1)
    gc.disable()  # no collection but close()'s
    try:
        with strategy:
            strategy.run(make_loader())
            wrapper = weakref.ref(strategy.ctx.models["main"])
            assert isinstance(wrapper(), DistributedDataParallel)
        assert wrapper() is None
    finally:
        gc.enable()
    assert dist.is_initialized()


@pytest.mark.usefixtures("world_of_one")
def test_settings_reach_distributed_data_parallel_with_manager_fallbacks() -> None:
    class Manager:
        rank, world_size, process_group = 0, 1, None
        find_unused_parameters, broadcast_buffers = True, True

    strategy = make_strategy(DDPHook(), distributed_manager=Manager())
    with strategy:
        strategy.train_batch(next(iter(make_loader())))
        wrapped = strategy.ctx.models["main"]
        assert wrapped.find_unused_parameters is True
        assert wrapped.broadcast_buffers is True
        assert wrapped.static_graph is False
    strategy = make_strategy(DDPHook(static_graph=True, find_unused_parameters=False), distributed_manager=Manager())
    with strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert strategy.ctx.models["main"].static_graph is True
    strategy = make_strategy(
        DDPHook(find_unused_parameters=False, broadcast_buffers=False), distributed_manager=Manager()
    )
    with strategy:
        strategy.train_batch(next(iter(make_loader())))
        wrapped = strategy.ctx.models["main"]
        assert wrapped.find_unused_parameters is False and wrapped.broadcast_buffers is False
    with make_strategy(DDPHook()) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        wrapped = strategy.ctx.models["main"]
        assert wrapped.find_unused_parameters is False and wrapped.broadcast_buffers is False


@pytest.mark.usefixtures("world_of_one")
def test_explicit_process_group_is_used() -> None:
    group = dist.new_group([0])
    with make_strategy(DDPHook(process_group=group)) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert strategy.ctx.models["main"].process_group is group


@pytest.mark.usefixtures("world_of_one")
def test_model_keys_choose_what_is_wrapped() -> None:
    models = {"main": make_model(), "teacher": make_model()}
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    # default: the models that have optimizers
    with make_strategy(DDPHook(), models, optimizers={"main": sgd}) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert isinstance(strategy.ctx.models["main"], DistributedDataParallel)
        assert strategy.ctx.models["teacher"] is models["teacher"]
    with make_strategy(DDPHook(model_keys=("main", "teacher")), models, optimizers={"main": sgd}) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        assert isinstance(strategy.ctx.models["main"], DistributedDataParallel)
        assert isinstance(strategy.ctx.models["teacher"], DistributedDataParallel)


@pytest.mark.parametrize("hook_class", ["ddp", "fsdp"])
@pytest.mark.parametrize("world", ["world_of_one", "one_process"])
def test_model_keys_leaving_out_a_trained_model_are_refused(
    hook_class: str, world: str, request: pytest.FixtureRequest
) -> None:
    """Each rank would train its own copy of the model left out: refused, also where nothing is wrapped."""
    if hook_class == "fsdp":
        pytest.importorskip("nvtrain_fsdp")  # the same refusal in the other data-parallel plugin, when installed
    if world == "world_of_one":
        request.getfixturevalue("world_of_one")
    models = {"main": make_model(), "teacher": make_model()}
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    hook = nvtrain.plugins.load(hook_class, model_keys="teacher")
    message = rf"{type(hook).__name__}\.model_keys=\('teacher',\) leaves out \['main'\], which an optimizer trains"
    with make_strategy(hook, models, optimizers={"main": sgd}) as strategy, pytest.raises(ValueError, match=message):
        strategy.train_batch(next(iter(make_loader())))
    teacher_left_out = nvtrain.plugins.load(hook_class, model_keys="main")  # no optimizer trains the teacher
    with make_strategy(teacher_left_out, dict(models), optimizers={"main": sgd}) as ok:
        ok.train_batch(next(iter(make_loader())))


@pytest.mark.usefixtures("world_of_one")
def test_unknown_model_key_and_frozen_model_are_named() -> None:
    with make_strategy(DDPHook(model_keys="student")) as strategy, pytest.raises(ValueError, match="'student'"):
        strategy.train_batch(next(iter(make_loader())))
    frozen = {"main": make_model(), "frozen": make_model().requires_grad_(False)}
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    strategy = make_strategy(DDPHook(model_keys=("main", "frozen")), frozen, optimizers={"main": sgd})
    with strategy, pytest.raises(ValueError, match="'frozen' has no trainable parameters"):
        strategy.train_batch(next(iter(make_loader())))
    # model_keys left out: the frozen model has an optimizer, which the message says
    both = {"main": sgd, "frozen": sgd}
    frozen = {"main": make_model(), "frozen": make_model().requires_grad_(False)}
    with make_strategy(DDPHook(), frozen, optimizers=both) as strategy, pytest.raises(ValueError) as err:
        strategy.train_batch(next(iter(make_loader())))
    assert "'frozen' has an optimizer but no trainable parameters" in str(err.value)
    assert "leave it out of model_keys" not in str(err.value)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("seed", [5, 7])
def test_the_injected_sampler_shuffles_with_the_loaders_generator_seed(seed: int) -> None:
    loader = make_loader(shuffle=True, generator=torch.Generator().manual_seed(seed))
    with make_strategy(DDPHook(), num_epochs=1) as strategy:
        strategy.run(loader)
        assert strategy.ctx.train_loader.sampler.seed == seed
    unseeded = make_loader(shuffle=True)
    with make_strategy(DDPHook(), num_epochs=1) as strategy:
        strategy.run(unseeded)
        assert strategy.ctx.train_loader.sampler.seed == 0  # no generator: 0 on every rank


@pytest.mark.usefixtures("world_of_one")
def test_a_sampler_refusing_its_keywords_at_setup_names_sampler_kwargs() -> None:
    strategy = make_strategy(DDPHook(sampler_kwargs={"num_replicas": "two"}), num_epochs=1)
    with (
        strategy,
        pytest.raises((TypeError, ValueError), match=r"^DDPHook\.sampler_kwargs: DistributedSampler\(dataset"),
    ):
        strategy.run(make_loader())


@pytest.mark.usefixtures("world_of_one")
def test_fsdp_models_are_refused_with_a_message() -> None:
    model = make_model()
    model._fsdp_wrapped_module = torch.nn.Identity()  # what FSDP-wrapped modules carry
    with make_strategy(DDPHook(), model) as strategy, pytest.raises(ValueError, match="FSDP"):
        strategy.train_batch(next(iter(make_loader())))


@pytest.mark.usefixtures("world_of_one")
def test_setup_runs_after_other_setup_hooks() -> None:
    class Freezer:
        """A fine-tuning style patch at SETUP: DDP must see the final requires_grad."""

        priority = 90

        @nvtrain.hookimpl
        def setup(self, ctx: nvtrain.TrainingContext) -> None:
            self.saw = type(ctx.models["main"])
            ctx.models["main"][0].requires_grad_(False)

    freezer = Freezer()
    with make_strategy(DDPHook(), hooks=[freezer]) as strategy:
        strategy.train_batch(next(iter(make_loader())))
        strategy.train_batch(next(iter(make_loader())))  # DDP wrapped after the freeze: no reducer error
        assert freezer.saw is torch.nn.Sequential
        assert isinstance(strategy.ctx.models["main"], DistributedDataParallel)


# -- the sampler ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("world_of_one")
def test_sampler_is_injected_with_the_loader_arguments_kept() -> None:
    def collate(samples: list[Any]) -> Any:
        return torch.utils.data.default_collate(samples)

    def init_worker(worker_id: int) -> None:
        return None

    generator = torch.Generator()
    loader = make_loader(
        batch_size=3,
        shuffle=True,
        drop_last=True,
        collate_fn=collate,
        pin_memory=False,
        timeout=0,
        worker_init_fn=init_worker,
        generator=generator,
    )
    with make_strategy(DDPHook(), num_epochs=1) as strategy:
        strategy.run(loader)
        injected = strategy.ctx.train_loader
    assert injected is not loader and type(injected) is DataLoader
    assert isinstance(injected.sampler, DistributedSampler)
    assert injected.sampler.shuffle is True and injected.sampler.drop_last is True
    assert injected.sampler.seed == generator.initial_seed()  # the loader's seed
    assert injected.sampler.num_replicas == 1 and injected.sampler.rank == 0
    assert injected.dataset is loader.dataset and injected.batch_size == 3 and injected.drop_last is True
    assert injected.collate_fn is collate and injected.worker_init_fn is init_worker
    assert injected.generator is generator


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_stateful_dataloader_is_rebuilt_as_one_with_a_distributed_sampler(shuffle: bool) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(make_loader().dataset, batch_size=4, shuffle=shuffle, snapshot_every_n_steps=3)
    with make_strategy(DDPHook()) as strategy:
        strategy.setup(loader)
        injected = strategy.ctx.train_loader
    assert type(injected) is stateful.StatefulDataLoader and injected is not loader
    assert isinstance(injected.sampler, DistributedSampler)
    assert injected.sampler.shuffle is shuffle  # torchdata's own RandomSampler means shuffle=True
    assert injected.snapshot_every_n_steps == 3 and injected.batch_size == 4


@pytest.mark.usefixtures("world_of_one")
def test_sequential_loader_gets_an_unshuffled_sampler_and_user_kwargs_win() -> None:
    hook = DDPHook(sampler_kwargs={"seed": 7, "drop_last": True})
    with make_strategy(hook) as strategy:
        strategy.setup(make_loader())
        sampler = strategy.ctx.train_loader.sampler
    assert isinstance(sampler, DistributedSampler)
    assert sampler.shuffle is False and sampler.seed == 7 and sampler.drop_last is True


@pytest.mark.usefixtures("world_of_one")
def test_custom_sampler_gets_only_the_keywords_it_accepts() -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []

    def by_rank(dataset: Any, *, rank: int, num_replicas: int, stride: int = 1) -> list[int]:
        calls.append((dataset, {"rank": rank, "num_replicas": num_replicas, "stride": stride}))
        return list(range(rank, len(dataset), num_replicas * stride))

    loader = make_loader()
    with make_strategy(DDPHook(sampler_cls=by_rank, sampler_kwargs={"stride": 2})) as strategy:
        strategy.setup(loader)
        assert strategy.ctx.train_loader.sampler == [0, 2, 4, 6, 8, 10, 12, 14]
    assert calls == [(loader.dataset, {"rank": 0, "num_replicas": 1, "stride": 2})]


@pytest.mark.usefixtures("world_of_one")
def test_a_sampler_factory_of_ones_own_replaces_a_custom_sampler() -> None:
    """Given explicitly, ``sampler_cls`` is the user's way to shard such a loader: it is used, without a warning."""

    def by_rank(dataset: Any, *, rank: int, num_replicas: int) -> list[int]:
        return list(range(rank, 6, num_replicas))  # e.g. a rank-aware version of the subset

    loader = DataLoader(make_loader().dataset, batch_size=4, sampler=SubsetRandomSampler(range(6)))
    with make_strategy(DDPHook(sampler_cls=by_rank)) as strategy:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.setup(loader)
        assert strategy.ctx.train_loader.sampler == [0, 1, 2, 3, 4, 5]


@pytest.mark.usefixtures("world_of_one")
def test_a_loader_that_already_shards_is_left_alone() -> None:
    data = make_loader().dataset
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    with make_strategy(DDPHook()) as strategy:
        strategy.setup(loader)
        assert strategy.ctx.train_loader is loader


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter([(torch.zeros(4), torch.zeros(2))] * 4)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: [(torch.zeros(2, 4), torch.zeros(2, 2))], "not a torch DataLoader"),
        (lambda: DataLoader(_Stream(), batch_size=2), "IterableDataset"),
        (
            lambda: DataLoader(
                make_loader().dataset, batch_sampler=BatchSampler(SequentialSampler(range(16)), 4, False)
            ),
            "custom batch_sampler",
        ),
        (  # a DistributedSampler over the whole dataset would drop the subset it selects
            lambda: DataLoader(make_loader().dataset, batch_size=4, sampler=SubsetRandomSampler(range(6))),
            r"custom sampler \(SubsetRandomSampler\)",
        ),
        (
            lambda: DataLoader(
                make_loader().dataset, batch_size=4, sampler=WeightedRandomSampler([1.0] * 16, num_samples=16)
            ),
            r"custom sampler \(WeightedRandomSampler\)",
        ),
        (  # draws with replacement: a DistributedSampler would make it a permutation
            lambda: DataLoader(
                make_loader().dataset, batch_size=4, sampler=RandomSampler(range(16), replacement=True, num_samples=8)
            ),
            r"custom sampler \(RandomSampler\)",
        ),
    ],
)
def test_unsupported_loaders_are_kept_with_one_warning(make: Any, reason: str) -> None:
    loader = make()
    hook = DDPHook()
    with make_strategy(hook) as strategy:
        with pytest.warns(UserWarning, match=reason):
            strategy.setup(loader)
        assert strategy.ctx.train_loader is loader
        strategy.ctx.train_loader = make()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hook.before_training(strategy.ctx)  # a second loader: no second warning


@pytest.mark.usefixtures("world_of_one")
def test_a_loader_given_after_setup_warns_and_shard_fixes_it() -> None:
    hook = DDPHook()
    with make_strategy(hook, num_epochs=1) as strategy:
        strategy.train_batch(next(iter(make_loader())))  # set up without a loader
        with pytest.warns(UserWarning, match=r"ddp_hook.shard\(loader\)"):
            strategy.run(make_loader())
        sharded = hook.shard(make_loader(shuffle=True))
        assert isinstance(sharded.sampler, DistributedSampler) and sharded.sampler.shuffle is True
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", r"TrainingStrategy\.run\(\): nothing to train")  # the epoch is done
            strategy.run(sharded)
            strategy.run(strategy.ctx.train_loader)
        assert strategy.ctx.train_loader is sharded


def test_shard_is_the_identity_in_a_single_process() -> None:
    loader = make_loader()
    assert DDPHook().shard(loader) is loader


@pytest.mark.usefixtures("world_of_one")
def test_set_epoch_is_called_every_epoch() -> None:
    epochs: list[int] = []

    class Recording(DistributedSampler):  # type: ignore[type-arg]
        def set_epoch(self, epoch: int) -> None:
            epochs.append(epoch)
            super().set_epoch(epoch)

    with make_strategy(DDPHook(sampler_cls=Recording), num_epochs=3) as strategy:
        strategy.run(make_loader(shuffle=True))
    assert sorted(set(epochs)) == [0, 1, 2]
    assert epochs == sorted(epochs)


# -- no_sync --------------------------------------------------------------------------------------------


class _Window:
    """Marks every other micro-batch as not ending a window; records DDP's sync flag around it."""

    def __init__(self) -> None:
        self.count = 0
        self.flags: list[tuple[str, bool]] = []

    @nvtrain.hookimpl(tryfirst=True)
    def before_forward(self, ctx: nvtrain.TrainingContext) -> None:
        ctx.sync_gradients = self.count % 2 == 1
        self.count += 1

    @nvtrain.hookimpl
    def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
        self.flags.append(("forward", ctx.models["main"].require_backward_grad_sync))

    @nvtrain.hookimpl
    def after_batch(self, ctx: nvtrain.TrainingContext) -> None:
        self.flags.append(("after", ctx.models["main"].require_backward_grad_sync))


@pytest.mark.usefixtures("world_of_one")
def test_forward_and_backward_run_under_no_sync_when_the_window_continues() -> None:
    window = _Window()
    with make_strategy(DDPHook(), hooks=[window]) as strategy:
        for batch in list(make_loader())[:4]:
            strategy.train_batch(batch)
    continuing, ending = [("forward", False), ("after", True)], [("forward", True), ("after", True)]
    assert window.flags == (continuing + ending) * 2


class _Boom:
    """Raises at AFTER_FORWARD of the first micro-batch only."""

    armed = True

    @nvtrain.hookimpl
    def after_forward(self, ctx: nvtrain.TrainingContext) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("boom")


@pytest.mark.usefixtures("world_of_one")
def test_a_micro_batch_that_raised_does_not_leave_no_sync_on() -> None:
    window = _Window()
    with make_strategy(DDPHook(), hooks=[window, _Boom()]) as strategy:
        batches = list(make_loader())
        with pytest.raises(RuntimeError, match="boom"):
            strategy.train_batch(batches[0])  # not the end of a window: entered no_sync, then failed
        assert strategy.ctx.models["main"].require_backward_grad_sync is False
        strategy.train_batch(batches[1])  # ends a window: must synchronise
        assert window.flags == [("forward", False), ("forward", True), ("after", True)]


@pytest.mark.usefixtures("world_of_one")
def test_close_leaves_no_sync() -> None:
    model = make_model()
    window = _Window()
    with make_strategy(DDPHook(), model, hooks=[window, _Boom()]) as strategy:
        with pytest.raises(RuntimeError, match="boom"):
            strategy.train_batch(next(iter(make_loader())))
        wrapped = strategy.ctx.models["main"]
        assert wrapped.require_backward_grad_sync is False
    assert wrapped.require_backward_grad_sync is True
    assert strategy.ctx.models["main"] is model
