"""What each tool imports first (``tools/`` is on ``sys.path`` as the script's folder): the project's
package, installed by ``make env`` (editable) or ``pip install -e .``, or one line naming the Python that
runs the tools instead of a ModuleNotFoundError traceback. The package checks its own dependencies."""
import sys
from pathlib import Path

VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"

try:
    import sparse_rl_mega  # noqa: F401
except ModuleNotFoundError as missing:
    if missing.name != "sparse_rl_mega":
        raise
    raise SystemExit(f"sparse-rl-mega: this Python ({sys.executable}) does not have the project installed: run "
                     f"its tools with its environment's, {VENV_PYTHON} (built by `make env`), e.g. {VENV_PYTHON} "
                     "tools/launch.py CONFIG; or `pip install -e .` into this one") from None
