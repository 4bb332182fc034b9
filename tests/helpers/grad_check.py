"""Run under torchrun by tests/test_layout_invariance.py: the full corrected loss's gradient of one
fixed global batch at a given TP/PP/DP layout and micro-batch size, saved in HF names by rank 0.

    torchrun --nproc-per-node W tests/helpers/grad_check.py MODEL_DIR TP PP MICRO_BATCH OUT.pt [PARALLEL_JSON]

PARALLEL_JSON: more ``parallel`` settings, e.g. ``{"recompute": "full"}`` or ``{"context_parallel_size": 2}``.

Every rank builds the same global batch (8 sequences, 2 GRPO groups) with fixed synthetic sampler,
reference and anchor logprobs around the model's own dense logprobs, so PPO clipping, dual clipping,
the veto, token rejection, IS truncation, the KL and entropy terms are all active.
"""
import json
import sys

from common import start  # (first: CPU shims before Megatron)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
N, WIDTH, GROUP = 8, 14, 4


def synthetic_batch(vocab: int):
    from sparse_rl_mega.batch import RolloutBatch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (N, WIDTH + 1), generator=g)
    mask = torch.zeros(N, WIDTH)
    for i in range(N):
        start = 2 + i % 4           # label position of the first response token
        end = WIDTH - (i * 3) % 5   # right padding of varying length
        mask[i, start:end] = 1.0
    return RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=mask,
                        logp_sparse=torch.zeros(N, WIDTH), rewards=torch.randint(0, 2, (N,), generator=g).float(),
                        group_ids=torch.arange(N) // GROUP)


def main() -> None:
    model_dir, tp, pp, mbs, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    parallel = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    cfg = start(model_dir, tp, pp, GROUP, N, mbs, {"dual_clip": 3.0, "kl_coef": 0.05, "entropy_coef": 0.01}, parallel)
    from megatron.core import parallel_state as ps

    from sparse_rl_mega.algo.advantages import grpo_advantages
    from sparse_rl_mega.algo.correction import compute_correction
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import REPORT_KEYS, forward_backward, forward_logprobs, sum_report
    from sparse_rl_mega.learner.weights import gather_hf_state_dict, load_hf_into_learner

    dp, dp_rank, dp_group = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()
    full = synthetic_batch(cfg.model.arch.vocab_size)
    rows = torch.arange(dp_rank * N // dp, (dp_rank + 1) * N // dp)
    results = {}
    for dtype_name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        cfg.model.dtype = dtype_name  # float64: rounding out of the way, the algorithm must agree exactly
        learner = build_learner(cfg)
        load_hf_into_learner(learner, model_dir, cfg.model.arch)
        local = full.select(rows)
        dense = forward_logprobs(learner.chunks, local, mbs)
        g = torch.Generator().manual_seed(99)
        noise = [torch.randn(N, WIDTH, generator=g, dtype=torch.float64)[rows].to(dtype) for _ in range(3)]
        local.logp_old = dense + 0.3 * noise[0]      # the anchor: the policy has moved since
        local.logp_old[rows == 1, 5] -= 12.0          # row 1: a token the dense policy finds ~impossible: vetoed
        local.logp_sparse = dense + 0.4 * noise[1]   # the sparse sampler disagrees
        local.logp_ref = dense - 0.2 * noise[2]
        local.advantages = grpo_advantages(full.rewards, GROUP)[rows].to(dtype)
        local.response_mask = local.response_mask.to(dtype)
        local.is_weights, local.loss_mask, metrics = compute_correction(
            local.logp_old, local.logp_sparse, local.response_mask, "sparse_rl", group=dp_group)
        results[dtype_name] = {"metrics": metrics}
        params = [p for chunk in learner.modules for p in chunk.parameters()]
        saved = [p.data.clone() for p in params]
        for mode in AGG_MODES:
            cfg.algorithm.loss_agg_mode = mode
            report = sum_report(forward_backward(learner, local, cfg.algorithm, mbs))
            for p in params:  # expose the reduced, scaled gradients through the weight-gather path
                p.data.copy_(p.main_grad)
            grads = gather_hf_state_dict(learner.modules, cfg.model.arch)
            for p, original in zip(params, saved):
                p.data.copy_(original)
            values = dict(zip(REPORT_KEYS, report.tolist()))
            # the loss report lives on the last stage; rank 0 may be elsewhere
            loss = torch.tensor([values["loss_sum"] / values["count"] if ps.is_pipeline_last_stage() else -1e30],
                                dtype=torch.float64)
            dist.all_reduce(loss, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                results[dtype_name][mode] = {"grads": grads, "loss": float(loss)}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
