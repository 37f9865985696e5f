#!/usr/bin/env bash
# Everything GPU-relevant in one run, for a short session on a borrowed CUDA machine (under 8 minutes):
#
#   bash benchmarks/gpu_suite.sh [YARDSTICK_DIR] [OUT_DIR]
#
# 1. the tests marked cuda on their own first (their results are in even if the whole suite runs out of
#    time), then the whole test suite (tests, plugins) with CUDA visible: nothing skips for want of a GPU
#    (pytest-xdist, when installed, spreads it over the cores; a machine without network needs its wheel,
#    and execnet's, brought along);
# 2. benchmarks/gpu_check.py --device cuda: loop cost without checkpoints, checkpoint cost apart
#    (blocked time per save, writer time, bytes, throughput), host syncs per step;
# 3. the yardsticks kept outside the repository, gpu_bench.py and ckpt_cost.py, from YARDSTICK_DIR
#    (each one that is absent is skipped, with a line saying so).
#
# Everything goes to OUT_DIR (default gpu-report-<UTC time>): env.txt (GPU, driver, versions),
# one log per stage, cuda-tests.xml and pytest.xml, gpu_check.json, summary.txt. It fails fast: no CUDA device ends it
# at once (exit 0: nothing to measure here), a broken environment (torch or nvtrain not importable,
# CUDA not initialising) exits 2 before any stage, and every stage runs under its own time limit.
# Stages are independent, so a failing one does not stop the next: the last lines are a summary,
# and the exit status is 1 when any stage failed or ran out of time.
#
# Time limits in seconds (environment): CUDA_TESTS_TIMEOUT (90), TESTS_TIMEOUT (240), CHECK_TIMEOUT (120),
# YARDSTICK_TIMEOUT (40).
# PYTHON picks the interpreter (default: python).

set -euo pipefail

YARDSTICKS="${1:-}"
OUT="${2:-gpu-report-$(date -u +%Y%m%dT%H%M%SZ)}"
PYTHON="${PYTHON:-python}"
CUDA_TESTS_TIMEOUT="${CUDA_TESTS_TIMEOUT:-90}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-240}"
CHECK_TIMEOUT="${CHECK_TIMEOUT:-120}"
YARDSTICK_TIMEOUT="${YARDSTICK_TIMEOUT:-40}"
[[ "$OUT" == /* ]] || OUT="$PWD/$OUT"  # relative paths are relative to where the script was started
[[ -z "$YARDSTICKS" || "$YARDSTICKS" == /* ]] || YARDSTICKS="$PWD/$YARDSTICKS"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# -- fail fast: is there anything to measure, and can Python see it? -----------------------------------
if ! probe="$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()), torch.__version__)' 2>&1)"; then
    echo "gpu_suite: error: cannot import torch with $PYTHON: ${probe##*$'\n'}" >&2
    exit 2
fi
if [[ "${probe%% *}" != "1" ]]; then
    echo "gpu_suite: no CUDA device: nothing to measure on this machine (torch ${probe#* }); run it where torch.cuda.is_available()"
    exit 0
fi
mkdir -p "$OUT"
if ! "$PYTHON" - >"$OUT/env.txt" 2>&1 <<'PY'
import datetime, platform, sys
import pluggy, torch
import nvtrain
torch.zeros(1, device="cuda").add_(1)  # CUDA initialises, and a kernel runs
print("date (UTC):", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print("python:", sys.version.split()[0], platform.platform())
print("torch:", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
print("pluggy:", pluggy.__version__, "| nvtrain:", nvtrain.__version__)
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    print(f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")
PY
then
    echo "gpu_suite: error: the environment is not usable (see $OUT/env.txt):" >&2
    tail -n 3 "$OUT/env.txt" >&2
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi >>"$OUT/env.txt" 2>&1 || true
git -C "$ROOT" log -1 --format='commit: %H %s' >>"$OUT/env.txt" 2>/dev/null || true
sed -n '1,/^cuda:/p' "$OUT/env.txt"

# -- the stages ---------------------------------------------------------------------------------------
SUMMARY=()
STATUS=0

stage() {  # stage NAME TIMEOUT LOG COMMAND...
    local name="$1" limit="$2" log="$3"
    shift 3
    local start=$SECONDS rc=0
    echo "== $name (at most ${limit} s) -> $log"
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$log" 2>&1 || rc=$?
    local took=$((SECONDS - start)) verdict="ok"
    if ((rc == 124 || rc == 137)); then
        verdict="TIMED OUT after ${limit} s"
    elif ((rc != 0)); then
        verdict="FAILED (exit $rc)"
    fi
    ((rc == 0)) || STATUS=1
    SUMMARY+=("$(printf '%-24s %-22s %4d s  %s' "$name" "$verdict" "$took" "$log")")
    tail -n 3 "$OUT/$log" | sed 's/^/   | /'
}

run_tests() {  # with pytest-xdist over the cores; without it, tests/ and plugins/ as two pytest processes at once
    local common=(-q -p no:cacheprovider -rfEs)
    if "$PYTHON" -c 'import xdist' 2>/dev/null; then
        "$PYTHON" -m pytest tests plugins "${common[@]}" -n "$(($(nproc) > 12 ? 12 : $(nproc)))" \
            --junitxml="$OUT/pytest.xml"
        return
    fi
    "$PYTHON" -m pytest tests "${common[@]}" --junitxml="$OUT/pytest-tests.xml" >"$OUT/tests-core.log" 2>&1 &
    local core=$!
    "$PYTHON" -m pytest plugins "${common[@]}" --junitxml="$OUT/pytest-plugins.xml" >"$OUT/tests-plugins.log" 2>&1 &
    local plugins=$!
    local rc=0
    wait "$core" || rc=$?
    wait "$plugins" || rc=$((rc ? rc : $?))
    tail -n 15 "$OUT/tests-core.log" "$OUT/tests-plugins.log"
    return "$rc"
}
export -f run_tests
export PYTHON OUT
# The CUDA-only tests first, on their own: their results are in even if the whole suite runs out of time.
stage "CUDA-marked tests" "$CUDA_TESTS_TIMEOUT" cuda_tests.log \
    "$PYTHON" -m pytest tests plugins -m cuda -q -p no:cacheprovider -rfEs --junitxml="$OUT/cuda-tests.xml"
stage "tests (CUDA visible)" "$TESTS_TIMEOUT" tests.log bash -c run_tests
stage "gpu_check --device cuda" "$CHECK_TIMEOUT" gpu_check.txt \
    "$PYTHON" benchmarks/gpu_check.py --device cuda --json-out "$OUT/gpu_check.json"
for yardstick in gpu_bench.py ckpt_cost.py; do
    if [[ -n "$YARDSTICKS" && -f "$YARDSTICKS/$yardstick" ]]; then
        stage "$yardstick" "$YARDSTICK_TIMEOUT" "${yardstick%.py}.txt" "$PYTHON" "$YARDSTICKS/$yardstick"
    else
        SUMMARY+=("$(printf '%-24s %s' "$yardstick" "skipped (not in '${YARDSTICKS:-no folder given}')")")
    fi
done

# -- summary -------------------------------------------------------------------------------------------
{
    echo "gpu_suite summary ($(date -u +%FT%TZ), $SECONDS s in all, results in $OUT)"
    printf '%s\n' "${SUMMARY[@]}"
    for group in cuda-tests pytest; do
        compgen -G "$OUT/$group*.xml" >/dev/null || continue
        echo "[$group]"
        "$PYTHON" - "$OUT"/"$group"*.xml <<'PY' || true
import sys, xml.etree.ElementTree as ET
root = ET.Element("all")
for path in sys.argv[1:]:
    tree = ET.parse(path).getroot()
    root.extend([tree] if tree.tag == "testsuite" else list(tree))
suites = list(root)
count = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
print(f"tests: {count['tests']} run, {count['failures']} failed, {count['errors']} errors, {count['skipped']} skipped")
reasons = {}
for case in root.iter("testcase"):
    skipped = case.find("skipped")
    if skipped is not None:
        reason = skipped.get("message", "").replace("\n", " ")[:100]
        reasons[reason] = reasons.get(reason, 0) + 1
for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
    print(f"  skipped {count}: {reason}")  # "needs a CUDA device" here means CUDA was not visible to pytest
for case in root.iter("testcase"):
    if case.find("failure") is not None or case.find("error") is not None:
        print("  failed:", case.get("classname"), case.get("name"))
PY
    done
    if [[ -f "$OUT/gpu_check.json" ]]; then
        "$PYTHON" - "$OUT/gpu_check.json" <<'PY' || true
import json, sys
report = json.load(open(sys.argv[1]))
nan = float("nan")


def figure(section, *keys):
    for key in keys:
        section = section.get(key, {}) if isinstance(section, dict) else {}
    return section if isinstance(section, (int, float)) else nan


for label, model in report["models"].items():
    failed = [f"{key}: {model[key]['error']}" for key in ("sync_check", "loop", "checkpoint") if "error" in model.get(key, {})]
    loop, ckpt = model.get("loop", {}), model.get("checkpoint", {})
    print(
        f"gpu_check {label}: no plugins {figure(loop, 'ratio_no_plugins', 'median'):.3f}x, "
        f"standard stack {figure(loop, 'ratio_standard_stack', 'median'):.3f}x; steady state: no plugins "
        f"{figure(loop, 'steady_ratio_no_plugins', 'median'):.3f}x, standard stack "
        f"{figure(loop, 'steady_ratio_standard_stack', 'median'):.3f}x (target <= 1.03x); "
        f"with durable saves sync {figure(ckpt, 'ratio_sync_vs_hand_written_durable', 'median'):.3f}x, "
        f"async {figure(ckpt, 'ratio_async_vs_hand_written_durable', 'median'):.3f}x "
        f"(writer thread {figure(ckpt, 'ratio_async_thread_vs_hand_written_durable', 'median'):.3f}x); "
        f"steps during a write {figure(ckpt, 'async_steps_during_writes', 'ratio'):.3f}x "
        f"(writer thread {figure(ckpt, 'async_thread_steps_during_writes', 'ratio'):.3f}x; "
        "target <= 1.05x); "
        f"sync check {model.get('sync_check')}"
        + (f"; FAILED {'; '.join(failed)}" if failed else "")
    )
if "error" in report.get("fsdp", {}):
    print(f"gpu_check fsdp: FAILED {report['fsdp']['error']}")
if not report.get("complete", True):
    print(f"gpu_check: INCOMPLETE ({report.get('stopped', 'stopped early')}); the figures above are what it measured")
PY
    fi
} | tee "$OUT/summary.txt"
exit "$STATUS"
