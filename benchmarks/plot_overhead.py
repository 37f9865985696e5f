"""Draw the dispatch-overhead plot, and print the result tables, from a pytest-benchmark JSON file.

    python -m pytest benchmarks --benchmark-json=.benchmarks/latest.json
    python benchmarks/plot_overhead.py .benchmarks/latest.json                  # docs/benchmarks-overhead.png
    python benchmarks/plot_overhead.py .benchmarks/latest.json --markdown       # tables for docs/benchmarks.md

The plot has two panels: one sweep of all 18 stages against the number of no-op
observers per stage (nvtrain's bus, the same plugins through pluggy directly, and
a plain Python loop over the same implementations), and the four update stages
against the number of update hooks. The tables give every group's median and
min, and both as ratios of the group's baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from nvtrain.atomic_files import replaced_atomically

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks-overhead.png"

STYLE = {
    "nvtrain": ("nvtrain bus", "tab:green", "o", "-"),
    "pluggy": ("pluggy, called directly", "tab:red", "s", "-"),
    "plain": ("plain Python loop (floor)", "tab:gray", "^", "--"),
}


def load(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    benchmarks = data.get("benchmarks")
    if not isinstance(benchmarks, list):
        raise ValueError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    return benchmarks


def series(benchmarks: list[dict[str, Any]], suite: str, x_key: str) -> dict[str, list[tuple[int, float, float]]]:
    """kind -> sorted (x, median us, min us) for one suite."""
    found: dict[str, list[tuple[int, float, float]]] = {}
    for bench in benchmarks:
        info = bench.get("extra_info", {})
        if info.get("suite") != suite:
            continue
        stats = bench["stats"]
        found.setdefault(info["kind"], []).append((int(info[x_key]), stats["median"] * 1e6, stats["min"] * 1e6))
    return {kind: sorted(points) for kind, points in found.items()}


def plot(benchmarks: list[dict[str, Any]], output: Path, machine: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("dispatch", "observers", "One sweep of all 18 stages", "no-op observers on each observer stage (K)"),
        ("update_path", "update_hooks", "The four update stages", "no-op update hooks in the orchestrator"),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for axis, (suite, x_key, title, xlabel) in zip(axes, panels, strict=True):
        data = series(benchmarks, suite, x_key)
        if not data:
            axis.set_visible(False)
            continue
        for kind, (label, color, marker, line) in STYLE.items():
            points = data.get(kind)
            if not points:
                continue
            xs = [p[0] for p in points]
            axis.plot(xs, [p[1] for p in points], line, color=color, marker=marker, label=label)
            axis.set_xticks(xs)
        axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("median time per sweep (us, log scale)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(f"Hook dispatch cost: nvtrain against direct pluggy calls ({machine})", fontsize=10)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    # written under a temporary name and renamed, so a failed draw never leaves half a PNG; the PNG gets a new
    # file's mode under the umask (0644 under the usual 022), not mkstemp's owner-only 0600
    try:
        with replaced_atomically(output, suffix=".png") as tmp:
            figure.savefig(tmp, dpi=110)
    finally:
        plt.close(figure)
    return output


def tables(benchmarks: list[dict[str, Any]]) -> str:
    """One markdown table per group: median, min, and both as ratios of the group's baseline.

    Loop groups (whose benchmarks record ``steps``) are given per step, with the
    single-step median and 10th percentile from ``extra_info["step_us"]`` beside them.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for bench in benchmarks:
        groups.setdefault(bench.get("group") or "", []).append(bench)
    lines: list[str] = []
    for group, members in sorted(groups.items()):
        for bench in members:
            lines += _comparison_table(group, bench.get("extra_info", {}).get("comparison"))
        baseline = next((b for b in members if "baseline" in b["name"]), None)
        if baseline is None:
            continue
        base_info = baseline.get("extra_info", {})
        steps = base_info.get("steps")
        base_step = base_info.get("step_us")
        unit = "per step" if steps else "per call"
        header = f"| benchmark | median {unit} | min {unit} | ratio (median) | ratio (min) |"
        rule = "| --- | --- | --- | --- | --- |"
        if base_step:
            header += " single step: median | p10 | ratio (median) | ratio (p10) |"
            rule += " --- | --- | --- | --- |"
        lines += [f"**{group}**", "", header, rule]
        base = baseline["stats"]
        for bench in sorted(members, key=lambda b: (b is not baseline, b["stats"]["median"])):
            stats, info = bench["stats"], bench.get("extra_info", {})
            divisor = info.get("steps") or 1
            row = (
                f"| {bench['name']} | {_us(stats['median'] / divisor)} | {_us(stats['min'] / divisor)} | "
                f"{stats['median'] / base['median']:.3f}x | {stats['min'] / base['min']:.3f}x |"
            )
            step = info.get("step_us")
            if base_step and step:
                row += (
                    f" {_us(step['median'] / 1e6)} | {_us(step['p10'] / 1e6)} | "
                    f"{step['median'] / base_step['median']:.3f}x | {step['p10'] / base_step['p10']:.3f}x |"
                )
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def _comparison_table(group: str, result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    lines = [
        f"**{group}** ({result['steps']} steps x {result['rounds']} rounds, round-robin)",
        "",
        "| loop | run: median per step | run: min | single step: p10 | ratio (run median) | ratio (run min) "
        "| ratio (step p10) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, loop in result["loops"].items():
        ratio = result["ratios"][name]
        lines.append(
            f"| {name} | {_us(loop['run_us']['median'] / 1e6)} | {_us(loop['run_us']['min'] / 1e6)} | "
            f"{_us(loop['step_us']['p10'] / 1e6)} | {ratio['run_median']:.3f}x | {ratio['run_min']:.3f}x | "
            f"{ratio['step_p10']:.3f}x |"
        )
    return [*lines, ""]


def _us(seconds: float) -> str:
    micro = seconds * 1e6
    return f"{micro:.2f} us" if micro < 100 else f"{micro:,.0f} us"


def _machine(path: Path) -> str:
    info = json.loads(path.read_text(encoding="utf-8")).get("machine_info", {})
    cpu = info.get("cpu", {}).get("brand_raw") or info.get("processor") or "CPU"
    return f"{cpu}, Python {info.get('python_version', '?')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_file", type=Path, metavar="JSON", help="written by pytest --benchmark-json=JSON")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="the PNG to write")
    parser.add_argument("--markdown", action="store_true", help="print the tables instead of drawing")
    args = parser.parse_args(argv)
    try:
        benchmarks = load(args.json_file)
    except (OSError, ValueError) as err:
        print(f"plot_overhead: {err}", file=sys.stderr)
        return 2
    if args.markdown:
        print(tables(benchmarks))
        return 0
    if not series(benchmarks, "dispatch", "observers"):
        print(f"plot_overhead: {args.json_file} holds no dispatch benchmarks (run benchmarks/test_dispatch.py)",
              file=sys.stderr)
        return 2
    print(plot(benchmarks, args.output, _machine(args.json_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
