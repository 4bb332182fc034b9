#!/usr/bin/env bash
# One prepared, offline check of the GPU-only parts, for a machine with an NVIDIA GPU:
#
#   bash tools/gpu_check.sh [WHEELS_DIR]
#
# Runs with the Python on PATH (or $PYTHON) in an environment that already has a CUDA torch; with
# WHEELS_DIR, first installs this project and what it lists from wheels placed there, with no package
# index (pip --no-index --find-links WHEELS_DIR). Then it prints the GPU and the versions found and
# runs, each on its own, reporting PASS / FAIL / SKIP (with the reason):
#   1. the GPU subset, tests/test_gpu.py: eviction scoring and the correction on CUDA tensors against
#      the CPU, the learner with Transformer Engine layers (bf16, FP8 where the GPU supports it) against
#      the local spec and transformers, the SGLang engine on the GPU with eviction against the
#      reference decoder (StreamingLLM with CUDA graphs; R-KV per layer and shared, for which the
#      engine must have switched CUDA graphs off);
#   2. the pure-math tests on this machine (correction, loss, policies, HF map, config).
# Exit status: 0 when nothing failed (skips allowed), 1 otherwise. The full log is in runs/gpu_check.log.
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

failed=0
run() {  # name, pytest arguments...
    local name="$1"; shift
    echo "[gpu_check] $name ..."
    "$PY" -m pytest -q -rs -p no:cacheprovider "$@" > runs/gpu_check_part.log 2>&1
    local code=$?
    cat runs/gpu_check_part.log >> "$LOG"
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|skipped|error" runs/gpu_check_part.log | tail -n 15 | sed 's/^/  /'
    if [ $code -ne 0 ] && [ $code -ne 5 ]; then failed=1; echo "[gpu_check] FAIL $name"; else echo "[gpu_check] PASS $name"; fi
}
run "GPU subset" tests/test_gpu.py -v
run "pure math on this machine" tests/test_correction.py tests/test_kv_policies.py tests/test_hf_map.py tests/test_config.py

echo "[gpu_check] log: $LOG"
exit $failed
