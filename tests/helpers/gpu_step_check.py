"""Run under torchrun (one process) by tests/test_gpu.py, and on the CPU in a tiny shape by
tests/test_tools.py: the learner's training step at a model shape with random weights, timed and
measured against ``--plan``.

Builds the Megatron learner (local spec, TP1, ``--dtype``) for a Llama shape (``1b``: Llama-3.2-1B's,
16 layers, hidden 2048, ffn 8192, 32 / 8 heads, vocabulary 128256, 1.24 B parameters; ``tiny``: 2
layers, hidden 64), runs ``--warmup`` then ``--steps`` optimizer steps of the corrected loss on one
global batch of 2 sequences of ``--seq`` tokens (micro-batch 1), and writes JSON to OUT: tokens/s of
the timed steps, the model FLOPs per token (``6 N`` for the matmul weights plus ``6 L s h`` for causal
attention's scores and values, as Megatron-LM and PaLM count them) and MFU against ``--peak-tflops``,
the peak memory allocated (CUDA) against the planner's estimate for the same config
(``planner.learner_memory``), and whether every loss and gradient norm was finite.

    torchrun --nproc-per-node 1 tests/helpers/gpu_step_check.py OUT.json [--shape 1b] [--seq 4096] ...
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from common import init_parallel  # (first: CPU shims before Megatron)

import torch
import torch.distributed as dist

SHAPES = {
    "1b": dict(family="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
               num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=500000.0),
    "tiny": dict(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=384, max_position_embeddings=512),
}


def shape_config(shape: str, dtype: str, max_new_tokens: int):
    """The validated one-process run config of a model shape of :data:`SHAPES` with random weights (no
    model folder is read): 2 sequences a step, micro-batch 1."""
    from sparse_rl_mega.config import config_from_dict

    return config_from_dict({
        "model": {"path": "unused", "arch": SHAPES[shape], "dtype": dtype}, "parallel": {"nproc_per_node": 1},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": max_new_tokens},
        "data": {"train_path": "unused.jsonl", "prompts_per_iteration": 1},
        "trainer": {"global_batch_size": 2, "micro_batch_size": 1}})


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="the accelerator's dense bf16 peak (H200: ~790 measured on this machine kind)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from sparse_rl_mega.algo.correction import compute_correction
    from sparse_rl_mega.batch import RolloutBatch
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import train_step
    from sparse_rl_mega.cli.planner import learner_memory, total_params

    cuda = torch.cuda.is_available()
    init_parallel(1, 1)
    prompt = 16
    cfg = shape_config(args.shape, args.dtype, args.seq - prompt)
    arch = cfg.model.arch
    learner = build_learner(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, args.seq + 1), generator=g)
    mask = torch.zeros(2, args.seq)
    mask[:, prompt - 1:] = 1.0
    batch = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=mask,
                         logp_sparse=torch.full((2, args.seq), -5.0), rewards=torch.tensor([1.0, 0.0]),
                         group_ids=torch.zeros(2, dtype=torch.long), advantages=torch.tensor([0.7, -0.7]))
    batch.logp_old = batch.logp_sparse.clone()
    batch.is_weights, batch.loss_mask, _ = compute_correction(batch.logp_old, batch.logp_sparse, mask, "sparse_rl")
    finite, seconds = True, []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = train_step(learner, batch, cfg.algorithm, 1)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - started)
        finite &= math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
    params = total_params(arch)
    tokens = 2 * args.seq
    flops_per_token = 6 * params + 6 * arch.num_layers * args.seq * arch.hidden_size
    step_s = min(seconds)
    plan = learner_memory(cfg, prompt, 0)
    result = {
        "shape": args.shape, "params": params, "dtype": args.dtype, "seq": args.seq, "tokens_per_step": tokens,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "step_seconds": seconds,
        "tokens_per_s": tokens / step_s, "flops_per_token": flops_per_token,
        "tflops": flops_per_token * tokens / step_s / 1e12, "peak_tflops": args.peak_tflops,
        "mfu": flops_per_token * tokens / step_s / (args.peak_tflops * 1e12), "finite": finite,
        "plan_bytes": {"states": plan.states_bytes, "activations": plan.activation_bytes, "total": plan.total_bytes},
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    if cuda:
        result["peak_over_plan"] = result["peak_allocated_bytes"] / plan.total_bytes
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    sys.exit(0 if finite else 1)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
