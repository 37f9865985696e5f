"""Resume with torchdata's StatefulDataLoader: the loader's own state goes into the checkpoint and is
restored with load_state_dict(), so a resumed epoch reads only unconsumed samples, bit for bit as before.

The scenario is the one of test_data_cursor.py (tests/resume_helpers.py): batch 4, shuffled, AdamW,
a model with dropout; 25 steps an epoch, a checkpoint at step 20 (mid-epoch) or 25 (the epoch's last),
then 30 steps in all.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import nvtrain
from nvtrain.data_cursor import is_stateful_dataloader
from nvtrain.step_scheduler import StepScheduler
from tests.resume_helpers import CountingDataset, CountingStream, GrabState, RecordSamples, train

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = stateful_dataloader.StatefulDataLoader

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates, in every StatefulDataLoader()
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

BATCH = 4
SAMPLES = 100  # 25 steps an epoch


def _loader(workers: int, seed: int) -> Any:
    """A shuffling StatefulDataLoader; ``seed`` is the global seed when it is built (its sampler draws one)."""
    torch.manual_seed(seed)
    return StatefulDataLoader(CountingDataset(SAMPLES), batch_size=BATCH, shuffle=True, num_workers=workers)


def _look_ahead(workers: int, loader: Any) -> int:
    """Samples a resumed run may read beyond the ones it trains: two batches, and the workers' prefetch."""
    return 2 * BATCH + (loader.prefetch_factor * workers * BATCH if workers else 0)


@pytest.mark.parametrize("at_step", [20, 25], ids=["mid-epoch", "epoch-end"])
@pytest.mark.parametrize("workers", [0, 2], ids=["0-workers", "2-workers"])
def test_a_resume_from_the_loaders_own_state_equals_the_uninterrupted_run(workers: int, at_step: int) -> None:
    grab = GrabState(at_step)
    straight_loader = _loader(workers, seed=5)
    trained = RecordSamples(straight_loader.dataset)
    straight = train(straight_loader, [grab, trained], 30)
    order = trained.samples  # 30 steps of 4 samples: the data order of the uninterrupted run
    if workers == 0:
        assert straight["reads"] == order
    state = grab.state
    assert state is not None
    saved = state["scheduler"]
    if at_step == 20:
        assert (saved["epoch"], saved["position"]) == (0, 20)
        assert saved["loader"]["num_workers"] == workers and saved["loader"]["state"]
    else:  # the epoch's last step: the next epoch starts from a fresh iterator, as it does without a stop
        assert (saved["epoch"], saved["position"], saved["loader"]) == (1, 0, None)
    assert "loader" not in state["rng"]  # this rank's loader state is the scheduler's

    loader = _loader(workers, seed=99)  # built under another seed: its sampler's generator differs until restored
    resumed = train(loader, [], 30, state=state)

    for name, tensor in straight["params"].items():
        assert torch.equal(tensor, resumed["params"][name]), name
    assert torch.equal(straight["rng"], resumed["rng"])
    assert torch.equal(straight_loader.sampler.generator.get_state(), loader.sampler.generator.get_state())
    reads = resumed["reads"]
    position, end = at_step * BATCH, 30 * BATCH
    assert len(reads) <= end - position + _look_ahead(workers, loader)
    if workers == 0:
        assert reads == order[position:end]  # exactly the samples it trains, in order
        return
    rest = SAMPLES - position  # what epoch 1 had left; its reads all come before epoch 2's
    assert sorted(reads[:rest]) == sorted(order[position:SAMPLES])  # never a sample before the saved position
    assert set(order[SAMPLES:end]) <= set(reads[rest:])


class GlobalShuffle(torch.utils.data.Sampler[int]):
    """A sampler of one's own that shuffles with the global RNG and keeps no state_dict()."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.samples).tolist())


@pytest.mark.parametrize("workers", [0, 2], ids=["0-workers", "2-workers"])
def test_a_sampler_without_a_state_of_its_own_resumes_on_the_saved_order(workers: int) -> None:
    """torchdata resumes such a sampler by iterating it again and skipping what was yielded: a new
    permutation, so the rest of the epoch repeated some samples and skipped others. Its state is left out
    of the checkpoint, and the epoch is replayed under the epoch's saved RNG states."""

    def loader() -> Any:
        dataset = CountingDataset(SAMPLES)
        return StatefulDataLoader(dataset, batch_size=BATCH, sampler=GlobalShuffle(SAMPLES), num_workers=workers)

    grab = GrabState(10)
    straight_loader = loader()
    trained = RecordSamples(straight_loader.dataset)
    straight = train(straight_loader, [grab, trained], 30)
    state = grab.state
    assert state is not None and state["scheduler"]["position"] == 10 and state["scheduler"]["loader"] is None
    resumed_loader = loader()
    resumed_trained = RecordSamples(resumed_loader.dataset)
    resumed = train(resumed_loader, [resumed_trained], 30, state=state)
    assert resumed_trained.samples == trained.samples[10 * BATCH :]
    for name, tensor in straight["params"].items():
        assert torch.equal(tensor, resumed["params"][name]), name


def _stream_loader(workers: int) -> Any:
    return StatefulDataLoader(CountingStream(SAMPLES), batch_size=BATCH, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2], ids=["0-workers", "2-workers"])
def test_a_stateful_stream_resumes_from_its_own_state_past_the_schedulers_look_ahead(workers: int) -> None:
    # Without len() the scheduler reads one micro-batch ahead to know whether the epoch goes on; the
    # state saved is the loader's from before that look-ahead, so the peeked batch is trained after the resume.
    grab = GrabState(20)
    straight = train(_stream_loader(workers), [grab], 30)
    state = grab.state
    assert state is not None and state["scheduler"]["position"] == 20
    assert state["scheduler"]["loader"] is not None

    resumed = train(_stream_loader(workers), [], 30, state=state)

    for name, tensor in straight["params"].items():
        assert torch.equal(tensor, resumed["params"][name]), name
    assert torch.equal(straight["rng"], resumed["rng"])
    reads = resumed["reads"]
    # 20 micro-batches of 4 were trained: samples 0-79 (with 2 workers, 10 batches of each worker's half)
    assert sorted(reads[:20]) == list(range(80, SAMPLES))  # the rest of epoch 1: never a sample before it
    if workers == 0:
        # the rest of epoch 1, then 5 steps of epoch 2 and one micro-batch of look-ahead
        assert reads == [*range(80, SAMPLES), *range(24)]
    else:  # epoch 1 ends with two half batches: 6 steps, then 4 of epoch 2, the look-ahead and the prefetch
        assert len(reads) <= 20 + 4 * BATCH + BATCH + 2 * workers * BATCH


# -- detection, checks, and nvtrain without torchdata ----------------------------------------------


def test_the_loader_is_recognised_by_its_class_without_importing_torchdata() -> None:
    class MyLoader(StatefulDataLoader):  # type: ignore[misc, valid-type]
        pass

    dataset = CountingDataset(8)
    assert is_stateful_dataloader(StatefulDataLoader(dataset, batch_size=4))
    assert is_stateful_dataloader(MyLoader(dataset, batch_size=4))
    assert not is_stateful_dataloader(DataLoader(dataset, batch_size=4))
    assert not is_stateful_dataloader([1, 2, 3])

    lookalike = type("StatefulDataLoader", (), {"state_dict": dict, "load_state_dict": print})
    assert not is_stateful_dataloader(lookalike())  # same name, another package
    lookalike.__module__ = "torchdata.stateful_dataloader.stateful_dataloader"
    assert is_stateful_dataloader(lookalike())
    lookalike.load_state_dict = None  # type: ignore[attr-defined]
    assert not is_stateful_dataloader(lookalike())  # cannot restore a state


def test_nvtrain_does_not_import_torchdata_and_works_without_it(tmp_path: Path) -> None:
    script = """
import sys
import nvtrain
assert "torchdata" not in sys.modules, "import nvtrain imported torchdata"
sys.modules["torchdata"] = None  # from here on, as if torchdata were not installed
import torch
from torch.utils.data import DataLoader, TensorDataset
from nvtrain.data_cursor import DataCursor, is_stateful_dataloader
from nvtrain.state import capture_rng_state
loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 2)), batch_size=4, shuffle=True)
assert not is_stateful_dataloader(loader) and DataCursor(loader).skips_without_reading
strategy = nvtrain.TrainingStrategy(
    models=torch.nn.Linear(3, 2), optimizers=lambda p: torch.optim.SGD(p, lr=0.1),
    loss_fn=torch.nn.functional.mse_loss, device="cpu", max_steps=2,
)
with strategy:
    strategy.run(loader)
state = strategy.state_dict()
assert state["scheduler"]["loader"] is None and "loader" not in capture_rng_state(loader)
print("ok")
"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _scheduler(loader: Any) -> StepScheduler:
    return StepScheduler(BATCH, BATCH, 1, loader, max_steps=30, preemption_signal=None)


def test_a_saved_loader_state_of_another_shape_is_refused_naming_what_came() -> None:
    saved = _scheduler(StatefulDataLoader(CountingDataset(SAMPLES), batch_size=BATCH)).state_dict()
    live = _scheduler(StatefulDataLoader(CountingDataset(SAMPLES), batch_size=BATCH))
    for bad, message in [
        ("junk", r"state\['loader'\] must be None or a dict with the loader's 'state' dict and its 'num_workers' "
                 r"\(got a str\)"),
        ({"state": {}}, r"state\['loader'\]\['num_workers'\] must be an int >= 0 \(got None\)"),
        ({"num_workers": 0}, r"\(got keys \['num_workers'\]\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            live.load_state_dict({**saved, "position": 3, "loader": bad})


def test_a_loader_state_saved_with_other_workers_is_refused_naming_both_counts() -> None:
    saved = {"num_workers": 0, "state": {"_num_yielded": 3}}
    live = _scheduler(StatefulDataLoader(CountingDataset(SAMPLES), batch_size=BATCH, num_workers=2))
    state = {**live.state_dict(), "position": 3, "loader": saved}
    with pytest.raises(ValueError, match="saved with num_workers=0, but this loader has num_workers=2"):
        live.load_state_dict(state)


def test_without_a_saved_loader_state_the_epoch_is_replayed_with_one_line_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a checkpoint written before nvtrain saved the loader's state: position and epoch RNG only
    grab = GrabState(20)
    straight = train(_loader(0, seed=5), [grab], 30)
    assert grab.state is not None
    grab.state["scheduler"]["loader"] = None
    with caplog.at_level(logging.WARNING, logger="nvtrain.data_cursor"):
        resumed = train(_loader(0, seed=99), [], 30, state=grab.state)
    for name, tensor in straight["params"].items():
        assert torch.equal(tensor, resumed["params"][name]), name
    assert len(resumed["reads"]) == 30 * BATCH  # the 20 consumed steps were read again
    (record,) = caplog.records
    assert "replaying 20 micro-batch(es)" in record.getMessage()
    assert "the checkpoint holds no state of it for this position" in record.getMessage()


def test_a_loader_state_that_torchdata_refuses_names_where_it_came_from() -> None:
    grab = GrabState(20)
    train(_loader(0, seed=5), [grab], 30)
    assert grab.state is not None
    grab.state["scheduler"]["loader"]["state"] = {"not": "a torchdata state"}
    with pytest.raises((AssertionError, KeyError)) as failure:  # torchdata's own check of the state's keys
        train(_loader(0, seed=99), [], 30, state=grab.state)
    notes = "\n".join(getattr(failure.value, "__notes__", []))
    assert "while restoring the StatefulDataLoader state saved after micro-batch 20 of epoch 1" in notes


def test_a_strategy_run_twice_continues_the_loader_from_its_own_state() -> None:
    # run() again on the same loader continues where the previous run stopped, mid-epoch
    loader = _loader(0, seed=5)
    strategy = nvtrain.TrainingStrategy(
        models=torch.nn.Linear(3, 2),
        optimizers=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=torch.nn.functional.mse_loss,
        device="cpu",
        max_steps=10,
    )
    with strategy:
        strategy.run(loader)
        strategy.max_steps = 20
        strategy.run(loader)
    reads = loader.dataset.read()
    assert len(reads) == 20 * BATCH and len(set(reads)) == 20 * BATCH  # no sample read twice
