"""Run under torchrun by tests/test_learner.py: load an HF folder into Megatron at a given TP/PP,
gather it back, and compute dense logprobs and entropies; rank 0 compares them with transformers and
writes JSON.

    torchrun --nproc-per-node 2 tests/helpers/learner_check.py MODEL_DIR TP PP OUT_JSON
"""
import json
import sys
from pathlib import Path

from common import start  # (first: CPU shims before Megatron)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    model_dir, tp, pp, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = start(model_dir, tp, pp, group_size=2, global_batch=2, micro_batch=1)
    from sparse_rl_mega.batch import RolloutBatch
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import forward_logprobs
    from sparse_rl_mega.learner.weights import gather_hf_state_dict, load_hf_into_model, read_hf_state_dict

    learner = build_learner(cfg)
    load_hf_into_model(learner.module, model_dir, cfg.model.arch)
    gathered = gather_hf_state_dict(learner.module, cfg.model.arch)

    ids = torch.tensor([[3, 9, 27, 81, 50, 7, 11, 13, 2, 5], [8, 6, 4, 2, 1, 3, 5, 7, 9, 10]])
    batch = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=torch.ones(2, 9),
                         logp_sparse=torch.zeros(2, 9), rewards=torch.zeros(2), group_ids=torch.zeros(2, dtype=torch.long))
    logp = forward_logprobs(learner.model, batch, micro_batch_size=1)
    entropy = None
    if pp == 1:  # one stage: the model's output is the logits (vocab-parallel under TP)
        from sparse_rl_mega.learner.vocab_parallel import logprobs_and_entropy

        with torch.no_grad():
            logits = learner.module(batch.input_ids, torch.arange(9).unsqueeze(0).expand(2, -1), None)
            logp_direct, entropy = logprobs_and_entropy(logits, batch.labels)
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        original = read_hf_state_dict(model_dir)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ref_all = torch.log_softmax(hf(ids[:, :-1]).logits.float(), -1)
            ref = ref_all.gather(-1, ids[:, 1:, None])[..., 0]
            ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
        Path(out_path).write_text(json.dumps({
            "same_names": sorted(gathered) == sorted(original),
            "bit_exact": all(torch.equal(gathered[k], original[k]) for k in original if k in gathered),
            "max_abs_logprob_diff": float((logp - ref).abs().max()),
            "max_abs_entropy_diff": None if entropy is None else float((entropy - ref_entropy).abs().max()),
            "entropy_mean": None if entropy is None else float(entropy.mean()),
        }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
