#!/usr/bin/env bash
# One prepared, offline check of the GPU-only parts, for a machine with an NVIDIA GPU:
#
#   bash tools/gpu_check.sh [WHEELS_DIR]
#
# Runs with the Python on PATH (or $PYTHON) in an environment that already has a CUDA torch; with
# WHEELS_DIR, first installs this project and what it lists from wheels placed there, with no package
# index (pip --no-index --find-links WHEELS_DIR). Then it prints the GPU and the versions found and
# runs, each on its own, reporting PASS / FAIL / NOT RUN with pytest's counts and every skip's reason:
#   1. the GPU subset, tests/test_gpu.py: eviction scoring and the correction on CUDA tensors against
#      the CPU, the learner with Transformer Engine layers (float32 and bf16 against the local spec and
#      transformers, FP8 against bf16 where the GPU supports it), the SGLang engine on the GPU with
#      eviction against the reference decoder (StreamingLLM with CUDA graphs; R-KV per layer and shared,
#      for which the engine must have switched CUDA graphs off). A skip there passes only for an
#      optional part named in OPTIONAL_SKIPS (Transformer Engine not installed, a GPU without FP8) and
#      is listed; any other skip fails it. NOT RUN: no CUDA device, or no test of it ran;
#   2. the pure-math tests on this machine (correction, loss, policies, HF map, config); skips listed.
#      GPU_CHECK_CPU_TESTS (space-separated test paths) replaces that list (the suite runs this script
#      with one small module: the four are in the suite anyway).
# Exit status: 0 when both parts ran and passed, 1 when one failed, 2 when none failed but one was NOT
# RUN (e.g. no CUDA device). The full log is in runs/gpu_check.log.
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOG=runs/gpu_check.log
mkdir -p runs
: > "$LOG"
export HF_HUB_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export SGLANG_USE_CPU_ENGINE=0

if [ -n "${1:-}" ]; then
    echo "[gpu_check] installing from $1 (no index) ..."
    "$PY" -m pip install --no-index --find-links "$1" -e '.[gpu]' >> "$LOG" 2>&1 \
        || { echo "[gpu_check] FAIL install (see $LOG)"; exit 1; }
fi

echo "[gpu_check] machine:"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/  /'
"$PY" -W ignore - <<'PYEOF'
import importlib
import torch
print(f"  torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}",
      f"capability {torch.cuda.get_device_capability() if torch.cuda.is_available() else '-'}")
for name in ("transformer_engine", "apex", "sglang", "sgl_kernel", "megatron.core", "flashinfer"):
    try:
        module = importlib.import_module(name)
        print(f"  {name}: {getattr(module, '__version__', 'present')}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {name}: not usable ({type(exc).__name__})")
PYEOF

# skip reasons (pytest's, a regular expression) that leave the GPU subset passing: optional parts
OPTIONAL_SKIPS='^(Transformer Engine is not installed|FP8 not supported)'

verdict() {  # part log, pytest exit code, allowed skip reasons (regex): prints the outcome; 0 PASS, 1 FAIL, 2 NOT RUN
    "$PY" - "$@" <<'PYEOF'
import re
import sys

log, code, allowed = sys.argv[1], int(sys.argv[2]), re.compile(sys.argv[3])
lines = [line.rstrip() for line in open(log, errors="replace")]
# the last line like "== 3 passed, 2 skipped, 1 warning in 4.20s ==" (or "no tests ran in ...")
summary = next((s for s in (line.strip("= ") for line in reversed(lines))
                if re.search(r"\bin [\d.]+s( \([\d:]+\))?$", s) and re.match(r"(\d+ \w+|no tests ran)\b", s)), None)
counts = {}
for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", summary or ""):
    counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
skips = [(int(m[1]), m[2], m[3]) for m in (re.match(r"SKIPPED \[(\d+)\] (.+?): (.*)$", line) for line in lines) if m]
for line in lines:
    if re.match(r"(FAILED|ERROR) ", line):
        print("  " + line)
for n, where, reason in skips:
    print(f"  skipped {n}: {reason} ({where}){'' if allowed.search(reason) else '  <- not an optional part'}")
print(f"  pytest exit code {code}: {summary or 'no summary line'}")
outcome = "PASS"
if summary is None or code not in (0, 1, 5):
    outcome = "FAIL"  # interrupted, internal or usage error, or output we cannot read
elif counts.get("failed", 0) or counts.get("error", 0) or code == 1:
    outcome = "FAIL"
elif code == 5 or counts.get("passed", 0) == 0:
    outcome = "NOT RUN"  # nothing collected, or every test skipped
elif sum(n for n, _, _ in skips) != counts.get("skipped", 0):
    print("  the skip reasons listed do not add up to the skipped count")
    outcome = "FAIL"
elif any(not allowed.search(reason) for _, _, reason in skips):
    outcome = "FAIL"
sys.exit({"PASS": 0, "FAIL": 1, "NOT RUN": 2}[outcome])
PYEOF
}

failed=0 not_run=0
record() {  # part name, verdict's status
    case "$2" in
        0) echo "[gpu_check] PASS $1" ;;
        2) not_run=1; echo "[gpu_check] NOT RUN $1" ;;
        *) failed=1; echo "[gpu_check] FAIL $1" ;;
    esac
}
run() {  # name, allowed skip reasons, pytest arguments...
    local name="$1" allowed="$2"; shift 2
    echo "[gpu_check] $name ..."
    # in-process (-o addopts=: not pytest.ini's two xdist workers; xdist need not be installed here)
    "$PY" -m pytest -o addopts= -q -rfEs -p no:cacheprovider "$@" > runs/gpu_check_part.log 2>&1
    local code=$?
    cat runs/gpu_check_part.log >> "$LOG"
    verdict runs/gpu_check_part.log "$code" "$allowed" > runs/gpu_check_verdict.txt 2>&1
    local status=$?
    tail -n 40 runs/gpu_check_verdict.txt
    record "$name" "$status"
}

devices=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>>"$LOG")
if [ "${devices:-0}" -gt 0 ] 2>/dev/null; then
    run "GPU subset" "$OPTIONAL_SKIPS" tests/test_gpu.py -v
else
    echo "[gpu_check] GPU subset: no CUDA device visible to torch"
    record "GPU subset" 2
fi
# shellcheck disable=SC2086  # (a list of paths)
run "pure math on this machine" "" ${GPU_CHECK_CPU_TESTS:-tests/test_correction.py tests/test_kv_policies.py tests/test_hf_map.py tests/test_config.py}

echo "[gpu_check] log: $LOG"
if [ $failed -ne 0 ]; then exit 1; elif [ $not_run -ne 0 ]; then exit 2; fi
exit 0
