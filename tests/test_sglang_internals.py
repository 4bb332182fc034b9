"""The one module that touches SGLang's internals (sglang_patches/sglang_internals.py): it is the only
one, and it refuses any SGLang but the one it was written for, in the trainer and in SGLang's processes."""
import re
from pathlib import Path

import pytest

from sglang_patches import sglang_internals
from sglang_patches.sglang_internals import SGLANG_VERSION, SGLangVersionError

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
    from sglang_patches.settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    monkeypatch.setattr(sglang_internals, "installed_version", lambda: OTHER)
    with pytest.raises(SGLangVersionError, match=f"sglang {OTHER} is installed"):
        RolloutEngine("no/model/needed", EngineKVSettings())
    installed = []
    monkeypatch.setattr(kv_eviction, "install", installed.append)
    monkeypatch.setattr(sglang_patches, "_installed", False)
    with pytest.raises(SGLangVersionError, match=f"sglang {OTHER} is installed"):
        sglang_patches.register()
    assert installed == [] and not sglang_patches._installed


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
