#!/usr/bin/env bash
# The GPU check, as the lent GPU machine runs it (tools/gpu_check.py says what it checks and reports):
#
#   bash tools/gpu_check.sh [--out DIR]         on the GPU machine: install the carried wheel set where
#                                               megatron-core is missing, run every part, write DIR/gpu_check.json
#   bash tools/gpu_check.sh --prepare|--dry-run here: build the wheel set (.gpu_wheels) / and say what would run
#   bash tools/gpu_check.sh --help
#
# With the device tool: run(command="bash tools/gpu_check.sh --out $OUT", carry=[".gpu_wheels"], timeout_s=540).
# Uses the Python on PATH (python3, the one that holds a CUDA torch there) or $PYTHON.
set -u
cd "$(dirname "$0")/.."
# (as a module from the root: the lent machine has no project installed)
exec "${PYTHON:-python3}" -m sparse_rl_mega.cli.gpu_check "$@"
