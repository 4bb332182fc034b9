#!/usr/bin/env bash
# Creates the project's CPU virtual environment (.venv by default) with exact pins, then installs the
# project itself (editable) and the SGLang plugin. Idempotent: when the venv already matches the lock
# file and the project, it returns in about a second.
#
#   bash tools/setup_env.sh [VENV_DIR]
#
# Needs python3.11 and PyPI. torch 2.13.0+cpu must be findable by pip (these machines keep it on
# local disk; elsewhere set TORCH_WHEEL=/path/to/torch-2.13.0+cpu-...whl or use an index that has it).
# GPU machines use `pip install -e .[gpu]` in their own CUDA environment instead (see docs/environment.md).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
LOCK=$ROOT/requirements/cpu-lock.txt
CONSTRAINTS=$ROOT/requirements/constraints.txt
STAMP=$VENV/.sparse_rl_mega.stamp
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the CPU lock file is for Python 3.11, got " + sys.version'

# The stamp records what was installed; a match means nothing to do.
want=$(cat "$LOCK" "$CONSTRAINTS" "$ROOT/setup.py" "$ROOT/tools/cpu_shims/sgl_kernel/__init__.py" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

t0=$(date +%s)
echo "[setup_env] building $VENV (first run takes 2-4 minutes)"
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# pip's own notices about index locations of this machine's pip config that do not exist (one line per
# package looked up, ~180 lines on a fresh venv) say nothing about the project: dropped; all else shows
pip_install() {
  $PIP install "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pip_install -q "setuptools>=77" wheel
# torch first, on its own, so the CPU wheel is what lands (a CUDA build would be several GB).
pip_install -c "$CONSTRAINTS" --no-deps ${TORCH_WHEEL:-torch==2.13.0}
# Everything else exactly as locked, without the resolver: sglang pins torch 2.14.1 and ~35 CUDA packages
# that a CPU venv must not get.
grep -v '^torch==' "$LOCK" > "$VENV/.lock-no-torch.txt"
pip_install -c "$CONSTRAINTS" --no-deps -r "$VENV/.lock-no-torch.txt"

SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# PyPI's torchvision is a CUDA build whose op library cannot load beside CPU torch; its fake/autograd
# op registrations are skipped when the ops are absent (SGLang only imports torchvision, never calls it).
"$VENV/bin/python" - "$SITE/torchvision/__init__.py" <<'PYEOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n    datasets,"
new = ("if extension._has_ops():\n    from torchvision import _autograd_registrations, _meta_registrations  # noqa\n"
       "from torchvision import (\n    datasets,")
if old in text:
    open(path, "w").write(text.replace(old, new))
elif new not in text:
    sys.exit(f"{path}: unexpected layout, torchvision import fix not applied")
PYEOF
# sgl_kernel has no CPU wheel on PyPI: install the project's stand-in.
rm -rf "$SITE/sgl_kernel"
cp -r "$ROOT/tools/cpu_shims/sgl_kernel" "$SITE/sgl_kernel"

# The project (and its SGLang plugin entry point), editable, no dependency resolution.
pip_install --no-deps --no-build-isolation -e "$ROOT"

if "$VENV/bin/python" -m pip list 2>/dev/null | grep -iqE '^(nvidia-|cuda-|flashinfer|sglang-kernel)'; then
  echo "[setup_env] CUDA packages got into a CPU venv" >&2; exit 1
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert not torch.version.cuda"
echo "$want" > "$STAMP"
echo "[setup_env] done in $(( $(date +%s) - t0 )) s"
