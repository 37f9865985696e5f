"""A data position saved by one number of ranks, continued on another (an elastic resume).

Under a ``DistributedSampler`` an epoch is one global sequence: a permutation of the
data set drawn from ``seed + epoch`` alone, of which rank r of W reads positions
r, r + W, r + 2W, ... So after k optimizer steps of ``global_batch_size`` samples the
ranks have together read exactly the first ``k * global_batch_size`` positions, whatever
W and the local batch size were. A job with another number of ranks (or local batch
size, with accumulation making up the same global batch) that opens the same epoch at
micro-batch ``k * global_batch_size / (local_batch_size * W')`` reads exactly the
positions after those: each later step trains on the samples the saving job's step
would have. Only the padding at the epoch's very end (``DistributedSampler`` repeats
samples so every rank gets as many) depends on W.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

from nvtrain.data_cursor import is_stateful_dataloader, is_torchdata_class

__all__ = ["global_order", "order_differences", "resharded_position", "sampler_kind"]


def global_order(loader: Any) -> dict[str, Any] | None:
    """What fixes ``loader``'s epochs as one global sequence on any number of ranks, or None when nothing does.

    That is a torch ``DataLoader`` over a map-style data set whose sampler is a
    ``DistributedSampler`` batched by a plain ``BatchSampler``; the sequence depends on
    the data set's length and the sampler's ``shuffle``, ``seed`` and ``drop_last``.
    """
    if not isinstance(loader, DataLoader) or is_stateful_dataloader(loader):
        return None
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler) or type(loader.batch_sampler) is not BatchSampler:
        return None
    try:
        samples = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return {"samples": samples, "shuffle": sampler.shuffle, "seed": sampler.seed, "drop_last": sampler.drop_last}


def sampler_kind(loader: Any) -> str | None:
    """The classes that order ``loader``'s epochs (``"RandomSampler"``, ``"SequentialSampler"``, a batch
    sampler of its own after a ``+``), or None for what is not a ``DataLoader``.

    A resume in the middle of an epoch replays its order under the saved random state; that
    order is the saved run's only when the same kind of sampler draws it (``shuffle=True``
    saved and ``shuffle=False`` now would skip some samples and read others twice).
    """
    if not isinstance(loader, DataLoader):
        return None
    kind = _sampler_name(loader.sampler)
    batch_sampler = loader.batch_sampler
    plain = type(batch_sampler) is BatchSampler or is_torchdata_class(batch_sampler, "BatchSampler")
    if batch_sampler is not None and not plain:
        kind += f"+{type(batch_sampler).__qualname__}"
    return kind


def _sampler_name(sampler: Any) -> str:
    """A sampler's class as far as its order goes: a sequential one is the same whoever implements it; torchdata's
    stateful samplers (which a StatefulDataLoader puts in place of torch's) draw otherwise than torch's."""
    cls = type(sampler)
    if cls.__name__ == "SequentialSampler":
        return "SequentialSampler"
    return f"torchdata {cls.__qualname__}" if cls.__module__.startswith("torchdata") else cls.__qualname__


def order_differences(saved: dict[str, Any], mine: dict[str, Any]) -> str:
    """How the two configurations' ``global_order`` differ (``"seed: saved 0, now 1"``); "" when they do not,
    or when either has none to compare."""
    saved_kind, kind = saved.get("sampler"), mine.get("sampler")
    if saved_kind is not None and kind is not None and saved_kind != kind:
        return f"sampler: saved {saved_kind}, now {kind}"
    order, saved_order = mine.get("global_order"), saved.get("global_order")
    if order is None or saved_order is None or saved_order == order:
        return ""
    return ", ".join(
        f"{key}: saved {saved_order.get(key)!r}, now {order[key]!r}" for key in order if saved_order.get(key) != order[key]
    )


def resharded_position(saved: dict[str, Any], mine: dict[str, Any], position: int) -> int:
    """The micro-batch of this job's epoch that follows what the saving job read in ``position`` micro-batches.

    ``saved`` and ``mine`` are the step scheduler configurations (global and local batch
    size, data-parallel size, accumulation, ``global_order``). Raises ``ValueError`` saying
    why when the saved position cannot be carried over. At an epoch's start (``position`` 0)
    nothing of the epoch was read, so any configuration starts it whole.
    """
    if position == 0:
        return 0
    if saved.get("global_batch_size") != mine["global_batch_size"]:
        raise ValueError(
            f"the global batch size differs (saved {saved.get('global_batch_size')}, now {mine['global_batch_size']}): "
            "the steps of the rest of this epoch would group its samples otherwise than the saved run's (set the "
            "step scheduler's global_batch_size to the saved one, or change it at an epoch's start)"
        )
    order, saved_order = mine.get("global_order"), saved.get("global_order")
    if order is None or saved_order is None:
        raise ValueError(
            "only an epoch read through a DistributedSampler (which DDPHook and FSDPHook inject) is one sample "
            "order on any number of ranks; here "
            + ("the saving job's loader" if saved_order is None else "this job's loader")
            + " is not one (a torchdata StatefulDataLoader keeps a per-rank state that cannot be split either)"
        )
    differ = order_differences(saved, mine)
    if differ:
        raise ValueError(f"the epoch's sample order differs ({differ})")
    consumed = position * saved["local_batch_size"] * saved["dp_size"]
    per_batch = mine["local_batch_size"] * mine["dp_size"]
    if position % saved["grad_acc_steps"] or consumed % per_batch:
        raise ValueError(
            f"the position ({position} micro-batches of {saved['local_batch_size']} on {saved['dp_size']} ranks) "
            "is not at an optimizer step's end"
        )
    return consumed // per_batch
