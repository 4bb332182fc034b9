"""The run's tree (:class:`RunConfig`): every section, and the layout derived from them."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from sparse_rl_mega.config.algorithm import AlgorithmConfig
from sparse_rl_mega.config.model import ModelConfig, ParallelConfig
from sparse_rl_mega.config.rollout import RolloutConfig


@dataclass
class DataConfig:
    """Training prompts (sparse_rl_mega/data/). ``format``: ``prompt_label`` rows hold the final prompt
    text (e.g. templated by tools/prepare_data.py) and the gold label; ``question_answer`` rows hold a
    raw question and answer, formatted at load time: ``question + "\\n" + instruction``, rendered with
    the chat template of ``tokenizer`` when ``apply_chat_template``; the label is the answer's text
    after ``####`` (GSM8K), else its last ``\\boxed{}`` (MATH solutions), else the whole answer."""
    train_path: str = ""  # the training prompts (jsonl)
    format: Literal["prompt_label", "question_answer"] = "prompt_label"
    prompt_key: str = "prompt"  # format prompt_label: the prompt's key
    label_key: str = "label"  # format prompt_label: the gold label's key
    question_key: str = "question"  # format question_answer
    answer_key: str = "answer"      # format question_answer
    # format question_answer: appended to the question
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    apply_chat_template: bool = False  # format question_answer
    tokenizer: Optional[str] = None    # HF folder with the chat template; None: model.path (set by the trainer)
    prompts_per_iteration: int = 32  # prompts sampled per iteration (each gets n_samples_per_prompt responses)
    shuffle: bool = True  # a new order of the prompts every epoch
    seed: int = 1234  # the shuffle's seed


@dataclass
class RewardConfig:
    """How responses are scored (sparse_rl_mega/reward/): ``reward = correct + format_weight * has_box``,
    ``correct`` in {0, 1}, ``has_box``: the response holds a complete ``\\boxed{}`` (or ``\\fbox{}``).
    ``exact_answer``: the response's last number (or boxed number) equals the label's, in process.
    ``math``: the last ``\\boxed{}`` answer, else ``fallback``, is checked against the label (GSM8K
    ``#### x``, a MATH solution's box, or the label as written) with math-verify in ``workers`` worker
    processes; one check past ``timeout_s`` seconds is killed and scores 0 (counted in reward/timeouts).
    Model output is never evaluated as code."""
    type: Literal["exact_answer", "math"] = "exact_answer"  # the scorer (above)
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
    top_p: float = 1.0  # nucleus sampling of the evaluation's decoding
    max_new_tokens: Optional[int] = None  # None: rollout.max_new_tokens
    seed: int = 0  # the evaluation's sampling seed


@dataclass
class TrainerConfig:
    iterations: int = 3  # RL iterations (rollout, then optimizer steps) of the run
    global_batch_size: int = 256  # samples per optimizer step; must divide the samples per iteration
    micro_batch_size: int = 1  # samples per forward/backward pass of one rank
    lr: float = 1e-6  # AdamW learning rate
    weight_decay: float = 0.1  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.98  # AdamW beta2
    clip_grad: float = 1.0  # gradient-norm clip
    seed: int = 1234  # the learner's and rollouts' seed
    run_dir: str = "runs/default"  # the run's folder: logs, checkpoints, eval.json, unsent metrics
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
    torch_threads: int = 1  # torch threads of each learner rank (CPU)
    # an optimizer step whose loss or gradient norm is NaN/Inf is skipped (weights and optimizer state
    # unchanged, counted in train/skipped_steps); this many skipped steps in a row stop the job
    max_consecutive_skips: int = 3
    # the learner's watchdog (sparse_rl_mega/runtime/watchdog.py): the job is stopped when no rank has made
    # progress for max(watchdog_floor_s, watchdog_factor x the longest time of the phase a rank is in);
    # watchdog_first_s in a phase not completed before (None: rollout.startup_timeout_s + 300); 0: off
    watchdog_floor_s: float = 180.0
    watchdog_factor: float = 5.0  # a phase's bound: this times the longest it took so far (at least watchdog_floor_s)
    # the bound of a phase not yet completed once; None: rollout.startup_timeout_s + 300
    watchdog_first_s: Optional[float] = None


@dataclass
class TrackingConfig:
    enabled: bool = True  # log metrics and the config to MLflow
    tracking_uri: Optional[str] = None  # None: sqlite store inside the run folder
    experiment: str = "sparse-rl-mega"  # the MLflow experiment
    run_name: Optional[str] = None  # the MLflow run's name; None: MLflow's
    # at the end of a job, how long to wait for a tracking store that does not take metrics before the
    # unsent ones are left in <run_dir>/mlflow_unsent.jsonl (the next launch there sends them)
    flush_timeout_s: float = 120.0


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # iterations between saves; 0 = never
    keep_last: int = 2  # checkpoints kept (older ones removed after a verified save)
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
