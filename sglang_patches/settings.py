"""How the trainer hands KV-compression settings to SGLang's spawned processes: one JSON env var."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ENV_VAR = "SPARSE_RL_MEGA_KV"
# a request may carry its own settings in sampling_params["custom_params"][REQUEST_KEY] (a dict of the
# fields below) when the engine was started with allow_request_override
REQUEST_KEY = "sparse_rl_kv"


@dataclass
class EngineKVSettings:
    policy: str = "none"
    budget: int = 512
    sink: int = 4
    window: int = 8
    interval: int = 128
    per_head: bool = False
    params: dict = field(default_factory=dict)  # policy-specific (kernel, pool, lam, similarity_threshold)
    # newline trigger: also compress when past the budget and the token about to be decoded is one of these
    newline_token_ids: list = field(default_factory=list)
    # let requests choose their own policy/budget (benchmarks and evaluation compare policies on one
    # engine); the engine then records decode queries and attention mass for every request, and
    # ``window`` is the largest window a request may ask for
    allow_request_override: bool = False
    # admit and keep running requests by their compressed size (budget + interval), not max_new_tokens
    compressed_admission: bool = True

    def updated(self, override: dict) -> "EngineKVSettings":
        unknown = set(override) - {f for f in self.to_dict() if f not in ("allow_request_override", "compressed_admission")}
        if unknown:
            raise ValueError(f"unknown KV settings in a request: {sorted(unknown)}")
        merged = {**self.to_dict(), **override}
        if merged["window"] > self.window:
            raise ValueError(f"a request's window {merged['window']} exceeds the engine's {self.window}")
        return EngineKVSettings(**merged)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "EngineKVSettings":
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()
