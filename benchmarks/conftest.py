"""Benchmark helpers: ``--quick``, one intra-op thread, and ratios against each group's baseline.

Run the suite with ``python -m pytest benchmarks`` (the normal test run does not
collect this folder); ``--quick`` takes fewer rounds and steps so the whole suite
finishes in under two minutes on two cores. Each group has one benchmark whose
name contains ``baseline``; the summary prints every other member's median time
as a ratio of it (the ratio of the minimums in brackets), so the figures compare
like with like from the same run.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch


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
    for group, benches in sorted(groups.items()):
        baseline = next((b for b in benches if "baseline" in b.name), None)
        if baseline is None:
            continue
        base, base_min = baseline.stats.median, baseline.stats.min
        terminalreporter.write_line(f"[{group}] baseline {baseline.name}: {base * 1e6:.2f} us")
        for bench in sorted(benches, key=lambda b: b.stats.median):
            if bench is baseline:
                continue
            ratio, ratio_min = bench.stats.median / base, bench.stats.min / base_min
            terminalreporter.write_line(
                f"    {bench.name:60s} {bench.stats.median * 1e6:10.2f} us  {ratio:6.3f}x  ({ratio_min:.3f}x)"
            )
