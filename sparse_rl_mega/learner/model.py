"""Build the Megatron-Core GPT model, DDP wrapper and optimizer from the run config.

The layer spec is chosen once here: Transformer Engine's spec (with FP8 if configured) when
``model.transformer_impl: transformer_engine``, the local (pure torch) spec otherwise. CPU runs use
the local spec with the shims of :mod:`sparse_rl_mega.learner.cpu_shims`. The HF family decides the
attention details (``model.arch``): head width (``kv_channels``), q/k/v biases (Qwen2) and per-head
q/k RMSNorm (Qwen3, ``qk_layernorm``); RoPE scaling (``model.arch.rope_scaling``: llama3, linear) sets
the rotary inverse frequencies after the model is built (:func:`scaled_inv_freq`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_rl_mega.config import RunConfig
from sparse_rl_mega.learner.context_parallel import AllGatherKVAttention

# float64 is not a config choice (SGLang serves float32/bfloat16): exactness tests set it directly.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def transformer_config_kwargs(cfg: RunConfig) -> dict:
    """Keyword arguments of Megatron's ``TransformerConfig`` for this run (importable without TE)."""
    a, p, m = cfg.model.arch, cfg.parallel, cfg.model
    dtype = _DTYPES[m.dtype]
    kwargs = dict(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups,
        kv_channels=a.kv_channels, qk_layernorm=a.qk_layernorm,
        normalization="RMSNorm", layernorm_epsilon=a.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=a.has_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # the loss returns (sum, count): Megatron divides gradients by the count of the whole step
        calculate_per_token_loss=True,
        # identical master weights for any TP split (and no CUDA needed to initialise)
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    if p.context_parallel_size > 1 and m.transformer_impl == "transformer_engine":
        kwargs.update(cp_comm_type="p2p")  # TE's ring exchange of K/V chunks, overlapped with attention
    if p.virtual_pipeline_model_parallel_size > 1:
        # as Megatron-LM does with virtual stages: per-direction p2p ops overlapped with compute. Batched
        # ops would also be wrong at PP 2, where both neighbours are the same rank: a chunk's activation
        # and another chunk's gradient cross in one batch and are matched in posting order (swapped)
        kwargs.update(virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
                      overlap_p2p_comm=True, batch_p2p_comm=False)
    if m.fp8 is not None:
        kwargs.update(fp8=m.fp8, fp8_recipe=m.fp8_recipe, fp8_param=m.fp8_param)
    if p.recompute == "selective":  # core attention (the s x s scores) recomputed in the backward pass
        kwargs.update(recompute_granularity="selective")
    elif p.recompute == "full":  # every layer's input kept, the layer recomputed
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return kwargs


def scaled_inv_freq(inv_freq: torch.Tensor, arch) -> torch.Tensor:
    """The rotary inverse frequencies ``[kv_channels / 2]`` of plain RoPE (float32, as Megatron and
    transformers make them) scaled as ``arch.rope_scaling`` says, on their own device and in their dtype.
    The float32 operations are transformers' (modeling_rope_utils, llama3 and linear) one for one, so
    the angles agree bit for bit. Megatron-Core 0.16.1's own ``rope_scaling`` hard-codes llama3's
    low_freq_factor 1, high_freq_factor 4 and 8192 original positions; this takes them from the config."""
    s = arch.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    original, low, high = arch.rope_original_positions, s.low_freq_factor, s.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > original / low, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * stretched / s.factor + smooth * stretched
    between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(between, blended, stretched)


def layer_spec(cfg: RunConfig):
    from megatron.core.models.gpt import gpt_layer_specs

    qk_layernorm = cfg.model.arch.qk_layernorm  # Qwen3's q_norm / k_norm
    if cfg.model.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    if cfg.parallel.context_parallel_size > 1:  # Megatron's local attention refuses CP: gather K/V instead
        spec.submodules.self_attention.submodules.core_attention = AllGatherKVAttention
    return spec


@dataclass
class Learner:
    """This rank's model chunks (one, or one per virtual pipeline stage, in stage order), their DDP
    wrappers, the optimizer over all of them and Megatron's config."""
    chunks: list  # DDP-wrapped chunks, what the pipeline schedule runs
    modules: list  # the GPTModel inside each chunk
    optimizer: object
    config: object


def _gpt_chunks(cfg: RunConfig, config) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks. With virtual stages, chunk ``v`` of pipeline rank ``r`` holds the
    ``(v * PP + r)``-th block of layers; only chunk 0 of the first rank embeds and only the last chunk
    of the last rank has the output layer."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    a, vpp = cfg.model.arch, cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp):
        stage = dict(ignore_virtual=vpp == 1, vp_stage=vp if vpp > 1 else None)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec(cfg), vocab_size=a.vocab_size,
                         max_sequence_length=a.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(**stage), post_process=ps.is_pipeline_last_stage(**stage),
                         share_embeddings_and_output_weights=a.tie_word_embeddings, position_embedding_type="rope",
                         rotary_base=int(a.rope_theta), vp_stage=stage["vp_stage"])
        if a.rope_scaling is not None:  # (every stage has a rotary embedding; its inv_freq is no parameter)
            model.rotary_pos_emb.inv_freq = scaled_inv_freq(model.rotary_pos_emb.inv_freq, a)
        if config.params_dtype == torch.float64:
            # the local spec's torch norms are created in float32; an exactness run wants every weight in float64
            model = model.to(torch.float64)
        chunks.append(model)
    return chunks


def build_reference_model(cfg: RunConfig) -> list[torch.nn.Module]:
    """A frozen copy of the policy's architecture for the KL penalty (same TP/PP split and chunks, no
    DDP, no optimizer); the caller loads its weights."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    chunks = _gpt_chunks(cfg, TransformerConfig(**transformer_config_kwargs(cfg)))
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        chunk.eval()
    return chunks


def build_model(cfg: RunConfig, initialize: bool = True) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks alone (no DDP, no optimizer), e.g. to load a checkpoint into
    (``tools/export_hf.py``); ``initialize=False`` skips the random initialisation of weights that are
    overwritten anyway."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return _gpt_chunks(cfg, TransformerConfig(**transformer_config_kwargs(cfg), perform_initialization=initialize))


def build_learner(cfg: RunConfig) -> Learner:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_kwargs(cfg))
    modules = _gpt_chunks(cfg, config)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=config.params_dtype == torch.bfloat16,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    # as Megatron-LM does: only the first chunk's buffer is bucketed
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=module, disable_bucketing=i > 0)
              for i, module in enumerate(modules)]
    config.finalize_model_grads_func = finalize_model_grads
    t = cfg.trainer
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer), chunks)
    return Learner(chunks=chunks, modules=modules, optimizer=optimizer, config=config)
