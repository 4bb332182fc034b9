"""``algorithm``: the PPO loss's settings and the sparsity correction's, with the correction's presets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from sparse_rl_mega.config.errors import ConfigError, require

# percent: the low tail (tokens only the compressed sampler would pick), the median
LOG_RHO_QUANTILES = (1, 5, 50)

Level = Literal["none", "token", "sequence", "geometric"]


@dataclass
class CorrectionConfig:
    """Sparsity correction between the sampler and the dense old policy (docs/algorithm.md).

    ``log rho_t = clamp(logp_old_t - logp_sparse_t, -log_ratio_bound, log_ratio_bound)``. A ``preset``
    fills every field it names; keys written next to it in YAML override the preset's values."""
    preset: Literal["sparse_rl", "tis", "icepop", "naive", "bypass", "custom"] = "sparse_rl"
    # "dense": pi_old is the learner's dense recomputation; "sampler": pi_old := pi_sparse (bypass,
    # skips the dense forward pass; the mismatch is then neither measured nor corrected)
    old_policy: Literal["dense", "sampler"] = "dense"
    log_ratio_bound: float = 20.0  # |log rho| clamp (above)
    # importance weights: level of the ratio, then truncate (min(w, U)), clip ([L, U]) or mask (0 outside)
    is_level: Level = "token"
    is_mode: Literal["truncate", "clip", "mask"] = "truncate"  # how the bounds apply (above; docs/algorithm.md)
    is_low: Optional[float] = None  # lower bound L of the weights (None: none)
    is_high: Optional[float] = 1.5  # upper bound U of the weights (None: none)
    is_batch_normalize: bool = True  # divide the weights by their mean over the optimizer step's global batch
    # rejection (rejected tokens leave numerator and denominator of the loss)
    seq_veto_threshold: Optional[float] = 1e-4
    reject_level: Level = "token"  # level of the ratio that rejection bounds (none: no rejection)
    reject_low: Optional[float] = 0.5  # reject where rho < reject_low (None: no lower bound)
    reject_high: Optional[float] = 1.5  # reject where rho > reject_high (None: no upper bound)
    kl_reject_estimator: Literal["k1", "k2", "k3"] = "k3"  # the divergence estimate of kl_reject_threshold
    # per token, or per sequence by sum / mean / max
    kl_reject_agg: Literal["token", "seq_sum", "seq_mean", "seq_max"] = "token"
    kl_reject_threshold: Optional[float] = None  # reject where the divergence exceeds this (None: off)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> CorrectionConfig:
        if name not in CORRECTION_PRESETS:
            raise ConfigError(f"unknown correction preset {name!r}; expected one of: {', '.join(CORRECTION_PRESETS)}")
        return cls(**{**CORRECTION_PRESETS[name], "preset": name, **overrides})


_NO_CORRECTION = dict(is_level="none", is_batch_normalize=False, seq_veto_threshold=None, reject_level="none",
                      reject_low=None, reject_high=None, kl_reject_threshold=None)
CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    # the paper: token IS truncated at 1.5 and batch-normalised, token rejection [0.5, 1.5], veto 1e-4
    "sparse_rl": dict(old_policy="dense", is_level="token", is_mode="truncate", is_low=None, is_high=1.5,
                      is_batch_normalize=True, seq_veto_threshold=1e-4, reject_level="token", reject_low=0.5,
                      reject_high=1.5, kl_reject_threshold=None),
    # truncated importance sampling (token weights capped at 2, no rejection)
    "tis": dict(_NO_CORRECTION, old_policy="dense", is_level="token", is_mode="truncate", is_low=None, is_high=2.0),
    # IcePop: token weights kept inside [0.5, 5], zeroed outside (tokens stay in the denominator)
    "icepop": dict(_NO_CORRECTION, old_policy="dense", is_level="token", is_mode="mask", is_low=0.5, is_high=5.0),
    # uncorrected sparse rollouts: PPO anchored at the dense pi_old, samples from pi_sparse
    "naive": dict(_NO_CORRECTION, old_policy="dense"),
    # the sampler's logprobs serve as pi_old: no dense recomputation, nothing to correct
    "bypass": dict(_NO_CORRECTION, old_policy="sampler"),
    # start from the sparse_rl values and change what you need
    "custom": {},
}


@dataclass
class AlgorithmConfig:
    eps_clip_low: float = 0.2  # PPO ratio clip below: 1 - eps_clip_low
    eps_clip_high: float = 0.2  # PPO ratio clip above: 1 + eps_clip_high
    dual_clip: Optional[float] = None  # c > 1: for A < 0 the token loss is capped at -c * A
    kl_coef: float = 0.0  # KL(pi_theta || pi_ref) penalty; > 0 keeps a frozen reference model
    # low_var_kl: k3 capped at 10 per token, as the paper's release (slime) trains with
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    # how token losses add up to the step's loss (docs/algorithm.md)
    loss_agg_mode: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    # what the step's summed loss is divided by: every sequence of the step (token-mean: every response
    # token), rejected ones included, as the paper's release does; or only what the correction kept
    loss_denominator: Literal["batch", "kept"] = "batch"
    advantage_std_normalize: bool = True  # GRPO advantages divided by the group's reward standard deviation
    # GRPO statistics over every sample of a group (default) or only over those that survive rejection
    advantage_after_rejection: bool = False
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


def validate_correction(c: CorrectionConfig, source: str) -> None:
    key = "algorithm.correction"
    require(c.log_ratio_bound > 0, source, f"{key}.log_ratio_bound", f"must be > 0, got {c.log_ratio_bound}")
    if c.is_level != "none":
        if c.is_mode == "truncate":
            require(c.is_high is not None and c.is_high >= 1.0, source, f"{key}.is_high",
                    f"truncation needs an upper bound >= 1, got {c.is_high}")
        else:
            require(c.is_low is not None and c.is_high is not None and 0 <= c.is_low < 1.0 < c.is_high, source,
                    f"{key}.is_low", f"{c.is_mode} mode needs 0 <= is_low < 1 < is_high, got [{c.is_low}, {c.is_high}]")
    if c.reject_level != "none":
        require(c.reject_low is not None or c.reject_high is not None, source, f"{key}.reject_level",
                f"{c.reject_level} rejection needs reject_low and/or reject_high")
        require((c.reject_low is None or c.reject_low < 1.0) and (c.reject_high is None or c.reject_high > 1.0),
                source, key, f"rejection bounds must satisfy low < 1 < high, got [{c.reject_low}, {c.reject_high}]")
        require(c.reject_low is None or c.reject_low >= 0, source, f"{key}.reject_low", "must be >= 0")
    if c.seq_veto_threshold is not None:
        require(0.0 < c.seq_veto_threshold < 1.0, source, f"{key}.seq_veto_threshold",
                f"must be in (0, 1), got {c.seq_veto_threshold}")
    if c.kl_reject_threshold is not None:
        require(c.kl_reject_threshold > 0, source, f"{key}.kl_reject_threshold", "must be > 0")
    if c.old_policy == "sampler":
        require(c.is_level == "none" and c.reject_level == "none" and c.seq_veto_threshold is None
                and c.kl_reject_threshold is None, source, f"{key}.old_policy",
                "with old_policy: sampler the sampler is pi_old and there is no mismatch to correct: "
                "set is_level/reject_level to none and veto/kl thresholds to null (preset bypass)")
