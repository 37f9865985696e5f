"""Real 2-process FSDP jobs (gloo on the CPU): ``fsdp_worker.py`` on two ranks, and ``nvtrain train``
under torchrun with ``hooks: [{name: fsdp}]``.

The workers write their results to files; the assertions run here. Ranks are started as
subprocesses with the variables torchrun sets (never forked); one launch runs the SUITE
scenarios in turn, since starting processes dominates the time.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nvtrain.testing import rank_environment, run_ranks

WORKER = Path(__file__).with_name("fsdp_worker.py")
TIMEOUT_S = 180
#: Same global batches, different summation order (reduce-scatter of shard gradients vs one batch).
RTOL, ATOL = 1e-5, 1e-6
#: FSDP units with parameters in the worker's model (two Linear layers; the root has none of its own).
UNITS = 2

pytestmark = pytest.mark.slow


def launch(worker: Path, out: Path, *scenarios: str, nprocs: int = 2) -> None:
    """Start ``nprocs`` ranks of ``worker`` on the CPU, with the environment torchrun would give them."""
    run_ranks(worker, [str(out), *scenarios], nprocs=nprocs, scenarios=len(scenarios), timeout_s=TIMEOUT_S)


def load(out: Path, name: str) -> dict[str, Any]:
    return torch.load(out / name, weights_only=True)  # type: ignore[no-any-return]


def assert_same_across_ranks(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), "the ranks gathered different parameters"


def assert_close_to(params: list[torch.Tensor], reference: list[torch.Tensor], **tolerance: float) -> None:
    assert len(params) == len(reference)
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got, want, **({"rtol": RTOL, "atol": ATOL} | tolerance))


SUITE = (
    "equivalence",
    "accumulation",
    "clipping",
    "clipping_inf",
    "spike_skip",
    "ema",
    "ema_without_reshard",
    "bf16",
    "fp16",
)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp-suite")
    launch(WORKER, out, *SUITE)
    return out


def ranks(out: Path) -> list[dict[str, Any]]:
    return [load(out, f"rank{r}.pt") for r in (0, 1)]


def test_two_sharded_ranks_match_one_process_on_the_global_batches(suite: Path) -> None:
    out = suite / "equivalence"
    results = ranks(out)
    assert_same_across_ranks(results[0]["params"], results[1]["params"])
    assert_close_to(results[0]["params"], load(out, "reference.pt")["params"])
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world_size"] == 2
        assert result["sharded"] and result["param_types"] == ["DTensor"]
        # each rank holds half of every parameter's rows: Linear(4, 16) and Linear(16, 3) (rows 2 and 1)
        assert result["local_rows"] == ([8, 8, 2, 2] if rank == 0 else [8, 8, 1, 1])
        assert result["optimizer_holds_the_shards"]
        assert result["optimizer_state_types"] == ["DTensor", "Tensor"]  # exp_avg(_sq) sharded, step a scalar
        assert result["units"] == {"main": ["2", "0", ""]}
        assert result["sampler"] == "DistributedSampler"
        assert result["step_count"] == 4 and result["global_step_count"] == 8
        # without accumulation every micro-batch reduce-scatters each unit's gradients once
        assert result["reduce_scatters"] == [UNITS] * 4


def test_accumulation_reduce_scatters_once_per_optimizer_step(suite: Path) -> None:
    out = suite / "accumulation"
    results = ranks(out)
    for rank, result in enumerate(results):
        assert result["rank"] == rank and result["world_size"] == 2
        assert result["batch_count"] == 8 and result["step_count"] == 4
        # none on the accumulating micro-batch, one per unit on the one that ends the window
        assert result["reduce_scatters"] == [0, UNITS] * 4
        # FSDPHook initialised the group from the environment, and destroyed it on close
        assert result["initialised_during_run"] and not result["process_group_alive"]
    assert_same_across_ranks(results[0]["params"], results[1]["params"])
    assert_close_to(results[0]["params"], load(out, "reference.pt")["params"])


def test_clipping_uses_the_global_norm_over_all_shards(suite: Path) -> None:
    out = suite / "clipping"
    results = ranks(out)
    reference = load(out, "reference.pt")
    for result in results:
        assert result["norm_types"] == ["Tensor"]  # a plain tensor, the same on every rank
        assert len(result["norms"]) == 4
        for got, want in zip(result["norms"], reference["norms"], strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
        assert min(float(n) for n in result["norms"]) > 0.05  # every step was clipped
    assert_same_across_ranks(results[0]["params"], results[1]["params"])
    assert_close_to(results[0]["params"], reference["params"])


def test_the_infinity_norm_over_shards_counts_a_rank_with_empty_shards(suite: Path) -> None:
    out = suite / "clipping_inf"
    first, second = ranks(out)
    reference = load(out, "reference.pt")
    assert 0 in second["local_rows"]  # the head's one row went to rank 0: rank 1 holds empty shards
    for result in (first, second):
        assert len(result["norms"]) == 4
        for got, want in zip(result["norms"], reference["norms"], strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert_same_across_ranks(first["params"], second["params"])
    assert_close_to(first["params"], reference["params"])


def test_spike_skip_makes_every_rank_skip_the_same_step(suite: Path) -> None:
    out = suite / "spike_skip"
    results = ranks(out)
    for result in results:
        # the spike is in rank 1's shard only; rank 0 skips too
        assert result["skipped_steps"] == 1
        assert result["batch_count"] == 6 and result["step_count"] == 5
    assert_same_across_ranks(results[0]["params"], results[1]["params"])
    assert_close_to(results[0]["params"], load(out, "reference.pt")["params"])


def test_ema_of_a_sharded_model_stays_sharded_and_gathers_for_validation(suite: Path) -> None:
    out = suite / "ema"
    results = ranks(out)
    reference = load(out, "reference.pt")
    for result in results:
        assert result["kind"] == "ShardedAverage" and result["shard_types"] == ["DTensor"]
        assert result["num_updates"] == 4
        assert result["comms_per_update"] == [0, 0, 0, 0]  # each rank averages its own shards
        assert_close_to(list(result["weights"].values()), reference["ema"])
        torch.testing.assert_close(result["validation_loss"], reference["validation_loss"], rtol=RTOL, atol=ATOL)
        assert result["model_untouched_by_validation"]
    assert_same_across_ranks(list(results[0]["weights"].values()), list(results[1]["weights"].values()))


def test_ema_validation_without_reshard_after_forward_leaves_training_alone(suite: Path) -> None:
    """FSDP keeps gathered parameters after a forward with reshard_after_forward=False: the average's forward
    must not leave its weights there for the next training step, nor run on the model's own gathered ones."""
    out = suite / "ema_without_reshard"
    results = ranks(out)
    reference = load(out, "reference.pt")
    for result in results:
        assert_close_to(result["params"], reference["params"])  # validating at step 2 did not change training
        assert len(result["validation_losses"]) == 2  # at steps 2 and 4
        assert_close_to(result["validation_losses"], reference["validation_losses"])
        assert result["left_gathered"]  # the case under test: the model's forward left its weights gathered
        torch.testing.assert_close(
            result["validation_loss_after_own_forward"], reference["validation_losses"][-1], rtol=RTOL, atol=ATOL
        )
        assert result["model_untouched_by_validation"]
    assert_same_across_ranks(results[0]["params"], results[1]["params"])


def test_fp16_loss_scaling_skips_the_same_steps_on_every_rank(suite: Path) -> None:
    results = ranks(suite / "fp16")
    for result in results:
        assert "ShardedGradScaler" in result["scaler"]  # torch's, or a subclass of it
        assert result["skipped"] == [2]  # the inf was in rank 1's batch only; rank 0 skipped it too
        assert result["overflow_skips"] == 1.0  # one step, not one per rank that saw the inf
        assert result["scale"] == 2.0**9  # backed off once, alike
        assert result["finite"]
    assert_same_across_ranks(results[0]["params"], results[1]["params"])


def test_hybrid_sharding_replicates_over_groups_of_shards(tmp_path: Path) -> None:
    """replicate_degree=2 on 4 ranks: a (replicate, shard) mesh, each parameter split in two and kept twice;
    with clipping and EMA it still equals one process on the global batches."""
    from nvtrain_checkpoint import export_weights

    launch(WORKER, tmp_path, "hsdp", nprocs=4)
    out = tmp_path / "hsdp"
    results = [load(out, f"rank{r}.pt") for r in range(4)]
    reference = load(out, "reference.pt")
    for rank, result in enumerate(results):
        assert result["mesh"] == [[0, 1], [2, 3]] and result["mesh_dims"] == ("replicate", "shard")
        assert result["placements"] == ["(Replicate(), Shard(dim=0))"]
        # Linear(4, 16) and Linear(16, 3) split in two along dim 0, whichever replica the rank is in
        assert result["local_rows"] == ([8, 8, 2, 2] if rank % 2 == 0 else [8, 8, 1, 1])
        assert result["ema_comms_per_update"] == [0, 0, 0, 0]
        for got, want in zip(result["norms"], reference["norms"], strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)
        assert_close_to(result["ema"], reference["ema"])
    for other in results[1:]:
        assert_same_across_ranks(results[0]["params"], other["params"])
    assert_close_to(results[0]["params"], reference["params"])
    # The sharded checkpoint consolidates in one process into the weights the ranks gathered, bit for bit.
    exported = export_weights(out / "checkpoints", tmp_path / "model.pt")
    weights = torch.load(exported, weights_only=True)
    assert_same_across_ranks(list(weights.values()), results[0]["params"])
    averaged = torch.load(export_weights(out / "checkpoints", tmp_path / "ema.pt", ema=True), weights_only=True)
    assert_same_across_ranks(list(averaged.values()), results[0]["ema"])
    # A meta-device model on the same mesh: the replicas of a shard initialised alike (else the gathered
    # weights would differ between replicas), the two shards of a weight drawn apart (on the CPU they are
    # separate streams), and no rank's training RNG touched.
    for other in results[1:]:
        assert_same_across_ranks(results[0]["meta_init"], other["meta_init"])
    first_weight = results[0]["meta_init"][0]
    assert not torch.equal(first_weight[:8], first_weight[8:])
    assert all(result["rng_kept"] for result in results)


def test_bf16_mixed_precision_keeps_fp32_shards_and_outputs(suite: Path) -> None:
    out = suite / "bf16"
    results = ranks(out)
    for result in results:
        assert result["output_dtypes"] == ["torch.float32"]
        assert result["param_dtypes"] == ["torch.float32"] and result["grad_dtypes"] == ["torch.float32"]
    assert_same_across_ranks(results[0]["params"], results[1]["params"])
    # bf16 compute: close to the fp32 reference, not equal (8 bits of mantissa)
    assert_close_to(results[0]["params"], load(out, "reference.pt")["params"], rtol=0.0, atol=2e-2)
    assert any(
        not torch.equal(a, b) for a, b in zip(results[0]["params"], load(out, "reference.pt")["params"], strict=True)
    ), "bf16 compute should differ from fp32 somewhere"


def bf16_representable(tensor: torch.Tensor) -> bool:
    return torch.equal(tensor, tensor.to(torch.bfloat16).float())


def test_reduce_dtype_is_the_dtype_gradients_are_reduced_in(suite: Path) -> None:
    """bf16 compute, the first step's gradient shards after backward: reduced in fp32 (``reduce_dtype: fp32``)
    the mean of two ranks' bf16 gradients keeps bits bf16 lacks; reduced in bf16 (the default) it has none."""
    for result in ranks(suite / "bf16"):
        in_fp32, in_bf16 = result["grads_reduced_in_fp32"], result["grads_reduced_in_bf16"]
        assert [g.dtype for g in in_fp32] == [g.dtype for g in in_bf16] == [torch.float32] * 4
        assert not all(bf16_representable(g) for g in in_fp32)
        assert all(bf16_representable(g) for g in in_bf16)
        assert_close_to(in_bf16, in_fp32, rtol=0.0, atol=2e-2)  # the same gradients, one rounded to bf16


#: The built-in digits job, small, with FSDP (and EMA: its average of the sharded model validates; and
#: checkpoints: sharded, with the EMA's shards in them), its model built on the meta device.
JOB = """\
name: digits-fsdp
device: cpu
model:
  factory: "nvtrain.builtin.digits:make_classifier"
  kwargs: {hidden: 32, depth: 2, dropout: 0.0}
  init_device: meta
data: {factory: "nvtrain.builtin.digits:make_loaders", kwargs: {batch_size: 32}}
trainer: {max_steps: 8}
logging: {progress_bar: false, tensorboard: false, plot: false, log_every_n_steps: 4}
hooks:
  - {name: fsdp, shard_classes: [Linear]}
  - {name: ema, decay: 0.9}
  - {name: checkpoint, async_save: true}
"""


def test_nvtrain_train_under_torchrun_shards_with_hooks_fsdp(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(JOB, encoding="utf-8")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "nvtrain", "train", str(config), "--set", f"output_dir={tmp_path / 'out'}",
    ]  # fmt: skip
    process = subprocess.run(
        command, cwd=tmp_path, env=rank_environment(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert process.returncode == 0, (process.stdout + process.stderr)[-6000:]
    run = tmp_path / "out" / "digits-fsdp"
    rows = (run / "metrics.csv").read_text(encoding="utf-8").splitlines()
    header = rows[0].split(",")
    steps = [int(row.split(",")[0]) for row in rows[1:] if row.split(",")[header.index("train_loss")]]
    assert steps == [4, 8]  # rank 0 alone writes the metrics
    column = header.index("train_loss")
    losses = [float(row.split(",")[column]) for row in rows[1:] if row.split(",")[column]]
    assert all(math.isfinite(loss) for loss in losses)  # the shards FSDP allocated were initialised
    assert "val_ema_loss" in header
    checkpoint = run / "checkpoints" / "step_8"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_8"
    manifest = json.loads((checkpoint / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["sharded"]["world_size"] == 2  # the model was sharded: every rank wrote its shards
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(manifest["files"])
    rest = torch.load(checkpoint / "state.pt", weights_only=True)
    averaged = rest["hooks"]["ema:main"]["averaged"]  # the EMA's shards went to the DCP part, marked here
    assert [key for key, value in averaged.items() if isinstance(value, dict) and "__nvtrain_sharded__" in value]
