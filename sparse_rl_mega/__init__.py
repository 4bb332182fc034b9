"""sparse-rl-mega: Sparse-RL on Megatron-Core (learner) and SGLang (sparse-KV rollouts).

Its tools run with the Python of the project's environment (``make env`` builds ``.venv``): one started
from another Python stops here with one line saying which command runs it."""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"

_MISSING = [name for name in ("torch", "yaml") if _util.find_spec(name) is None]
if _MISSING:
    _venv = _Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    raise SystemExit(f"sparse-rl-mega: this Python ({_sys.executable}) has no {' or '.join(_MISSING)}: run the "
                     f"project's tools with its environment's, {_venv} (built by `make env`), e.g. "
                     f"{_venv} tools/launch.py CONFIG")
