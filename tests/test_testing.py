"""nvtrain.testing: ranks started as torchrun starts them, failures and time-outs reported with the rank's output."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nvtrain.testing import RanksFailed, free_port, load_script, run_ranks, spawn_ranks, start_ranks, wait_ranks

REPORT = textwrap.dedent(
    """
    import json, os, sys
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NVTRAIN_PLUGINS")
    from nvtrain.testing import scenario_ports
    print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "ports": scenario_ports(), "args": sys.argv[1:]}))
    """
)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(body)
    return path


def test_each_rank_gets_torchruns_variables_and_its_own_ports_per_scenario(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_PORT", "1")  # a launcher's own torchrun variables do not leak into the ranks
    monkeypatch.setenv("NVTRAIN_PLUGINS", "amp")  # nor does its nvtrain configuration
    outputs = run_ranks(_script(tmp_path, REPORT), ["a", "b"], nprocs=3, scenarios=2, timeout_s=60)
    reports = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    assert [r["env"]["RANK"] for r in reports] == ["0", "1", "2"]
    assert [r["env"]["LOCAL_RANK"] for r in reports] == ["0", "1", "2"]
    for report in reports:
        assert report["args"] == ["a", "b"]
        env = report["env"]
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == ("3", "3", "127.0.0.1")
        assert env["MASTER_PORT"] is None and env["NVTRAIN_PLUGINS"] is None
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
        assert report["ports"] == reports[0]["ports"] and len(set(report["ports"])) == 2


def test_cuda_true_leaves_the_gpus_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    outputs = run_ranks(_script(tmp_path, REPORT), nprocs=1, cuda=True, timeout_s=60)
    assert json.loads(outputs[0].strip().splitlines()[-1])["env"]["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_failing_rank_is_named_with_the_end_of_its_output(tmp_path: Path) -> None:
    script = _script(tmp_path, "import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit('rank one gave up')\n")
    with pytest.raises(RanksFailed, match=r"rank 1 exited with status 1:\nrank one gave up"):
        run_ranks(script, timeout_s=60)


def test_ranks_that_run_too_long_are_killed(tmp_path: Path) -> None:
    script = _script(tmp_path, "import time\ntime.sleep(120)\n")
    procs = start_ranks(script)
    started = time.monotonic()
    with pytest.raises(RanksFailed, match=r"the ranks did not finish within 0.5 s"):
        wait_ranks(procs, 0.5)
    assert time.monotonic() - started < 60
    assert all(proc.returncode is not None and proc.returncode < 0 for proc in procs)  # killed, and reaped


def test_free_port_can_be_bound() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert 0 < port < 65536


SCENARIOS = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from nvtrain.testing import run_scenarios

    seen = []

    def run(name, arg, manager):
        total = __import__("torch").ones(1) * (manager.rank + 1)
        dist.all_reduce(total)  # a working group of the scenario's own
        seen.append({"name": name, "arg": arg, "world": manager.world_size, "sum": int(total),
                     "port": __import__("os").environ["MASTER_PORT"]})

    run_scenarios(sys.argv[1:], run)
    print(json.dumps({"seen": seen, "initialized_after": dist.is_initialized()}))
    """
)


def test_run_scenarios_gives_each_scenario_a_group_on_its_own_port(tmp_path: Path) -> None:
    outputs = run_ranks(_script(tmp_path, SCENARIOS), ["first=a", "second"], scenarios=2, timeout_s=120)
    reports = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    for report in reports:
        assert [(s["name"], s["arg"], s["world"], s["sum"]) for s in report["seen"]] == [
            ("first", "a", 2, 3),
            ("second", "", 2, 3),
        ]
        assert report["seen"][0]["port"] != report["seen"][1]["port"]
        assert report["initialized_after"] is False  # each group is destroyed after its scenario
    assert reports[0]["seen"] == reports[1]["seen"]


def test_load_script_imports_a_worker_under_the_given_name(tmp_path: Path) -> None:
    path = tmp_path / "helper_worker.py"
    path.write_text("VALUE = 7\n")
    module = load_script(path, "nvtrain_test_helper_worker")
    assert module.VALUE == 7 and sys.modules["nvtrain_test_helper_worker"] is module
    with pytest.raises(ImportError, match="cannot import"):
        load_script(tmp_path / "missing.txt", "nvtrain_test_missing")


def test_full_tensors_copies_a_nested_state_off_its_tensors() -> None:
    import torch

    from nvtrain.testing import full_tensors

    weight = torch.ones(2)
    copied = full_tensors({"w": weight, "group": ({"step": torch.tensor(3)}, 5), "name": "x"})
    weight.add_(1)  # the copy stays as it was
    assert torch.equal(copied["w"], torch.ones(2)) and copied["group"][0]["step"].item() == 3
    assert copied["group"][1] == 5 and copied["name"] == "x"


def test_a_rank_printing_a_lot_does_not_block_the_others(tmp_path: Path) -> None:
    """Rank 1 prints far more than a pipe holds before rank 0 may finish: every output is read as it comes."""
    script = _script(
        tmp_path,
        textwrap.dedent(
            f"""
            import os, pathlib, time
            done = pathlib.Path({str(tmp_path)!r}) / "printed"
            if os.environ["RANK"] == "1":
                for _ in range(3000):
                    print("x" * 99, flush=True)
                done.touch()
            else:
                while not done.exists():
                    time.sleep(0.05)
            print("rank", os.environ["RANK"], "done")
            """
        ),
    )
    outputs = run_ranks(script, timeout_s=30)
    assert outputs[0].endswith("rank 0 done\n") and outputs[1].endswith("rank 1 done\n")
    assert len(outputs[1]) > 300_000


def test_the_rank_that_failed_first_is_quoted_first_and_a_blocked_peer_is_killed(tmp_path: Path) -> None:
    """Rank 1 fails; rank 2 fails after it; rank 0 would wait for rank 1 for minutes (as in a collective)."""
    script = _script(
        tmp_path,
        textwrap.dedent(
            """
            import os, sys, time
            rank = os.environ["RANK"]
            if rank == "1":
                sys.exit("the real bug, on rank one")
            if rank == "2":
                time.sleep(1)
                sys.exit("rank two gave up after rank one")
            print("rank zero waits for rank one", flush=True)
            time.sleep(120)
            """
        ),
    )
    started = time.monotonic()
    with pytest.raises(RanksFailed) as caught:
        run_ranks(script, nprocs=3, timeout_s=60)
    assert time.monotonic() - started < 40  # killed after a grace, not at the time-out
    message = str(caught.value)
    assert message.startswith("rank 1 exited with status 1:\nthe real bug, on rank one")
    assert "rank 2 exited with status 1 too:\nrank two gave up after rank one" in message
    assert "rank 0 was killed, still running after rank 1 failed:\nrank zero waits for rank one" in message


def test_one_deadline_for_all_ranks_and_each_ranks_output_on_a_time_out(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        textwrap.dedent(
            """
            import os, time
            print("rank", os.environ["RANK"], "started", flush=True)
            time.sleep(5 if os.environ["RANK"] == "0" else 120)
            """
        ),
    )
    started = time.monotonic()
    with pytest.raises(RanksFailed) as caught:
        run_ranks(script, timeout_s=7)
    assert time.monotonic() - started < 10  # not 5 s for rank 0, then 7 more for rank 1
    message = str(caught.value)
    assert message.startswith("the ranks did not finish within 7 s (still running: rank 1)")
    assert "rank 0 had exited with status 0:\nrank 0 started" in message
    assert "rank 1 was killed:\nrank 1 started" in message


def _sleeps(rank: int, port: int, seconds: float) -> None:
    time.sleep(seconds)


def _fails_on_rank_one(rank: int, port: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")


def test_spawn_ranks_gives_up_after_its_timeout_and_ends_the_ranks() -> None:
    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks import this module by name
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        with pytest.raises(RanksFailed, match=r"the 2 ranks did not finish within 2 s"):
            spawn_ranks(_sleeps, 60.0, timeout_s=2)


def test_spawn_ranks_raises_a_ranks_error_with_its_traceback() -> None:
    import torch.multiprocessing as mp

    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
            spawn_ranks(_fails_on_rank_one)
