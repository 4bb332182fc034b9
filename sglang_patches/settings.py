"""How the trainer hands KV-compression settings to SGLang's spawned processes: one JSON env var."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV_VAR = "SPARSE_RL_MEGA_KV"


@dataclass
class EngineKVSettings:
    policy: str = "none"
    budget: int = 512
    sink: int = 4
    window: int = 8
    interval: int = 128

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "EngineKVSettings":
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()
