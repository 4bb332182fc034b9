"""Run under torchrun by tests/test_learner.py: a bfloat16 learner (plain and distributed optimizer)
loads an HF model the way the trainer does, then takes one Adam step with zero gradients (an update of
exactly zero). Its weights must still be the HF weights; rank 0 writes, per optimizer kind, the
largest difference after the step and how far the built (random) weights were from the HF ones.

    torchrun --nproc-per-node 1 tests/helpers/bf16_load_check.py MODEL_DIR OUT_JSON
"""
import json
import sys

from common import start  # (first: CPU shims before Megatron)

import torch.distributed as dist


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    cfg = start(model_dir, 1, 1, 2, 2, 1)
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.weights import gather_hf_state_dict, load_hf_into_learner, read_hf_state_dict

    cfg.model.dtype = "bfloat16"
    cfg.trainer.weight_decay = 0.0  # (decay would move the weights with zero gradients too)
    hf = read_hf_state_dict(model_dir)
    results = {}
    for distributed in (False, True):
        cfg.parallel.use_distributed_optimizer = distributed
        learner = build_learner(cfg)
        built = gather_hf_state_dict(learner.modules, cfg.model.arch)
        load_hf_into_learner(learner, model_dir, cfg.model.arch)
        for chunk in learner.chunks:
            chunk.zero_grad_buffer()  # zero gradients: Adam's first update is exactly zero
        learner.optimizer.step()
        after = gather_hf_state_dict(learner.modules, cfg.model.arch)

        def gap(weights):  # in each parameter's own dtype (the local spec's norms stay float32)
            return max(float((weights[k].float() - hf[k].to(weights[k].dtype).float()).abs().max()) for k in hf)
        results["distributed" if distributed else "plain"] = {"after_step": gap(after), "as_built": gap(built)}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
