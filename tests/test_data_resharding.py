"""An elastic resume: a data position saved by W ranks continued by W' ranks (or another local batch size with
the same global batch). Every step after the resume trains on exactly the samples the saving job's step would
have; what cannot carry over is refused, saying why. The ranks of a job are simulated in one process: each is a
step scheduler over a DistributedSampler of its rank (the scheduler's collective needs no process group here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from nvtrain.data_resharding import global_order
from nvtrain.step_scheduler import StepScheduler


def loader(samples: int, ranks: int, rank: int, batch: int, **sampler: Any) -> DataLoader[Any]:
    dataset = list(range(samples))  # each sample is its own index
    options = {"shuffle": True, "seed": 7, **sampler}
    return DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, ranks, rank, **options))


def schedulers(
    samples: int, ranks: int, batch: int, global_batch: int, max_steps: int | None = None, **sampler: Any
) -> list[StepScheduler]:
    return [
        StepScheduler(
            global_batch,
            batch,
            ranks,
            loader(samples, ranks, rank, batch, **sampler),
            num_epochs=1,
            max_steps=max_steps,
            preemption_signal=None,
        )
        for rank in range(ranks)
    ]


def steps_of(job: list[StepScheduler]) -> list[set[int]]:
    """The samples each optimizer step of a job trains on, over all its ranks (the ranks step in lockstep)."""
    per_rank: list[list[set[int]]] = []
    for scheduler in job:
        steps: list[set[int]] = []
        for _ in scheduler.epochs:
            for window in scheduler:
                steps.append({int(i) for batch in window for i in batch})
                scheduler.finish_step(stepped=True)
        per_rank.append(steps)
    assert len({len(steps) for steps in per_rank}) == 1, "the ranks made different numbers of steps"
    return [set().union(*step) for step in zip(*per_rank, strict=True)]


def resume(
    saved: list[StepScheduler], samples: int, ranks: int, batch: int, global_batch: int, **sampler: Any
) -> list[set[int]]:
    state = saved[0].state_dict()  # rank 0 writes the checkpoint for every rank
    job = schedulers(samples, ranks, batch, global_batch, **sampler)
    for scheduler in job:
        scheduler.load_state_dict(state)
    return steps_of(job)


@pytest.mark.parametrize(
    ("ranks", "batch"),
    [(4, 2), (1, 4), (2, 2), (8, 1), (1, 8)],  # the global batch 8 made of ranks x batch x accumulation
)
def test_every_step_after_the_resume_trains_on_the_samples_of_the_saving_jobs_step(ranks: int, batch: int) -> None:
    straight = steps_of(schedulers(96, 2, 4, 8))  # 2 ranks x 4 samples: 12 steps
    saved = schedulers(96, 2, 4, 8, max_steps=5)
    assert steps_of(saved) == straight[:5]
    assert resume(saved, 96, ranks, batch, 8) == straight[5:]


def test_the_epoch_end_may_pad_differently_but_no_sample_is_lost() -> None:
    """50 samples: 2 ranks pad the epoch to 52 (2 repeated), 3 ranks to 51; the steps before the end agree."""
    straight = steps_of(schedulers(50, 2, 3, 6))  # 9 steps of 6, the last of 2 real and padding
    saved = schedulers(50, 2, 3, 6, max_steps=4)
    steps_of(saved)
    resumed = resume(saved, 50, 3, 2, 6)
    assert resumed[:4] == straight[4:8]
    assert set().union(*resumed) >= set().union(*straight[4:])  # every unconsumed sample still trained


@settings(max_examples=25, deadline=None)
@given(
    saved_ranks=st.sampled_from([1, 2, 3, 4]),
    ranks=st.sampled_from([1, 2, 3, 4, 6]),
    steps=st.integers(1, 5),
    shuffle=st.booleans(),
)
def test_resharding_keeps_the_steps_for_any_ranks(saved_ranks: int, ranks: int, steps: int, shuffle: bool) -> None:
    """Global batch 12 over 144 samples: 12 steps, no padding for any of these rank counts."""
    straight = steps_of(schedulers(144, saved_ranks, 12 // saved_ranks, 12, shuffle=shuffle))
    saved = schedulers(144, saved_ranks, 12 // saved_ranks, 12, max_steps=steps, shuffle=shuffle)
    steps_of(saved)
    assert resume(saved, 144, ranks, 12 // ranks, 12, shuffle=shuffle) == straight[steps:]


# -- what cannot carry over ---------------------------------------------------------------------------------


def saved_after(steps: int, **options: Any) -> dict[str, Any]:
    saved = schedulers(96, 2, 4, 8, max_steps=steps, **options)
    steps_of(saved)
    return saved[0].state_dict()


def test_another_global_batch_size_is_refused() -> None:
    job = schedulers(96, 4, 4, 16)
    message = r"global_batch_size: saved 8, now 16.*the global batch size differs \(saved 8, now 16\)"
    with pytest.raises(ValueError, match=message):
        job[0].load_state_dict(saved_after(3))


def test_another_sample_order_is_refused() -> None:
    job = schedulers(96, 4, 2, 8, seed=8)
    with pytest.raises(ValueError, match=r"the epoch's sample order differs \(seed: saved 7, now 8\)"):
        job[0].load_state_dict(saved_after(3))


def test_a_loader_without_a_distributed_sampler_is_refused() -> None:
    plain = StepScheduler(8, 8, 1, DataLoader(list(range(96)), batch_size=8, shuffle=True), preemption_signal=None)
    with pytest.raises(ValueError, match=r"only an epoch read through a DistributedSampler .* this job's loader"):
        plain.load_state_dict(saved_after(3))


def test_an_unchanged_job_resumes_as_before() -> None:
    """The same ranks and batches: the position is used as saved (no resharding message, same micro-batch)."""
    job = schedulers(96, 2, 4, 8)
    job[0].load_state_dict(saved_after(3))
    assert job[0].state_dict()["position"] == 3


def test_global_order_describes_only_a_distributed_sampler_over_a_sized_data_set() -> None:
    assert global_order(loader(10, 2, 0, 2)) == {"samples": 10, "shuffle": True, "seed": 7, "drop_last": False}
    assert global_order(DataLoader(list(range(10)), batch_size=2)) is None
    assert global_order([torch.zeros(2)]) is None
