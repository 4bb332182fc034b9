"""The one module that touches SGLang's internals (sparse_rl_mega/rollout/sglang_internals.py): it is the only
one, and it refuses any SGLang but the one it was written for, in the trainer and in SGLang's processes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparse_rl_mega.rollout import sglang_internals
from sparse_rl_mega.kv.engine_settings import ENV_VAR
from sparse_rl_mega.rollout.sglang_internals import SGLANG_VERSION, SGLangVersionError

ROOT = Path(__file__).resolve().parent.parent
OTHER = "0.6.1"  # a faked other SGLang


def test_another_sglang_is_refused_with_one_line():
    sglang_internals.check_version()  # the pinned one, installed here
    with pytest.raises(SGLangVersionError) as info:
        sglang_internals.check_version(OTHER)
    message = str(info.value)
    assert "\n" not in message
    assert f"written for sglang {SGLANG_VERSION}, and sglang {OTHER} is installed" in message
    assert f"install sglang=={SGLANG_VERSION}" in message


def test_an_engine_and_the_plugin_refuse_another_sglang_before_starting(monkeypatch):
    """The trainer's engine refuses before any SGLang process starts; the plugin, which SGLang loads
    in each of its processes, refuses before it installs a hook."""
    import sglang_patches
    from sglang_patches import kv_eviction
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    monkeypatch.setattr(sglang_internals, "installed_version", lambda: OTHER)
    with pytest.raises(SGLangVersionError, match=f"sglang {OTHER} is installed"):
        RolloutEngine("no/model/needed", EngineKVSettings())
    installed = []
    monkeypatch.setattr(kv_eviction, "install", installed.append)
    monkeypatch.setattr(sglang_patches, "_installed", False)
    with pytest.raises(SystemExit, match=f"SGLangVersionError: .*sglang {OTHER} is installed"):
        sglang_patches.register()
    assert installed == [] and not sglang_patches._installed


def test_a_failing_plugin_ends_the_sglang_process_instead_of_leaving_it_dense():
    """SGLang's plugin loader logs and swallows an Exception from a plugin: an engine whose KV settings
    the plugin refuses would then decode dense under a compressed label (seen: evaluate.py's engine at
    budget 32 with --sink 24 reported R-KV 56 with 0 evicted tokens). Through SGLang's own loader, the
    process must end with the plugin's one line."""
    settings = json.dumps({"policy": "rkv", "budget": 32, "sink": 24, "window": 8})  # 24 + 8 = the budget
    result = subprocess.run([sys.executable, "-c", "from sglang.srt.plugins import load_plugins\n"
                             "load_plugins()\nprint('decoding without the plugin')"],
                            env={**os.environ, ENV_VAR: settings}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "decoding without the plugin" not in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("sparse-rl-mega's SGLang plugin failed in process")
    assert "PolicyError: budget 32 must exceed sink + window = 32" in result.stderr


SGLANG_INTERNAL = re.compile(r"^\s*(from|import)\s+sglang\.srt\b|[.'\"]_subprocess_watchdog|last_receive_tstamp", re.M)


def test_no_other_module_reaches_into_sglang():
    """``sglang.srt`` imports and SGLang's private attributes appear in sglang_internals.py alone (the
    engine module may use SGLang's public ``sglang.Engine``)."""
    offenders = []
    for folder in ("sparse_rl_mega", "sglang_patches", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "sglang_internals.py" and SGLANG_INTERNAL.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
