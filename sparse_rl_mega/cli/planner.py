"""Per-GPU memory plan of a run: the learner's shard and the rollout engines' KV pool.

Pure arithmetic on a validated :class:`RunConfig` (no torch, nothing started);
``python tools/launch.py CONFIG --plan`` prints :func:`format_plan`. Sizes are bytes, printed in GiB
(2**30 bytes, the unit torch and SGLang report GPU memory in).

Learner (one GPU = one Megatron rank; the worst pipeline stage is reported):

* parameters: the exact element count of this rank's shard (:func:`stage_params`), in ``model.dtype``;
* gradients: Megatron DDP's main-grad buffer, float32 for every dtype here (``grad_reduce_in_fp32``
  when bfloat16, see ``learner/model.py``): 4 bytes per parameter;
* Adam: float32 ``exp_avg`` + ``exp_avg_sq`` (8 bytes per parameter), plus a float32 master copy when
  the parameters are bfloat16 (12 bytes); divided over DP with ``parallel.use_distributed_optimizer``;
* activations of the micro-batches in flight: an *estimate* (:func:`layer_activation_bytes`);
* a frozen reference copy of the parameters when ``algorithm.kl_coef > 0``.

Engine (one GPU = one engine TP rank): weights of one TP shard, KV bytes per token, and the KV pool
SGLang sizes as ``mem_fraction_static x free memory at start - weights - side buffers`` (capped by
``rollout.max_total_tokens``), with the requests it holds at once densely and compressed. Side buffers:
the KV patch's decode-query ring and H2O's attention mass (``side_buffer_bytes``), which the engine
takes out of ``mem_fraction_static`` before SGLang sizes its pool.

Colocated placement, the assumption made: the engine releases its weights and KV pool while the
learner trains (SGLang's ``release_memory_occupation``), and the learner's model states (parameters,
gradients, Adam, reference) stay on the GPU during rollouts. So training needs learner states +
activations <= GPU, and the engine starts with GPU - learner states free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from sparse_rl_mega.config import ArchConfig, RunConfig
from sparse_rl_mega.config.evaluation import needs_request_override, parse_kv_variants
from sparse_rl_mega.kv.engine_settings import (DEFAULT_RUNNING_REQUESTS, EngineKVSettings, compressed_bound,
                                               cuda_graphs_allowed, records_queries, side_buffer_bytes)

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
GRAD_BYTES = 4          # float32 main grads (Megatron DDP)
LOGIT_COPIES = 4        # float32 [b, s, V/tp] tensors kept by the loss: upcast, shifted, exp, exp * shifted


# ----------------------------------------------------------------------------- parameters


def layer_params(a: ArchConfig, tp: int, kv_heads: int | None = None) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank.

    ``kv_heads``: key/value heads this rank holds; ``None``: ``num_query_groups / tp`` (Megatron, where
    TP divides the groups). SGLang keeps one head per rank when TP exceeds the groups (replicas)."""
    h, d, ffn = a.hidden_size, a.kv_channels, a.ffn_hidden_size
    kv_heads = a.num_query_groups // tp if kv_heads is None else kv_heads
    q = a.num_attention_heads // tp * d  # query width of this rank
    kv = kv_heads * d                    # key width = value width of this rank
    n = (q + 2 * kv) * h                 # linear_qkv.weight [q + 2 kv, h]   (HF q/k/v_proj, column-parallel)
    n += h * q                           # linear_proj.weight [h, q]         (o_proj, row-parallel, no bias)
    n += 2 * (ffn // tp) * h             # linear_fc1.weight [2 ffn/tp, h]   (gate_proj + up_proj, SwiGLU)
    n += h * (ffn // tp)                 # linear_fc2.weight [h, ffn/tp]     (down_proj)
    n += 2 * h                           # input / pre-MLP RMSNorm weights [h], replicated
    if a.has_qkv_bias:                   # qwen2: linear_qkv.bias [q + 2 kv]
        n += q + 2 * kv
    if a.qk_layernorm:                   # qwen3: q_layernorm, k_layernorm [d], shared by heads, replicated
        n += 2 * d
    return n


def stage_params(a: ArchConfig, tp: int, pp: int, stage: int) -> int:
    """Parameters of one TP rank of pipeline stage ``stage`` (Megatron's GPTModel split).

    The first stage holds the word embedding [V/tp, h]; the last the final RMSNorm [h] and the output
    layer [V/tp, h]. Tied embeddings share one tensor only when one stage holds both (PP 1); with
    PP > 1 the last stage keeps its own copy, kept equal to the first stage's by Megatron."""
    h, vocab_rows = a.hidden_size, a.vocab_size // tp
    first, last = stage == 0, stage == pp - 1
    n = a.num_layers // pp * layer_params(a, tp)
    if first:
        n += vocab_rows * h
    if last:
        n += h
        if not (a.tie_word_embeddings and first):
            n += vocab_rows * h
    return n


def total_params(a: ArchConfig) -> int:
    """Parameters of the whole model (the HF model's count, tied embeddings counted once)."""
    return stage_params(a, 1, 1, 0)


def engine_kv_heads(a: ArchConfig, tp: int) -> int:
    """KV heads on one engine TP rank: SGLang splits them over TP and replicates when TP exceeds
    them (one head per rank)."""
    return max(1, a.num_query_groups // tp)


def engine_params(a: ArchConfig, tp: int) -> int:
    """Parameters of one SGLang TP rank: layers with this rank's heads (KV heads replicated past
    their count), vocabulary rows ceil(V / tp) (SGLang's padding of < 64 rows is ignored), the final
    norm, and the LM head unless tied."""
    vocab_rows = math.ceil(a.vocab_size / tp)
    embeddings = vocab_rows * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    return a.num_layers * layer_params(a, tp, engine_kv_heads(a, tp)) + embeddings + a.hidden_size


# ----------------------------------------------------------------------------- activations


def layer_activation_bytes(a: ArchConfig, seq: int, micro_batch: int, tp: int, sequence_parallel: bool,
                           flash_attention: bool, dtype_bytes: int, key_len: Optional[int] = None) -> int:
    """Estimate: activations one transformer layer stores for backward, one micro-batch, no recompute.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), for
    16-bit activations: ``s b h (34 + 5 a s / h)`` bytes per layer. Tensor parallelism divides the 24
    bytes of the parallel regions and the ``5 a s / h`` attention scores by ``tp``; sequence
    parallelism also the remaining 10 (norms, dropout inputs). Fused / flash attention (Transformer
    Engine) stores no ``[a, s, s]`` scores: that term is dropped. Scaled by ``dtype_bytes / 2``. The
    paper's layer (4h MLP, multi-head attention, dropout masks) differs from a GQA + SwiGLU layer
    without dropout: a rough figure, not a bound. With context parallelism ``seq`` is this rank's
    share of the tokens and ``key_len`` the whole sequence its queries attend to."""
    s, b, h = seq, micro_batch, a.hidden_size
    per_token = (34 / tp) if sequence_parallel else (10 + 24 / tp)
    if not flash_attention:
        per_token += 5 * a.num_attention_heads * (key_len or s) / (h * tp)
    return int(s * b * h * per_token * dtype_bytes / 2)


# ----------------------------------------------------------------------------- results


@dataclass
class LearnerMemory:
    """One learner rank on its worst pipeline stage (bytes unless named otherwise)."""
    stage: int
    params: int              # element count of this rank's shard
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    reference_bytes: int     # frozen KL reference copy (0 without algorithm.kl_coef)
    push_buffer_bytes: int   # the weight push's two bucket buffers, kept between pushes (bucket owners)
    activation_bytes: int    # estimate, micro-batches in flight
    micro_batches_in_flight: float  # whole-stage micro-batches (interleaved: chunk passes / virtual stages)
    seq_len: int

    @property
    def states_bytes(self) -> int:
        """What stays resident between steps: parameters, gradients, Adam, reference, push buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.reference_bytes + self.push_buffer_bytes

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.activation_bytes


@dataclass
class EngineMemory:
    """One engine TP rank (bytes unless named otherwise)."""
    tp: int
    params: int
    weight_bytes: int
    kv_heads: int              # KV heads on this rank
    kv_bytes_per_token: int
    free_bytes: int            # free GPU memory when the engine starts
    static_bytes: int          # mem_fraction_static x free: weights + KV pool
    pool_tokens: int           # KV slots (capped by rollout.max_total_tokens)
    dense_tokens: int          # one request's KV slots: prompt + max_new_tokens
    sparse_tokens: int         # the same under compression (admission rule), = dense without
    requests_per_engine: int   # samples of one iteration per engine
    max_running_requests: int | None
    side_buffers: dict = field(default_factory=dict)  # KV patch's buffers beside the pool, bytes by name
    side_running: int = 0      # running requests the side buffers are sized for
    cuda_graphs: str = ""      # whether the engine captures CUDA graphs, and why not

    @property
    def side_bytes(self) -> int:
        return sum(self.side_buffers.values())

    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * self.kv_bytes_per_token

    @property
    def dense_concurrent(self) -> int:
        return self.pool_tokens // self.dense_tokens

    @property
    def sparse_concurrent(self) -> int:
        return self.pool_tokens // self.sparse_tokens


@dataclass
class MemoryPlan:
    gpu_bytes: int
    prompt_tokens: int
    colocated: bool
    learner: LearnerMemory
    engine: EngineMemory
    problems: list[str] = field(default_factory=list)  # "does NOT fit" reasons; empty: everything fits

    @property
    def fits(self) -> bool:
        return not self.problems


# ----------------------------------------------------------------------------- planning


def push_buffer_bytes(cfg: RunConfig, stage: int) -> int:
    """The two flattened-bucket buffers of the rank that owns stage ``stage``'s buckets (its first TP
    rank), bucket k in buffer k % 2. Each is as large as the largest bucket it takes:
    ``trainer.sync_bucket_mb``, or a larger HF tensor alone (a tensor is never split): counted as the
    stage's two largest tensors (the embedding and output layer it holds, else MLP matrices), at most
    the stage's HF bytes."""
    a, pp = cfg.model.arch, cfg.parallel.pipeline_model_parallel_size
    dtype_bytes = 4 if cfg.model.dtype == "float32" else 2
    owned = stage_params(a, 1, pp, stage) * dtype_bytes
    bucket = int(cfg.trainer.sync_bucket_mb * 2**20)
    vocab, mlp = a.vocab_size * a.hidden_size * dtype_bytes, a.ffn_hidden_size * a.hidden_size * dtype_bytes
    # HF tensors of vocabulary rows here: the embedding on the first stage, the output layer on the last
    # (none with tied embeddings: the HF model has one)
    vocabs = int(stage == 0) + int(stage == pp - 1 and not a.tie_word_embeddings)
    largest = [vocab] * vocabs + [mlp] * 2
    return sum(min(max(bucket, size), owned) for size in largest[:2])


def learner_memory(cfg: RunConfig, prompt_tokens: int, stage: int) -> LearnerMemory:
    """Memory of one learner rank on pipeline stage ``stage``."""
    a, p, t, m = cfg.model.arch, cfg.parallel, cfg.trainer, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dtype_bytes = DTYPE_BYTES[m.dtype]
    n = stage_params(a, tp, pp, stage)
    adam = 8 + (4 if m.dtype == "bfloat16" else 0)  # exp_avg + exp_avg_sq (+ fp32 master), per parameter
    optimizer = n * adam // (cfg.data_parallel_size if p.use_distributed_optimizer else 1)
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    cp, vpp = p.context_parallel_size, p.virtual_pipeline_model_parallel_size
    local_seq = -(-seq // cp)  # this rank's share of every sequence
    micro_batches = t.global_batch_size // (cfg.data_parallel_size * t.micro_batch_size)
    layers = a.num_layers // pp
    if vpp == 1:  # 1F1B: stage k holds the activations of up to pp - k micro-batches before its first backward
        layer_micro_batches = min(pp - stage, micro_batches) * layers
    else:  # interleaved: Megatron's warm-up of (pp - k - 1) * 2 + (vpp - 1) * pp chunk passes, plus one
        chunk_passes = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp)
        layer_micro_batches = chunk_passes * layers // vpp
    in_flight = layer_micro_batches / layers  # in whole-stage micro-batches
    # selective recomputation keeps no attention scores (as fused attention); full keeps each layer's
    # input and rebuilds one layer at a time in the backward pass
    per_layer = layer_activation_bytes(a, local_seq, t.micro_batch_size, tp, p.sequence_parallel,
                                       m.transformer_impl == "transformer_engine" or p.recompute != "none",
                                       dtype_bytes, key_len=seq)
    if p.recompute == "full":
        layer_input = (local_seq * t.micro_batch_size * a.hidden_size * dtype_bytes
                       // (tp if p.sequence_parallel else 1))
        activations = layer_micro_batches * layer_input + per_layer
    else:
        activations = layer_micro_batches * per_layer
    if stage == pp - 1:  # float32 logits of this rank's vocabulary slice and the loss's copies of them
        activations += LOGIT_COPIES * local_seq * t.micro_batch_size * (a.vocab_size // tp) * 4
    return LearnerMemory(stage=stage, params=n, param_bytes=n * dtype_bytes, grad_bytes=n * GRAD_BYTES,
                         optimizer_bytes=optimizer,
                         reference_bytes=n * dtype_bytes if cfg.algorithm.kl_coef > 0 else 0,
                         push_buffer_bytes=push_buffer_bytes(cfg, stage),
                         activation_bytes=activations, micro_batches_in_flight=in_flight, seq_len=seq)


def request_kv_tokens(cfg: RunConfig, prompt_tokens: int) -> tuple[int, int]:
    """KV slots one request reserves when admitted: ``(dense, sparse)``.

    Dense: prompt + max_new_tokens. Sparse (sglang_patches/admission.py): the prompt (prefill is
    never compressed) + ``min(max_new_tokens, budget + interval + 1)`` decode slots; equal to dense
    with ``policy: none``. Requests of a GRPO group share their prompt's slots in the radix cache; not
    counted here (conservative)."""
    kv, max_new = cfg.rollout.kv_compression, cfg.rollout.max_new_tokens
    dense = prompt_tokens + max_new
    if kv.policy == "none":
        return dense, dense
    return dense, prompt_tokens + min(max_new, compressed_bound(engine_settings(cfg)))


def engine_settings(cfg: RunConfig) -> EngineKVSettings:
    """The KV settings the trainer starts its engines with (per-request overrides when the held-out
    evaluation asks for KV settings other than the rollout's)."""
    kv = cfg.rollout.kv_compression
    override = False
    if cfg.eval.path is not None:
        override = needs_request_override(parse_kv_variants(cfg.eval.kv, kv))
    return EngineKVSettings.from_config(kv, allow_request_override=override)


def engine_memory(cfg: RunConfig, gpu_bytes: int, prompt_tokens: int, resident_bytes: int = 0) -> EngineMemory:
    """One engine TP rank on a GPU of ``gpu_bytes`` where ``resident_bytes`` are already taken (the
    colocated learner's states). SGLang's pool: ``mem_fraction_static x free - weights`` bytes."""
    a, r = cfg.model.arch, cfg.rollout
    tp, dtype_bytes = r.engine_tensor_parallel_size, DTYPE_BYTES[cfg.model.dtype]
    n = engine_params(a, tp)
    kv_heads = engine_kv_heads(a, tp)
    per_token = 2 * a.num_layers * kv_heads * a.kv_channels * dtype_bytes  # K and V [layers, kv_heads, d]
    free = max(0, gpu_bytes - resident_bytes)
    settings = engine_settings(cfg)
    side, running, graphs = {}, 0, cuda_graphs_allowed(settings)[1]
    if records_queries(settings):  # rollout/engine.py: taken out of mem_fraction_static before SGLang sizes its pool
        running = r.max_running_requests or DEFAULT_RUNNING_REQUESTS
        side = side_buffer_bytes(settings, running_requests=running, layers=a.num_layers,
                                 q_heads=a.num_attention_heads // tp, kv_heads=kv_heads, head_dim=a.kv_channels,
                                 dtype_bytes=dtype_bytes, prompt_tokens=prompt_tokens)
    static = int(free * r.mem_fraction_static) - sum(side.values())
    pool_tokens = max(0, static - n * dtype_bytes) // per_token
    if r.max_total_tokens:
        pool_tokens = min(pool_tokens, r.max_total_tokens)
    dense, sparse = request_kv_tokens(cfg, prompt_tokens)
    return EngineMemory(tp=tp, params=n, weight_bytes=n * dtype_bytes, kv_heads=kv_heads,
                        kv_bytes_per_token=per_token, free_bytes=free, static_bytes=static, pool_tokens=pool_tokens,
                        dense_tokens=dense, sparse_tokens=sparse,
                        requests_per_engine=math.ceil(cfg.samples_per_iteration / r.num_engines),
                        max_running_requests=r.max_running_requests, side_buffers=side, side_running=running,
                        cuda_graphs=graphs)


def plan_memory(cfg: RunConfig, gpu_memory_gb: float = 80.0, prompt_tokens: int = 512) -> MemoryPlan:
    """The plan for GPUs of ``gpu_memory_gb`` GiB and prompts of ``prompt_tokens`` tokens; the
    learner's worst pipeline stage is the one with the largest total."""
    gpu = int(gpu_memory_gb * GIB)
    pp = cfg.parallel.pipeline_model_parallel_size
    stages = [learner_memory(cfg, prompt_tokens, s) for s in range(pp)]
    learner = max(stages, key=lambda lm: lm.total_bytes)
    colocated = cfg.rollout.placement == "colocated"
    # colocated: the engine starts next to the learner's resident states (of the heaviest stage)
    resident = max(lm.states_bytes for lm in stages) if colocated else 0
    engine = engine_memory(cfg, gpu, prompt_tokens, resident)
    problems = []
    if learner.total_bytes > gpu:
        problems.append(f"learner (stage {learner.stage}) needs {gib(learner.total_bytes)} GiB, "
                        f"{gib(learner.total_bytes - gpu)} GiB more than the GPU's {gib(gpu)} GiB")
    need = engine.sparse_tokens  # = dense without compression
    if engine.static_bytes < engine.weight_bytes:
        problems.append(f"engine weights {gib(engine.weight_bytes)} GiB exceed mem_fraction_static x free = "
                        f"{gib(engine.static_bytes)} GiB by {gib(engine.weight_bytes - engine.static_bytes)} GiB")
    elif engine.pool_tokens < need:
        problems.append(f"engine KV pool holds {engine.pool_tokens} tokens, {need - engine.pool_tokens} fewer than "
                        f"one request needs ({need})")
    return MemoryPlan(gpu_bytes=gpu, prompt_tokens=prompt_tokens, colocated=colocated, learner=learner,
                      engine=engine, problems=problems)


# ----------------------------------------------------------------------------- text


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def format_plan(cfg: RunConfig, plan: MemoryPlan) -> str:
    """The plan as text: learner, engine, assumptions and a verdict line."""
    lm, em, m, p, r = plan.learner, plan.engine, cfg.model, cfg.parallel, cfg.rollout
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, cfg.data_parallel_size
    adam = "fp32 master + exp_avg + exp_avg_sq" if m.dtype == "bfloat16" else "exp_avg + exp_avg_sq"
    if p.use_distributed_optimizer:
        adam += f", divided over DP {dp} (distributed optimizer)"
    fused = m.transformer_impl == "transformer_engine" or p.recompute != "none"
    vpp, cp = p.virtual_pipeline_model_parallel_size, p.context_parallel_size
    interleaved = f" (interleaved, {vpp} virtual stages)" if vpp > 1 else ""
    split = f", each sequence split over CP {cp}" if cp > 1 else ""
    activations = (f"estimate: Korthikanti et al. per layer, {'SP' if p.sequence_parallel else 'no SP'}, "
                   f"{'fused attention, no s x s scores' if fused else 'with s x s scores'}"
                   f"{'' if p.recompute == 'none' else f', {p.recompute} recomputation'}; "
                   f"{lm.micro_batches_in_flight:g} micro-batch(es) of {cfg.trainer.micro_batch_size} x {lm.seq_len} "
                   f"tokens in flight{interleaved}{split}{' + fp32 logits' if lm.stage == pp - 1 else ''}")
    replicated = ", KV heads replicated" if em.tp > m.arch.num_query_groups else ""
    capped = " (capped by rollout.max_total_tokens)" if r.max_total_tokens == em.pool_tokens else ""
    sparse = (f"sparse {em.sparse_tokens:,} (prompt + min(max_new, budget + interval + 1)) -> "
              f"{em.sparse_concurrent:,} concurrent" if r.kv_compression.policy != "none" else "no KV compression")
    running = f", max_running_requests {em.max_running_requests}" if em.max_running_requests else ""
    lines = [
        f"memory plan: GPU {gib(plan.gpu_bytes)} GiB, prompts of {plan.prompt_tokens} tokens "
        f"+ {r.max_new_tokens} new = {lm.seq_len}; model {total_params(m.arch) / 1e9:.3f}B parameters",
        f"learner    rank of stage {lm.stage} (worst of PP {pp}), TP {tp}{f', CP {cp}' if cp > 1 else ''}: "
        f"{lm.params:,} parameters",
        f"  parameters   {gib(lm.param_bytes):>9} GiB  ({m.dtype})",
        f"  gradients    {gib(lm.grad_bytes):>9} GiB  (fp32 main grads)",
        f"  Adam         {gib(lm.optimizer_bytes):>9} GiB  ({adam})",
    ]
    if lm.reference_bytes:
        lines.append(f"  reference    {gib(lm.reference_bytes):>9} GiB  (frozen KL reference, algorithm.kl_coef > 0)")
    if lm.push_buffer_bytes:
        lines.append(f"  push buffers {gib(lm.push_buffer_bytes):>9} GiB  (2 flattened buckets of the weight push, "
                     f"on the stage's first TP rank)")
    lines += [
        f"  activations  {gib(lm.activation_bytes):>9} GiB  ({activations})",
        f"  total        {gib(lm.total_bytes):>9} GiB",
        f"engine     TP {em.tp} rank ({'colocated with a learner rank' if plan.colocated else 'own GPU'}): "
        f"{em.params:,} parameters",
        f"  weights      {gib(em.weight_bytes):>9} GiB  ({m.dtype})",
        f"  KV per token {em.kv_bytes_per_token:>9,} B    (2 x {m.arch.num_layers} layers x {em.kv_heads} KV head(s) "
        f"x {m.arch.kv_channels} x {DTYPE_BYTES[m.dtype]} B{replicated})",
        f"  static       {gib(em.static_bytes):>9} GiB  (mem_fraction_static {r.mem_fraction_static} "
        f"x {gib(em.free_bytes)} GiB free at start{' - side buffers' if em.side_bytes else ''})",
        f"  KV pool      {gib(em.pool_bytes):>9} GiB  = {em.pool_tokens:,} tokens{capped}",
        f"  per request  dense {em.dense_tokens:,} tokens -> {em.dense_concurrent:,} concurrent; {sparse}",
        f"  demand       {em.requests_per_engine:,} samples per iteration per engine{running}",
    ]
    if em.side_bytes:
        side = em.side_buffers
        mass = f", H2O mass {gib(side['h2o_mass'])} GiB" if side["h2o_mass"] else ""
        lines.append(f"  side buffers {gib(em.side_bytes):>9} GiB  (query ring {gib(side['query_ring'])} GiB{mass} for "
                     f"{em.side_running:,} running requests, scoring workspace {gib(side['scoring'])} GiB; "
                     f"taken out before SGLang sizes its pool)")
    if r.kv_compression.policy != "none" or em.side_bytes:
        lines.append(f"  GPU engine   {em.cuda_graphs}")
    if plan.colocated:
        lines.append(
            "assumption colocated: the engine releases its weights and KV pool while the learner trains (SGLang "
            "release_memory_occupation) and the learner's states stay resident during rollouts, so the engine starts "
            f"with GPU - learner states = {gib(em.free_bytes)} GiB free; without the release, training has "
            f"{gib(em.free_bytes - em.static_bytes)} GiB left for {gib(lm.activation_bytes)} GiB of activations")
    lines.append("not counted: CUDA context, allocator fragmentation, NCCL buffers, SGLang's CUDA graphs and "
                 "activations (the 1 - mem_fraction_static it leaves), FP8 caches")
    lines.append("verdict    " + ("fits" if plan.fits else "does NOT fit: " + "; ".join(plan.problems)))
    return "\n".join(lines)
