"""StepScheduler on its own: windows, cadences, the last step, resume, configuration."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from nvtrain import StepScheduler, StepSchedulerConfig


class Unsized:
    """A finite re-iterable without ``len()`` (like an IterableDataset stream)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self.items))


def make(data: Any, global_batch_size: int = 1, **kwargs: Any) -> StepScheduler:
    kwargs.setdefault("preemption_signal", None)
    return StepScheduler(global_batch_size, 1, 1, data, **kwargs)


def drive(scheduler: StepScheduler, stepped: Any = None) -> list[dict[str, Any]]:
    """Run the documented loop; record every boundary's answers."""
    rows = []
    for epoch in scheduler.epochs:
        for window in scheduler:
            last_batch = scheduler.is_last_batch
            ok = True if stepped is None else stepped(len(rows))
            scheduler.finish_step(stepped=ok)
            rows.append(
                {
                    "epoch": epoch,
                    "window": list(window),
                    "step": scheduler.step,
                    "ckpt": scheduler.is_ckpt_step,
                    "val": scheduler.is_val_step,
                    "log": scheduler.is_remote_logging_step,
                    "gc": scheduler.is_gc_step,
                    "last_batch": last_batch,
                    "last": scheduler.is_last_step,
                }
            )
    return rows


# -- windows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", [list(range(10)), Unsized(list(range(10)))], ids=["sized", "unsized"])
def test_windows_with_a_trailing_partial_window(loader: Any) -> None:
    scheduler = make(loader, global_batch_size=3)
    rows = drive(scheduler)
    assert [r["window"] for r in rows] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["last_batch"] for r in rows] == [False, False, False, True]
    assert [r["last"] for r in rows] == [False, False, False, True]
    assert scheduler.epoch == 1


@pytest.mark.parametrize("loader", [list(range(8)), Unsized(list(range(8)))], ids=["sized", "unsized"])
def test_exact_windows_have_no_empty_tail(loader: Any) -> None:
    rows = drive(make(loader, global_batch_size=4, num_epochs=2))
    assert [r["window"] for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [r["last_batch"] for r in rows] == [False, True] * 2
    assert [r["last"] for r in rows] == [False, False, False, True]


def test_dataloader_micro_batches_and_epoch_len() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20.0))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    scheduler = StepScheduler(8, 2, 2, loader, preemption_signal=None)
    assert scheduler.grad_acc_steps == 2 and scheduler.epoch_len == 5
    windows = [window for _ in scheduler.epochs for window in scheduler if scheduler.finish_step() is False]
    assert len(windows) == 5
    assert torch.equal(windows[0][1][0], torch.tensor([2.0, 3.0]))
    assert make(Unsized([1])).epoch_len is None


def test_grad_acc_steps_from_global_local_and_dp_sizes() -> None:
    assert StepScheduler(64, 4, 2, [0], preemption_signal=None).grad_acc_steps == 8
    with pytest.raises(ValueError, match=r"global_batch_size=30 is not a multiple of local_batch_size=4 \* dp_size=2"):
        StepScheduler(30, 4, 2, [0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 0}, r"StepScheduler.global_batch_size must be an int >= 1 \(got 0\)"),
        ({"local_batch_size": -2}, r"StepScheduler.local_batch_size must be an int >= 1 \(got -2\)"),
        ({"dp_size": 0}, r"StepScheduler.dp_size must be an int >= 1 \(got 0\)"),
        ({"ckpt_every_steps": 0}, r"StepScheduler.ckpt_every_steps must be an int >= 1 or None \(got 0\)"),
        ({"val_every_steps": -1}, r"StepScheduler.val_every_steps must be an int >= 1 \(got -1\)"),
        ({"gc_every_steps": 0}, r"StepScheduler.gc_every_steps must be an int >= 1 or None \(got 0\)"),
        ({"log_remote_every_steps": 0}, r"StepScheduler.log_remote_every_steps must be an int >= 1 \(got 0\)"),
        ({"max_steps": 0}, r"StepScheduler.max_steps must be an int >= 1 or None \(got 0\)"),
        ({"num_epochs": True}, r"StepScheduler.num_epochs must be an int >= 1 or None \(got True\)"),
        ({"start_step": -1}, r"StepScheduler.start_step must be an int >= 0 \(got -1\)"),
        ({"preemption_signal": "SIGNOPE"}, r"'SIGNOPE' is not a signal name"),
        ({"preemption_signal": "SIGKILL"}, r"SIGKILL cannot be caught"),
    ],
)
def test_constructor_refuses_bad_values(kwargs: dict[str, Any], message: str) -> None:
    args = {"global_batch_size": 4, "local_batch_size": 1, "dp_size": 1, "dataloader": [0], **kwargs}
    with pytest.raises(ValueError, match=message):
        StepScheduler(**args)


def test_empty_loader_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the dataloader is empty"):
        make([])
    with pytest.raises(ValueError, match=r"yielded no micro-batches in epoch 1"):
        drive(make(Unsized([])))


class _Overstated(Unsized):
    """Claims more micro-batches than it yields."""

    def __len__(self) -> int:
        return 5


def test_a_loader_that_ends_before_its_len_warns_naming_the_epoch_from_1() -> None:
    scheduler = make(_Overstated([0, 1, 2]), num_epochs=2)
    with pytest.warns(RuntimeWarning) as record:
        rows = drive(scheduler)
    assert [str(warning.message) for warning in record] == [
        f"StepScheduler: the dataloader reported len() == 5 but epoch {epoch} ended after 3 micro-batches"
        for epoch in (1, 2)
    ]
    assert len(rows) == 6  # each epoch ends where the data does


# -- cadences -------------------------------------------------------------------------------------


def test_every_predicate_over_a_run() -> None:
    # the worked table of docs/step-scheduler.md: 5 steps per epoch, 2 epochs
    scheduler = make(
        list(range(5)), num_epochs=2, ckpt_every_steps=3, val_every_steps=2, log_remote_every_steps=2, gc_every_steps=4
    )
    rows = drive(scheduler)
    fired = {key: [r["step"] for r in rows if r[key]] for key in ("ckpt", "val", "log", "gc", "last_batch", "last")}
    assert fired == {
        "ckpt": [3, 5, 6, 9, 10],  # cadence 3, 6, 9; epoch ends 5, 10; the last step 10
        "val": [2, 3, 4, 5, 6, 8, 9, 10],  # cadence 2 plus every checkpoint step (validate_on_checkpoint)
        "log": [2, 4, 6, 8, 10],
        "gc": [4, 8],
        "last_batch": [5, 10],
        "last": [10],
    }


def test_no_epoch_checkpoints_and_no_validation_on_checkpoint() -> None:
    scheduler = make(
        list(range(5)),
        num_epochs=2,
        ckpt_every_steps=4,
        save_checkpoint_every_epoch=False,
        validate_on_checkpoint=False,
        val_every_steps=[3, 7],
    )
    rows = drive(scheduler)
    assert [r["step"] for r in rows if r["ckpt"]] == [4, 8, 10]
    assert [r["step"] for r in rows if r["val"]] == [3, 6, 7, 9]


def test_predicates_are_false_while_a_window_is_open() -> None:
    scheduler = make(list(range(4)), ckpt_every_steps=1, val_every_steps=1)
    scheduler.finish_step_required = True  # the precise loop (TrainingStrategy's): every window is closed by hand
    for _ in scheduler.epochs:
        for _window in scheduler:
            assert not (scheduler.is_ckpt_step or scheduler.is_val_step or scheduler.is_last_step)
            scheduler.finish_step()
            assert scheduler.is_ckpt_step and scheduler.is_val_step


def test_skipped_steps_consume_data_but_fire_no_cadence() -> None:
    scheduler = make(list(range(6)), ckpt_every_steps=2, save_checkpoint_every_epoch=False, max_steps=4)
    rows = drive(scheduler, stepped=lambda index: index not in (1, 2))
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 3, 4]
    assert [r["ckpt"] for r in rows] == [False, False, False, True, False, True]
    assert [r["last"] for r in rows] == [False] * 5 + [True]


# -- the last step ----------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", [list(range(5)), Unsized(list(range(5)))], ids=["sized", "unsized"])
def test_max_steps_ends_mid_epoch_on_exactly_one_last_step(loader: Any) -> None:
    scheduler = make(loader, max_steps=7)
    rows = drive(scheduler)
    assert len(rows) == 7
    assert [r["step"] for r in rows if r["last"]] == [7]
    assert rows[-1]["ckpt"]
    state = scheduler.state_dict()
    assert (state["step"], state["epoch"], state["position"]) == (7, 1, 2)


@pytest.mark.parametrize("loader", [list(range(5)), Unsized(list(range(5)))], ids=["sized", "unsized"])
def test_epochs_running_out_before_max_steps_end_with_one_last_step(loader: Any) -> None:
    scheduler = make(loader, global_batch_size=2, num_epochs=2, max_steps=100)
    rows = drive(scheduler)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["last"] for r in rows] == [False] * 5 + [True]
    assert rows[-1]["ckpt"]


def test_max_steps_alone_trains_that_many_steps_across_epochs() -> None:
    scheduler = make(Unsized(list(range(3))), max_steps=8)
    assert scheduler.num_epochs is None
    rows = drive(scheduler)
    assert len(rows) == 8 and [r["last"] for r in rows].count(True) == 1


def test_neither_bound_means_one_epoch() -> None:
    rows = drive(make(list(range(3))))
    assert len(rows) == 3 and rows[-1]["last"]


def test_start_step_and_epoch_are_absolute() -> None:
    rows = drive(make(list(range(4)), start_step=5, start_epoch=1, num_epochs=2, max_steps=20))
    assert [r["step"] for r in rows] == [6, 7, 8, 9]
    assert rows[-1]["last"]


# -- protocol errors ---------------------------------------------------------------------------------


def test_finish_step_is_required_once_per_window() -> None:
    scheduler = make(list(range(4)))
    scheduler.finish_step_required = True
    iterator = iter(scheduler)
    next(iterator)
    with pytest.raises(RuntimeError, match=r"finish_step\(\) was not called for step 0 \(epoch 1\)"):
        next(iterator)
    scheduler = make(list(range(4)))
    for _ in scheduler:
        scheduler.finish_step()
        with pytest.raises(RuntimeError, match=r"no open window"):
            scheduler.finish_step()
        break


def test_a_window_left_open_by_break_is_yielded_again() -> None:
    scheduler = make(list(range(6)), global_batch_size=2)
    for window in scheduler:
        assert window == [0, 1]
        break
    assert scheduler.state_dict()["position"] == 0
    assert [w for w in scheduler if scheduler.finish_step() is False] == [[0, 1], [2, 3], [4, 5]]


# -- epochs reach the loader ---------------------------------------------------------------------------


class EpochSpy:
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class SpyLoader(Unsized):
    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.own = EpochSpy()
        self.sampler = EpochSpy()
        self.dataset = EpochSpy()

    def set_epoch(self, epoch: int) -> None:
        self.own.set_epoch(epoch)


def test_set_epoch_reaches_the_sampler_the_loader_and_its_dataset() -> None:
    loader = SpyLoader([1, 2])
    drive(make(loader, num_epochs=3))
    assert loader.own.epochs == loader.sampler.epochs == loader.dataset.epochs == [0, 1, 2]


def test_set_epoch_reaches_a_distributed_sampler() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(8))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=1, sampler=sampler)
    drive(make(loader, num_epochs=2))
    assert sampler.epoch == 1


# -- resume --------------------------------------------------------------------------------------------


def shuffled_loader(generator: bool) -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(14))
    gen = torch.Generator().manual_seed(11) if generator else None
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, generator=gen)


def record_run(scheduler: StepScheduler, save_at: int | None = None) -> tuple[list[Any], Any]:
    """Drive like a training loop that draws from the global RNG; save (state, rng) after step ``save_at``."""
    rows, saved = [], None
    for _ in scheduler.epochs:
        for window in scheduler:
            torch.rand(3)  # "training" consumes the global RNG between fetches
            scheduler.finish_step()
            rows.append(
                (scheduler.step, scheduler.is_val_step, scheduler.is_ckpt_step, [b[0].tolist() for b in window])
            )
            if scheduler.step == save_at:  # what a checkpoint keeps: the state and every RNG stream
                generator = scheduler.dataloader.generator
                rng = (torch.get_rng_state(), None if generator is None else generator.get_state())
                saved = (copy.deepcopy(scheduler.state_dict()), rng)
    return rows, saved


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "loader-generator"])
@pytest.mark.parametrize("save_at", [2, 4, 5], ids=["mid-epoch", "epoch-end", "next-epoch"])
def test_resume_replays_the_same_steps_and_micro_batches(generator: bool, save_at: int) -> None:
    def build() -> StepScheduler:
        return StepScheduler(
            4,
            2,
            1,
            shuffled_loader(generator),
            num_epochs=3,
            ckpt_every_steps=3,
            val_every_steps=2,
            preemption_signal=None,
        )

    torch.manual_seed(0)
    straight, saved = record_run(build(), save_at=save_at)
    assert saved is not None
    state, rng = saved
    # 7 micro-batches per epoch in windows of 2, 2, 2, 1: four steps per epoch
    assert (state["epoch"], state["position"]) == {2: (0, 4), 4: (1, 0), 5: (1, 2)}[save_at]

    torch.manual_seed(123)  # a fresh process: whatever RNG it starts with
    resumed = build()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng[0])  # what a checkpoint restores before the loop continues
    if generator:
        resumed.dataloader.generator.set_state(rng[1])
    rest, _ = record_run(resumed)
    assert rest == straight[save_at:]


@pytest.mark.parametrize("generator", [False, True], ids=["global-rng", "loader-generator"])
@pytest.mark.parametrize("epoch", [0, 1])
def test_a_state_taken_inside_an_epochs_first_window_replays_its_order(generator: bool, epoch: int) -> None:
    """Position 0 with the epoch's order already drawn: the resume draws it again from the epoch's states.

    A fresh iterator would draw from the states of the capture moment (later ones), and so
    train a different permutation for this epoch and every one after it.
    """

    def build() -> StepScheduler:
        return StepScheduler(4, 2, 1, shuffled_loader(generator), num_epochs=3, preemption_signal=None)

    torch.manual_seed(0)
    straight, _ = record_run(build())
    torch.manual_seed(0)
    first = build()
    first.finish_step_required = True  # the precise loop: an open window counts for nothing yet
    rows, captured = [], None
    for current in first.epochs:
        for window in first:
            if current == epoch and captured is None:  # the first window is open: nothing counted yet
                generator_state = None if first.dataloader.generator is None else first.dataloader.generator.get_state()
                captured = (copy.deepcopy(first.state_dict()), torch.get_rng_state(), generator_state)
                break
            torch.rand(3)
            first.finish_step()
            rows.append((first.step, first.is_val_step, first.is_ckpt_step, [b[0].tolist() for b in window]))
        if captured is not None:
            break
    assert captured is not None
    state, global_rng, loader_rng = captured
    assert (state["epoch"], state["position"]) == (epoch, 0) and state["epoch_rng"] is not None

    torch.manual_seed(123)
    resumed = build()
    resumed.load_state_dict(state)
    torch.set_rng_state(global_rng)
    if loader_rng is not None:
        resumed.dataloader.generator.set_state(loader_rng)
    rest, _ = record_run(resumed)
    assert rows + rest == straight


def test_state_dict_after_the_loop_points_past_the_data() -> None:
    scheduler = make(list(range(4)), global_batch_size=2, num_epochs=2)
    drive(scheduler)
    state = scheduler.state_dict()
    assert (state["step"], state["epoch"], state["position"], state["epoch_rng"]) == (4, 2, 0, None)
    fresh = make(list(range(4)), global_batch_size=2, num_epochs=2)
    fresh.load_state_dict(state)
    assert drive(fresh) == []


def test_state_dict_records_the_configuration_to_match() -> None:
    state = make(list(range(4)), global_batch_size=2).state_dict()
    assert state["config"] == {
        "global_batch_size": 2,
        "local_batch_size": 1,
        "dp_size": 1,
        "grad_acc_steps": 2,
        "loader_len": 4,
        "dataset_len": None,  # a plain list has no dataset behind it
        "global_order": None,  # a plain list: no DistributedSampler fixes a global sample order
        "sampler": None,  # nor a sampler: a plain list is not a DataLoader
    }


def _shuffled(samples: int) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(samples)), batch_size=2, shuffle=True)


def test_load_state_dict_refuses_another_data_set_of_the_same_loader_length() -> None:
    """10 and 9 samples in batches of 2 both make 5 micro-batches; the shuffled order is another one."""
    state = make(_shuffled(10)).state_dict()
    assert state["config"]["dataset_len"] == 10
    with pytest.raises(ValueError, match=r"a data set of 10 samples, the dataloader's has 9: the saved position"):
        make(_shuffled(9)).load_state_dict(state)
    make(_shuffled(10)).load_state_dict(state)  # the same data: accepted


def test_another_data_set_that_changes_the_loader_length_is_named_as_the_cause() -> None:
    """40 -> 44 samples also changes len(loader): the message names the data sets, not ranks or samplers."""
    state = make(_shuffled(40)).state_dict()
    with pytest.raises(ValueError, match=r"a data set of 40 samples, the dataloader's has 44") as caught:
        make(_shuffled(44)).load_state_dict(state)
    assert "DistributedSampler" not in str(caught.value)


def test_a_state_saved_before_the_data_set_length_was_recorded_still_loads() -> None:
    state = make(_shuffled(10)).state_dict()
    del state["config"]["dataset_len"]
    make(_shuffled(10)).load_state_dict(state)


def test_load_state_dict_refuses_another_configuration() -> None:
    saving = make(list(range(8)), global_batch_size=2, max_steps=1)
    drive(saving)
    state = saving.state_dict()
    assert state["position"] == 2  # in the middle of the epoch
    with pytest.raises(ValueError, match=r"global_batch_size: saved 2, now 4.*grad_acc_steps: saved 2, now 4"):
        make(list(range(8)), global_batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"loader_len: saved 8, now 9"):
        make(list(range(9)), global_batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"the state lacks \['config'\]"):
        make(list(range(4))).load_state_dict({"step": 1, "epoch": 0, "position": 2})


def test_another_batch_configuration_is_accepted_at_an_epoch_start(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing of the next epoch was read: it starts whole, grouped by the new configuration."""
    saving = make(list(range(8)), global_batch_size=2, max_steps=4, num_epochs=3)
    drive(saving)
    state = saving.state_dict()
    assert (state["step"], state["epoch"], state["position"]) == (4, 1, 0)
    resumed = make(list(range(8)), global_batch_size=4, num_epochs=3)
    with caplog.at_level("INFO", logger="nvtrain"):
        resumed.load_state_dict(state)
    assert "epoch 2 starts with another batch configuration (global_batch_size: saved 2, now 4" in caplog.text
    rows = drive(resumed)
    assert [row["window"] for row in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [row["step"] for row in rows] == [5, 6, 7, 8]


def _sampled(shuffle: bool) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=shuffle)


@pytest.mark.parametrize("saved_shuffle", [True, False])
def test_another_sampler_is_refused_in_the_middle_of_an_epoch(saved_shuffle: bool) -> None:
    """shuffle=True saved, False now (or the reverse): the replayed order is not the one the saved steps read."""
    saving = make(_sampled(saved_shuffle), max_steps=2)
    drive(saving)
    state = saving.state_dict()
    assert state["position"] == 2
    saved_kind, kind = ("RandomSampler", "SequentialSampler")[:: 1 if saved_shuffle else -1]
    with pytest.raises(ValueError, match=rf"sample order differs \(sampler: saved {saved_kind}, now {kind}\)"):
        make(_sampled(not saved_shuffle)).load_state_dict(state)
    make(_sampled(saved_shuffle)).load_state_dict(state)  # the same sampler: accepted


def test_another_sampler_is_accepted_at_an_epoch_start() -> None:
    saving = make(_sampled(True), max_steps=6)
    drive(saving)
    state = saving.state_dict()
    assert (state["epoch"], state["position"]) == (1, 0)
    resumed = make(_sampled(False), num_epochs=2)
    resumed.load_state_dict(state)
    assert [row["window"][0][0].tolist() for row in drive(resumed)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_load_state_dict_refused_while_iterating() -> None:
    scheduler = make(list(range(4)))
    for _ in scheduler:
        with pytest.raises(RuntimeError, match=r"cannot load while iterating"):
            scheduler.load_state_dict(scheduler.state_dict())
        scheduler.finish_step()


# -- no collectives behind properties -----------------------------------------------------------------


def test_properties_never_communicate_and_each_boundary_polls_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        calls.append("all_reduce")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    scheduler = StepScheduler(1, 1, 1, list(range(3)), num_epochs=2, preemption_signal="SIGUSR1")
    per_boundary = []
    for _ in scheduler.epochs:
        for _window in scheduler:
            before = len(calls)
            scheduler.finish_step()
            for _ in range(5):
                _ = (
                    scheduler.is_ckpt_step,
                    scheduler.is_val_step,
                    scheduler.is_last_step,
                    scheduler.sigterm_received,
                    scheduler.is_remote_logging_step,
                    scheduler.is_gc_step,
                    scheduler.is_last_batch,
                )
            scheduler.state_dict()
            per_boundary.append(len(calls) - before)
    assert per_boundary == [1] * 6
    assert len(calls) == 7  # plus the one poll between the two epochs


# -- the configuration -------------------------------------------------------------------------------


def test_config_defaults_follow_the_none_means_derive_rule() -> None:
    config = StepSchedulerConfig(max_steps=100)
    assert config.num_epochs is None and config.global_batch_size is None
    scheduler = config.build(list(range(7)), dp_group_size=1, local_batch_size=4)
    assert scheduler.grad_acc_steps == 1 and scheduler.global_batch_size == 4
    rows = drive(scheduler)
    assert len(rows) == 100 and rows[-1]["last"]


def test_config_build_passes_every_field() -> None:
    config = StepSchedulerConfig(
        global_batch_size=16,
        num_epochs=3,
        ckpt_every_steps=5,
        val_every_steps=7,
        gc_every_steps=9,
        log_remote_every_steps=2,
        start_step=4,
        start_epoch=1,
        preemption_signal=["SIGTERM", 10],
    )
    scheduler = config.build(list(range(8)), dp_group_size=2, local_batch_size=2)
    assert (scheduler.grad_acc_steps, scheduler.num_epochs, scheduler.step, scheduler.epoch) == (4, 3, 4, 1)
    assert (scheduler.ckpt_every_steps, scheduler.val_every_steps, scheduler.gc_every_steps) == (5, (7,), 9)
    assert [s.name for s in scheduler.preemption_signals] == ["SIGTERM", "SIGUSR1"]
    assert StepSchedulerConfig(preemption_signal=None).build([0], 1, 1).preemption_signals == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 0}, r"StepSchedulerConfig.global_batch_size must be an int >= 1 or None \(got 0\)"),
        ({"num_epochs": -1}, r"StepSchedulerConfig.num_epochs must be an int >= 1 or None \(got -1\)"),
        ({"ckpt_every_steps": 0}, r"StepSchedulerConfig.ckpt_every_steps must be an int >= 1 or None \(got 0\)"),
        ({"log_remote_every_steps": 0}, r"StepSchedulerConfig.log_remote_every_steps must be an int >= 1 \(got 0\)"),
        ({"start_epoch": -3}, r"StepSchedulerConfig.start_epoch must be an int >= 0 \(got -3\)"),
        ({"preemption_signal": "SIGSTOP"}, r"StepSchedulerConfig.preemption_signal: SIGSTOP cannot be caught"),
        ({"preemption_signal": 1.5}, r"StepSchedulerConfig.preemption_signal must be a signal name"),
    ],
)
def test_config_refuses_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepSchedulerConfig(**kwargs)


def test_config_build_checks_divisibility_with_all_three_numbers() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not a multiple of local_batch_size=4 \* dp_size=1"):
        StepSchedulerConfig(global_batch_size=10).build([0], 1, 4)


def test_synchronized_stream_stops_at_the_end_of_the_source() -> None:
    scheduler = make(Unsized(list(range(5))), global_batch_size=2, num_epochs=3, synchronized_stream=True)
    rows = drive(scheduler)
    assert [r["window"] for r in rows] == [[0, 1], [2, 3], [4]]
    assert rows[-1]["last"] and scheduler.stream_exhausted


# -- divergence ------------------------------------------------------------------------------------


def test_consecutive_skipped_steps_stop_the_run_across_epochs() -> None:
    from nvtrain.errors import TrainingDivergedError

    scheduler = make(list(range(2)), num_epochs=1000, max_consecutive_skipped_steps=5)
    skipped = 0
    with pytest.raises(TrainingDivergedError, match=r"5 optimizer steps in a row were skipped \(none since step 1"):
        for _ in scheduler.epochs:
            for _ in scheduler:
                stepped = scheduler.epoch == 0 and scheduler.position == 0  # the very first step only
                scheduler.finish_step(stepped=stepped)
                skipped += not stepped
    assert skipped == 5 and scheduler.epoch == 3  # 2 windows an epoch: stopped before epoch 3's first


def test_a_real_step_resets_the_skip_count_and_none_disables_it() -> None:
    scheduler = make(list(range(12)), max_consecutive_skipped_steps=3)
    for index, _ in enumerate(scheduler):
        scheduler.finish_step(stepped=index % 3 == 2)  # two skips, one step: never three in a row
    assert scheduler.step == 4
    scheduler = make(list(range(12)), max_consecutive_skipped_steps=None)
    for _ in scheduler:
        scheduler.finish_step(stepped=False)
    assert scheduler.consecutive_skipped_steps == 12


def test_the_config_default_stops_after_100_skipped_steps() -> None:
    config = StepSchedulerConfig()
    assert config.max_consecutive_skipped_steps == 100
    assert config.build(list(range(4)), 1, 1).max_consecutive_skipped_steps == 100


def test_ranks_may_read_data_sets_of_their_own_length() -> None:
    """With several ranks a state holds rank 0's data set length, and a rank may read a shard of another:
    only one process checks the length (a DistributedSampler's is in ``global_order``)."""
    saved = StepScheduler(4, 2, 2, _shuffled(10), preemption_signal=None).state_dict()
    StepScheduler(4, 2, 2, _shuffled(9), preemption_signal=None).load_state_dict(saved)


# -- a loader whose len() is below what it yields ----------------------------------------------------


class Understated:
    """Re-iterable, yielding ``items`` but claiming ``claimed`` in ``len()`` (an estimated stream length)."""

    def __init__(self, items: int, claimed: int) -> None:
        self.items, self.claimed = items, claimed

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.items))

    def __len__(self) -> int:
        return self.claimed


def test_a_loader_yielding_past_its_len_is_said_once() -> None:
    """Each epoch reads len() micro-batches; the rest would go untrained, silently."""
    scheduler = make(Understated(6, 4), num_epochs=3)
    with pytest.warns(RuntimeWarning, match=r"reported len\(\) == 4 but yields more: epoch 1 ended after its 4") as caught:
        rows = drive(scheduler)
    assert [row["window"] for row in rows] == [[0], [1], [2], [3]] * 3
    assert len([w for w in caught if "yields more" in str(w.message)]) == 1


@pytest.mark.filterwarnings("ignore:Length of IterableDataset")  # torch's own, once the extra item is read
def test_a_data_loader_over_a_stream_with_a_low_len_is_said() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(6))

        def __len__(self) -> int:
            return 4

    with pytest.warns(RuntimeWarning, match=r"reported len\(\) == 4 but yields more"):
        drive(make(DataLoader(Stream(), batch_size=None), num_epochs=1))


def test_an_exact_len_or_a_one_shot_iterator_is_not_read_past() -> None:
    """A one-shot iterator's next epoch goes on from where the last stopped: reading one more would lose it."""

    class OneShot:
        def __init__(self) -> None:
            self.next_item = 0

        def __iter__(self) -> OneShot:
            return self

        def __next__(self) -> int:
            self.next_item += 1
            return self.next_item - 1

        def __len__(self) -> int:
            return 3

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [row["window"] for row in drive(make(OneShot(), num_epochs=2))] == [[0], [1], [2], [3], [4], [5]]
        assert len(drive(make(Understated(4, 4), num_epochs=2))) == 8


@pytest.mark.parametrize("name", ["save_checkpoint_every_epoch", "validate_on_checkpoint", "synchronized_stream"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_a_switch_takes_a_bool_only(name: str, value: Any) -> None:
    """"no" would read as True, 1 as a number: the switch is refused, as StepSchedulerConfig refuses it."""
    with pytest.raises(TypeError, match=rf"StepScheduler\.{name} must be True or False \(got {value!r}\)"):
        make(list(range(4)), **{name: value})


def test_a_stateful_data_loader_reads_the_same_sequential_order_and_another_shuffled_one() -> None:
    """torch's and torchdata's sequential samplers give one order; their random samplers draw otherwise."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    from nvtrain.data_resharding import sampler_kind

    data = list(range(8))
    assert sampler_kind(DataLoader(data, batch_size=2)) == sampler_kind(stateful(data, batch_size=2))
    assert sampler_kind(DataLoader(data, batch_size=2, shuffle=True)) == "RandomSampler"
    assert sampler_kind(stateful(data, batch_size=2, shuffle=True)) == "torchdata RandomSampler"
