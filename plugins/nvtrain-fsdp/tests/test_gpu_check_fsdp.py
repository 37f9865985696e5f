"""benchmarks/gpu_check.py's one-rank FSDP case, run here on the CPU (gloo) as it runs with NCCL on CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports harness from its folder
    spec = importlib.util.spec_from_file_location("gpu_check_fsdp_under_test", BENCHMARKS / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:FSDPHook. no distributed sampler was injected")  # a list of batches
def test_one_rank_fsdp_case_shards_checkpoints_and_exports(gpu_check: ModuleType, tmp_path: Path) -> None:
    report = gpu_check.fsdp_one_rank(gpu_check.TINY_MLP, torch.device("cpu"), 6, 1, 3, tmp_path)
    assert not dist.is_initialized()  # its group is gone again
    assert report["backend"] == "gloo" and report["param_dtype"] == "float32"
    assert set(report["per_step"]) == {"standard stack", "standard stack, FSDP"}
    assert report["ratio_fsdp_vs_plain"]["median"] > 0
    assert report["sharded_parameters"] and report["export_equals_weights"] and report["passed"]
    # the warm-up step before run() and 6 steps: the last checkpoint is of step 7
    assert report["checkpoint"]["step"] == 7 and report["checkpoint"]["sharded"]["world_size"] == 1
