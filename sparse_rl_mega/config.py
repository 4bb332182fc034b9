"""Typed, validated run configuration.

A YAML file loads into :class:`RunConfig`, a tree of dataclasses. Loading checks, before any process
starts heavy work:

* every key exists (``trainer.stepz`` -> "unknown key trainer.stepz; expected one of ...");
* every value has the declared type (ints are accepted where floats are expected);
* values are possible together (TP divides the attention heads, the KV budget exceeds sink + recent
  window, the world size is divisible by TP x PP, ...).

Every problem raises :class:`ConfigError` whose message names the key path and what was expected.
Overrides use dotted paths: ``load_config(path, ["trainer.iterations=5"])``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key path and what was expected."""


# ----------------------------------------------------------------------------- the tree


@dataclass
class ArchConfig:
    """Transformer shape. Checked against the HF ``config.json`` when the model folder exists.

    The family fixes what the layout cannot say: ``qwen2`` always has q/k/v biases, ``qwen3`` has a
    per-head RMSNorm on queries and keys (``q_norm``/``k_norm``; Megatron's ``qk_layernorm``) and no
    biases, ``llama`` neither."""
    family: Literal["llama", "qwen2", "qwen3"] = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    # width of one attention head; None: hidden_size / num_attention_heads (Qwen3 sets it explicitly)
    head_dim: Optional[int] = None
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projection biases (implied by family qwen2)

    @property
    def kv_channels(self) -> int:
        """Width of one attention head (Megatron's ``kv_channels``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.qkv_bias or self.family == "qwen2"

    @property
    def qk_layernorm(self) -> bool:
        """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
        return self.family == "qwen3"


@dataclass
class TinyModelConfig:
    """Build a small model locally when ``model.path`` does not exist yet (no hub access needed):
    a byte-level BPE tokenizer trained on the training prompts and a model warm-started with a few
    supervised steps on the training set so that RL has a reward signal from the first iteration.
    The supervised target of a row is its ``worked`` answer when the data file has one (tools/
    prepare_data.py writes them for ``long_sums``), else a short sentence ending in the label."""
    tokenizer_vocab_size: int = 320
    warmup_sft_steps: int = 150
    warmup_lr: float = 3e-3
    warmup_batch_size: int = 16
    # a linear warm-up of the learning rate over the first 50 steps and a linear decay to 0.1 of it
    warmup_decay: bool = False
    seed: int = 0


@dataclass
class ModelConfig:
    path: str = ""
    arch: ArchConfig = field(default_factory=ArchConfig)
    create_tiny: Optional[TinyModelConfig] = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Learner layer implementation: "local" (pure torch, CPU and GPU) or "transformer_engine" (GPU).
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    # delayed / tensorwise (current) scaling on Hopper; mxfp8 on Blackwell; blockwise (Hopper, TE >= 2.3)
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    fp8_param: bool = False  # keep the weights themselves in FP8 (Transformer Engine)


@dataclass
class ParallelConfig:
    nnodes: int = 1
    nproc_per_node: int = 2
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    # activation recomputation: "selective" recomputes core attention in the backward pass, "full"
    # every transformer layer (uniform, one layer per checkpoint); trades compute for activation memory
    recompute: Literal["none", "selective", "full"] = "none"
    # interleaved pipeline: each pipeline rank holds this many non-adjacent chunks of layers (a smaller
    # bubble for more point-to-point traffic); the micro-batches of a step must fill the pipeline
    virtual_pipeline_model_parallel_size: int = 1
    # context parallelism: each sequence is split over this many ranks (load-balanced causal halves),
    # attention exchanges keys/values between them; for long responses
    context_parallel_size: int = 1


@dataclass
class AutoBudgetConfig:
    """``rollout.kv_compression.auto_budget``: the budget of each rollout set from the mismatch the last
    one measured (sparse_rl_mega/kv/auto_budget.py, docs/algorithm.md "The automatic budget"). The
    section's ``budget`` is where it starts; engines, ``--plan``, admission and the side buffers are
    sized for ``max``."""
    min: Optional[int] = None
    max: Optional[int] = None
    # the target: the quantile-percent quantile of rho = pi_old / pi_sparse over response tokens stays
    # >= min_rho (one of the measured quantiles, algo/correction.py LOG_RHO_QUANTILES below the median)
    quantile: float = 5.0
    min_rho: float = 0.5
    # tokens up after a violation / down after a rollout within the target; default a third of the
    # range up and a quarter of that down
    increase: Optional[int] = None
    decrease: Optional[int] = None

    @property
    def step_up(self) -> int:
        return self.increase if self.increase is not None else max(1, math.ceil((self.max - self.min) / 3))

    @property
    def step_down(self) -> int:
        return self.decrease if self.decrease is not None else max(1, math.ceil(self.step_up / 4))


@dataclass
class KVCompressionConfig:
    """Per-request KV eviction during decode (prefill is never compressed); docs/kv_compression.md.

    Once a request's KV length reaches ``budget + interval`` it is compressed back to ``budget``
    tokens: ``sink`` first tokens + the policy's choice among the older tokens + the ``window`` most
    recent. ``policy`` names a registered policy (``sparse_rl_mega/kv/policies.py``: ``streaming``,
    ``snapkv``, ``rkv``, ``h2o``, or a package's through an entry point) and ``params`` its own
    parameters (e.g. ``rkv``: ``{kernel: 7, lam: 0.1}``; the policy class lists them and checks them).
    The paper's runs: ``rkv``, ``sink: 0``, ``selection: shared``."""
    policy: str = "none"          # none: dense decoding
    budget: int = 512
    sink: int = 4                 # first tokens always kept (StreamingLLM's sinks; the published R-KV/SnapKV: 0)
    window: int = 8
    interval: int = 128
    # scoring policies: one kept set per layer (KV heads' scores summed), per KV head (R-KV's own code),
    # or one set for every layer of a request (the paper's release; the engine then copies no K/V)
    selection: Literal["per_layer", "per_head", "shared"] = "per_layer"
    shared_scores: Literal["first_layer", "layer_sum"] = "first_layer"  # shared: scores of the first layer (release) or all
    # "newline": also compress whenever past the budget and the token about to be decoded ends a line
    trigger: Literal["length", "newline"] = "length"
    # the policy's own parameters; a dense run's (or another policy's) evaluation under compression takes
    # those its policy has
    params: dict = field(default_factory=dict)
    # set: the budget follows the measured mismatch within [min, max], starting at ``budget``
    auto_budget: Optional[AutoBudgetConfig] = None

    @property
    def largest_budget(self) -> int:
        """The most a rollout's request may keep: what engines and memory are sized for."""
        return self.auto_budget.max if self.auto_budget is not None else self.budget

    def policy_params(self, policy: Optional[str] = None) -> dict:
        """Every parameter of ``policy`` (default: this section's): its defaults, overridden by those of
        ``params`` it takes (each must be some registered policy's: ``validate``)."""
        from sparse_rl_mega.kv.policies import NO_POLICY, policy_class, resolve_params

        name = policy or self.policy
        if name == NO_POLICY:
            return {}
        taken = policy_class(name).param_names()
        return resolve_params(name, {key: value for key, value in self.params.items() if key in taken})

    def build_policy(self, policy: Optional[str] = None):
        """The policy object of ``policy`` (default: this section's) with these settings; a bad setting
        raises ``PolicyError`` naming its key."""
        from sparse_rl_mega.kv.policies import build_policy

        return build_policy(policy or self.policy, sink=self.sink, window=self.window, selection=self.selection,
                            shared_scores=self.shared_scores, **self.policy_params(policy))


@dataclass
class RolloutConfig:
    num_engines: int = 1
    engine_tensor_parallel_size: int = 1
    placement: Literal["colocated", "separate"] = "colocated"
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 1024
    # the sampling distribution: softmax(logits / temperature), truncated to the top_k most likely tokens
    # (-1: off) and to the smallest set of them holding top_p of the mass, renormalised. The learner's
    # passes reproduce it exactly (docs/algorithm.md, "The behaviour policy"); min_p is refused (> 0):
    # SGLang 0.5.23's seeded sampler cannot draw it
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.8
    max_running_requests: Optional[int] = None
    attention_backend: Optional[str] = None  # None: torch_native on CPU, SGLang's default on GPU
    kv_compression: KVCompressionConfig = field(default_factory=KVCompressionConfig)
    # supervision (sparse_rl_mega/rollout/supervisor.py): an engine call with no answer from the engine
    # for engine_timeout_s (no generated output, no reply to a weight bucket) fails, as does one whose
    # engine processes died; the engine is then restarted, at most max_engine_restarts times per job
    startup_timeout_s: float = 1800.0  # an engine's start (a 70B engine loads for minutes)
    engine_timeout_s: float = 600.0
    max_engine_restarts: int = 3
    # overlapped rollouts (sparse_rl_mega/rollout/pipeline.py): 0 = generate, then train, then push; K >= 1:
    # the engines generate the next iteration's samples while the learner trains, and no sample is trained
    # on with weights more than K versions (iterations) older than the learner's
    max_staleness: int = 0

    @property
    def truncates(self) -> bool:
        """Whether sampling truncates the distribution (top-k or top-p): the engines then report each
        token's support and the learner renormalises over it."""
        return self.top_p < 1.0 or self.top_k > 0


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
    log_ratio_bound: float = 20.0
    # importance weights: level of the ratio, then truncate (min(w, U)), clip ([L, U]) or mask (0 outside)
    is_level: Level = "token"
    is_mode: Literal["truncate", "clip", "mask"] = "truncate"
    is_low: Optional[float] = None
    is_high: Optional[float] = 1.5
    is_batch_normalize: bool = True
    # rejection (rejected tokens leave numerator and denominator of the loss)
    seq_veto_threshold: Optional[float] = 1e-4
    reject_level: Level = "token"
    reject_low: Optional[float] = 0.5
    reject_high: Optional[float] = 1.5
    kl_reject_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_reject_agg: Literal["token", "seq_sum", "seq_mean", "seq_max"] = "token"
    kl_reject_threshold: Optional[float] = None

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "CorrectionConfig":
        if name not in CORRECTION_PRESETS:
            raise ConfigError(f"unknown correction preset {name!r}; expected one of: {', '.join(CORRECTION_PRESETS)}")
        return cls(**{**CORRECTION_PRESETS[name], "preset": name, **overrides})


_NO_CORRECTION = dict(is_level="none", is_batch_normalize=False, seq_veto_threshold=None, reject_level="none",
                      reject_low=None, reject_high=None, kl_reject_threshold=None)
CORRECTION_PRESETS: dict[str, dict] = {
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
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    dual_clip: Optional[float] = None  # c > 1: for A < 0 the token loss is capped at -c * A
    kl_coef: float = 0.0  # KL(pi_theta || pi_ref) penalty; > 0 keeps a frozen reference model
    # low_var_kl: k3 capped at 10 per token, as the paper's release (slime) trains with
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    loss_agg_mode: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    # what the step's summed loss is divided by: every sequence of the step (token-mean: every response
    # token), rejected ones included, as the paper's release does; or only what the correction kept
    loss_denominator: Literal["batch", "kept"] = "batch"
    advantage_std_normalize: bool = True
    # GRPO statistics over every sample of a group (default) or only over those that survive rejection
    advantage_after_rejection: bool = False
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


@dataclass
class DataConfig:
    """Training prompts (sparse_rl_mega/data/). ``format``: ``prompt_label`` rows hold the final prompt
    text (e.g. templated by tools/prepare_data.py) and the gold label; ``question_answer`` rows hold a
    raw question and answer, formatted at load time: ``question + "\\n" + instruction``, rendered with
    the chat template of ``tokenizer`` when ``apply_chat_template``; the label is the answer's text
    after ``####`` (GSM8K), else its last ``\\boxed{}`` (MATH solutions), else the whole answer."""
    train_path: str = ""
    format: Literal["prompt_label", "question_answer"] = "prompt_label"
    prompt_key: str = "prompt"
    label_key: str = "label"
    question_key: str = "question"  # format question_answer
    answer_key: str = "answer"      # format question_answer
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    apply_chat_template: bool = False  # format question_answer
    tokenizer: Optional[str] = None    # HF folder with the chat template; None: model.path (set by the trainer)
    prompts_per_iteration: int = 32
    shuffle: bool = True
    seed: int = 1234


@dataclass
class RewardConfig:
    """How responses are scored (sparse_rl_mega/reward/): ``reward = correct + format_weight * has_box``,
    ``correct`` in {0, 1}, ``has_box``: the response holds a complete ``\\boxed{}`` (or ``\\fbox{}``).
    ``exact_answer``: the response's last number (or boxed number) equals the label's, in process.
    ``math``: the last ``\\boxed{}`` answer, else ``fallback``, is checked against the label (GSM8K
    ``#### x``, a MATH solution's box, or the label as written) with math-verify in ``workers`` worker
    processes; one check past ``timeout_s`` seconds is killed and scores 0 (counted in reward/timeouts).
    Model output is never evaluated as code."""
    type: Literal["exact_answer", "math"] = "exact_answer"
    # math, answer when no \boxed{}: answer_is ("the answer is X" / "Answer: X"), last_number, both in that
    # order (default), or none (only boxed answers count)
    fallback: Literal["answer_is_or_last_number", "answer_is", "last_number", "none"] = "answer_is_or_last_number"
    timeout_s: float = 2.0     # math: per-check time limit
    workers: int = 2           # math: checking processes (started once, on rank 0)
    format_weight: float = 0.0  # bonus (> 0) or penalty (< 0) for a boxed answer; in [-1, 1]


@dataclass
class EvalConfig:
    """Held-out accuracy, measured on the rollout engine with the weights it serves: before training
    (unless resuming or ``before_training: false``), every ``interval`` iterations, and after the last one. Each setting in ``kv``
    decodes the same prompts with the same seed: ``dense`` (no compression), ``rollout`` (the
    rollout's ``kv_compression``) or ``POLICY:BUDGET``. Correctness is judged by ``reward.type``.
    Metrics ``eval/<setting>/mean_at_k`` etc. go to MLflow at step = iterations trained; the run
    ends with a before/after table, also in ``<run_dir>/eval.json``."""
    path: Optional[str] = None        # prompt_label jsonl (tools/prepare_data.py); None: no evaluation
    limit: Optional[int] = None       # first N rows
    interval: int = 0                 # 0: only before and after training
    # false: no evaluation before the first iteration (a baseline measured once for several runs from
    # the same start, e.g. by tools/evaluate.py)
    before_training: bool = True
    kv: str = "dense,rollout"         # comma-separated settings
    n_samples: int = 4                # samples per problem (k of mean@k / pass@k)
    temperature: float = 1.0          # 0: greedy (then n_samples must be 1)
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None  # None: rollout.max_new_tokens
    seed: int = 0


@dataclass
class TrainerConfig:
    iterations: int = 3
    global_batch_size: int = 256
    micro_batch_size: int = 1
    lr: float = 1e-6
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    seed: int = 1234
    run_dir: str = "runs/default"
    # After every weight sync, compare the engine's dense logprobs of a fixed sequence with the
    # learner's and log the largest difference (sync/max_abs_logprob_diff).
    verify_sync: bool = True
    # a weight push moves flattened buckets of at most this many MB; every rank that owns buckets (the
    # first TP rank of each pipeline stage) holds two buffers of them, kept between pushes (--plan
    # counts them)
    sync_bucket_mb: float = 256.0
    # how weights reach the engines (rollout/weight_push.py): "tensor" (the engine maps each bucket from
    # its owner's shared buffer: host shared memory on CPU, CUDA IPC on GPU; one colocated engine) or
    # "broadcast" (each owner broadcasts its buckets over a weight group of its own, NCCL on GPU;
    # needed by several engines and by engines on other devices or nodes; on CPU, engines read the
    # buckets of owners on their node from shared buffers, the others' over gloo)
    sync_method: Literal["tensor", "broadcast"] = "tensor"
    torch_threads: int = 1
    # an optimizer step whose loss or gradient norm is NaN/Inf is skipped (weights and optimizer state
    # unchanged, counted in train/skipped_steps); this many skipped steps in a row stop the job
    max_consecutive_skips: int = 3
    # the learner's watchdog (sparse_rl_mega/watchdog.py): the job is stopped when no rank has made
    # progress for max(watchdog_floor_s, watchdog_factor x the longest time of the phase a rank is in);
    # watchdog_first_s in a phase not completed before (None: rollout.startup_timeout_s + 300); 0: off
    watchdog_floor_s: float = 180.0
    watchdog_factor: float = 5.0
    watchdog_first_s: Optional[float] = None


@dataclass
class TrackingConfig:
    enabled: bool = True
    tracking_uri: Optional[str] = None  # None: sqlite store inside the run folder
    experiment: str = "sparse-rl-mega"
    run_name: Optional[str] = None
    # at the end of a job, how long to wait for a tracking store that does not take metrics before the
    # unsent ones are left in <run_dir>/mlflow_unsent.jsonl (the next launch there sends them)
    flush_timeout_s: float = 120.0


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # iterations between saves; 0 = never
    keep_last: int = 2
    dir: Optional[str] = None  # None: <run_dir>/checkpoints
    # resume from: "auto" (the newest complete checkpoint under ``dir``; start fresh when there is
    # none), a checkpoint folder (iter_*) or a folder of checkpoints; None: start from model.path.
    # The layout (TP/PP/DP) may differ from the one that saved.
    resume: Optional[str] = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # the model.arch fields read from the model folder because the YAML left them out (set on loading)
    arch_from_folder: typing.ClassVar[list[str]] = []
    config_path: typing.ClassVar[Optional[str]] = None  # the YAML file it was loaded from (set on loading)

    # ------------------------------------------------------------------ derived layout
    @property
    def world_size(self) -> int:
        return self.parallel.nnodes * self.parallel.nproc_per_node

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                   * p.context_parallel_size)

    @property
    def samples_per_iteration(self) -> int:
        return self.data.prompts_per_iteration * self.rollout.n_samples_per_prompt

    @property
    def optimizer_steps_per_iteration(self) -> int:
        return self.samples_per_iteration // self.trainer.global_batch_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load, type-check and validate a YAML config; ``overrides`` are ``dotted.key=yaml_value``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = config_from_dict(raw, str(path))
    cfg.config_path = str(path)
    return cfg


def config_from_dict(raw: dict, source: str = "<dict>") -> RunConfig:
    """Build and validate a config from its YAML tree; ``model.arch`` fields left out are read from the
    model folder's config.json (:func:`fill_arch_from_folder`)."""
    from_folder = fill_arch_from_folder(raw, source)
    cfg = _build(RunConfig, raw, "", source)
    cfg.arch_from_folder = from_folder
    validate(cfg, source)
    return cfg


def fill_arch_from_folder(raw: dict, source: str) -> list[str]:
    """Fill the ``model.arch`` fields that ``raw`` leaves out from the HF ``config.json`` in ``model.path``
    (``family`` from its ``model_type``), in place; returns the names filled. Fields written in the
    config stay as written (and are checked against the folder by :func:`validate`). Without a folder
    to read, the section must be written out, unless ``model.create_tiny`` builds the model from it."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("path"), str) or not model["path"]:
        return []  # (reported by _build / validate, naming the key)
    given = model.get("arch")
    if given is not None and not isinstance(given, dict):
        return []
    hf_config = Path(model["path"]) / "config.json"
    if not hf_config.is_file():
        if given is None and model.get("create_tiny") is None:
            raise ConfigError(f"{source}: model.arch: not given, and {hf_config} does not exist here to read it "
                              "from: write the model.arch section, or run where the model folder is")
        return []
    read = arch_from_hf_config(model["path"], source)
    filled = [name for name in read if name not in (given or {})]
    model["arch"] = {**{name: read[name] for name in filled}, **(given or {})}
    return filled


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. trainer.iterations=5")
    key, value = item.split("=", 1)
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        if node.get(part) is None:  # (absent, or an optional section set to null: its field makes it a section)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(value)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return getattr(tp, "__name__", str(tp))


_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key, source)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{source}: {key} = {value!r}: expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping (section), got {value!r}")
        return _build(tp, value, key + ".", source)
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value):
        return float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and type(value) is tp:
        return value
    raise ConfigError(f"{source}: {key} = {value!r}: expected {_type_name(tp)}, got {type(value).__name__}")


def _policy_param_names() -> set[str]:
    from sparse_rl_mega.kv.policies import policy_class, policy_names

    return {name for policy in policy_names() for name in policy_class(policy).param_names()}


def _build(cls: type, raw: dict, prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            if cls is KVCompressionConfig and key in _policy_param_names():  # the section's former shape
                raise ConfigError(f"{source}: {prefix}{key}: a KV policy's own parameters now go under "
                                  f"{prefix}params: write `params: {{{key}: {raw[key]}}}`")
            raise ConfigError(f"{source}: unknown key {prefix}{key}; expected one of: {', '.join(names)}")
    kwargs = {name: _coerce(hints[name], raw[name], prefix + name, source) for name in names if name in raw}
    if cls is CorrectionConfig:  # the preset fills what the YAML does not say
        return CorrectionConfig.from_preset(kwargs.pop("preset", "sparse_rl"), **kwargs)
    return cls(**kwargs)


# ----------------------------------------------------------------------------- validation


def _require(ok: bool, source: str, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{source}: {key}: {message}")


def validate(cfg: RunConfig, source: str = "<config>") -> None:
    """Cross-field checks; the first failure raises :class:`ConfigError` naming its key."""
    a, p, r, t, d = cfg.model.arch, cfg.parallel, cfg.rollout, cfg.trainer, cfg.data
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    positive = {
        "model.arch.num_layers": a.num_layers, "model.arch.hidden_size": a.hidden_size,
        "model.arch.ffn_hidden_size": a.ffn_hidden_size, "model.arch.num_attention_heads": a.num_attention_heads,
        "model.arch.num_query_groups": a.num_query_groups, "model.arch.vocab_size": a.vocab_size,
        "parallel.nnodes": p.nnodes, "parallel.nproc_per_node": p.nproc_per_node,
        "parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size": pp,
        "rollout.num_engines": r.num_engines, "rollout.engine_tensor_parallel_size": r.engine_tensor_parallel_size,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt, "rollout.max_new_tokens": r.max_new_tokens,
        "data.prompts_per_iteration": d.prompts_per_iteration, "trainer.iterations": t.iterations,
        "trainer.global_batch_size": t.global_batch_size, "trainer.micro_batch_size": t.micro_batch_size,
        "trainer.sync_bucket_mb": t.sync_bucket_mb, "trainer.torch_threads": t.torch_threads,
        "rollout.startup_timeout_s": r.startup_timeout_s, "rollout.engine_timeout_s": r.engine_timeout_s,
        "trainer.max_consecutive_skips": t.max_consecutive_skips,
    }
    for key, value in positive.items():
        _require(value > 0, source, key, f"must be > 0, got {value}")
    _require(cfg.tracking.flush_timeout_s >= 0, source, "tracking.flush_timeout_s",
             f"must be >= 0, got {cfg.tracking.flush_timeout_s}")
    _require(t.watchdog_floor_s >= 0, source, "trainer.watchdog_floor_s", f"must be >= 0 (0: no watchdog), got {t.watchdog_floor_s}")
    _require(t.watchdog_factor >= 1, source, "trainer.watchdog_factor", f"must be >= 1, got {t.watchdog_factor}")
    _require(t.watchdog_first_s is None or t.watchdog_first_s > 0, source, "trainer.watchdog_first_s",
             f"must be > 0, got {t.watchdog_first_s}")

    _require(bool(cfg.model.path), source, "model.path", "required: an HF model folder (or where to create one)")
    tiny = cfg.model.create_tiny
    if tiny is not None:
        _require(tiny.warmup_sft_steps >= 0, source, "model.create_tiny.warmup_sft_steps",
                 f"must be >= 0, got {tiny.warmup_sft_steps}")
        _require(tiny.warmup_batch_size >= 1, source, "model.create_tiny.warmup_batch_size",
                 f"must be >= 1, got {tiny.warmup_batch_size}")
        _require(tiny.warmup_lr > 0, source, "model.create_tiny.warmup_lr", f"must be > 0, got {tiny.warmup_lr}")
    _require(bool(d.train_path), source, "data.train_path", "required: a jsonl file of prompts and labels")
    if d.format == "prompt_label":
        _require(bool(d.prompt_key) and bool(d.label_key) and d.prompt_key != d.label_key, source, "data.prompt_key",
                 f"prompt_key and label_key must be distinct non-empty keys, got {d.prompt_key!r}, {d.label_key!r}")
        _require(not d.apply_chat_template, source, "data.apply_chat_template",
                 "prompt_label rows are used as written (template them with tools/prepare_data.py), or set "
                 "data.format: question_answer")
    else:
        _require(bool(d.question_key) and bool(d.answer_key) and d.question_key != d.answer_key, source,
                 "data.question_key", "question_key and answer_key must be distinct non-empty keys, got "
                 f"{d.question_key!r}, {d.answer_key!r}")
        _require(cfg.model.create_tiny is None, source, "data.format",
                 "model.create_tiny builds its tokenizer and warm-up from prompt_label rows; write them with "
                 "tools/prepare_data.py or use an existing model.path")
    if d.tokenizer is not None:
        _require(d.apply_chat_template, source, "data.tokenizer", "only used with data.apply_chat_template: true")
        _require(Path(d.tokenizer).is_dir(), source, "data.tokenizer", f"{d.tokenizer} is not a folder")
    if d.apply_chat_template:
        folder = Path(d.tokenizer or cfg.model.path)
        _require(not folder.is_dir() or _has_chat_template(folder), source,
                 "data.tokenizer" if d.tokenizer else "data.apply_chat_template",
                 f"the tokenizer in {folder} has no chat template")
    if a.head_dim is None:
        _require(a.hidden_size % a.num_attention_heads == 0, source, "model.arch.hidden_size",
                 f"{a.hidden_size} is not divisible by num_attention_heads={a.num_attention_heads} "
                 "(set model.arch.head_dim for heads of another width)")
    else:
        _require(a.head_dim > 0, source, "model.arch.head_dim", f"must be > 0, got {a.head_dim}")
    _require(not a.qkv_bias or a.family == "qwen2", source, "model.arch.qkv_bias",
             f"q/k/v-only biases exist in family qwen2; HF {a.family}'s attention_bias also biases o_proj, "
             "which the Megatron map does not carry")
    _require(a.num_attention_heads % a.num_query_groups == 0, source, "model.arch.num_query_groups",
             f"{a.num_query_groups} must divide num_attention_heads={a.num_attention_heads}")
    _require(a.num_attention_heads % tp == 0, source, "parallel.tensor_model_parallel_size",
             f"TP={tp} must divide model.arch.num_attention_heads={a.num_attention_heads}")
    _require(a.num_query_groups % tp == 0, source, "parallel.tensor_model_parallel_size",
             f"TP={tp} must divide model.arch.num_query_groups={a.num_query_groups}")
    _require(a.ffn_hidden_size % tp == 0, source, "parallel.tensor_model_parallel_size",
             f"TP={tp} must divide model.arch.ffn_hidden_size={a.ffn_hidden_size}")
    _require(a.vocab_size % tp == 0, source, "parallel.tensor_model_parallel_size",
             f"TP={tp} must divide model.arch.vocab_size={a.vocab_size} (the embedding is split by vocabulary)")
    _require(a.num_layers % pp == 0, source, "parallel.pipeline_model_parallel_size",
             f"PP={pp} must divide model.arch.num_layers={a.num_layers}")
    vpp, cp = p.virtual_pipeline_model_parallel_size, p.context_parallel_size
    _require(vpp >= 1, source, "parallel.virtual_pipeline_model_parallel_size", f"must be >= 1, got {vpp}")
    _require(vpp == 1 or pp > 1, source, "parallel.virtual_pipeline_model_parallel_size",
             "virtual pipeline stages interleave the chunks of several pipeline ranks: needs "
             "pipeline_model_parallel_size > 1")
    _require(a.num_layers % (pp * vpp) == 0, source, "parallel.virtual_pipeline_model_parallel_size",
             f"PP={pp} x virtual stages {vpp} must divide model.arch.num_layers={a.num_layers}")
    _require(cp >= 1, source, "parallel.context_parallel_size", f"must be >= 1, got {cp}")
    _require(cfg.world_size % (tp * pp * cp) == 0, source, "parallel",
             f"world size nnodes*nproc_per_node={cfg.world_size} is not divisible by "
             f"TP*PP*CP={tp}*{pp}*{cp}={tp * pp * cp}")
    _require(not p.sequence_parallel or tp > 1, source, "parallel.sequence_parallel",
             "needs tensor_model_parallel_size > 1")
    _require(not p.sequence_parallel or cfg.model.transformer_impl == "transformer_engine", source,
             "parallel.sequence_parallel", "needs model.transformer_impl: transformer_engine (the local layer spec's "
             "torch norms do not support sequence parallelism)")
    _require(r.engine_tensor_parallel_size <= p.nproc_per_node or r.placement == "separate", source,
             "rollout.engine_tensor_parallel_size",
             f"{r.engine_tensor_parallel_size} exceeds the devices of one node (parallel.nproc_per_node="
             f"{p.nproc_per_node}); an engine's TP group stays within a node")
    _require(a.num_attention_heads % r.engine_tensor_parallel_size == 0, source,
             "rollout.engine_tensor_parallel_size",
             f"{r.engine_tensor_parallel_size} must divide model.arch.num_attention_heads={a.num_attention_heads}")
    _require(r.placement != "separate" or t.sync_method == "broadcast", source, "trainer.sync_method",
             "separate engines (rollout.placement: separate) receive weights by broadcast: set 'broadcast'")
    _require(r.num_engines == 1 or t.sync_method == "broadcast", source, "trainer.sync_method",
             f"{r.num_engines} engines receive weights from rank 0 over one broadcast group: set 'broadcast'")
    _require(r.num_engines % p.nnodes == 0, source, "rollout.num_engines",
             f"{r.num_engines} engines cannot be spread evenly over parallel.nnodes={p.nnodes} nodes")
    per_node = r.num_engines // p.nnodes
    if r.placement == "colocated":
        need = per_node * r.engine_tensor_parallel_size
        _require(need <= p.nproc_per_node, source, "rollout.num_engines",
                 f"{per_node} colocated engine(s) per node x TP {r.engine_tensor_parallel_size} = {need} devices "
                 f"exceed the {p.nproc_per_node} devices of a node (parallel.nproc_per_node)")
    else:
        _require(per_node <= p.nproc_per_node, source, "rollout.num_engines",
                 f"{per_node} separate engines per node need as many learner processes per node to drive them "
                 f"(parallel.nproc_per_node={p.nproc_per_node})")
    _require(d.prompts_per_iteration % r.num_engines == 0, source, "data.prompts_per_iteration",
             f"{d.prompts_per_iteration} prompts cannot be shared equally by rollout.num_engines={r.num_engines}")
    most = a.max_position_embeddings - 3  # after a one-token prompt (preflight.response_room: positions - prompt - 2)
    _require(r.max_new_tokens <= most, source, "rollout.max_new_tokens",
             f"{r.max_new_tokens} does not fit the model's {a.max_position_embeddings} positions "
             f"(model.arch.max_position_embeddings): SGLang generates at most {most}, after a one-token prompt")
    _require(r.max_staleness >= 0, source, "rollout.max_staleness",
             f"must be >= 0 (0: no overlap; K: samples at most K weight versions old), got {r.max_staleness}")
    _require(0.0 < r.top_p <= 1.0, source, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _require(r.top_k == -1 or r.top_k >= 2, source, "rollout.top_k",
             f"must be -1 (off) or >= 2 (1 is greedy: every sample of a prompt would be the same), got {r.top_k}")
    _require(r.min_p == 0.0, source, "rollout.min_p",
             f"must be 0, got {r.min_p}: SGLang 0.5.23's pytorch sampler cannot draw min-p with a per-request "
             "seed (an assertion in top_k_top_p_min_p_sampling_from_probs_torch), and every rollout is seeded "
             "so that a resumed run repeats the uninterrupted one; truncate with top_p or top_k")
    _require(r.temperature > 0.0, source, "rollout.temperature",
             f"must be > 0 (RL samples), got {r.temperature}")
    _require(0.0 < r.mem_fraction_static < 1.0, source, "rollout.mem_fraction_static",
             f"must be in (0, 1), got {r.mem_fraction_static}")

    _validate_kv(cfg, source)

    rw = cfg.reward
    _require(0.0 < rw.timeout_s <= 600.0, source, "reward.timeout_s",
             f"must be in (0, 600] seconds, got {rw.timeout_s}")
    _require(1 <= rw.workers <= 64, source, "reward.workers", f"must be in [1, 64], got {rw.workers}")
    _require(-1.0 <= rw.format_weight <= 1.0, source, "reward.format_weight",
             f"must be in [-1, 1] so that correctness dominates, got {rw.format_weight}")

    _validate_eval(cfg, source)
    _validate_correction(cfg.algorithm.correction, source)
    al = cfg.algorithm
    _require(0 <= al.eps_clip_low < 1 and al.eps_clip_high >= 0, source, "algorithm.eps_clip_low",
             f"expected 0 <= eps_clip_low < 1 and eps_clip_high >= 0, got {al.eps_clip_low}, {al.eps_clip_high}")
    if al.dual_clip is not None:
        _require(al.dual_clip > 1.0, source, "algorithm.dual_clip", f"must be > 1, got {al.dual_clip}")
    _require(al.kl_coef >= 0, source, "algorithm.kl_coef", f"must be >= 0, got {al.kl_coef}")
    _require(al.entropy_coef >= 0, source, "algorithm.entropy_coef", f"must be >= 0, got {al.entropy_coef}")
    _require(r.n_samples_per_prompt >= 2, source, "rollout.n_samples_per_prompt",
             "GRPO needs at least 2 samples per prompt to form a group baseline")

    dp = cfg.data_parallel_size
    samples = cfg.samples_per_iteration
    _require(samples % t.global_batch_size == 0, source, "trainer.global_batch_size",
             f"{t.global_batch_size} must divide the samples per iteration "
             f"(data.prompts_per_iteration x rollout.n_samples_per_prompt = {samples})")
    _require(t.global_batch_size % (dp * t.micro_batch_size) == 0, source, "trainer.global_batch_size",
             f"{t.global_batch_size} must be divisible by data-parallel size x micro_batch_size = "
             f"{dp} x {t.micro_batch_size}")
    if p.virtual_pipeline_model_parallel_size > 1:  # (the batch divides evenly: checked just above)
        steps_mbs = t.global_batch_size // (dp * t.micro_batch_size)
        _require(steps_mbs % pp == 0, source, "trainer.micro_batch_size",
                 f"the interleaved pipeline (virtual_pipeline_model_parallel_size > 1) runs micro-batches in "
                 f"groups of PP={pp}: a step's {steps_mbs} micro-batches per data-parallel rank "
                 f"(global_batch_size / (DP x micro_batch_size)) must be a multiple of {pp}")
    _require((t.global_batch_size // dp) % r.n_samples_per_prompt == 0, source, "trainer.global_batch_size",
             f"each data-parallel rank's share ({t.global_batch_size // dp}) must hold whole GRPO groups of "
             f"rollout.n_samples_per_prompt={r.n_samples_per_prompt}")
    _require(t.lr > 0, source, "trainer.lr", f"must be > 0, got {t.lr}")
    _require(cfg.checkpoint.save_interval >= 0, source, "checkpoint.save_interval", "must be >= 0")
    _require(cfg.checkpoint.keep_last >= 1, source, "checkpoint.keep_last", "must be >= 1")
    _require(r.max_engine_restarts >= 0, source, "rollout.max_engine_restarts", f"must be >= 0, got {r.max_engine_restarts}")
    resume = cfg.checkpoint.resume
    _require(resume in (None, "auto") or Path(resume).is_dir(), source, "checkpoint.resume",
             f"must be 'auto', null or an existing checkpoint folder; {resume!r} is not a folder")

    m = cfg.model
    if m.fp8 is not None:
        _require(m.transformer_impl == "transformer_engine", source, "model.fp8",
                 "FP8 needs model.transformer_impl: transformer_engine")
        _require(m.dtype == "bfloat16", source, "model.fp8", "FP8 training keeps bfloat16 params: set model.dtype")
    _require(not m.fp8_param or m.fp8 is not None, source, "model.fp8_param", "needs model.fp8")
    _require(not m.fp8_param or cfg.parallel.use_distributed_optimizer, source, "model.fp8_param",
             "needs parallel.use_distributed_optimizer: true (only Megatron's distributed optimizer writes its "
             "fp32 master weights back into FP8 parameters)")
    _check_against_hf_config(cfg, source)


def load_config_or_exit(path: str | Path, overrides: Optional[list[str]] = None) -> RunConfig:
    """:func:`load_config` for the command-line tools: a problem is printed as one ``config error:``
    line and the tool exits with status 2."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _validate_eval(cfg: RunConfig, source: str) -> None:
    e = cfg.eval
    if e.path is None:
        return
    _require(e.limit is None or e.limit > 0, source, "eval.limit", f"must be > 0 or null, got {e.limit}")
    _require(e.interval >= 0, source, "eval.interval", f"must be >= 0 (0: before and after only), got {e.interval}")
    _require(e.n_samples > 0, source, "eval.n_samples", f"must be > 0, got {e.n_samples}")
    _require(e.temperature >= 0, source, "eval.temperature", f"must be >= 0, got {e.temperature}")
    _require(0.0 < e.top_p <= 1.0, source, "eval.top_p", f"must be in (0, 1], got {e.top_p}")
    _require(e.temperature > 0 or e.n_samples == 1, source, "eval.n_samples",
             "greedy decoding (eval.temperature: 0) gives one answer per problem: set n_samples: 1")
    _require(e.max_new_tokens is None or e.max_new_tokens > 0, source, "eval.max_new_tokens",
             f"must be > 0 or null, got {e.max_new_tokens}")
    positions = cfg.model.arch.max_position_embeddings
    _require(e.max_new_tokens is None or e.max_new_tokens <= positions - 3, source, "eval.max_new_tokens",
             f"{e.max_new_tokens} does not fit the model's {positions} positions (model.arch.max_position_embeddings): "
             f"SGLang generates at most {positions - 3}, after a one-token prompt")
    from sparse_rl_mega.evaluation import AUTO, parse_kv_variants

    try:
        variants = parse_kv_variants(e.kv, cfg.rollout.kv_compression)
    except ValueError as exc:
        raise ConfigError(f"{source}: eval.kv: {exc}") from None
    from sparse_rl_mega.kv.policies import PolicyError

    kv = cfg.rollout.kv_compression
    for label, override in variants:
        if override and override is not AUTO and override["policy"] != "none":  # (AUTO: within auto_budget)
            try:
                kv.build_policy(override["policy"]).check_budget(override["budget"])
            except PolicyError as exc:
                raise ConfigError(f"{source}: eval.kv: {label}: {exc} (its other settings: rollout.kv_compression)") from None


def _validate_kv(cfg: RunConfig, source: str) -> None:
    """``rollout.kv_compression``: its policy and parameters, checked by the policy class itself. Each
    of ``params`` must be a parameter of some registered policy; the policy takes those it has (one
    section serves a comparison of policies by ``--set rollout.kv_compression.policy=...``, and a dense
    run's compressed evaluation)."""
    from sglang_patches.settings import EngineKVSettings, tp_split_problem
    from sparse_rl_mega.kv.policies import NO_POLICY, PolicyError

    kv, r, a = cfg.rollout.kv_compression, cfg.rollout, cfg.model.arch
    key = "rollout.kv_compression"
    known = _policy_param_names()
    for name in kv.params:
        _require(name in known, source, f"{key}.params.{name}",
                 f"no registered KV policy takes it; parameters: {', '.join(sorted(known))}")
    if kv.policy == NO_POLICY:
        return
    try:
        kv.build_policy().check_budget(kv.budget)
    except PolicyError as exc:
        raise ConfigError(f"{source}: {key}.{exc.key}: {exc}") from None
    _require(kv.interval > 0, source, f"{key}.interval", f"must be > 0, got {kv.interval}")
    if kv.auto_budget is not None:
        _validate_auto_budget(kv, source)
    problem = tp_split_problem(EngineKVSettings.from_config(kv), r.engine_tensor_parallel_size, a.num_query_groups)
    _require(problem is None, source, "rollout.engine_tensor_parallel_size",
             f"{r.engine_tensor_parallel_size} exceeds model.arch.num_query_groups={a.num_query_groups}: {problem}")


def _validate_auto_budget(kv: KVCompressionConfig, source: str) -> None:
    from sparse_rl_mega.algo.correction import LOG_RHO_QUANTILES
    from sparse_rl_mega.kv.policies import PolicyError

    auto, key = kv.auto_budget, "rollout.kv_compression.auto_budget"
    for bound in ("min", "max"):
        _require(getattr(auto, bound) is not None, source, f"{key}.{bound}",
                 "required: the automatic budget stays within [min, max]")
    try:
        kv.build_policy().check_budget(auto.min)
    except PolicyError as exc:
        raise ConfigError(f"{source}: {key}.min: {exc}") from None
    _require(auto.min <= auto.max, source, f"{key}.max", f"must be >= min = {auto.min}, got {auto.max}")
    _require(auto.min <= kv.budget <= auto.max, source, "rollout.kv_compression.budget",
             f"{kv.budget} is where the automatic budget starts: it must lie in auto_budget [{auto.min}, {auto.max}]")
    tails = [q for q in LOG_RHO_QUANTILES if q < 50]
    _require(auto.quantile in tails, source, f"{key}.quantile",
             f"must be one of the measured lower quantiles of log rho {tails} (percent), got {auto.quantile:g}")
    _require(0 < auto.min_rho < 1, source, f"{key}.min_rho", f"must be in (0, 1), got {auto.min_rho}")
    for step in ("increase", "decrease"):
        value = getattr(auto, step)
        _require(value is None or value >= 1, source, f"{key}.{step}", f"must be >= 1 token, got {value}")


def _has_chat_template(folder: Path) -> bool:
    """Whether an HF tokenizer folder carries a chat template (without loading transformers)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _validate_correction(c: CorrectionConfig, source: str) -> None:
    key = "algorithm.correction"
    _require(c.log_ratio_bound > 0, source, f"{key}.log_ratio_bound", f"must be > 0, got {c.log_ratio_bound}")
    if c.is_level != "none":
        if c.is_mode == "truncate":
            _require(c.is_high is not None and c.is_high >= 1.0, source, f"{key}.is_high",
                     f"truncation needs an upper bound >= 1, got {c.is_high}")
        else:
            _require(c.is_low is not None and c.is_high is not None and 0 <= c.is_low < 1.0 < c.is_high, source,
                     f"{key}.is_low", f"{c.is_mode} mode needs 0 <= is_low < 1 < is_high, got [{c.is_low}, {c.is_high}]")
    if c.reject_level != "none":
        _require(c.reject_low is not None or c.reject_high is not None, source, f"{key}.reject_level",
                 f"{c.reject_level} rejection needs reject_low and/or reject_high")
        _require((c.reject_low is None or c.reject_low < 1.0) and (c.reject_high is None or c.reject_high > 1.0),
                 source, key, f"rejection bounds must satisfy low < 1 < high, got [{c.reject_low}, {c.reject_high}]")
        _require(c.reject_low is None or c.reject_low >= 0, source, f"{key}.reject_low", "must be >= 0")
    if c.seq_veto_threshold is not None:
        _require(0.0 < c.seq_veto_threshold < 1.0, source, f"{key}.seq_veto_threshold",
                 f"must be in (0, 1), got {c.seq_veto_threshold}")
    if c.kl_reject_threshold is not None:
        _require(c.kl_reject_threshold > 0, source, f"{key}.kl_reject_threshold", "must be > 0")
    if c.old_policy == "sampler":
        _require(c.is_level == "none" and c.reject_level == "none" and c.seq_veto_threshold is None
                 and c.kl_reject_threshold is None, source, f"{key}.old_policy",
                 "with old_policy: sampler the sampler is pi_old and there is no mismatch to correct: "
                 "set is_level/reject_level to none and veto/kl thresholds to null (preset bypass)")


def arch_from_hf_config(model_dir: str | Path, source: Optional[str] = None) -> dict:
    """``model.arch`` values read from an HF folder's ``config.json`` (the keys it defines).

    Reads both config layouts of transformers (``rope_theta`` at the top, 4.x, or inside
    ``rope_parameters``, 5.x). HF features the Megatron map cannot represent (another model type,
    RoPE scaling, MLP biases, sliding-window attention) raise :class:`ConfigError` naming the file and key."""
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ConfigError(f"{source + ': ' if source else ''}model.path: {path} cannot be read as JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{source + ': ' if source else ''}model.path: {path} holds no JSON object")
    names = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
             "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
             "head_dim": "head_dim", "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
             "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings"}
    arch = {ours: hf[theirs] for ours, theirs in names.items() if hf.get(theirs) is not None}
    arch.setdefault("num_query_groups", arch.get("num_attention_heads"))
    model_type = hf.get("model_type")
    if model_type is not None:
        if model_type not in _HF_FAMILIES:
            raise ConfigError(f"{path}: model_type {model_type!r} is not supported; expected one of: "
                              f"{', '.join(_HF_FAMILIES)}")
        arch["family"] = model_type
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_theta") is not None:
        arch["rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{path}: rope type {rope_type!r} is not supported (only plain RoPE: 'default')")
    for key in ("mlp_bias", "use_sliding_window"):
        if hf.get(key):
            raise ConfigError(f"{path}: {key} = {hf[key]!r} is not supported")
    if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
        arch["qkv_bias"] = True  # rejected by validation, naming model.arch.qkv_bias
    return arch


_HF_FAMILIES = typing.get_args(typing.get_type_hints(ArchConfig)["family"])


def _check_against_hf_config(cfg: RunConfig, source: str) -> None:
    """When the model folder exists, its config.json must agree with ``model.arch``."""
    hf_config = Path(cfg.model.path) / "config.json"
    if not hf_config.is_file():
        _require(cfg.model.create_tiny is not None or not Path(cfg.model.path).exists(), source, "model.path",
                 f"{cfg.model.path} exists but has no config.json")
        return
    hf_arch = arch_from_hf_config(cfg.model.path)
    a = cfg.model.arch
    for name in ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "vocab_size", "tie_word_embeddings", "max_position_embeddings", "qkv_bias"):
        ours = getattr(a, name)
        _require(name not in hf_arch or ours == hf_arch[name], source, f"model.arch.{name}",
                 f"{ours} disagrees with {hf_config} ({hf_arch.get(name)})")
    # HF's head width: head_dim where written, else hidden_size / num_attention_heads (as transformers derives it)
    hf_head_dim = hf_arch.get("head_dim") or (hf_arch["hidden_size"] // hf_arch["num_attention_heads"]
                                              if "hidden_size" in hf_arch and hf_arch.get("num_attention_heads") else None)
    _require(hf_head_dim is None or a.kv_channels == hf_head_dim, source, "model.arch.head_dim",
             f"heads of width {a.kv_channels} disagree with {hf_config} (heads of width {hf_head_dim}"
             + (")" if "head_dim" in hf_arch else " = hidden_size / num_attention_heads)"))
    for name in ("rope_theta", "norm_eps"):  # floats (HF may store 1e-5 as 9.99999974e-06)
        ours = getattr(a, name)
        _require(name not in hf_arch or abs(ours - hf_arch[name]) <= 1e-6 * abs(hf_arch[name]), source,
                 f"model.arch.{name}", f"{ours} disagrees with {hf_config} ({hf_arch.get(name)})")
