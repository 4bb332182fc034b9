"""What ``tools/launch.py`` prints about a run before it starts (``--dry-run``, ``--plan``, the job's first
lines) and when it stops: the layout, the model's shape, the sampling, and what ``--resume`` would do."""
from __future__ import annotations

from sparse_rl_mega.cli.planner import engine_settings
from sparse_rl_mega.config import RunConfig
from sparse_rl_mega.config.rollout import RolloutConfig
from sparse_rl_mega.kv.engine_settings import cuda_graphs_allowed
from sparse_rl_mega.kv.registry import policy_class
from sparse_rl_mega.runtime.checkpoint_files import checkpoint_folder, find_checkpoint


def sampling_line(r: RolloutConfig) -> str:
    """The rollout's sampling distribution, and what the learner does to recompute it."""
    truncation = ", ".join(part for part in (f"top_k {r.top_k}" if r.top_k > 0 else "",
                                             f"top_p {r.top_p:g}" if r.top_p < 1 else "") if part)
    line = f"temperature {r.temperature:g}" + (f", {truncation}" if truncation else "")
    line += "; the learner's log-probabilities divide the logits by it" if r.temperature != 1 else ""
    if r.truncates:
        most = f"at most {r.top_k} ids" if r.top_k > 0 else "up to the whole vocabulary: a top_k bounds it"
        line += f"; the learner renormalises over each token's support as the engines report it ({most})"
    return line


def describe_layout(cfg: RunConfig) -> str:
    """The run in a few lines: model, learner layout, rollout, sampling, KV compression, optimizer, tracking."""
    p, r, kv, m = cfg.parallel, cfg.rollout, cfg.rollout.kv_compression, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    position_only = kv.policy == "none" or policy_class(kv.policy).position_only
    selection = "" if position_only else (
        f", {kv.selection} selection" + (f" ({kv.shared_scores} scores)" if kv.selection == "shared" else ""))
    graphs_on, why = cuda_graphs_allowed(engine_settings(cfg))
    graphs = "" if graphs_on else f"; GPU engines: {why}"
    params = kv.policy_params()
    unused = sorted(set(kv.params) - set(params))  # (other policies' parameters, for --set policy=...)
    params_text = "".join([f"; params {', '.join(f'{k} {v}' for k, v in params.items())}" if params else "",
                           f" ({', '.join(unused)} not taken by {kv.policy})" if unused else ""])
    auto = kv.auto_budget
    budget = f"budget {kv.budget} tokens" if auto is None else (
        f"automatic budget in [{auto.min}, {auto.max}] tokens from {kv.budget} (p{auto.quantile:g} of rho >= "
        f"{auto.min_rho:g}; +{auto.step_up} on a violation, -{auto.step_down} otherwise; engines sized for {auto.max})")
    kv_line = ("dense (no KV compression)" if kv.policy == "none" else
               f"{kv.policy}: {budget} (sink {kv.sink}, recent window {kv.window}{selection}), "
               f"compress every {kv.interval} decode tokens past the budget{params_text}{graphs}")
    precision = m.dtype + (f", FP8 {m.fp8} ({m.fp8_recipe} scaling)" if m.fp8 else "")
    vpp, cp = p.virtual_pipeline_model_parallel_size, p.context_parallel_size
    virtual = f" ({vpp} virtual stages each)" if vpp > 1 else ""
    context = f" x CP {cp}" if cp > 1 else ""
    lines = [
        f"model      {m.path}: {describe_arch(cfg)}",
        f"learner    world {cfg.world_size} = {p.nnodes} node(s) x {p.nproc_per_node}; TP {tp} x PP {pp}{virtual}"
        f"{context} x DP {cfg.data_parallel_size}; layers {m.transformer_impl}, {precision}",
        f"rollout    {r.num_engines} engine(s) x TP {r.engine_tensor_parallel_size}, {r.placement}"
        f"{f', one batch ahead (max_staleness {r.max_staleness})' if r.max_staleness else ''}; "
        f"{cfg.data.prompts_per_iteration} prompts x {r.n_samples_per_prompt} samples, "
        f"max {r.max_new_tokens} new tokens",
        f"sampling   {sampling_line(r)}",
        f"kv         {kv_line}",
        f"optimizer  {cfg.samples_per_iteration} samples/iteration -> {cfg.optimizer_steps_per_iteration} step(s) of "
        f"{cfg.trainer.global_batch_size} (micro-batch {cfg.trainer.micro_batch_size}); "
        f"{cfg.trainer.iterations} iterations",
        f"tracking   {cfg.tracking.tracking_uri or 'sqlite store in ' + cfg.trainer.run_dir}",
    ]
    return "\n".join(lines)


def describe_arch(cfg: RunConfig) -> str:
    """Every ``model.arch`` field in a few words, and which were read from the model folder."""
    a = cfg.model.arch
    features = [name for name, on in (("tied embeddings", a.tie_word_embeddings), ("q/k/v biases", a.has_qkv_bias),
                                      ("q/k norms", a.qk_layernorm)) if on]
    text = (f"{a.family}, {a.num_layers} layers, hidden {a.hidden_size}, ffn {a.ffn_hidden_size}, heads "
            f"{a.num_attention_heads} ({a.num_query_groups} kv) x {a.kv_channels}, vocab {a.vocab_size}, "
            f"{a.max_position_embeddings} positions, rope_theta {a.rope_theta:g}, norm_eps {a.norm_eps:g}"
            + "".join(f", {f}" for f in features))
    read = cfg.arch_from_folder
    return text + (f"; read from its config.json: {', '.join(read)}" if read else "")


def resume_hint(cfg: RunConfig) -> str:
    """What ``--resume`` would start from now: the newest complete checkpoint, or nothing."""
    folder = checkpoint_folder(cfg)
    newest = find_checkpoint("auto", folder)
    if newest is not None:
        return f"--resume continues from {newest}"
    why = ("checkpoint.save_interval is 0" if not cfg.checkpoint.save_interval else
           f"the first is due after iteration {cfg.checkpoint.save_interval}")
    return f"no checkpoint under {folder} ({why}): --resume would start from the beginning"
