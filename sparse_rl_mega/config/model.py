"""``model`` and ``parallel``: the transformer's shape, the tiny model built locally, the learner's layout."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class RopeScalingConfig:
    """RoPE scaling of the rotary inverse frequencies (HF ``rope_scaling``, transformers 4.x, or
    ``rope_parameters``, 5.x; the same key names).

    ``llama3`` (Llama 3.1 / 3.2): with ``L = original_max_position_embeddings``, a frequency whose
    wavelength ``2 pi / f`` exceeds ``L / low_freq_factor`` is divided by ``factor``, one below
    ``L / high_freq_factor`` is kept, and one between is blended, ``(1 - s) f / factor + s f`` with
    ``s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``. ``linear``: every
    frequency divided by ``factor``. ``dynamic``, ``yarn`` and the others are refused where a
    config.json is read (config/hf.py)."""
    rope_type: Literal["llama3", "linear"] = "llama3"  # the scaling rule (above)
    factor: Optional[float] = None  # required
    low_freq_factor: Optional[float] = None  # llama3 only (required there)
    high_freq_factor: Optional[float] = None  # llama3 only (required there)
    # llama3 only; None: model.arch.max_position_embeddings (as transformers and SGLang default it)
    original_max_position_embeddings: Optional[int] = None


LLAMA3_ONLY = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_scaling_problem(s: RopeScalingConfig) -> Optional[tuple[str, str]]:
    """The first value of ``s`` that cannot be: ``(field, what is wrong)``, or None."""
    if s.factor is None or not s.factor >= 1:
        return "factor", f"must be >= 1 (the wavelengths' stretch), got {s.factor}"
    if s.rope_type == "linear":
        given = [name for name in LLAMA3_ONLY if getattr(s, name) is not None]
        return (given[0], "is a setting of rope_type llama3 only, not linear") if given else None
    low, high, original = s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
    if low is None or not low > 0:
        return "low_freq_factor", f"must be > 0 (required for rope_type llama3), got {low}"
    if high is None or not high > low:
        return "high_freq_factor", f"must exceed low_freq_factor = {low} (required for rope_type llama3), got {high}"
    if original is not None and original < 1:
        return "original_max_position_embeddings", f"must be >= 1, got {original}"
    return None


@dataclass
class ArchConfig:
    """Transformer shape. Checked against the HF ``config.json`` when the model folder exists.

    The family fixes what the layout cannot say: ``qwen2`` always has q/k/v biases, ``qwen3`` has a
    per-head RMSNorm on queries and keys (``q_norm``/``k_norm``; Megatron's ``qk_layernorm``) and no
    biases, ``llama`` neither."""
    family: Literal["llama", "qwen2", "qwen3"] = "llama"  # the HF architecture (above: what each implies)
    num_layers: int = 2  # transformer layers (HF num_hidden_layers)
    hidden_size: int = 64  # model width
    ffn_hidden_size: int = 128  # SwiGLU inner width (HF intermediate_size)
    num_attention_heads: int = 4  # query heads
    num_query_groups: int = 2  # KV heads (HF num_key_value_heads; GQA when below the query heads)
    # width of one attention head; None: hidden_size / num_attention_heads (Qwen3 sets it explicitly)
    head_dim: Optional[int] = None
    vocab_size: int = 512  # embedding rows (HF vocab_size)
    max_position_embeddings: int = 2048  # positions the model takes: prompt + response must fit (pre-flight)
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-6  # RMSNorm epsilon (HF rms_norm_eps)
    tie_word_embeddings: bool = False  # the output layer shares the embedding's weights
    qkv_bias: bool = False  # q/k/v projection biases (implied by family qwen2)
    rope_scaling: Optional[RopeScalingConfig] = None  # None: plain RoPE

    @property
    def rope_original_positions(self) -> Optional[int]:
        """llama3 scaling's ``original_max_position_embeddings`` (default: ``max_position_embeddings``)."""
        s = self.rope_scaling
        if s is None or s.rope_type != "llama3":
            return None
        original = s.original_max_position_embeddings
        return self.max_position_embeddings if original is None else original

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
    tokenizer_vocab_size: int = 320  # the byte-level BPE tokenizer's vocabulary
    warmup_sft_steps: int = 150  # supervised steps before RL (0: none)
    warmup_lr: float = 3e-3  # their learning rate
    warmup_batch_size: int = 16  # their batch size (rows)
    # a linear warm-up of the learning rate over the first 50 steps and a linear decay to 0.1 of it
    warmup_decay: bool = False
    seed: int = 0  # seed of the tokenizer training, the initial weights and the supervised steps


@dataclass
class ModelConfig:
    # the HF model folder (config.json, tokenizer, safetensors); built there first by create_tiny when set and absent
    path: str = ""
    arch: ArchConfig = field(default_factory=ArchConfig)
    create_tiny: Optional[TinyModelConfig] = None
    dtype: Literal["float32", "bfloat16"] = "float32"  # the learner's and engines' compute dtype
    # Learner layer implementation: "local" (pure torch, CPU and GPU) or "transformer_engine" (GPU).
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    # FP8 training (Transformer Engine, GPU): e4m3 everywhere, or hybrid (e5m2 gradients); None: off
    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    # delayed / tensorwise (current) scaling on Hopper; mxfp8 on Blackwell; blockwise (Hopper, TE >= 2.3)
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    fp8_param: bool = False  # keep the weights themselves in FP8 (Transformer Engine)


@dataclass
class ParallelConfig:
    nnodes: int = 1  # nodes of the job (torchrun --nnodes; checked against the launch)
    nproc_per_node: int = 2  # learner ranks per node (torchrun --nproc-per-node)
    tensor_model_parallel_size: int = 1  # Megatron TP of the learner
    pipeline_model_parallel_size: int = 1  # Megatron PP of the learner; DP is what the world size leaves
    sequence_parallel: bool = False  # Megatron sequence parallelism (with TP > 1)
    use_distributed_optimizer: bool = False  # shard the optimizer state over DP (Megatron's distributed optimizer)
    # activation recomputation: "selective" recomputes core attention in the backward pass, "full"
    # every transformer layer (uniform, one layer per checkpoint); trades compute for activation memory
    recompute: Literal["none", "selective", "full"] = "none"
    # interleaved pipeline: each pipeline rank holds this many non-adjacent chunks of layers (a smaller
    # bubble for more point-to-point traffic); the micro-batches of a step must fill the pipeline
    virtual_pipeline_model_parallel_size: int = 1
    # context parallelism: each sequence is split over this many ranks (load-balanced causal halves),
    # attention exchanges keys/values between them; for long responses
    context_parallel_size: int = 1
