"""The ranks' agreement on the step to resume from, with the other rank's answer simulated: what the refusal
says when rank-0-only checkpoints are not on storage every rank shares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nvtrain_checkpoint.hook as hook_module
import pytest
import torch
from nvtrain_checkpoint import CheckpointError

import nvtrain


def agree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mine: int | None, theirs: int) -> Path | None:
    """``_agree`` on a rank that found step ``mine`` (None: no checkpoint) while another found ``theirs``."""

    def all_reduce(tensor: torch.Tensor, op: Any = None) -> None:  # MAX over [step, -step] of both ranks
        tensor.copy_(torch.maximum(tensor, torch.tensor([theirs, -theirs], dtype=tensor.dtype)))

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    ctx = nvtrain.TrainingContext(rank=0, world_size=2, device=torch.device("cpu"))
    found = None if mine is None else tmp_path / f"step_{mine}"
    return hook_module._agree(ctx, tmp_path, found, shared=True)


def test_ranks_that_see_no_checkpoint_and_one_are_told_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CheckpointError) as caught:
        agree(monkeypatch, tmp_path, None, 6)
    assert f"ranks see different latest checkpoints in {tmp_path} (none on some ranks, step 6 on others)" in str(
        caught.value
    )
    with pytest.raises(CheckpointError, match=r"\(steps 3 to 6\); with rank_zero_only=True checkpoint_dir must be"):
        agree(monkeypatch, tmp_path, 3, 6)
    assert agree(monkeypatch, tmp_path, 6, 6) == tmp_path / "step_6"
