"""Cross-field checks of a whole :class:`RunConfig`: the first failure raises ``ConfigError`` naming its key."""
from __future__ import annotations

import json
from pathlib import Path

from sparse_rl_mega.config.algorithm import validate_correction
from sparse_rl_mega.config.errors import require
from sparse_rl_mega.config.evaluation import validate_eval
from sparse_rl_mega.config.hf import check_against_hf_config
from sparse_rl_mega.config.model import rope_scaling_problem
from sparse_rl_mega.config.rollout import validate_kv
from sparse_rl_mega.config.run import RunConfig
from sparse_rl_mega.kv.engine_settings import attention_backend_problem


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
        require(value > 0, source, key, f"must be > 0, got {value}")
    if a.rope_scaling is not None and (rope_problem := rope_scaling_problem(a.rope_scaling)):
        require(False, source, f"model.arch.rope_scaling.{rope_problem[0]}", rope_problem[1])
    require(cfg.tracking.flush_timeout_s >= 0, source, "tracking.flush_timeout_s",
            f"must be >= 0, got {cfg.tracking.flush_timeout_s}")
    require(t.watchdog_floor_s >= 0, source, "trainer.watchdog_floor_s", f"must be >= 0 (0: no watchdog), got {t.watchdog_floor_s}")
    require(t.watchdog_factor >= 1, source, "trainer.watchdog_factor", f"must be >= 1, got {t.watchdog_factor}")
    require(t.watchdog_first_s is None or t.watchdog_first_s > 0, source, "trainer.watchdog_first_s",
            f"must be > 0, got {t.watchdog_first_s}")

    require(bool(cfg.model.path), source, "model.path", "required: an HF model folder (or where to create one)")
    tiny = cfg.model.create_tiny
    if tiny is not None:
        require(tiny.warmup_sft_steps >= 0, source, "model.create_tiny.warmup_sft_steps",
                f"must be >= 0, got {tiny.warmup_sft_steps}")
        require(tiny.warmup_batch_size >= 1, source, "model.create_tiny.warmup_batch_size",
                f"must be >= 1, got {tiny.warmup_batch_size}")
        require(tiny.warmup_lr > 0, source, "model.create_tiny.warmup_lr", f"must be > 0, got {tiny.warmup_lr}")
    require(bool(d.train_path), source, "data.train_path", "required: a jsonl file of prompts and labels")
    if d.format == "prompt_label":
        require(bool(d.prompt_key) and bool(d.label_key) and d.prompt_key != d.label_key, source, "data.prompt_key",
                f"prompt_key and label_key must be distinct non-empty keys, got {d.prompt_key!r}, {d.label_key!r}")
        require(not d.apply_chat_template, source, "data.apply_chat_template",
                "prompt_label rows are used as written (template them with tools/prepare_data.py), or set "
                "data.format: question_answer")
    else:
        require(bool(d.question_key) and bool(d.answer_key) and d.question_key != d.answer_key, source,
                "data.question_key", "question_key and answer_key must be distinct non-empty keys, got "
                f"{d.question_key!r}, {d.answer_key!r}")
        require(cfg.model.create_tiny is None, source, "data.format",
                "model.create_tiny builds its tokenizer and warm-up from prompt_label rows; write them with "
                "tools/prepare_data.py or use an existing model.path")
    if d.tokenizer is not None:
        require(d.apply_chat_template, source, "data.tokenizer", "only used with data.apply_chat_template: true")
        require(Path(d.tokenizer).is_dir(), source, "data.tokenizer", f"{d.tokenizer} is not a folder")
    if d.apply_chat_template:
        folder = Path(d.tokenizer or cfg.model.path)
        require(not folder.is_dir() or has_chat_template(folder), source,
                "data.tokenizer" if d.tokenizer else "data.apply_chat_template",
                f"the tokenizer in {folder} has no chat template")
    if a.head_dim is None:
        require(a.hidden_size % a.num_attention_heads == 0, source, "model.arch.hidden_size",
                f"{a.hidden_size} is not divisible by num_attention_heads={a.num_attention_heads} "
                "(set model.arch.head_dim for heads of another width)")
    else:
        require(a.head_dim > 0, source, "model.arch.head_dim", f"must be > 0, got {a.head_dim}")
    require(not a.qkv_bias or a.family == "qwen2", source, "model.arch.qkv_bias",
            f"q/k/v-only biases exist in family qwen2; HF {a.family}'s attention_bias also biases o_proj, "
            "which the Megatron map does not carry")
    require(a.num_attention_heads % a.num_query_groups == 0, source, "model.arch.num_query_groups",
            f"{a.num_query_groups} must divide num_attention_heads={a.num_attention_heads}")
    require(a.num_attention_heads % tp == 0, source, "parallel.tensor_model_parallel_size",
            f"TP={tp} must divide model.arch.num_attention_heads={a.num_attention_heads}")
    require(a.num_query_groups % tp == 0, source, "parallel.tensor_model_parallel_size",
            f"TP={tp} must divide model.arch.num_query_groups={a.num_query_groups}")
    require(a.ffn_hidden_size % tp == 0, source, "parallel.tensor_model_parallel_size",
            f"TP={tp} must divide model.arch.ffn_hidden_size={a.ffn_hidden_size}")
    require(a.vocab_size % tp == 0, source, "parallel.tensor_model_parallel_size",
            f"TP={tp} must divide model.arch.vocab_size={a.vocab_size} (the embedding is split by vocabulary)")
    require(a.num_layers % pp == 0, source, "parallel.pipeline_model_parallel_size",
            f"PP={pp} must divide model.arch.num_layers={a.num_layers}")
    vpp, cp = p.virtual_pipeline_model_parallel_size, p.context_parallel_size
    require(vpp >= 1, source, "parallel.virtual_pipeline_model_parallel_size", f"must be >= 1, got {vpp}")
    require(vpp == 1 or pp > 1, source, "parallel.virtual_pipeline_model_parallel_size",
            "virtual pipeline stages interleave the chunks of several pipeline ranks: needs "
            "pipeline_model_parallel_size > 1")
    require(a.num_layers % (pp * vpp) == 0, source, "parallel.virtual_pipeline_model_parallel_size",
            f"PP={pp} x virtual stages {vpp} must divide model.arch.num_layers={a.num_layers}")
    require(cp >= 1, source, "parallel.context_parallel_size", f"must be >= 1, got {cp}")
    require(cfg.world_size % (tp * pp * cp) == 0, source, "parallel",
            f"world size nnodes*nproc_per_node={cfg.world_size} is not divisible by "
            f"TP*PP*CP={tp}*{pp}*{cp}={tp * pp * cp}")
    require(not p.sequence_parallel or tp > 1, source, "parallel.sequence_parallel",
            "needs tensor_model_parallel_size > 1")
    require(not p.sequence_parallel or cfg.model.transformer_impl == "transformer_engine", source,
            "parallel.sequence_parallel", "needs model.transformer_impl: transformer_engine (the local layer spec's "
            "torch norms do not support sequence parallelism)")
    require(r.engine_tensor_parallel_size <= p.nproc_per_node or r.placement == "separate", source,
            "rollout.engine_tensor_parallel_size",
            f"{r.engine_tensor_parallel_size} exceeds the devices of one node (parallel.nproc_per_node="
            f"{p.nproc_per_node}); an engine's TP group stays within a node")
    require(a.num_attention_heads % r.engine_tensor_parallel_size == 0, source,
            "rollout.engine_tensor_parallel_size",
            f"{r.engine_tensor_parallel_size} must divide model.arch.num_attention_heads={a.num_attention_heads}")
    require(r.placement != "separate" or t.sync_method == "broadcast", source, "trainer.sync_method",
            "separate engines (rollout.placement: separate) receive weights by broadcast: set 'broadcast'")
    require(r.num_engines == 1 or t.sync_method == "broadcast", source, "trainer.sync_method",
            f"{r.num_engines} engines receive weights from rank 0 over one broadcast group: set 'broadcast'")
    require(r.num_engines % p.nnodes == 0, source, "rollout.num_engines",
            f"{r.num_engines} engines cannot be spread evenly over parallel.nnodes={p.nnodes} nodes")
    per_node = r.num_engines // p.nnodes
    if r.placement == "colocated":
        need = per_node * r.engine_tensor_parallel_size
        require(need <= p.nproc_per_node, source, "rollout.num_engines",
                f"{per_node} colocated engine(s) per node x TP {r.engine_tensor_parallel_size} = {need} devices "
                f"exceed the {p.nproc_per_node} devices of a node (parallel.nproc_per_node)")
    else:
        require(per_node <= p.nproc_per_node, source, "rollout.num_engines",
                f"{per_node} separate engines per node need as many learner processes per node to drive them "
                f"(parallel.nproc_per_node={p.nproc_per_node})")
    require(d.prompts_per_iteration % r.num_engines == 0, source, "data.prompts_per_iteration",
            f"{d.prompts_per_iteration} prompts cannot be shared equally by rollout.num_engines={r.num_engines}")
    most = a.max_position_embeddings - 3  # after a one-token prompt (preflight.response_room: positions - prompt - 2)
    require(r.max_new_tokens <= most, source, "rollout.max_new_tokens",
            f"{r.max_new_tokens} does not fit the model's {a.max_position_embeddings} positions "
            f"(model.arch.max_position_embeddings): SGLang generates at most {most}, after a one-token prompt")
    require(r.max_staleness >= 0, source, "rollout.max_staleness",
            f"must be >= 0 (0: no overlap; K: samples at most K weight versions old), got {r.max_staleness}")
    require(r.partial == "none" or r.max_staleness >= 1, source, "rollout.partial",
            f"{r.partial!r} needs rollout.max_staleness >= 1 (with 0 no request is in flight at a push)")
    require(0.0 < r.top_p <= 1.0, source, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    require(r.top_k == -1 or r.top_k >= 2, source, "rollout.top_k",
            f"must be -1 (off) or >= 2 (1 is greedy: every sample of a prompt would be the same), got {r.top_k}")
    require(r.min_p == 0.0, source, "rollout.min_p",
            f"must be 0, got {r.min_p}: SGLang 0.5.23's pytorch sampler cannot draw min-p with a per-request "
            "seed (an assertion in top_k_top_p_min_p_sampling_from_probs_torch), and every rollout is seeded "
            "so that a resumed run repeats the uninterrupted one; truncate with top_p or top_k")
    require(attention_backend_problem(r.attention_backend) is None, source, "rollout.attention_backend",
            str(attention_backend_problem(r.attention_backend)))
    require(r.temperature > 0.0, source, "rollout.temperature",
            f"must be > 0 (RL samples), got {r.temperature}")
    require(0.0 < r.mem_fraction_static < 1.0, source, "rollout.mem_fraction_static",
            f"must be in (0, 1), got {r.mem_fraction_static}")

    validate_kv(cfg, source)

    rw = cfg.reward
    require(0.0 < rw.timeout_s <= 600.0, source, "reward.timeout_s",
            f"must be in (0, 600] seconds, got {rw.timeout_s}")
    require(1 <= rw.workers <= 64, source, "reward.workers", f"must be in [1, 64], got {rw.workers}")
    require(-1.0 <= rw.format_weight <= 1.0, source, "reward.format_weight",
            f"must be in [-1, 1] so that correctness dominates, got {rw.format_weight}")

    validate_eval(cfg, source)
    validate_correction(cfg.algorithm.correction, source)
    al = cfg.algorithm
    require(0 <= al.eps_clip_low < 1 and al.eps_clip_high >= 0, source, "algorithm.eps_clip_low",
            f"expected 0 <= eps_clip_low < 1 and eps_clip_high >= 0, got {al.eps_clip_low}, {al.eps_clip_high}")
    if al.dual_clip is not None:
        require(al.dual_clip > 1.0, source, "algorithm.dual_clip", f"must be > 1, got {al.dual_clip}")
    require(al.kl_coef >= 0, source, "algorithm.kl_coef", f"must be >= 0, got {al.kl_coef}")
    require(al.entropy_coef >= 0, source, "algorithm.entropy_coef", f"must be >= 0, got {al.entropy_coef}")
    require(r.n_samples_per_prompt >= 2, source, "rollout.n_samples_per_prompt",
            "GRPO needs at least 2 samples per prompt to form a group baseline")

    dp = cfg.data_parallel_size
    samples = cfg.samples_per_iteration
    require(samples % t.global_batch_size == 0, source, "trainer.global_batch_size",
            f"{t.global_batch_size} must divide the samples per iteration "
            f"(data.prompts_per_iteration x rollout.n_samples_per_prompt = {samples})")
    require(t.global_batch_size % (dp * t.micro_batch_size) == 0, source, "trainer.global_batch_size",
            f"{t.global_batch_size} must be divisible by data-parallel size x micro_batch_size = "
            f"{dp} x {t.micro_batch_size}")
    if p.virtual_pipeline_model_parallel_size > 1:  # (the batch divides evenly: checked just above)
        steps_mbs = t.global_batch_size // (dp * t.micro_batch_size)
        require(steps_mbs % pp == 0, source, "trainer.micro_batch_size",
                f"the interleaved pipeline (virtual_pipeline_model_parallel_size > 1) runs micro-batches in "
                f"groups of PP={pp}: a step's {steps_mbs} micro-batches per data-parallel rank "
                f"(global_batch_size / (DP x micro_batch_size)) must be a multiple of {pp}")
    require((t.global_batch_size // dp) % r.n_samples_per_prompt == 0, source, "trainer.global_batch_size",
            f"each data-parallel rank's share ({t.global_batch_size // dp}) must hold whole GRPO groups of "
            f"rollout.n_samples_per_prompt={r.n_samples_per_prompt}")
    require(t.lr > 0, source, "trainer.lr", f"must be > 0, got {t.lr}")
    require(cfg.checkpoint.save_interval >= 0, source, "checkpoint.save_interval", "must be >= 0")
    require(cfg.checkpoint.keep_last >= 1, source, "checkpoint.keep_last", "must be >= 1")
    require(r.max_engine_restarts >= 0, source, "rollout.max_engine_restarts", f"must be >= 0, got {r.max_engine_restarts}")
    resume = cfg.checkpoint.resume
    require(resume in (None, "auto") or Path(resume).is_dir(), source, "checkpoint.resume",
            f"must be 'auto', null or an existing checkpoint folder; {resume!r} is not a folder")

    m = cfg.model
    if m.fp8 is not None:
        require(m.transformer_impl == "transformer_engine", source, "model.fp8",
                "FP8 needs model.transformer_impl: transformer_engine")
        require(m.dtype == "bfloat16", source, "model.fp8", "FP8 training keeps bfloat16 params: set model.dtype")
    require(not m.fp8_param or m.fp8 is not None, source, "model.fp8_param", "needs model.fp8")
    require(not m.fp8_param or cfg.parallel.use_distributed_optimizer, source, "model.fp8_param",
            "needs parallel.use_distributed_optimizer: true (only Megatron's distributed optimizer writes its "
            "fp32 master weights back into FP8 parameters)")
    check_against_hf_config(cfg, source)


def has_chat_template(folder: Path) -> bool:
    """Whether an HF tokenizer folder carries a chat template (without loading transformers)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
