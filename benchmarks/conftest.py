"""Benchmark helpers: ``--quick``, one intra-op thread, and ratios against each group's baseline.

Run the suite with ``python -m pytest benchmarks`` (the normal test run does not
collect this folder); ``--quick`` takes fewer rounds and steps so the whole suite
finishes in under two minutes on two cores. Each group has one benchmark whose
name contains ``baseline``; the summary prints every other member's median time
as a ratio of it (the ratio of the minimums in brackets), so the figures compare
like with like from the same run.

The suite imports its harness (``benchmarks/harness.py``) as ``harness``, as the
scripts in this folder do; this folder goes on ``sys.path`` first, since pytest's
``importlib`` import mode adds none.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from harness import StampedBatches, Workload


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        default=False,
        help="fewer rounds and steps: the whole benchmark suite in under two minutes on 2 cores",
    )


@attrs.frozen
class Scale:
    """How long to measure: ``pick(full, quick)`` returns the number for the mode in use."""

    quick: bool

    def pick(self, full: int, quick: int) -> int:
        return quick if self.quick else full


@pytest.fixture(scope="session")
def scale(request: pytest.FixtureRequest) -> Scale:
    return Scale(quick=bool(request.config.getoption("--quick")))


@pytest.fixture
def time_loop(benchmark: Any) -> Callable[..., None]:
    """Time a loop ``Workload`` with pytest-benchmark: a fresh ``prepare()`` per round, untimed.

    ``time_loop(workload, batches, rounds, before_round=None, **info)``: ``info`` goes
    to ``extra_info`` (``suite``, ``kind``...), and so do the single-step figures of
    ``batches`` (a ``StampedBatches``) afterwards. ``before_round`` runs before each
    round's ``prepare()`` (e.g. to empty a checkpoint directory).
    """

    def time(
        workload: Workload,
        batches: StampedBatches,
        rounds: int,
        before_round: Callable[[], object] | None = None,
        **info: Any,
    ) -> None:
        benchmark.extra_info.update(steps=workload.units, **info)

        def setup() -> tuple[tuple[Any], dict[str, Any]]:
            if before_round is not None:
                before_round()
            return (workload.prepare(),), {}

        def teardown(state: Any) -> None:
            if workload.cleanup is not None:
                workload.cleanup(state)

        benchmark.pedantic(workload.run, setup=setup, teardown=teardown, rounds=rounds, warmup_rounds=1)
        benchmark.extra_info["step_us"] = {key: ns / 1e3 for key, ns in batches.step_figures().items()}

    return time


@pytest.fixture
def time_sweep(benchmark: Any, scale: Scale) -> Callable[..., None]:
    """Time a dispatch ``Workload`` (no state): many iterations per round; ``info`` goes to ``extra_info``."""

    def time(workload: Workload, **info: Any) -> None:
        benchmark.extra_info.update(**info)
        benchmark.pedantic(
            workload.run,
            args=(None,),
            rounds=scale.pick(40, 8),
            iterations=scale.pick(200, 50),
            warmup_rounds=1,
        )

    return time


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Per-step overhead is measured on one intra-op thread, as the targets are stated."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups: dict[str, list[Any]] = {}
    for bench in session.benchmarks:
        if not bench.stats.data:  # the benchmark failed before it timed anything
            continue
        groups.setdefault(bench.group or "", []).append(bench)
    terminalreporter.write_sep("-", "ratios against each group's baseline (median; min in brackets)")
    per = _per_unit
    for group, benches in sorted(groups.items()):
        for bench in benches:
            _comparison(terminalreporter, group, bench.extra_info.get("comparison"))
        baseline = next((b for b in benches if "baseline" in b.name), None)
        if baseline is None:
            continue
        base, base_min = baseline.stats.median, baseline.stats.min
        unit = "per step" if baseline.extra_info.get("steps") else "per call"
        terminalreporter.write_line(f"[{group}] baseline {baseline.name}: {per(baseline, base):.2f} us {unit}")
        for bench in sorted(benches, key=lambda b: b.stats.median):
            if bench is baseline:
                continue
            ratio, ratio_min = bench.stats.median / base, bench.stats.min / base_min
            terminalreporter.write_line(
                f"    {bench.name:60s} {per(bench, bench.stats.median):10.2f} us  {ratio:6.3f}x  ({ratio_min:.3f}x)"
            )
        _step_ratios(terminalreporter, baseline, benches)


def _comparison(terminalreporter: Any, group: str, result: dict[str, Any] | None) -> None:
    """An interleaved loop comparison (``harness.compare_loops``), per step."""
    if not result:
        return
    terminalreporter.write_line(
        f"[{group}] {result['steps']} steps x {result['rounds']} rounds; us per step: run median, run min, "
        "single-step p10; ratios to the first"
    )
    for name, loop in result["loops"].items():
        ratio = result["ratios"][name]
        terminalreporter.write_line(
            f"    {name:36s} {loop['run_us']['median']:10.1f} {loop['run_us']['min']:10.1f} "
            f"{loop['step_us']['p10']:10.1f}   {ratio['run_median']:.3f}x  {ratio['run_min']:.3f}x  "
            f"{ratio['step_p10']:.3f}x"
        )


def _step_ratios(terminalreporter: Any, baseline: Any, benches: list[Any]) -> None:
    """For loop groups: ratios of single-step times (from StampedBatches), the steadier figures."""
    base = baseline.extra_info.get("step_us")
    if not base:
        return
    figures = " / ".join(f"{base[key]:.1f}" for key in ("median", "p10", "min"))
    terminalreporter.write_line(f"    single steps (median / p10 / min), baseline {figures} us:")
    for bench in benches:
        step = bench.extra_info.get("step_us")
        if bench is baseline or not step:
            continue
        ratios = " / ".join(f"{step[key] / base[key]:.3f}x" for key in ("median", "p10", "min"))
        terminalreporter.write_line(f"      {bench.name:58s} {ratios}")


def _per_unit(bench: Any, seconds: float) -> float:
    """Microseconds per step for loop benchmarks (a round is ``steps`` steps), else per call."""
    return seconds * 1e6 / (bench.extra_info.get("steps") or 1)
